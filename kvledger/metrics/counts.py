"""The ledger observer's side of the metrics: plain ints, counted per folded event.

    Ledger._submit ─► fold ─► observer(seq, event, effects) = EventCounts.observe
                                 events[type] += 1
                                 PagesShared       pages_shared += pages     (prefix-cache hits)
                                 StepAborted       aborts[reason label] += 1
                                 effects:  ClearPages     pages_listed += pages
                                           StepPlan       steps_sealed, pages_planned, clear-list sizes
                                           PagesMarked    pages_marked += pages
                                           BlocksStored   blocks_stored += blocks
                                           BlocksRemoved  blocks_removed += blocks
    LedgerMetrics.prefix_lookup(asked, found)    lookup_pages += asked, lookup_hit_pages += found
                                                 (Engine.lookup calls it; a ledger's caller may)

No prometheus_client here and no lock: the ledger folds one event at a time (the
engine's worker thread, or the caller's), and a scrape from another thread reads
ints, each written whole. The families a scrape builds from these counts live in
``families.py``. ``observe`` never raises: an event or effect type it does not
know (a newer kvledger) is counted under its own tag or skipped.

Abort reasons become one of ``ABORT_REASONS`` (``abort_reason``): the engine's
wording is recognised, a reason that is already a vocabulary word keeps it, anything
else is ``other``. A reason never becomes a label as written: it may hold rank
numbers, exception texts, page ids.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any

from kvledger.core.events.events import (
    EVENT_TYPES,
    BlocksRemoved,
    BlocksStored,
    ClearPages,
    PagesMarked,
    PagesShared,
    StepAborted,
    StepPlan,
)

__all__ = ["ABORT_REASONS", "CLEAR_LIST_BUCKETS", "Buckets", "EventCounts", "abort_reason", "event_tag"]

ABORT_REASONS = (
    "unspecified",  # StepAborted(reason="")
    "cancelled",  # the caller gave up on the step (engine: "cancelled", "cancelled before dispatch")
    "rank_failed",  # a rank raised in its copies, clear or graph ("rank R failed: ...")
    "rank_cancelled",  # a rank's task ended without being asked to ("rank R cancelled")
    "wire_abort",  # a peer REJECTed, timed out or was lost ("rank R aborted the step over the wire: ...")
    "wire_handshake",  # the PREPARE/READY handshake itself raised ("remote handshake: ...")
    "timeout",  # a caller's own word
    "other",
)
_VOCABULARY = frozenset(ABORT_REASONS)
_RANK_REASONS = ((" failed", "rank_failed"), (" cancelled", "rank_cancelled"),
                 (" aborted the step over the wire", "wire_abort"))

# clear-list sizes (pages per sealed step): 0 apart, then powers of 4
CLEAR_LIST_BUCKETS = (0, 1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


def abort_reason(reason: str) -> str:
    """The bounded label of a ``StepAborted`` reason: one of ``ABORT_REASONS``."""
    if not reason:
        return "unspecified"
    if reason in _VOCABULARY:
        return reason
    if reason.startswith("cancelled"):
        return "cancelled"
    if reason.startswith("remote handshake"):
        return "wire_handshake"
    if reason.startswith("rank "):
        rest = reason[5:].lstrip("0123456789")
        for prefix, label in _RANK_REASONS:
            if rest.startswith(prefix):
                return label
    return "other"


def event_tag(event_type: type) -> str:
    """An event class's tag (``pages_reserved``): what the log stores and the ``type`` label."""
    tag = getattr(getattr(event_type, "__struct_config__", None), "tag", None)
    return tag if isinstance(tag, str) else event_type.__name__


class Buckets:
    """A histogram's counts kept as plain ints: ``add(x)`` puts ``x`` in the first bucket
    whose upper bound is ``>= x`` (the last one is +Inf)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def add(self, x: float) -> None:
        self.counts[bisect_left(self.bounds, x)] += 1
        self.total += x

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, observations <= le)`` for every bound and ``+Inf``: Prometheus' buckets."""
        out, running = [], 0
        counts = list(self.counts)  # one copy: a fold in another thread may add meanwhile
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class EventCounts:
    """What the ledger observer counts (see the module docstring). ``observe`` is the
    ``Ledger`` observer; read the attributes from any thread."""

    def __init__(self) -> None:
        self.events: dict[type, int] = dict.fromkeys(EVENT_TYPES, 0)
        self.aborts: dict[str, int] = dict.fromkeys(ABORT_REASONS, 0)
        self.pages_listed = 0  # ClearPages: marked pages commits listed for a clear
        self.steps_sealed = 0  # StepPlan effects
        self.pages_planned = 0  # clear-list entries of sealed plans (carried pages again)
        self.pages_marked = 0  # PagesMarked: pages that became stale
        self.blocks_stored = 0  # BlocksStored: block hashes published
        self.blocks_removed = 0  # BlocksRemoved: block hashes evicted
        self.pages_shared = 0  # PagesShared: pages a request took from the prefix cache
        self.lookup_pages = 0  # blocks prefix-cache lookups asked for
        self.lookup_hit_pages = 0  # leading blocks those lookups found ready to share
        self.clear_lists = Buckets(CLEAR_LIST_BUCKETS)
        self._effects: dict[type, Callable[[Any], None]] = {
            ClearPages: self._listed,
            StepPlan: self._planned,
            PagesMarked: self._marked,
            BlocksStored: self._stored,
            BlocksRemoved: self._removed,
        }

    @property
    def observed(self) -> int:
        """Events observed so far."""
        return sum(list(self.events.values()))

    def observe(self, seq: int, event: object, effects: tuple) -> None:
        """The ``Ledger`` observer: count one folded event and its effects. Never raises."""
        t = type(event)
        events = self.events
        events[t] = events.get(t, 0) + 1
        if t is PagesShared:
            self.pages_shared += len(event.page_ids)  # type: ignore[attr-defined]
        elif t is StepAborted:
            self.aborts[abort_reason(event.reason)] += 1  # type: ignore[attr-defined]
        if effects:
            handlers = self._effects
            for eff in effects:
                fn = handlers.get(type(eff))
                if fn is not None:
                    fn(eff)

    def lookup(self, asked: int, found: int) -> None:
        """One prefix-cache lookup asked for ``asked`` blocks and found the first ``found``."""
        self.lookup_pages += asked
        self.lookup_hit_pages += found

    def _listed(self, eff: ClearPages) -> None:
        self.pages_listed += len(eff.page_ids)

    def _planned(self, plan: StepPlan) -> None:
        n = len(plan.clear_list)
        self.steps_sealed += 1
        self.pages_planned += n
        self.clear_lists.add(n)

    def _marked(self, eff: PagesMarked) -> None:
        self.pages_marked += len(eff.page_ids)

    def _stored(self, eff: BlocksStored) -> None:
        self.blocks_stored += len(eff.hashes)

    def _removed(self, eff: BlocksRemoved) -> None:
        self.blocks_removed += len(eff.hashes)
