"""Scheduler state, the fold and the invariant checker (``kvledger.core.state``)."""

from .invariants import check_invariants
from .state import (
    ALIAS,
    FREE,
    HOLDER_NAMES,
    KV,
    MARK_ALL,
    MARK_TENANT,
    HOLDER_ALIAS,
    HOLDER_FREE,
    RESERVED,
    LedgerState,
    RequestRecord,
)

__all__ = [
    "ALIAS",
    "FREE",
    "HOLDER_NAMES",
    "KV",
    "MARK_ALL",
    "MARK_TENANT",
    "HOLDER_ALIAS",
    "HOLDER_FREE",
    "RESERVED",
    "LedgerState",
    "RequestRecord",
    "check_invariants",
]
