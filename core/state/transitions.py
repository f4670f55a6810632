"""The transition table: every event, its rule in SPEC's words, and the code that enforces it.

One row per event type, as in h11's ``_state.py``: what a page's holder must be
before (the precondition), what it becomes, what happens to the mark and which
effect the fold emits, next to the precondition function that rejects and the
applier that folds. ``LedgerState.validate`` / ``apply`` dispatch through this
table and nothing else; an event type that is not in it is refused
(``InvalidArgumentError``) naming the type.

    event                   precondition                     pages                 mark       effect
    CacheConfigured         first event of a log             all free              none       -
    PagesReserved           free, not restoring              -> reserved(r)        kept       -
    ReservationReturned     reserved(r)                      -> free               kept       -
    PagesCommitted          reserved(r), not restoring;      -> kv(r), in order    cleared    ClearPages
                            step not older than open step
    RequestCancelled/       r known                          reserved, kv -> free  kept       -
      RequestFinished
    SnapshotAliased         free or alias(S), not restoring  -> alias(S + {s})     kept       -
    SnapshotReleased        s live                           S - {s}; empty: free  set        -
    RestoreStarted          reserved(r) / alias(S with s)    unchanged             into r:    restoring set
                                                                                   cleared
    RestoreCompleted        restoring                        unchanged             unchanged  restoring cleared
    StepSealed              step open                        -                     -          StepPlan
    StepCompleted           step sealed                      -                     -          -
    StepAborted             a step in flight (sealed, not    -                     re-listed  -
                            completed everywhere); it and                          or set
                            every later step in flight
    PagesPublished          kv(r) written by r, completed    gain their hash       -          BlocksStored
    PagesShared             hashed kv(R) or cached(h)        -> kv(R + {r})        unchanged  -
    PagesEvicted            cached(h)                        -> free               policy     BlocksRemoved
    SanitizerViolation      step sealed                      -                     -          - (a record)

To add an event: its struct in ``core/events/events.py``, a precondition in
``preconditions.py``, an applier in ``fold.py`` (``fold_prefix.py`` for prefix caching), and its row here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..events.events import (
    EVENT_TYPES,
    CacheConfigured,
    PagesCommitted,
    PagesEvicted,
    PagesPublished,
    PagesReserved,
    PagesShared,
    RequestCancelled,
    RequestFinished,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SanitizerViolation,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepSealed,
)
from . import fold, fold_prefix, fold_steps
from . import preconditions as pre

__all__ = ["TRANSITIONS", "Transition"]


class Transition(NamedTuple):
    """One row of the table. The four text columns are SPEC's words for the rule;
    ``validate(state, event)`` enforces the precondition, ``apply(state, event)`` folds."""

    precondition: str
    pages: str
    mark: str
    effect: str
    validate: Callable[[Any, Any], None]
    apply: Callable[[Any, Any], tuple]


# The text columns are SPEC's cells, word for word (markdown code spans dropped);
# tests/core/test_transitions.py holds them against a copy of SPEC's table.
TRANSITIONS: dict[type, Transition] = {
    CacheConfigured: Transition(
        "first event of a log", "all free", "none", "—",
        pre.cache_configured, fold.cache_configured),
    PagesReserved: Transition(
        "each page free, not restoring", "→ reserved(r)", "kept", "—",
        pre.pages_reserved, fold.pages_reserved),
    ReservationReturned: Transition(
        "each page reserved(r)", "→ free", "kept", "—",
        pre.reservation_returned, fold.reservation_returned),
    PagesCommitted: Transition(
        "each page reserved(r), not restoring; step not older than the open step",
        "→ kv(r), appended in order", "cleared",
        "the page ids that were marked, in commit order: the clear list of step",
        pre.pages_committed, fold.pages_committed),
    RequestCancelled: Transition(
        "r known", "reserved and kv pages → free", "kept", "—",
        pre.request_known, fold.request_gone),
    RequestFinished: Transition(
        "r known", "reserved and kv pages → free", "kept", "—",
        pre.request_known, fold.request_gone),
    SnapshotAliased: Transition(
        "each page free or alias(S), not restoring", "→ alias(S ∪ {s})",
        "kept (snapshot reuse keeps the mark)", "—",
        pre.snapshot_aliased, fold.snapshot_aliased),
    SnapshotReleased: Transition(
        "s live", "s leaves each page's S; a page whose S becomes empty → free",
        "set on every page whose last alias was released", "—",
        pre.snapshot_released, fold.snapshot_released),
    RestoreStarted: Transition(
        "target is r with pages reserved(r), or s with pages in alias(S∋s)", "unchanged",
        "into a request: cleared (overwritten whole); into a snapshot: unchanged", "restoring set",
        pre.restore_started, fold.restore_started),
    RestoreCompleted: Transition(
        "pages restoring", "unchanged (a page may be free now if its snapshot was released mid-restore)",
        "unchanged", "restoring cleared",
        pre.restore_completed, fold.restore_completed),
    StepSealed: Transition(
        "step open", "—", "—", "the step plan: the union of that step's clear lists, each id once",
        pre.step_sealed, fold_steps.step_sealed),
    # Not in SPEC's table: the engine's record of how a sealed step ran.
    StepCompleted: Transition(
        "step sealed", "—", "—", "—",
        pre.step_completed, fold_steps.step_completed),
    StepAborted: Transition(
        "a step in flight (sealed, not aborted, not yet completed on every rank, among the last "
        "MAX_IN_FLIGHT sealed); it is aborted with every later step in flight", "—",
        "their pages still in kv(r) listed again for the open step; the others set", "—",
        pre.step_aborted, fold_steps.step_aborted),
    SanitizerViolation: Transition(
        "step sealed; page in range", "—", "—", "— (a record for audits; the step is aborted by its own event)",
        pre.sanitizer_violation, fold_steps.sanitizer_violation),
    # SPEC, "Prefix-shared pages".
    PagesPublished: Transition(
        "each page kv(r) written by r, full, committed in a step that has completed; "
        "hash not already published", "gain their hash", "—", "KV event BlockStored",
        pre.pages_published, fold_prefix.pages_published),
    PagesShared: Transition(
        "each page hashed, kv(R) or cached(h), not stale, not restoring; under cross_tenant / "
        "all_reused same tenant as r", "→ kv(R ∪ {r}), appended to r's block table in order",
        "unchanged (a hashed page holds the KV r wants: never listed)", "—",
        pre.pages_shared, fold_prefix.pages_shared),
    PagesEvicted: Transition(
        "each page cached(h)", "→ free, hash dropped", "as for a request's page going free under the policy",
        "KV event BlockRemoved",
        pre.pages_evicted, fold_prefix.pages_evicted),
}

assert set(TRANSITIONS) == set(EVENT_TYPES), "every event type has exactly one row"
