"""Creating and reopening an ``EventLog``: atomic create, verify, repair a torn tail, stamp.

    create_log   header written atomically and durably (temp file, fsync, link,
                 directory fsync), the log locked for this writer
    open_log     lock ─► read ─► scan (CRC, chain, seq, the sync stamp) ─►
                 [corruption: raise, nothing changed] ─► loader(view) (the
                 ledger rebuilds its state; raising leaves the file as it was)
                 ─► truncate a torn tail ─► fsync ─► stamp ─► appendable log

``EventLog.create`` and ``EventLog.open`` call these.
"""

from __future__ import annotations

import os

from ..errors import InvalidArgumentError, LogError, LogIOError, TornLogError
from ..events.events import Geometry
from .files import default_layer, release_buffer
from .format import (
    DEFAULT_MAX_PAGES,
    HEADER_SIZE,
    decode_header,
    decode_stamp,
    encode_header,
    new_chain,
)
from .reader import LogView, read_stamp
from .scan import scan
from .writer import DEFAULT_MAX_LAG_BYTES, policy_mode

__all__ = ["create_log", "open_log"]


def _segment_options(segment_bytes, retain_bytes, retain_segments) -> dict | None:
    if segment_bytes is None:
        if retain_bytes is not None or retain_segments is not None:
            raise InvalidArgumentError("retention needs a segmented log (segment_bytes=...)")
        return None
    for name, v, low in (("segment_bytes", segment_bytes, 4096), ("retain_bytes", retain_bytes, 1),
                         ("retain_segments", retain_segments, 1)):
        if v is not None and (type(v) is not int or v < low):
            raise InvalidArgumentError(f"{name} must be an int >= {low}, got {v!r}")
    return {"segment_bytes": segment_bytes, "retain_bytes": retain_bytes, "retain_segments": retain_segments}


def create_log(cls, path, geometry: Geometry, *, policy: str = "released_aliases", fsync: str = "background",
               background: bool | None = None, layer=None, log_id: bytes | None = None,
               max_pages: int = DEFAULT_MAX_PAGES, max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES,
               segment_bytes: int | None = None, retain_bytes: int | None = None,
               retain_segments: int | None = None):
    """Create a new log holding only its header, atomically and durably.

    ``segment_bytes``: make ``path`` a log directory of segments of about that
    size (``segments.py``), with the retention bounds ``retain_bytes`` /
    ``retain_segments`` (oldest segments deleted past them); otherwise one file.
    Raises ``LogExistsError`` if ``path`` exists, ``LogError`` for a geometry over
    ``max_pages`` (readers would refuse the log), ``LogIOError`` if the file
    cannot be written (nothing is left at ``path`` then).
    """
    segs = _segment_options(segment_bytes, retain_bytes, retain_segments)
    policy_mode(fsync, background)
    if not isinstance(geometry, Geometry):
        raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
    path = os.fspath(path)
    if geometry.num_pages > max_pages:
        raise LogError(f"{path}: {geometry.num_pages:,} pages is more than max_pages={max_pages:,}; "
                       "pass a larger max_pages (readers of the log will need it too)")
    layer = layer if layer is not None else default_layer
    log_id = log_id if log_id is not None else os.urandom(16)
    if segs is not None:
        from .segments import create_dir_log

        encode_header(geometry, policy, log_id)  # (checks the policy and the sizes first)
        kw = {"fsync": fsync, "background": background, "layer": layer, "max_lag_bytes": max_lag_bytes,
              "max_pages": max_pages}
        return create_dir_log(cls, path, (geometry, policy, log_id), kw, segs)
    header_bytes = encode_header(geometry, policy, log_id)
    try:
        handle = layer.create(path, header_bytes)
    except LogError:
        raise
    except OSError as exc:
        raise LogIOError(path, "create", exc) from exc
    chain = new_chain(header_bytes[12:28])
    chain.update(header_bytes)
    return cls(handle, decode_header(header_bytes, path, max_pages=max_pages), fsync=fsync, size=HEADER_SIZE,
               next_seq=0, chain=chain, background=background, layer=layer, max_lag_bytes=max_lag_bytes)


def open_log(cls, path, *, fsync: str = "background", background: bool | None = None, layer=None,
             repair: bool = True, loader=None, max_pages: int = DEFAULT_MAX_PAGES,
             max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES, segment_bytes: int | None = None,
             retain_bytes: int | None = None, retain_segments: int | None = None):
    """Open an existing log for appending: verify it, repair a torn tail, fsync, stamp.

    ``loader(view)``, if given, runs on the verified records before anything
    is changed on disk (the ledger rebuilds its state there); its result is
    ``log.loaded``. If it raises, the file is left exactly as it was.

    Raises ``CorruptLogError`` (damage that is not a torn tail, including damage
    before the sync stamp: synced events lost; the file is untouched),
    ``TornLogError`` (a torn tail and ``repair=False``), ``LogVersionError``,
    ``LogLockedError``, ``LogError`` (not a regular file, a symbolic link,
    another user's file, a geometry over ``max_pages``) or ``LogIOError``.
    """
    policy_mode(fsync, background)
    layer = layer if layer is not None else default_layer
    path = os.fspath(path)
    segs = None
    if getattr(layer, "isdir", None) is not None and layer.isdir(path):
        from .segments import open_dir_log

        opts = _segment_options(segment_bytes or 64 << 20, retain_bytes, retain_segments)
        res, loaded, handle, _, segs = open_dir_log(cls, path, repair=repair, loader=loader, max_pages=max_pages,
                                                    log_kw={"layer": layer}, segments=opts or {})
        try:
            _repair(handle, handle.path, res)
        except BaseException:
            handle.close()
            segs["lock"].close()
            raise
    else:
        res, loaded, handle = _open_file(layer, path, repair, loader, max_pages)
    head = bytes.fromhex(res.chain_head) if res.chain_head else bytes(8)
    log = cls(handle, res.header, fsync=fsync, size=res.end, next_seq=res.next_seq, chain=res.chain, head=head,
              background=background, layer=layer, max_lag_bytes=max_lag_bytes, segments=segs)
    log.recovery = res
    log.loaded = loaded
    try:
        log._stamp()
    except BaseException:
        log.abandon()
        raise
    return log


def _open_file(layer, path: str, repair: bool, loader, max_pages: int):
    """Lock, verify and repair a single-file log: (scan, loaded, handle)."""
    try:
        handle = layer.open(path)
    except FileNotFoundError:
        raise LogError(f"{path}: no such log") from None
    except OSError as exc:
        raise LogIOError(path, "open", exc) from exc
    try:
        res, loaded = _verify(handle, layer, path, repair, loader, max_pages)
        _repair(handle, path, res)
    except BaseException:
        handle.close()
        raise
    return res, loaded, handle


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


def _repair(handle, path: str, res) -> None:
    """Cut the torn tail off and make what remains durable (what we read may sit only in the page cache)."""
    if res.torn_at is not None:
        try:
            handle.truncate(res.end)
        except OSError as exc:
            raise LogIOError(path, "truncate", exc) from exc
    try:
        handle.sync()
    except OSError as exc:
        raise LogIOError(path, "fsync", exc) from exc
