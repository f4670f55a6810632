"""Scheduler state and the fold (``kvledger.core.state``): pure, no I/O.

    table.py          holder and mark codes, a request's record
    state.py          LedgerState: the page table, its queries, the allocator, dispatch
    transitions.py    THE TABLE: every event's rule, its precondition and its applier
    preconditions.py  one precondition per event (raises the specific error)
    fold.py           the appliers of pages, requests and snapshot rows (return the effects)
    fold_steps.py     the appliers of the step book (seal, complete, abort, sanitizer records)
    fold_prefix.py    the appliers of the prefix index (publish, share, evict)
    projection.py     a state projected onto one page (the audit's page fold)
    canonical.py      the canonical form: digest and checkpoints
    invariants.py     SPEC invariants 1-4, checked over the whole state
"""

from .invariants import check_invariants
from .state import LedgerState
from .table import (
    ALIAS,
    CACHED,
    FREE,
    HOLDER_ALIAS,
    HOLDER_FREE,
    HOLDER_NAMES,
    KV,
    MARK_ALL,
    MARK_TENANT,
    MAX_IN_FLIGHT,
    RESERVED,
    RequestRecord,
)
from .transitions import TRANSITIONS, Transition

__all__ = [
    "ALIAS",
    "CACHED",
    "FREE",
    "HOLDER_ALIAS",
    "HOLDER_FREE",
    "HOLDER_NAMES",
    "KV",
    "MARK_ALL",
    "MARK_TENANT",
    "MAX_IN_FLIGHT",
    "RESERVED",
    "TRANSITIONS",
    "LedgerState",
    "RequestRecord",
    "Transition",
    "check_invariants",
]
