"""A log as a directory of segments, the read side: naming, listing, scanning, linking.

    <log dir>/                            mode 0700
        seg-00000000000000000000.kvlog    segment 0: events from seq 0
        seg-00000000000000812345.kvlog    segment k: opens with a checkpoint at seq 812345
        seg-00000000000000812345.kvlog.sync   the last segment's sync stamp

Every segment is a version-2 file (``format.encode_segment_header``): its
header names its index, its first seq, and the final size and chain value of
the segment before it, so a segment that was deleted from the middle, cut short,
reordered or taken from another log breaks the link, and a segment that has a
successor is complete (damage in it is corruption, never a torn tail). Segment
k > 0 opens with a checkpoint, so any segment is a starting point: replay,
audit and ``open_ledger`` fold from its checkpoint on.

    list_segments      the segment files of a directory, in seq order
    scan_segments      map and verify segments in order, each against its successor's
                       header (complete and intact) and the last one against its stamp
    missing_tail       a sync stamp of a segment after the last one present: the
                       directory lost its tail (``CorruptLogError`` naming what was synced)
    combine            one ``Scan`` for a view over several segments

The write side (creating a directory, rolling to the next segment, retention)
is ``directory.py``; the live segment is ``live.py``.
"""

from __future__ import annotations

import os

from ..errors import CorruptLogError, LogError, LogIOError
from .format import (
    DEFAULT_MAX_PAGES,
    SyncStamp,
    decode_header,
    decode_stamp,
)
from .scan import Scan, scan

__all__ = ["LOCK_NAME", "SEGMENT_SUFFIX", "combine", "is_segment_name", "list_segments", "missing_tail",
           "scan_segments", "segment_name", "unfinished_directory"]

SEGMENT_PREFIX, SEGMENT_SUFFIX = "seg-", ".kvlog"
LOCK_NAME = "LOCK"


def segment_name(first_seq: int) -> str:
    return f"{SEGMENT_PREFIX}{first_seq:020d}{SEGMENT_SUFFIX}"


def is_segment_name(name: str) -> bool:
    digits = name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]
    return name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX) and len(digits) == 20 \
        and digits.isdigit()


def list_segments(layer, directory: str) -> list[str]:
    """The segment files of a log directory, in seq order (other files are ignored)."""
    try:
        names = layer.listdir(directory)
    except FileNotFoundError:
        raise LogError(f"{directory}: no such log") from None
    except OSError as exc:
        raise LogIOError(directory, "read", exc) from exc
    return [os.path.join(directory, n) for n in sorted(names) if is_segment_name(n)]


def unfinished_directory(layer, directory: str) -> bool:
    """Whether ``directory`` is a log directory whose creation was cut short: it holds nothing but
    what creating one writes before segment 0 exists (its ``LOCK``, a create's temporary files).
    ``open_ledger`` with a geometry creates the log there."""
    try:
        names = layer.listdir(directory)
    except OSError:
        return False
    return all(n == LOCK_NAME or (".tmp-" in n and n.startswith((LOCK_NAME, SEGMENT_PREFIX))) for n in names)


def missing_tail(layer, directory: str, paths: list[str], header) -> CorruptLogError | None:
    """The error for a directory that lost its last segment(s), else None.

    A segment gets its sync stamp when it becomes the live one and keeps it until its successor
    holds a checkpoint; retention never deletes the live segment. So a stamp (``seg-N.kvlog.sync``)
    of this log (``header``: any of its segments' headers) whose segment sorts after the last one
    present names a segment that was lost with everything the stamp says was synced in it.
    """
    last = os.path.basename(paths[-1])
    try:
        names = layer.listdir(directory)
    except OSError as exc:
        raise LogIOError(directory, "read", exc) from exc
    suffix = ".sync"
    for name in sorted((n[: -len(suffix)] for n in names if n.endswith(suffix)), reverse=True):
        if not is_segment_name(name) or name <= last:
            break
        path = os.path.join(directory, name)
        if layer.exists(path):
            return None  # (a writer rolled to it after the caller listed the segments: not lost)
        try:
            stamp = decode_stamp(layer.read_stamp(path), header)
        except OSError:
            stamp = None
        if stamp is None:
            continue  # not this log's, or not a stamp: no evidence either way
        first = int(name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)])
        return CorruptLogError(path, stamp.size, first,
                               f"segment {name} is missing, and its sync stamp says it was synced up to seq "
                               f"{stamp.next_seq - 1}: the directory lost its last segment(s), synced events "
                               f"seq {first}-{stamp.next_seq - 1} are gone")
    return None


def _read(layer, path: str):
    try:
        return layer.read(path)
    except OSError as exc:
        raise LogIOError(path, "read", exc) from exc


def _link_error(path: str, what: str) -> CorruptLogError:
    return CorruptLogError(path, 0, None, f"segment does not continue the one before it: {what}")


def scan_segments(layer, paths: list[str], *, until: int | None = None, max_pages: int = DEFAULT_MAX_PAGES,
                  stamps: bool = True) -> tuple[list, list[Scan]]:
    """Map and verify segments in order: (buffers, scans). Stops after the first problem.

    A segment with a successor is checked against the successor's header (its
    size and last chain value: it must be complete and intact); the last one
    against its sync stamp. The caller releases the buffers.
    """
    raw_stamp = layer.read_stamp(paths[-1]) if stamps and hasattr(layer, "read_stamp") else None
    bufs = [_read(layer, p) for p in paths]
    try:
        headers = [decode_header(b, p, max_pages=max_pages) for b, p in zip(bufs, paths, strict=True)]
        scans: list[Scan] = []
        for i, (buf, p, hdr) in enumerate(zip(bufs, paths, headers, strict=True)):
            nxt = headers[i + 1] if i + 1 < len(headers) else None
            problem = _link_problem(headers[i - 1] if i else None, hdr, scans[-1] if scans else None)
            if problem is not None:
                res = Scan(p, hdr, len(buf))
                res.error = _link_error(p, problem)
                scans.append(res)
                break
            stamp = decode_stamp(raw_stamp, hdr) if nxt is None else \
                SyncStamp(log_id=hdr.log_id, size=nxt.prev_size, next_seq=nxt.first_seq, chain=nxt.prev_chain)
            res = scan(buf, p, until=until, stamp=stamp, max_pages=max_pages, segment=i)
            if nxt is not None and res.error is None and not res.stopped and (res.size != nxt.prev_size
                                                                              or res.torn_at is not None):
                res.error = CorruptLogError(p, res.end, res.next_seq, f"segment is {res.size} bytes, its successor "
                                            f"says it was closed at {nxt.prev_size}")
            scans.append(res)
            if res.error is not None or res.stopped:
                break
    except BaseException:
        for b in bufs:
            getattr(b, "close", lambda: None)()
        raise
    return bufs, scans


def _link_problem(prev, hdr, prev_scan: Scan | None) -> str | None:
    if hdr.version != 2:
        return f"format version {hdr.version} in a log directory"
    if prev is None:
        return None
    if hdr.log_id != prev.log_id:
        return "another log's segment (log id differs)"
    if hdr.segment != prev.segment + 1:
        return f"segment {hdr.segment} follows segment {prev.segment}"
    if prev_scan is not None and hdr.first_seq != prev_scan.next_seq:
        return f"first seq {hdr.first_seq}, the segment before ends at seq {prev_scan.next_seq}"
    return None


def combine(path: str, scans: list[Scan]) -> Scan:
    """One ``Scan`` for a view over several segments: every record, the last segment's end state,
    the first error."""
    last = scans[-1]
    res = Scan(path, last.header, last.size)
    for name in Scan.__slots__:
        if name not in ("path", "records"):
            setattr(res, name, getattr(last, name))
    res.records = [r for s in scans for r in s.records]
    return res
