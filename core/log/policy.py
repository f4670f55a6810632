"""The writer's policies and counters: when a commit writes and fsyncs, and what a log reports.

    fsync         commit after               where the write and fsync happen
    "background"  each StepSealed (default)  the writer thread (``syncer.py``)
    "per_step"    each StepSealed            inline, before the append returns
    "per_event"   every event                inline
    "none"        only sync() / close()      inline (writes past 4 MiB unsynced)
"""

from __future__ import annotations

import struct

import msgspec

from ..errors import InvalidArgumentError
from ..events.events import EVENT_TYPES, StepSealed
from .format import PREFIX_SIZE

__all__ = ["DEFAULT_MAX_LAG_BYTES", "FSYNC_POLICIES", "LogStatistics", "policy_mode"]  # and the writer's constants

FSYNC_POLICIES = ("background", "per_step", "per_event", "none")
DEFAULT_MAX_LAG_BYTES = 64 << 20
_BATCH_BYTES = 1 << 20  # close an events record past this size
_FLUSH_BYTES = 4 << 20  # write (without fsync) past this much buffered
_EVENT_TYPES = frozenset(EVENT_TYPES)
_SEALS = frozenset((StepSealed,))
_NONE: frozenset = frozenset()
_POLICIES = {"background": (_SEALS, True), "per_step": (_SEALS, False), "per_event": (_EVENT_TYPES, False),
             "none": (_NONE, False)}  # commit after these types, in the writer thread?
_BATCH_HEAD = bytes(PREFIX_SIZE + 5)  # prefix + array32 header, filled in when the batch is sealed
_COUNT = struct.Struct(">I")


class LogStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    events: int  # events in the log (= the next seq)
    durable_seq: int
    appended: int  # events appended by this handle
    records: int  # records written by this handle
    bytes_written: int
    syncs: int
    checkpoints: int
    size: int  # file size, buffered bytes excluded
    lag_bytes: int  # handed to the writer thread (or written) but not yet synced
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
