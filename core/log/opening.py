"""Creating and reopening a log: what an ``EventLog`` continues from.

    create_log   a file: header written atomically and durably (temp file, fsync, link,
                 directory fsync), locked for this writer; a directory: ``LogDirectory.create``
    open_log     lock ─► read ─► scan (CRC, chain, seq, the sync stamp; a directory: every
                 segment, linked, and no head or stamp naming a lost last segment) ─►
                 [corruption: raise, nothing changed] ─► [a directory whose last segment's
                 opening checkpoint is torn: the head moves back, that segment goes, scan
                 again] ─► loader(view) (the ledger rebuilds its state; raising leaves the
                 files as they were) ─► truncate a torn tail ─► fsync ─► stamp (─► the head
                 names the last segment)

Both return an ``Opened``: the live segment (``live.py``), the directory's write
side (``directory.py``; None for a file), the next seq, and for an open what
the scan found and what the loader built. ``EventLog.create`` / ``EventLog.open``
build the log from it. Nothing here keeps running after it returns.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from ..errors import InvalidArgumentError, LogError, LogIOError, TornLogError
from ..events.events import Geometry
from .directory import LogDirectory, segment_header
from .files import default_layer, release_buffer
from .format import HEADER_SIZE, decode_header, decode_stamp, encode_header, new_chain
from .live import LiveSegment
from .reader import LogView, read_stamp
from .scan import Scan, scan
from .segments import Head, combine, head, list_segments, missing_tail, scan_segments, write_head

__all__ = ["Opened", "create_log", "open_log"]


class Opened(NamedTuple):
    live: LiveSegment
    directory: LogDirectory | None
    next_seq: int
    recovery: Scan | None = None
    loaded: Any = None


def create_log(path, geometry: Geometry, *, policy: str, layer, log_id: bytes | None, max_pages: int,
               segments: dict | None) -> Opened:
    """Create a new log holding only its header, atomically and durably.

    ``segments`` (``directory.segment_options``): make ``path`` a log directory.
    Raises ``LogExistsError`` if ``path`` exists (a directory whose creation was
    cut short is finished instead), ``LogError`` for a geometry over
    ``max_pages``, ``LogIOError`` if the file cannot be written (nothing is left
    at ``path`` then).
    """
    if not isinstance(geometry, Geometry):
        raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
    path = os.fspath(path)
    if geometry.num_pages > max_pages:
        raise LogError(f"{path}: {geometry.num_pages:,} pages is more than max_pages={max_pages:,}; "
                       "pass a larger max_pages (readers of the log will need it too)")
    layer = layer if layer is not None else default_layer
    log_id = log_id if log_id is not None else os.urandom(16)
    header_bytes = encode_header(geometry, policy, log_id)  # (checks the policy and the sizes first)
    if segments is not None:
        directory, live = LogDirectory.create(layer, path, segment_header(geometry, policy, log_id), segments,
                                              max_pages=max_pages)
        return Opened(live, directory, 0)
    try:
        handle = layer.create(path, header_bytes)
    except LogError:
        raise
    except OSError as exc:
        raise LogIOError(path, "create", exc) from exc
    chain = new_chain(log_id)
    chain.update(header_bytes)
    return Opened(LiveSegment(handle, decode_header(header_bytes, path, max_pages=max_pages), size=HEADER_SIZE,
                              chain=chain), None, 0)


def open_log(path, *, layer, repair: bool, loader, max_pages: int, segments: dict | None) -> Opened:
    """Open an existing log for appending: verify it, repair a torn tail, fsync, stamp.

    ``loader(view)``, if given, runs on the verified records before anything
    is changed on disk (the ledger rebuilds its state there); its result is
    ``loaded``. If it raises, the files are left exactly as they were.

    Raises ``CorruptLogError`` (damage that is not a torn tail, including damage
    before the sync stamp, and a directory missing its last segment: synced
    events lost; nothing is changed), ``TornLogError`` (a torn tail and
    ``repair=False``), ``LogVersionError``, ``LogLockedError``, ``LogError`` (not
    a regular file, a symbolic link, another user's file, a geometry over
    ``max_pages``) or ``LogIOError``.
    """
    layer = layer if layer is not None else default_layer
    path = os.fspath(path)
    if getattr(layer, "isdir", None) is not None and layer.isdir(path):
        return _open_directory(layer, path, repair, loader, max_pages, segments or {"segment_bytes": 64 << 20})
    try:
        handle = layer.open(path)
    except FileNotFoundError:
        raise LogError(f"{path}: no such log") from None
    except OSError as exc:
        raise LogIOError(path, "open", exc) from exc
    try:
        res, loaded = _verify(handle, layer, path, repair, loader, max_pages)
        live = _continue(handle, res, layer)
    except BaseException:
        handle.close()
        raise
    return Opened(live, None, res.next_seq, res, loaded)


def _open_directory(layer, directory: str, repair: bool, loader, max_pages: int, options: dict) -> Opened:
    """Lock, verify every segment, repair, continue in the last; the head names it."""
    if not list_segments(layer, directory):  # (before the lock file: nothing is written into another directory)
        raise LogError(f"{directory} is a directory without log segments, not a kvledger log")
    try:
        lock = LogDirectory.take_lock(layer, directory)
    except OSError as exc:
        raise LogIOError(directory, "open", exc) from exc
    d = LogDirectory(directory, layer, lock, **options)
    dropped: tuple[int | None, int] | None = None
    try:
        while True:
            paths = d.drop_empty_tail(list_segments(layer, directory))
            bufs, scans = scan_segments(layer, paths, max_pages=max_pages)
            res = combine(directory, scans)
            view = LogView(None, res, directory, bufs=bufs, paths=paths[: len(scans)])
            try:
                res.raise_error()
                lost = missing_tail(layer, directory, paths, res.header)
                if lost is not None:
                    raise lost
                if res.torn_at is not None and not repair:
                    raise TornLogError(paths[-1], res.torn_at, res.torn_bytes)
                if _torn_opening_checkpoint(scans, paths):
                    dropped = (scans[-1].torn_at, scans[-1].torn_bytes)
                    d.drop_last(paths)  # it held nothing else: continue in the segment before it
                    continue
                loaded = loader(view) if loader is not None else None
            finally:
                view.close()
            break
        handle = layer.open(paths[-1])
        try:
            live = _continue(handle, res, layer)
            if dropped is not None:  # reported as the torn tail it was (its offset in the segment removed)
                res.torn_at, res.torn_bytes = dropped
            if head(layer, directory, res.header.log_id) != Head(res.header.segment, res.header.first_seq):
                write_head(layer, directory, res.header)  # (a directory of an older kvledger has none)
        except OSError as exc:
            handle.close()
            raise LogIOError(paths[-1], "stamp", exc) from exc
        except BaseException:
            handle.close()
            raise
    except BaseException:
        lock.close()
        raise
    return Opened(live, d, res.next_seq, res, loaded)


def _torn_opening_checkpoint(scans: list[Scan], paths: list[str]) -> bool:
    """Whether the last segment (not the first) holds its header and a torn tail from there:
    its opening checkpoint never made it whole (a roll of another writer, or damage nothing
    proves was synced). Truncating it would leave a segment without its checkpoint, which
    every later open refuses; removing it loses nothing (the checkpoint restates the state
    the segment before it ends with) and appends continue in the segment before it."""
    last = scans[-1]
    return (len(scans) == len(paths) > 1 and not last.records and last.error is None
            and last.torn_at == last.header.size)


def _verify(handle, layer, path: str, repair: bool, loader, max_pages: int):
    """Scan what the handle holds (with the stamp) and run the loader; nothing is changed."""
    try:
        buf = handle.read()
    except OSError as exc:
        raise LogIOError(path, "read", exc) from exc
    view = None
    try:
        header = decode_header(buf, path, max_pages=max_pages)
        stamp = decode_stamp(read_stamp(layer, path), header)
        res = scan(buf, path, stamp=stamp, max_pages=max_pages)
        res.raise_error()
        if res.torn_at is not None and not repair:
            raise TornLogError(path, res.torn_at, res.torn_bytes)
        loaded = None
        if loader is not None:
            view = LogView(buf, res, path)
            loaded = loader(view)
    finally:
        if view is not None:
            view.close()
        else:
            release_buffer(buf)
    return res, loaded


def _continue(handle, res: Scan, layer) -> LiveSegment:
    """Cut the torn tail off, make what remains durable (what we read may sit only in the page
    cache), stamp it: the live segment appends continue in."""
    path = handle.path
    if res.torn_at is not None:
        try:
            handle.truncate(res.end)
        except OSError as exc:
            raise LogIOError(path, "truncate", exc) from exc
    try:
        handle.sync()
    except OSError as exc:
        raise LogIOError(path, "fsync", exc) from exc
    head = bytes.fromhex(res.chain_head) if res.chain_head else bytes(8)
    live = LiveSegment(handle, res.header, size=res.end, chain=res.chain, head=head)
    try:
        live.stamp(layer, res.next_seq)
    except OSError as exc:
        raise LogIOError(path, "stamp", exc) from exc
    return live

