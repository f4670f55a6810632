"""A log as a directory of segments: naming, reading, creating, rotating, retention.

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

    rotate       the ledger (``DurableLedger``) sees ``log.rotation_due`` (the
                 live segment reached ``segment_bytes``) and hands a checkpoint:
                 sync the live segment ─► create the next (atomic, durable) ─►
                 its checkpoint record ─► sync ─► stamp ─► retention
    retention    oldest segments first, never the live one: deleted while the
                 total passes ``retain_bytes`` or the count ``retain_segments``.
                 A reader that mapped a deleted segment keeps reading it whole.
    open         every segment verified and linked; a header-only last segment
                 (a rotation cut short by a crash) is removed; the writer
                 continues in the last segment (torn tail repaired as for a file)
"""

from __future__ import annotations

import os

from ..errors import CorruptLogError, LogError, LogIOError
from .format import (
    DEFAULT_MAX_PAGES,
    SEGMENT_HEADER_SIZE,
    SyncStamp,
    decode_header,
    decode_stamp,
    encode_segment_header,
    new_chain,
)
from .scan import Scan, scan

__all__ = ["SEGMENT_SUFFIX", "combine", "create_dir_log", "is_segment_name", "list_segments", "open_dir_log",
           "retain", "rotate", "scan_segments", "segment_name"]

SEGMENT_PREFIX, SEGMENT_SUFFIX = "seg-", ".kvlog"


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


# ---------------------------------------------------------------------- the writer's side


LOCK_NAME = "LOCK"


def _lock_dir(layer, directory: str):
    """Hold the log directory's writer lock (a handle on its ``LOCK`` file; closing releases it)."""
    path = os.path.join(directory, LOCK_NAME)
    if not layer.exists(path):
        try:
            return layer.create(path, b"")
        except LogError:
            pass  # (another writer created it first: open it, and find it locked)
    return layer.open(path)


def create_dir_log(cls, directory: str, header_args: tuple, log_kw: dict, segments: dict):
    """Create a log directory (0700) with its lock and segment 0 holding only its header."""
    geometry, policy, log_id = header_args
    try:
        layer = log_kw["layer"]
        layer.makedir(directory)
    except FileExistsError:
        from ..errors import LogExistsError

        raise LogExistsError(f"{directory} already exists") from None
    except OSError as exc:
        raise LogIOError(directory, "create", exc) from exc
    path = os.path.join(directory, segment_name(0))
    header = encode_segment_header(geometry, policy, log_id, segment=0, first_seq=0, prev_size=0,
                                   prev_chain=bytes(8))
    try:
        lock = _lock_dir(layer, directory)
        handle = layer.create(path, header)
    except OSError as exc:
        raise LogIOError(directory, "create", exc) from exc
    chain = new_chain(log_id)
    chain.update(header)
    hdr = decode_header(header, path, max_pages=log_kw.pop("max_pages"))
    return cls(handle, hdr, size=len(header), next_seq=0, chain=chain,
               segments={**segments, "path": directory, "lock": lock}, **log_kw)


def open_dir_log(cls, directory: str, *, repair: bool, loader, max_pages: int, log_kw: dict, segments: dict):
    """Open a log directory for appending: lock, verify every segment, repair, continue in the last."""
    from ..errors import TornLogError
    from .reader import LogView

    layer = log_kw["layer"]
    if not list_segments(layer, directory):  # (before the lock file: nothing is written into another directory)
        raise LogError(f"{directory} is a directory without log segments, not a kvledger log")
    try:
        lock = _lock_dir(layer, directory)
    except OSError as exc:
        raise LogIOError(directory, "open", exc) from exc
    try:
        paths = _drop_empty_tail(layer, list_segments(layer, directory))
        bufs, scans = scan_segments(layer, paths, max_pages=max_pages)
        res = combine(directory, scans)
        view = LogView(bufs[0], res, directory, bufs=bufs, paths=paths[: len(scans)])
        try:
            res.raise_error()
            if res.torn_at is not None and not repair:
                raise TornLogError(paths[-1], res.torn_at, res.torn_bytes)
            loaded = loader(view) if loader is not None else None
        finally:
            view.close()
        handle = layer.open(paths[-1])
    except BaseException:
        lock.close()
        raise
    return res, loaded, handle, paths[-1], {**segments, "path": directory, "lock": lock}


def _drop_empty_tail(layer, paths: list[str]) -> list[str]:
    """Remove a last segment that holds only its header (a rotation cut short: it holds nothing)."""
    if len(paths) > 1 and layer.size_of(paths[-1]) <= SEGMENT_HEADER_SIZE:
        try:
            layer.remove(paths[-1])
            layer.remove_stamp(paths[-1])
        except OSError as exc:
            raise LogIOError(paths[-1], "remove", exc) from exc
        return paths[:-1]
    if not paths:
        raise LogError("no segments (not a kvledger log directory)")
    return paths


def rotate(log, seq: int, digest: str, state: bytes) -> None:
    """Close the live segment and open the next with a checkpoint at ``seq`` (see the module docstring).

    Raises ``LogIOError`` (the log then refuses appends, as for any failed write)."""
    log.sync()
    if log._syncer is not None:
        log._syncer.quiesce()  # (no round may still publish the old segment's size)
    hdr, layer = log.header, log._layer
    path = os.path.join(log.path, segment_name(seq))
    header = encode_segment_header(hdr.geometry, hdr.policy, hdr.log_id, segment=log._segment + 1, first_seq=seq,
                                   prev_size=log._synced_end, prev_chain=log._head)
    try:
        handle = layer.create(path, header)
    except OSError as exc:
        log._fail("rotate", exc)
        raise  # (unreachable: _fail raises)
    old, old_path = log._handle, log._file
    chain = new_chain(hdr.log_id)
    chain.update(header)
    # appends go to the new segment from now on (everything before it was synced)
    log._handle, log._file, log._chain, log._head = handle, path, chain, bytes(8)
    log._end = log._size = log._synced_end = len(header)
    log._segment += 1
    log.rotation_due = False
    old.close()
    try:
        layer.remove_stamp(old_path)  # (its successor proves the old segment complete from now on)
    except OSError as exc:
        log._fail("rotate", exc)
    log.checkpoint(seq, digest, state)
    log.sync()
    retain(log)


def retain(log) -> list[str]:
    """Delete the oldest segments past the retention bounds (never the live one); returns them."""
    if log.retain_bytes is None and log.retain_segments is None:
        return []
    layer = log._layer
    paths = list_segments(layer, log.path)
    sizes = [layer.size_of(p) for p in paths]
    gone = []
    while len(paths) > 1 and ((log.retain_bytes is not None and sum(sizes) > log.retain_bytes)
                              or (log.retain_segments is not None and len(paths) > log.retain_segments)):
        p = paths.pop(0)
        sizes.pop(0)
        try:
            layer.remove(p)
            layer.remove_stamp(p)
        except OSError as exc:
            log._fail("retain", exc)
        gone.append(p)
    log.segments_deleted += len(gone)
    return gone

