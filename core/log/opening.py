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
    scan,
)
from .reader import LogView, read_stamp
from .writer import DEFAULT_MAX_LAG_BYTES, policy_mode

__all__ = ["create_log", "open_log"]


def create_log(cls, path, geometry: Geometry, *, policy: str = "released_aliases", fsync: str = "background",
               background: bool | None = None, layer=None, log_id: bytes | None = None,
               max_pages: int = DEFAULT_MAX_PAGES, max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES):
    """Create a new log holding only its header, atomically and durably.

    Raises ``LogExistsError`` if ``path`` exists, ``LogError`` for a geometry over
    ``max_pages`` (readers would refuse the log), ``LogIOError`` if the file
    cannot be written (nothing is left at ``path`` then).
    """
    policy_mode(fsync, background)
    if not isinstance(geometry, Geometry):
        raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
    path = os.fspath(path)
    if geometry.num_pages > max_pages:
        raise LogError(f"{path}: {geometry.num_pages:,} pages is more than max_pages={max_pages:,}; "
                       "pass a larger max_pages (readers of the log will need it too)")
    layer = layer if layer is not None else default_layer
    header_bytes = encode_header(geometry, policy, log_id if log_id is not None else os.urandom(16))
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
             max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES):
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
    head = bytes.fromhex(res.chain_head) if res.chain_head else bytes(8)
    log = cls(handle, res.header, fsync=fsync, size=res.end, next_seq=res.next_seq, chain=res.chain, head=head,
              background=background, layer=layer, max_lag_bytes=max_lag_bytes)
    log.recovery = res
    log.loaded = loaded
    try:
        log._stamp()
    except BaseException:
        log.abandon()
        raise
    return log


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
