"""The live segment: the one file appends go to, and the records it seals.

    LiveSegment
        handle, path      the open, locked file (a log file, or the last segment of a directory)
        header            its header (geometry, policy, log id; for a segment its index)
        chain, head       the hash chain after the last record, and that record's chain value
        size, synced      bytes written to the file, and bytes known to be on stable storage

    seal(items) ─► bytes  pending records (``batch.py``) become records: events encoded
                          (one msgspec call per record), prefix, chain value, CRC; each
                          record's ``synced`` claim is ``synced`` at that moment
    write(data)           append to the file                       (``size`` grows)
    sync()                fsync it                                 (``synced = size``)
    stamp(next_seq)       the out-of-band proof that all of it is synced (``format.SyncStamp``)
    successor(...)        the next segment of a directory, created atomically and durably
                          holding its header and its opening checkpoint (never one without
                          the other: a crash leaves the old segment last, or the new one whole)

Invariants: ``synced <= size``; ``chain`` has seen every byte of the file up to
``size`` plus whatever ``seal`` returned and was not yet written (the caller
writes what it sealed, in order, or fails the log); ``head`` is the chain value
of the last sealed record. Only the writer side (``durability.py``) calls these,
from one thread at a time. Raises ``OSError`` from the file layer; the caller
turns it into ``LogIOError`` and stops the log.
"""

from __future__ import annotations

import os

import msgspec

from .files import FileHandle
from .format import (
    KIND_CHECKPOINT,
    KIND_EVENTS,
    PREFIX,
    PREFIX_SIZE,
    RECORD_MAGIC,
    LogHeader,
    SyncStamp,
    decode_header,
    encode_segment_header,
    encode_stamp,
    new_chain,
    seal_record,
)
from .segments import segment_name

__all__ = ["LiveSegment", "SPLIT_BYTES"]

SPLIT_BYTES = 1 << 20  # an events record whose payload passes this is cut in two (bounds a reader's record)
_ARRAY32 = 0xDD


class LiveSegment:
    """The file appends go to (see the module docstring)."""

    __slots__ = ("handle", "path", "header", "chain", "head", "size", "synced", "_enc")

    def __init__(self, handle: FileHandle, header: LogHeader, *, size: int, chain, head: bytes = bytes(8)) -> None:
        self.handle = handle
        self.path = handle.path
        self.header = header
        self.chain = chain
        self.head = head
        self.size = size
        self.synced = size  # (a segment is handed over synced: created durably, or repaired and fsynced)
        self._enc = msgspec.msgpack.Encoder()

    @property
    def index(self) -> int:
        """The segment's index in its directory (0 for a single-file log)."""
        return self.header.segment

    # ------------------------------------------------------------------ records

    def seal(self, items) -> tuple[bytearray, int]:
        """The records of ``items`` (``(kind, seq, count, body)``: body a list of events or a payload)
        as bytes to write next, and how many records that is."""
        buf = bytearray()
        records = 0
        for kind, seq, _, body in items:
            if kind == KIND_EVENTS:
                records += self._seal_events(buf, seq, body)
            else:
                self._seal(buf, kind, seq, 0, body)
                records += 1
        return buf, records

    def _seal_events(self, buf: bytearray, seq: int, events: list) -> int:
        """One events record (two or more when its payload would pass ``SPLIT_BYTES``)."""
        start = len(buf)
        n = len(events)
        buf += bytes(PREFIX_SIZE + 5)
        # msgspec writes the array's own header (1, 3 or 5 bytes); it lands so that it ends where
        # the array32 header the format wants ends, and is then overwritten by it
        head = 1 if n < 16 else 3 if n < 65536 else 5
        self._enc.encode_into(events, buf, start + PREFIX_SIZE + 5 - head)
        size = len(buf) - start - PREFIX_SIZE
        if size > SPLIT_BYTES and n > 1:
            del buf[start:]
            half = n // 2
            return self._seal_events(buf, seq, events[:half]) + self._seal_events(buf, seq + half, events[half:])
        at = start + PREFIX_SIZE
        buf[at] = _ARRAY32
        buf[at + 1 : at + 5] = n.to_bytes(4, "big")
        PREFIX.pack_into(buf, start, RECORD_MAGIC, KIND_EVENTS, 0, size, seq, n, self.synced)
        self.head = seal_record(buf, start, self.chain)
        return 1

    def _seal(self, buf: bytearray, kind: int, seq: int, count: int, payload: bytes) -> None:
        start = len(buf)
        buf += PREFIX.pack(RECORD_MAGIC, kind, 0, len(payload), seq, count, self.synced)
        buf += payload
        self.head = seal_record(buf, start, self.chain)

    # ------------------------------------------------------------------ I/O

    def write(self, data) -> None:
        self.handle.write(data)
        self.size += len(data)

    def sync(self) -> None:
        self.handle.sync()
        self.synced = self.size

    def stamp(self, layer, next_seq: int) -> bool:
        """Record out of band that every byte of the file is synced (False: not all of it is yet)."""
        if self.size != self.synced:
            return False
        stamp = SyncStamp(log_id=self.header.log_id, size=self.synced, next_seq=next_seq, chain=self.head)
        layer.write_stamp(self.path, encode_stamp(stamp))
        return True

    def close(self) -> None:
        self.handle.close()

    def successor(self, layer, directory: str, seq: int, checkpoint: bytes) -> LiveSegment:
        """Create the next segment of ``directory`` at ``seq``, atomically and durably, holding its
        header and a checkpoint record (``checkpoint``: the encoded ``Checkpoint`` payload).

        This segment must be synced whole first (its successor's header names its size and last
        chain value). Raises ``OSError`` (nothing was created then) or ``LogError``."""
        hdr = self.header
        header = encode_segment_header(hdr.geometry, hdr.policy, hdr.log_id, segment=hdr.segment + 1,
                                       first_seq=seq, prev_size=self.synced, prev_chain=self.head)
        chain = new_chain(hdr.log_id)
        chain.update(header)
        data = bytearray(header)
        nxt_header = decode_header(header, max_pages=hdr.geometry.num_pages)
        path = os.path.join(directory, segment_name(seq))
        # the checkpoint's claim: the header (the whole file is created durably at once)
        start = len(data)
        data += PREFIX.pack(RECORD_MAGIC, KIND_CHECKPOINT, 0, len(checkpoint), seq, 0, len(header))
        data += checkpoint
        head = seal_record(data, start, chain)
        handle = layer.create(path, bytes(data))
        return LiveSegment(handle, nxt_header, size=len(data), chain=chain, head=head)
