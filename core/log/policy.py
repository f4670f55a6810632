"""The writer's policies and counters: when a commit writes and fsyncs, and what a log reports.

    fsync         commit after               where the write and fsync happen
    "background"  each StepSealed (default)  the writer thread (``durability.Background``)
    "per_step"    each StepSealed            inline, before the append returns
    "per_event"   every event                inline
    "none"        only sync() / close()      inline (a full batch is written, unsynced)

Whatever the policy, the open batch never holds more than ``BATCH_EVENTS``
events: a full batch is handed off (and, under every policy but ``"none"``,
fsynced), so a log whose steps are never sealed still reaches the disk and its
memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from ..checks import MAX_TENANT_CHARS
from ..errors import InvalidArgumentError
from ..events.events import EVENT_TYPES, StepSealed
from ..state.transitions import TRANSITIONS

__all__ = ["APPENDABLE", "BATCH_EVENTS", "DEFAULT_MAX_LAG_BYTES", "FSYNC_POLICIES", "SIZE_RISKS", "TENANT_CHARS",
           "TENANT_TYPES", "LogStatistics", "policy_mode"]

FSYNC_POLICIES = ("background", "per_step", "per_event", "none")
DEFAULT_MAX_LAG_BYTES = 64 << 20
BATCH_EVENTS = 8192  # a batch this full is handed off (sealed step or not)
APPENDABLE = frozenset(EVENT_TYPES)  # what append takes
_SEALS = frozenset((StepSealed,))
_NONE: frozenset = frozenset()
_POLICIES = {"background": (_SEALS, True), "per_step": (_SEALS, False), "per_event": (APPENDABLE, False),
             "none": (_NONE, False)}  # commit after these types, in the writer thread?


TENANT_CHARS = MAX_TENANT_CHARS  # a tenant up to this long cannot make an event pass max_event_bytes (the
# ledger refuses longer ones: the events its commands append straight to the batch are bounded)


def _long(field: str) -> Callable[[Any], bool]:
    def risky(ev) -> bool:
        value = getattr(ev, field)
        return value is not None and len(value) > TENANT_CHARS

    return risky


def _always(ev) -> bool:
    return True


# A validated event's page lists hold at most num_pages ids, well inside ``format.max_event_bytes``;
# only the fields the transition table calls unbounded may pass it: an event whose predicate says so
# is encoded once to be measured (``RecordTooLargeError`` before anything changed). A name (a
# tenant, a reason) is measured by its length; anything else (a publish's tokens, a geometry) always.
SIZE_RISKS: dict[type, Callable[[Any], bool]] = {
    t: (_long(row.unbounded[0]) if row.unbounded in (("tenant",), ("reason",)) else _always)
    for t, row in TRANSITIONS.items() if row.unbounded}
TENANT_TYPES = tuple(t for t, row in TRANSITIONS.items() if row.unbounded == ("tenant",))


class LogStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    events: int  # events in the log (= the next seq)
    durable_seq: int
    appended: int  # events appended by this handle
    records: int  # records written by this handle
    bytes_written: int
    syncs: int
    checkpoints: int
    size: int  # file size, buffered bytes excluded
    lag_bytes: int  # handed to the writer thread but not yet written and synced (estimated), or written unsynced
    stalls: int  # appends that waited for the disk (back-pressure)


def policy_mode(fsync: str, background: bool | None) -> tuple[frozenset, bool]:
    """(event types that commit, writer thread?) for a policy name; ``InvalidArgumentError`` otherwise.

    ``background=True`` moves an inline policy's commits to the writer thread
    (``per_step`` + ``background=True`` is ``"background"``); ``False`` makes
    ``"background"`` inline per step.
    """
    mode = _POLICIES.get(fsync) if type(fsync) is str else None
    if mode is None:
        raise InvalidArgumentError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
    return (mode[0], mode[1] if background is None else bool(background))
