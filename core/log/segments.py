"""A log as a directory of segments, the read side: naming, listing, scanning, linking.

    <log dir>/                            mode 0700
        seg-00000000000000000000.kvlog    segment 0: events from seq 0
        seg-00000000000000812345.kvlog    segment k: opens with a checkpoint at seq 812345
        seg-00000000000000812345.kvlog.sync   the last segment's sync stamp
        HEAD.sync                         the directory's head: the newest segment created
                                          (index, first seq), replaced atomically at each roll

Every segment is a version-2 file (``format.encode_segment_header``): its
header names its index, its first seq, and the final size and chain value of
the segment before it, so a segment that was deleted from the middle, cut short,
reordered or taken from another log breaks the link, and a segment that has a
successor is complete (damage in it is corruption, never a torn tail). Segment
k > 0 opens with a checkpoint, so any segment is a starting point: replay,
audit and ``open_ledger`` fold from its checkpoint on.

    list_segments      the segment files of a directory, in seq order
    scan_segments      map and verify segments in order, each against its successor's
                       header (complete and intact) and the last one against its stamp,
                       holding at most two mapped at once while it scans
    SegmentBuffers     a view's segments: at most ``MAPPED_SEGMENTS`` mapped (each mapping
                       holds a file descriptor), the others mapped again when a record of
                       theirs is read, and checked to still hold what was verified
    missing_tail       a head, or a sync stamp, naming a segment after the last one present:
                       the directory lost its tail (``CorruptLogError`` naming what is gone)
    head / write_head  the directory's head stamp (44 bytes: magic, log id, index, first seq,
                       CRC-32): which segment is the newest. Losing the last segment *with*
                       its sync stamp leaves the head naming it, so that too is detected
                       (issue 32); only a directory that also lost ``HEAD.sync`` cannot tell
    combine            one ``Scan`` for a view over several segments

The write side (creating a directory, rolling to the next segment, retention)
is ``directory.py``; the live segment is ``live.py``.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import OrderedDict
from typing import NamedTuple

from ..errors import CorruptLogError, LogError, LogIOError
from .files import release_buffer
from .format import (
    DEFAULT_MAX_PAGES,
    SyncStamp,
    decode_header,
    decode_stamp,
)
from .scan import Scan, scan

__all__ = ["HEAD_NAME", "LOCK_NAME", "MAPPED_SEGMENTS", "SEGMENT_SUFFIX", "Head", "SegmentBuffers", "combine",
           "encode_head", "head", "is_segment_name", "list_segments", "missing_tail", "scan_segments",
           "segment_name", "unfinished_directory", "write_head"]

MAPPED_SEGMENTS = 32  # segments a view keeps mapped at once (a mapping holds a file descriptor)

SEGMENT_PREFIX, SEGMENT_SUFFIX = "seg-", ".kvlog"
LOCK_NAME = "LOCK"
HEAD_NAME = "HEAD"  # written through the layer's stamp call: the file is ``HEAD.sync``
_HEAD = struct.Struct("<8s16sQQ")  # magic, log id, segment index, its first seq; then a CRC-32
_HEAD_MAGIC = b"KVLHEAD1"


class Head(NamedTuple):
    """The newest segment a directory's writer created: its index and first seq."""

    segment: int
    first_seq: int


def encode_head(log_id: bytes, segment: int, first_seq: int) -> bytes:
    body = _HEAD.pack(_HEAD_MAGIC, log_id, segment, first_seq)
    return body + struct.pack("<I", zlib.crc32(body))


def head(layer, directory: str, log_id: bytes) -> Head | None:
    """The directory's head, if it has one for log ``log_id`` (None: none, unreadable, another
    log's, or a layer without stamps: no evidence either way)."""
    reader = getattr(layer, "read_stamp", None)
    if reader is None:
        return None
    try:
        data = reader(os.path.join(directory, HEAD_NAME))
    except (OSError, LogError):
        return None
    if data is None or len(data) != _HEAD.size + 4 or data[:8] != _HEAD_MAGIC:
        return None
    if zlib.crc32(data[: _HEAD.size]) != struct.unpack_from("<I", data, _HEAD.size)[0]:
        return None
    _, owner, segment, first_seq = _HEAD.unpack_from(data, 0)
    return Head(segment, first_seq) if owner == log_id else None


def write_head(layer, directory: str, header) -> None:
    """Say, durably and atomically, that the segment with ``header`` is the directory's newest
    (a layer without stamps: nothing). Raises ``OSError``."""
    writer = getattr(layer, "write_stamp", None)
    if writer is not None:
        writer(os.path.join(directory, HEAD_NAME), encode_head(header.log_id, header.segment, header.first_seq))


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
    """The error for a directory that lost its last segment(s), else None (``header``: the
    header of the last segment present).

    A segment gets its sync stamp when it becomes the live one and keeps it until its
    successor holds a checkpoint; retention never deletes the live segment. So a stamp
    (``seg-N.kvlog.sync``) of this log whose segment sorts after the last one present names
    a segment that was lost with everything the stamp says was synced in it. Lost together
    with its stamp, the segment is still named by the head (``HEAD.sync``: the newest
    segment the writer created, moved back only by a writer that removes one itself): a
    head of this log naming a segment after the last one present says the tail is gone.
    A directory of an older kvledger has no head until a writer opens it.
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
    newest = head(layer, directory, header.log_id)
    if newest is not None and newest.segment > header.segment:
        name = segment_name(newest.first_seq)
        if not layer.exists(os.path.join(directory, name)):  # (else: a writer rolled after the listing)
            return CorruptLogError(os.path.join(directory, name), 0, newest.first_seq,
                                   f"segment {name} is missing: the directory's head (HEAD.sync) names it as "
                                   f"segment {newest.segment}, "
                                   f"but the last segment present is segment {header.segment} ({last}): the "
                                   f"directory lost its last {newest.segment - header.segment} segment(s), sync "
                                   f"stamps and all; every event after the last present segment's is gone (the "
                                   f"newest segment began at seq {newest.first_seq})")
    return None


def _read(layer, path: str):
    try:
        return layer.read(path)
    except OSError as exc:
        raise LogIOError(path, "read", exc) from exc


def _link_error(path: str, what: str) -> CorruptLogError:
    return CorruptLogError(path, 0, None, f"segment does not continue the one before it: {what}")


class SegmentBuffers:
    """The mapped segments of a view over a log directory, at most ``limit`` at once.

    A mapping holds a file descriptor, so a view that kept every segment of a long
    log mapped could not open one with more segments than ``RLIMIT_NOFILE`` allows
    (issue 32). ``scan_segments`` hands each segment over as it verified it; the
    ``limit`` used most recently stay mapped, and ``get`` maps another again when one
    of its records is read (a fold reads them in order: each is mapped once more).

    A segment mapped again must still hold what was verified: its header bytes, at
    least the verified length, and the chain value of its last verified record at the
    same place. Closed segments never change and the last one only grows or is
    replaced by its own prefix (``files``), so that holds unless the file was deleted
    meanwhile (retention, while a reader folds a long log: ``LogError``, read the log
    again) or replaced by other bytes (``CorruptLogError``). A log of at most
    ``limit`` segments stays mapped whole, as before: a reader keeps its view whole
    whatever retention deletes.
    """

    __slots__ = ("layer", "paths", "limit", "_held", "_kept", "remapped")

    def __init__(self, layer, paths: list[str], limit: int = MAPPED_SEGMENTS) -> None:
        self.layer = layer
        self.paths = paths
        self.limit = max(1, limit)
        self._held: OrderedDict[int, object] = OrderedDict()  # index -> buffer, least recently used first
        self._kept: dict[int, tuple[bytes, int, int, bytes]] = {}  # index -> (header, verified end, the last
        #                                                            verified record's end, its chain value)
        self.remapped = 0  # segments mapped again on demand

    def put(self, i: int, buf, scanned: Scan) -> None:
        """Hold segment ``i``'s buffer, verified as ``scanned`` (may unmap the least recently used)."""
        last = scanned.records[-1].end if scanned.records else 0
        chain = bytes(buf[last - 12 : last - 4]) if last else b""
        self._kept[i] = (bytes(buf[: scanned.header.size]), scanned.end, last, chain)
        self._hold(i, buf)

    def _hold(self, i: int, buf) -> None:
        self._held[i] = buf
        self._held.move_to_end(i)
        while len(self._held) > self.limit:
            _, old = self._held.popitem(last=False)
            release_buffer(old)

    def get(self, i: int):
        """Segment ``i``'s buffer: held, or mapped again and checked (class docstring)."""
        buf = self._held.get(i)
        if buf is not None:
            self._held.move_to_end(i)
            return buf
        path = self.paths[i]
        header, end, last, chain = self._kept[i]
        try:
            buf = self.layer.read(path)
        except FileNotFoundError:
            raise LogError(f"{path} was deleted (by retention?) while this view was reading it: "
                           "read the log again") from None
        except OSError as exc:
            raise LogIOError(path, "read", exc) from exc
        same = len(buf) >= end and bytes(buf[: len(header)]) == header
        if not same or (last and bytes(buf[last - 12 : last - 4]) != chain):
            release_buffer(buf)
            raise CorruptLogError(path, 0, None, "the segment no longer holds what was verified when the view "
                                  "was made (replaced meanwhile)")
        self.remapped += 1
        self._hold(i, buf)
        return buf

    def close(self) -> None:
        held, self._held = self._held, OrderedDict()
        for buf in held.values():
            release_buffer(buf)


def scan_segments(layer, paths: list[str], *, until: int | None = None, max_pages: int = DEFAULT_MAX_PAGES,
                  stamps: bool = True, limit: int = MAPPED_SEGMENTS) -> tuple[SegmentBuffers, list[Scan]]:
    """Map and verify segments in order: (their buffers, scans). Stops after the first problem.

    A segment with a successor is checked against the successor's header (its
    size and last chain value: it must be complete and intact); the last one
    against its sync stamp. At most two segments are mapped for the scan itself
    (one and its successor's header); the buffers keep the ``limit`` most recent
    (``SegmentBuffers``). The caller closes the buffers.
    """
    raw_stamp = layer.read_stamp(paths[-1]) if stamps and hasattr(layer, "read_stamp") else None
    held = SegmentBuffers(layer, paths, limit)
    scans: list[Scan] = []
    loose: list = []  # mapped here and not yet handed to ``held``: released if anything raises
    try:
        buf = _read(layer, paths[0])
        loose.append(buf)
        hdr = decode_header(buf, paths[0], max_pages=max_pages)
        prev = None
        for i, p in enumerate(paths):
            nxt = nxt_buf = None
            if i + 1 < len(paths):
                nxt_buf = _read(layer, paths[i + 1])
                loose.append(nxt_buf)
                nxt = decode_header(nxt_buf, paths[i + 1], max_pages=max_pages)
            problem = _link_problem(prev, hdr, scans[-1] if scans else None)
            if problem is not None:
                res = Scan(p, hdr, len(buf))
                res.error = _link_error(p, problem)
                res.segment = i
            else:
                stamp = decode_stamp(raw_stamp, hdr) if nxt is None else \
                    SyncStamp(log_id=hdr.log_id, size=nxt.prev_size, next_seq=nxt.first_seq, chain=nxt.prev_chain)
                res = scan(buf, p, until=until, stamp=stamp, max_pages=max_pages, segment=i)
                if nxt is not None and res.error is None and not res.stopped and (res.size != nxt.prev_size
                                                                                  or res.torn_at is not None):
                    res.error = CorruptLogError(p, res.end, res.next_seq, f"segment is {res.size} bytes, its "
                                                f"successor says it was closed at {nxt.prev_size}")
            scans.append(res)
            loose = [b for b in loose if b is not buf]
            held.put(i, buf, res)
            if res.error is not None or res.stopped or nxt is None:
                break
            prev, buf, hdr = hdr, nxt_buf, nxt
    except BaseException:
        held.close()
        raise
    finally:
        for b in loose:
            release_buffer(b)
    return held, scans


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
