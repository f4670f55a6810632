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
    SEGMENT_VERSION,
    Checkpoint,
    RecordInfo,
    decode_checkpoint,
    decode_events,
    decode_header,
    decode_stamp,
)
from .scan import Scan, scan
from .segments import SegmentBuffers, combine, list_segments, missing_tail, scan_segments, segment_name

__all__ = ["LogView", "open_view", "read_stamp"]


class LogView:
    """Read-only, verified access to a log's records (``open_view``, or the ``loader`` of ``EventLog.open``).

    The scan ran when the view was made: ``scan.records`` are verified (CRC,
    chain, seq), ``scan.error`` is the corruption that stopped it (if any) and
    ``scan.torn_at`` a torn tail. Decoding a payload can still raise
    ``CorruptLogError`` (an intact record whose payload does not decode).

    A view of a log directory reads its segments (``paths``, in order;
    ``RecordInfo.segment`` says which holds a record) through
    ``segments.SegmentBuffers``: at most ``MAPPED_SEGMENTS`` mapped at once, so a
    directory of any number of segments opens within a small file-descriptor
    limit; ``first_seq`` is the seq its first record starts at (0, unless
    retention deleted the first segments or the view starts at a later segment:
    then fold from its first checkpoint, ``start_state``).
    """

    def __init__(self, buf, result: Scan, path: str, *, bufs: SegmentBuffers | None = None,
                 paths: list[str] | None = None) -> None:
        self._bufs: SegmentBuffers | _OneBuffer | None = _OneBuffer(buf) if bufs is None else bufs
        self.paths = [path] if paths is None else paths
        self.scan = result
        self.path = path
        self.header = result.header
        recs = result.records
        self.first_seq = recs[0].seq if recs else result.next_seq

    @property
    def records(self) -> list[RecordInfo]:
        return self.scan.records

    def close(self) -> None:
        bufs, self._bufs = self._bufs, None
        if bufs is not None:
            bufs.close()

    def __enter__(self) -> LogView:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live(self, rec: RecordInfo):
        if self._bufs is None:
            raise LogClosedError(f"{self.path}: the view was released")
        return self._bufs.get(rec.segment)

    def events(self, rec: RecordInfo) -> list:
        """The events of an events record, in seq order from ``rec.seq``."""
        return decode_events(self._live(rec), rec, self.paths[rec.segment])

    def checkpoint(self, rec: RecordInfo) -> Checkpoint:
        return decode_checkpoint(self._live(rec), rec, self.paths[rec.segment])

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
        for i in range(start, len(recs)):
            rec = recs[i]
            if rec.kind != KIND_EVENTS:
                continue
            if until is not None and rec.seq > until:
                return
            seq = rec.seq
            for ev in self.events(rec):
                if until is not None and seq > until:
                    return
                yield seq, ev, rec
                seq += 1


class _OneBuffer:
    """The buffer of a one-file view (the ``SegmentBuffers`` interface)."""

    __slots__ = ("buf",)

    def __init__(self, buf) -> None:
        self.buf = buf

    def get(self, i: int):
        return self.buf

    def close(self) -> None:
        release_buffer(self.buf)


def read_stamp(layer, path: str) -> bytes | None:
    """The raw sync stamp of the log at ``path`` (None: none, or a layer without stamps)."""
    reader = getattr(layer, "read_stamp", None)
    if reader is None:
        return None
    try:
        return reader(path)
    except (OSError, LogError):
        return None  # an unreadable stamp is no evidence either way


def open_view(path, *, layer=None, until: int | None = None, max_pages: int = DEFAULT_MAX_PAGES,
              since: int | None = None) -> LogView:
    """Read and verify a log without locking or changing it (replay, audit, tools).

    Raises ``CorruptLogError``/``LogVersionError`` only for a bad header, and
    ``LogError`` for a header over ``max_pages`` (``format.DEFAULT_MAX_PAGES``:
    what an untrusted file may make a reader allocate), a missing file, or one
    that is not a regular file (refused at once: a FIFO never blocks it).
    Problems in records are reported in ``view.scan`` (``error``, ``torn_at``).
    ``until``: verify only the records up to the one holding seq ``until``.
    ``since`` (a log directory): map and verify only from the last segment
    that starts at or before seq ``since`` (its opening checkpoint is where a
    fold that needs nothing earlier starts: ``start_state(view, at=since)``),
    so a question about recent history costs one segment, not the whole log.

    The view maps the file as it is now. Writers only append and replace a file
    (never cut it in place), so the view stays a consistent prefix whatever a
    writer does meanwhile.
    """
    layer = layer if layer is not None else default_layer
    path = os.fspath(path)
    isdir = getattr(layer, "isdir", None)
    if isdir is not None and isdir(path):
        return _open_directory(layer, path, None, until, max_pages, since)
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
        if header.version == SEGMENT_VERSION:  # one segment of a log directory: start there
            release_buffer(buf)
            return _open_directory(layer, os.path.dirname(path) or ".", path, until, max_pages)
        stamp = decode_stamp(raw_stamp, header)
        res = scan(buf, path, until=until, stamp=stamp, max_pages=max_pages)
    except BaseException:
        release_buffer(buf)
        raise
    return LogView(buf, res, path)


def _open_directory(layer, directory: str, start: str | None, until: int | None, max_pages: int,
                    since: int | None = None) -> LogView:
    """A view over the segments of a log directory, from ``start`` (a segment path), from the
    segment holding seq ``since``, or from the first."""
    for _ in range(8):  # retention may delete the oldest segment between the listing and the reads
        paths = list_segments(layer, directory)
        if since is not None:
            earlier = [p for p in paths if os.path.basename(p) <= segment_name(since)]
            start = earlier[-1] if earlier else None
        if start is not None:
            paths = [p for p in paths if os.path.basename(p) >= os.path.basename(start)]
        if not paths:
            raise LogError(f"{directory}: no segments (not a kvledger log directory)")
        try:
            bufs, scans = scan_segments(layer, paths, until=until, max_pages=max_pages)
        except LogIOError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                continue
            raise
        res = combine(directory, scans)
        if res.error is None and not res.stopped and len(scans) == len(paths):
            res.error = missing_tail(layer, directory, paths, res.header)
        return LogView(None, res, directory, bufs=bufs, paths=paths[: len(scans)])
    raise LogError(f"{directory}: segments keep disappearing while being read")
