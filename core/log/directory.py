"""A log directory, the write side: its lock, creating it, rolling to the next segment, retention.

    LogDirectory
        path, lock          the directory and the handle on its ``LOCK`` file (the writer's flock)
        segment_bytes       roll when the live segment passes this
        retain_bytes,       delete the oldest segments (never the live one) while the total
        retain_segments     size passes ``retain_bytes`` or the count ``retain_segments``

    create(...)  ─► mkdir (0700, durable) ─► LOCK ─► segment 0 (header only, atomic)
                    ─► the head (``HEAD.sync``) names segment 0
                    an existing directory that holds only what an interrupted create
                    leaves (``segments.unfinished_directory``) is finished, not refused
    roll(live, seq, checkpoint) ─► the live segment is synced whole ─► its successor is
                    created atomically and durably *with* its opening checkpoint
                    (``LiveSegment.successor``) ─► the successor is stamped ─► the head
                    names it ─► the old segment's stamp is removed (its successor now
                    proves it complete) ─► retention
    retain()        oldest first; a reader that mapped a deleted segment keeps it whole

A crash at any point of a roll leaves either the old segment last (synced, its
stamp in place) or the new one whole: the new segment never exists without its
checkpoint, so reopening never appends behind a missing one. The head never names
a segment before it exists whole, so a head naming a segment that is not there
means the directory lost it (``segments.missing_tail``); a writer that removes a
last segment itself (``drop_empty_tail``, a torn opening checkpoint at reopen)
moves the head back first. Every method raises
``OSError`` (or ``LogError`` from the layer); the caller (``durability.py``) fails
the log with it.
"""

from __future__ import annotations

import os

from ..errors import InvalidArgumentError, LogError, LogExistsError, LogIOError
from .files import FileHandle, release_buffer
from .format import SEGMENT_HEADER_SIZE, decode_header, decode_stamp, encode_segment_header, new_chain
from .live import LiveSegment
from .segments import (
    LOCK_NAME,
    is_segment_name,
    list_segments,
    segment_name,
    unfinished_directory,
    write_head,
)

__all__ = ["LogDirectory", "segment_options"]


def segment_options(segment_bytes, retain_bytes, retain_segments) -> dict | None:
    """Checked directory options (None: a single-file log). Raises ``InvalidArgumentError``."""
    if segment_bytes is None:
        if retain_bytes is not None or retain_segments is not None:
            raise InvalidArgumentError("retention needs a segmented log (segment_bytes=...)")
        return None
    for name, v, low in (("segment_bytes", segment_bytes, 4096), ("retain_bytes", retain_bytes, 1),
                         ("retain_segments", retain_segments, 1)):
        if v is not None and (type(v) is not int or v < low):
            raise InvalidArgumentError(f"{name} must be an int >= {low}, got {v!r}")
    return {"segment_bytes": segment_bytes, "retain_bytes": retain_bytes, "retain_segments": retain_segments}


class LogDirectory:
    """The write side of a log directory (see the module docstring)."""

    __slots__ = ("path", "layer", "lock", "segment_bytes", "retain_bytes", "retain_segments", "deleted")

    def __init__(self, path: str, layer, lock: FileHandle, *, segment_bytes: int, retain_bytes: int | None = None,
                 retain_segments: int | None = None) -> None:
        self.path = path
        self.layer = layer
        self.lock = lock
        self.segment_bytes = segment_bytes
        self.retain_bytes = retain_bytes
        self.retain_segments = retain_segments
        self.deleted = 0  # segments deleted by retention

    # ------------------------------------------------------------------ opening

    @staticmethod
    def take_lock(layer, directory: str) -> FileHandle:
        """Hold the directory's writer lock (a handle on its ``LOCK`` file; closing releases it).
        Raises ``LogLockedError``, ``OSError``."""
        path = os.path.join(directory, LOCK_NAME)
        if not layer.exists(path):
            try:
                return layer.create(path, b"")
            except LogExistsError:
                pass  # (another writer created it first: open it, and find it locked)
        return layer.open(path)

    @classmethod
    def create(cls, layer, directory: str, header: bytes, options: dict, *,
               max_pages: int) -> tuple[LogDirectory, LiveSegment]:
        """Create ``directory`` (or finish an interrupted create) with segment 0 holding ``header``.

        Raises ``LogExistsError`` (the path exists and is not an unfinished log directory),
        ``LogIOError``, ``LogLockedError``."""
        try:
            layer.makedir(directory)
        except FileExistsError:
            if not (layer.isdir(directory) and unfinished_directory(layer, directory)):
                raise LogExistsError(f"{directory} already exists") from None
        except OSError as exc:
            raise LogIOError(directory, "create", exc) from exc
        path = os.path.join(directory, segment_name(0))
        try:
            lock = cls.take_lock(layer, directory)
        except OSError as exc:
            raise LogIOError(directory, "create", exc) from exc
        hdr = decode_header(header, path, max_pages=max_pages)
        try:
            if list_segments(layer, directory):  # (someone else finished it meanwhile)
                raise LogExistsError(f"{directory} already exists")
            handle = layer.create(path, header)
            try:
                write_head(layer, directory, hdr)
            except BaseException:
                handle.close()
                raise
        except OSError as exc:
            lock.close()
            raise LogIOError(directory, "create", exc) from exc
        except BaseException:
            lock.close()
            raise
        chain = new_chain(hdr.log_id)
        chain.update(header)
        return cls(directory, layer, lock, **options), LiveSegment(handle, hdr, size=len(header), chain=chain)

    def drop_empty_tail(self, paths: list[str]) -> list[str]:
        """Remove a last segment that holds only its header (a roll of an older kvledger cut short by a
        crash: it holds nothing, and no stamp says it held more); returns the segments left. Anything
        else at that name (a link, a FIFO, a file that is not a bare header) is left for the scan and
        the open to judge. Raises ``LogIOError``, ``LogError`` (not a regular file)."""
        if not paths:
            raise LogError(f"{self.path}: no segments (not a kvledger log directory)")
        last = paths[-1]
        if len(paths) == 1 or self.layer.size_of(last) > SEGMENT_HEADER_SIZE:
            return paths
        data = self.layer.read(last)  # (refuses a FIFO, a device, a directory; follows a link)
        size = len(data)
        try:
            header = decode_header(data, last, max_pages=1 << 32)
        except LogError:
            return paths  # not a bare header: the scan reports it
        finally:
            release_buffer(data)
        stamp = decode_stamp(self.layer.read_stamp(last), header)
        if size != header.size or (stamp is not None and stamp.size > header.size):
            return paths
        self.drop_last(paths)
        return paths[:-1]

    def drop_last(self, paths: list[str]) -> None:
        """Remove the last of ``paths`` (a segment that holds nothing a crash did not leave torn),
        moving the head back to the one before it first, so that the head never names a segment
        this writer removed. Raises ``LogIOError``, ``LogError`` (the one before is no segment)."""
        last, prev = paths[-1], paths[-2]
        data = self.layer.read(prev)
        try:
            prev_header = decode_header(data, prev, max_pages=1 << 32)
        finally:
            release_buffer(data)
        try:
            write_head(self.layer, self.path, prev_header)
            self.layer.remove(last)
            self.layer.remove_stamp(last)
        except OSError as exc:
            raise LogIOError(last, "remove", exc) from exc

    # ------------------------------------------------------------------ writing

    def roll(self, live: LiveSegment, seq: int, checkpoint: bytes, next_seq: int) -> LiveSegment:
        """Close ``live`` and return its successor at ``seq``, opening with ``checkpoint`` (an encoded
        ``Checkpoint``), stamped (``next_seq``: the seq after the checkpoint); then apply retention.
        ``live`` must be synced whole. Raises ``OSError`` (see the module docstring for what a
        failure at each point leaves)."""
        nxt = live.successor(self.layer, self.path, seq, checkpoint)
        live.close()
        nxt.stamp(self.layer, next_seq)
        write_head(self.layer, self.path, nxt.header)
        self.layer.remove_stamp(live.path)
        self.retain()
        return nxt

    def retain(self) -> list[str]:
        """Delete the oldest segments past the retention bounds (never the live one); returns them."""
        if self.retain_bytes is None and self.retain_segments is None:
            return []
        layer = self.layer
        paths = [os.path.join(self.path, n) for n in sorted(layer.listdir(self.path)) if is_segment_name(n)]
        sizes = [layer.size_of(p) for p in paths]
        gone = []
        while len(paths) > 1 and ((self.retain_bytes is not None and sum(sizes) > self.retain_bytes)
                                  or (self.retain_segments is not None and len(paths) > self.retain_segments)):
            p = paths.pop(0)
            sizes.pop(0)
            layer.remove(p)
            layer.remove_stamp(p)
            gone.append(p)
        self.deleted += len(gone)
        return gone

    def release(self) -> None:
        self.lock.close()


def segment_header(geometry, policy: str, log_id: bytes) -> bytes:
    """Segment 0's header."""
    return encode_segment_header(geometry, policy, log_id, segment=0, first_seq=0, prev_size=0, prev_chain=bytes(8))
