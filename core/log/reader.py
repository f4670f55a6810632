"""Reading a log: ``open_view`` verifies a log's records without locking or changing it.

``LogView`` gives verified, read-only access to the records (replay, audit, and
``EventLog.open``'s loader); ``fold.py`` folds them into a state.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..errors import LogClosedError, LogError, LogIOError
from .files import default_layer, release_buffer
from .format import (
    DEFAULT_MAX_PAGES,
    KIND_CHECKPOINT,
    KIND_EVENTS,
    Checkpoint,
    RecordInfo,
    Scan,
    decode_checkpoint,
    decode_events,
    decode_header,
    decode_stamp,
    scan,
)

__all__ = ["LogView", "open_view", "read_stamp"]


class LogView:
    """Read-only, verified access to a log's records (``open_view``, or the ``loader`` of ``EventLog.open``).

    The scan ran when the view was made: ``scan.records`` are verified (CRC,
    chain, seq), ``scan.error`` is the corruption that stopped it (if any) and
    ``scan.torn_at`` a torn tail. Decoding a payload can still raise
    ``CorruptLogError`` (an intact record whose payload does not decode).
    """

    def __init__(self, buf, result: Scan, path: str) -> None:
        self._buf = buf
        self.scan = result
        self.path = path
        self.header = result.header

    @property
    def records(self) -> list[RecordInfo]:
        return self.scan.records

    def close(self) -> None:
        buf, self._buf = self._buf, None
        if buf is not None:
            release_buffer(buf)

    def __enter__(self) -> "LogView":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self):
        if self._buf is None:
            raise LogClosedError(f"{self.path}: the view was released")
        return self._buf

    def events(self, rec: RecordInfo) -> list:
        """The events of an events record, in seq order from ``rec.seq``."""
        return decode_events(self._live(), rec, self.path)

    def checkpoint(self, rec: RecordInfo) -> Checkpoint:
        return decode_checkpoint(self._live(), rec, self.path)

    def last_checkpoint(self, at_or_before: int | None = None) -> int:
        """Index in ``records`` of the last checkpoint with seq <= ``at_or_before`` (or any); -1 if none."""
        recs = self.scan.records
        for i in range(len(recs) - 1, -1, -1):
            r = recs[i]
            if r.kind == KIND_CHECKPOINT and (at_or_before is None or r.seq <= at_or_before):
                return i
        return -1

    def iter_events(self, start: int = 0, until: int | None = None) -> Iterator[tuple[int, object, RecordInfo]]:
        """Yield ``(seq, event, record)`` for events records from index ``start`` on, up to seq ``until`` inclusive."""
        recs = self.scan.records
        buf = self._live()
        for i in range(start, len(recs)):
            rec = recs[i]
            if rec.kind != KIND_EVENTS:
                continue
            if until is not None and rec.seq > until:
                return
            seq = rec.seq
            for ev in decode_events(buf, rec, self.path):
                if until is not None and seq > until:
                    return
                yield seq, ev, rec
                seq += 1


def read_stamp(layer, path: str) -> bytes | None:
    """The raw sync stamp of the log at ``path`` (None: none, or a layer without stamps)."""
    reader = getattr(layer, "read_stamp", None)
    if reader is None:
        return None
    try:
        return reader(path)
    except (OSError, LogError):
        return None  # an unreadable stamp is no evidence either way


def open_view(path, *, layer=None, until: int | None = None, max_pages: int = DEFAULT_MAX_PAGES) -> LogView:
    """Read and verify a log without locking or changing it (replay, audit, tools).

    Raises ``CorruptLogError``/``LogVersionError`` only for a bad header, and
    ``LogError`` for a header over ``max_pages`` (``format.DEFAULT_MAX_PAGES``:
    what an untrusted file may make a reader allocate), a missing file, or one
    that is not a regular file (refused at once: a FIFO never blocks it).
    Problems in records are reported in ``view.scan`` (``error``, ``torn_at``).
    ``until``: verify only the records up to the one holding seq ``until``.

    The view maps the file as it is now. Writers only append and replace a file
    (never cut it in place), so the view stays a consistent prefix whatever a
    writer does meanwhile.
    """
    layer = layer if layer is not None else default_layer
    path = os.fspath(path)
    raw_stamp = read_stamp(layer, path)  # before the map: a stamp never claims more than the file then holds
    try:
        buf = layer.read(path)
    except FileNotFoundError:
        raise LogError(f"{path}: no such log") from None
    except IsADirectoryError:
        raise LogError(f"{path}: is a directory, not a log") from None
    except OSError as exc:
        raise LogIOError(path, "read", exc) from exc
    try:
        header = decode_header(buf, path, max_pages=max_pages)
        stamp = decode_stamp(raw_stamp, header)
        res = scan(buf, path, until=until, stamp=stamp, max_pages=max_pages)
    except BaseException:
        release_buffer(buf)
        raise
    return LogView(buf, res, path)
