"""The on-disk format of the event log: header, records, hash chain, and the scan.

Sans-I/O: everything here works on a buffer (``bytes``, ``bytearray`` or an
``mmap``) and never touches a file. ``log.py`` does the I/O.

File layout (all integers little-endian unless noted)::

    offset 0: header, 64 bytes
        0   8  magic            b"\\x89KVLOG\\r\\n"
        8   2  format version   1
       10   2  header size      64
       12  16  log id           random; keys the hash chain, tells logs apart
       28   8  num_pages
       36   8  page_tokens
       44  16  clear policy     ASCII, NUL padded
       60   4  CRC-32 of bytes [0, 60)
    then records, back to back:
        0   2  magic            b"KR"
        2   1  kind             1 events | 2 checkpoint | 3 close
        3   1  flags            0
        4   4  n                payload length
        8   8  seq              events: seq of the first event; checkpoint and
                                close: seq the next event will get
       16   4  count            events in the payload (0 for other kinds)
       20   8  synced           file size covered by the last completed fsync
                                when the record was sealed
       28   n  payload          events: MessagePack array32 of events (each the
                                msgspec encoding of an ``Event``); checkpoint:
                                MessagePack ``Checkpoint``; close: empty
     28+n   8  chain            BLAKE2b-64 keyed with the log id over every byte
                                of the file before this field
     36+n   4  CRC-32 of the record's bytes [0, 36+n)

A record of events is one group commit: the events appended since the last
flush (with ``fsync="per_step"``, one step). ``chain`` makes every record
depend on everything before it, so a record that was deleted, duplicated,
reordered, spliced in from another log or edited (with its CRC fixed) breaks the
chain at that record. The chain key is in the header: the chain detects damage
and edits that do not rewrite the rest of the file; whoever can rewrite the
whole file can forge it, so pin the chain head (``Scan.chain_head``) elsewhere
if that matters.

Torn tail or corruption? A crash can leave anything after the last completed
fsync: holes of zeros, torn records, later writes without earlier ones. Bytes
before it were synced and must be intact. Every record carries ``synced``, the
file size the writer knew to be durable when it sealed the record, so an intact
record proves that every byte before its ``synced`` was fsynced. A damaged
record (bad magic, impossible length, bad CRC) is a torn tail, to be truncated,
when no intact record anywhere after it proves its bytes were synced; otherwise
it is corruption (``CorruptLogError``), never skipped. A record that is intact
by its CRC but does not continue the chain or the sequence is corruption
wherever it is: no crash produces it. A log closed with ``EventLog.close`` ends
with a close record that proves the whole file synced, so damage in any record
but the last one of a closed log is corruption.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any

import msgspec

from ..errors import CorruptLogError, LogError, LogVersionError
from ..events.events import CLEAR_POLICIES, Event, Geometry

__all__ = [
    "FILE_MAGIC",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "RECORD_MAGIC",
    "RECORD_OVERHEAD",
    "PREFIX_SIZE",
    "KIND_EVENTS",
    "KIND_CHECKPOINT",
    "KIND_CLOSE",
    "KIND_NAMES",
    "Checkpoint",
    "LogHeader",
    "RecordInfo",
    "Scan",
    "encode_header",
    "decode_header",
    "new_chain",
    "max_record_bytes",
    "max_event_bytes",
    "seal_record",
    "scan",
    "decode_events",
    "decode_checkpoint",
]

FILE_MAGIC = b"\x89KVLOG\r\n"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sHH16sQQ16s")  # 60 bytes, then the CRC
_U32 = struct.Struct("<I")

RECORD_MAGIC = b"KR"
KIND_EVENTS, KIND_CHECKPOINT, KIND_CLOSE = 1, 2, 3
KIND_NAMES = {KIND_EVENTS: "events", KIND_CHECKPOINT: "checkpoint", KIND_CLOSE: "close"}
PREFIX = struct.Struct("<2sBBIQIQ")
PREFIX_SIZE = PREFIX.size  # 28
TRAILER_SIZE = 12  # chain (8) + crc (4)
RECORD_OVERHEAD = PREFIX_SIZE + TRAILER_SIZE  # 40
_PERSON = b"kvledger-log-v1"
_U64_MAX = (1 << 64) - 1








class Checkpoint(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A state checkpoint: ``state`` is ``LedgerState.canonical_bytes()`` after ``seq`` events."""

    seq: int
    digest: str
    state: bytes


class LogHeader(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    version: int
    log_id: bytes
    geometry: Geometry
    policy: str


class RecordInfo(msgspec.Struct, frozen=True, gc=False):
    """Where one verified record lies (positional: built once per record in the scan)."""

    offset: int
    kind: int
    seq: int
    count: int
    length: int  # payload bytes
    synced: int

    @property
    def end(self) -> int:
        return self.offset + RECORD_OVERHEAD + self.length


def max_record_bytes(num_pages: int) -> int:
    """Largest payload a reader accepts: bounds what a garbage length can make it read."""
    return min((64 << 20) + 64 * num_pages, 0xFFFF_FFFF - RECORD_OVERHEAD)


def max_event_bytes(num_pages: int) -> int:
    """Largest single encoded event the writer accepts (page lists are bounded by num_pages)."""
    return (1 << 20) + 10 * num_pages


def new_chain(log_id: bytes):
    """A fresh chain hash for a log (feed it the header first)."""
    return hashlib.blake2b(digest_size=8, key=log_id, person=_PERSON)


# ---------------------------------------------------------------------- header


def encode_header(geometry: Geometry, policy: str, log_id: bytes) -> bytes:
    if policy not in CLEAR_POLICIES:
        raise LogError(f"unknown clear policy {policy!r}")
    if len(log_id) != 16:
        raise LogError("log id must be 16 bytes")
    n, t = geometry.num_pages, geometry.page_tokens
    if not (0 < n <= _U64_MAX and 0 < t <= _U64_MAX):
        raise LogError(f"geometry {geometry} does not fit the log header")
    body = _HEADER.pack(FILE_MAGIC, FORMAT_VERSION, HEADER_SIZE, log_id, n, t, policy.encode("ascii"))
    return body + _U32.pack(zlib.crc32(body))


def decode_header(buf, path: str = "<memory>") -> LogHeader:
    """Parse and check the header. Raises ``CorruptLogError`` (offset 0) or ``LogVersionError``."""
    size = len(buf)
    if size < 12 or bytes(buf[:8]) != FILE_MAGIC:
        if size < 8 and FILE_MAGIC.startswith(bytes(buf[:size])):
            raise CorruptLogError(path, 0, None, f"file is {size} bytes, shorter than the log header")
        raise CorruptLogError(path, 0, None, "not a kvledger log (bad magic)")
    version, hsize = struct.unpack_from("<HH", buf, 8)
    if version != FORMAT_VERSION:
        raise LogVersionError(f"{path}: log format version {version}; this kvledger reads version {FORMAT_VERSION}")
    if hsize != HEADER_SIZE or size < HEADER_SIZE:
        raise CorruptLogError(path, 0, None, f"header size {hsize}, file size {size}: expected a {HEADER_SIZE}-byte header")
    (crc,) = _U32.unpack_from(buf, 60)
    if zlib.crc32(bytes(buf[:60])) != crc:
        raise CorruptLogError(path, 0, None, "header checksum mismatch")
    _, _, _, log_id, n, t, policy = _HEADER.unpack_from(buf, 0)
    policy_s = policy.rstrip(b"\x00").decode("ascii", "replace")
    if policy_s not in CLEAR_POLICIES or not 0 < n <= (1 << 32) or t < 1:
        raise CorruptLogError(path, 0, None, f"header names an invalid geometry ({n}, {t}) or policy {policy_s!r}")
    return LogHeader(version=version, log_id=log_id, geometry=Geometry(num_pages=n, page_tokens=t), policy=policy_s)


# ---------------------------------------------------------------------- records


def seal_record(buf: bytearray, start: int, chain) -> None:
    """Append chain and CRC to the record whose prefix and payload sit at ``buf[start:]``.

    ``chain`` has seen every byte of the log before ``start``; it sees the whole
    record (trailer included) afterwards.
    """
    body = buf[start:]
    chain.update(body)
    ch = chain.digest()
    trailer = ch + _U32.pack(zlib.crc32(ch, zlib.crc32(body)))
    chain.update(trailer)
    buf += trailer


class Scan:
    """What a full verification pass found in a log's bytes.

    ``records``: every verified record, in order. ``end``: where the verified
    records end (where appends continue). ``torn_at``/``torn_bytes``: tail damage
    after ``end`` (None/0 when the file ends cleanly). ``error``: the
    ``CorruptLogError`` that stopped the scan, if any (records before it are
    verified). ``next_seq``: the seq the next event gets. ``closed``: the last
    record is a close record. ``chain``: the chain hash after ``end`` (for the
    writer). ``chain_head``: the chain value of the last record, hex.
    """

    __slots__ = ("path", "header", "records", "end", "size", "torn_at", "torn_bytes", "error",
                 "next_seq", "closed", "chain", "chain_head", "synced")

    def __init__(self, path: str, header: LogHeader, size: int) -> None:
        self.path = path
        self.header = header
        self.records: list[RecordInfo] = []
        self.end = HEADER_SIZE
        self.size = size
        self.torn_at: int | None = None
        self.torn_bytes = 0
        self.error: CorruptLogError | None = None
        self.next_seq = 0
        self.closed = False
        self.chain: Any = None
        self.chain_head = ""
        self.synced = HEADER_SIZE

    @property
    def events(self) -> int:
        return self.next_seq

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def _intact(buf, pos: int, size: int, cap: int) -> int:
    """The ``synced`` claim of an intact record at ``pos`` (CRC and structure), or -1."""
    if size - pos < RECORD_OVERHEAD:
        return -1
    magic, kind, flags, n, seq, count, synced = PREFIX.unpack_from(buf, pos)
    if magic != RECORD_MAGIC or flags or not 1 <= kind <= 3 or n > cap or size - pos - RECORD_OVERHEAD < n:
        return -1
    end = pos + RECORD_OVERHEAD + n
    rec = buf[pos:end]
    if zlib.crc32(memoryview(rec)[:-4]) != _U32.unpack_from(rec, len(rec) - 4)[0]:
        return -1
    return synced


def _last_claim_after(buf, off: int, size: int, cap: int) -> tuple[int, int]:
    """(offset, synced) of the last intact record that starts after ``off``, or (-1, -1)."""
    end = size - RECORD_OVERHEAD + len(RECORD_MAGIC)
    while end > off + 1:
        pos = buf.rfind(RECORD_MAGIC, off + 1, end)
        if pos < 0:
            return -1, -1
        claim = _intact(buf, pos, size, cap)
        if claim >= 0:
            return pos, claim
        end = pos + 1
    return -1, -1


def scan(buf, path: str = "<memory>", *, until: int | None = None) -> Scan:
    """Verify every record of a log held in ``buf``; never raises for bad record bytes.

    ``until``: stop after the records that hold events up to seq ``until`` (a
    partial replay need not verify the rest of a long log; ``end`` is then
    where the scan stopped and nothing after it is reported).

    Header problems raise (``CorruptLogError`` at offset 0, ``LogVersionError``).
    Record problems end the scan: tail damage sets ``torn_at``/``torn_bytes``,
    corruption sets ``error`` (see the module docstring for which is which).
    Payloads are checked but not decoded (``decode_events``).
    """
    size = len(buf)
    header = decode_header(buf, path)
    res = Scan(path, header, size)
    cap = max_record_bytes(header.geometry.num_pages)
    chain = new_chain(header.log_id)
    chain.update(buf[:HEADER_SIZE])
    unpack = PREFIX.unpack_from
    crc32 = zlib.crc32
    records = res.records
    append = records.append
    off = HEADER_SIZE
    expect = 0
    synced_max = HEADER_SIZE
    last_kind = 0
    head = b""
    damaged = False
    stop = (1 << 64) if until is None else until + 1  # (a checkpoint at until + 1 holds the state after until)
    while off < size:
        if size - off < RECORD_OVERHEAD:
            damaged = True
            break
        magic, kind, flags, n, seq, count, synced = unpack(buf, off)
        if seq > stop:
            break
        if magic != RECORD_MAGIC or flags or not 1 <= kind <= 3 or n > cap or size - off - RECORD_OVERHEAD < n:
            damaged = True
            break
        rec = buf[off : off + RECORD_OVERHEAD + n]
        mv = memoryview(rec)
        if crc32(mv[:-4]) != _U32.unpack_from(rec, n + PREFIX_SIZE + 8)[0]:
            damaged = True
            break
        chain.update(mv[:-TRAILER_SIZE])
        ch = chain.digest()
        if ch != rec[n + PREFIX_SIZE : n + PREFIX_SIZE + 8]:
            res.error = CorruptLogError(
                path, off, expect,
                f"{KIND_NAMES[kind]} record claiming seq {seq} does not continue the log's hash chain "
                "(a record was deleted, duplicated, reordered, spliced in from another log, or edited)",
            )
            break
        detail = None
        if seq != expect:
            detail = f"record has seq {seq}, expected {expect}"
        elif kind == KIND_EVENTS:
            if count < 1 or n < 5 or rec[PREFIX_SIZE] != 0xDD or int.from_bytes(rec[PREFIX_SIZE + 1 : PREFIX_SIZE + 5], "big") != count:
                detail = f"events record with count {count} and a payload that is not an array of {count}"
        elif count != 0 or (kind == KIND_CLOSE and n != 0):
            detail = f"{KIND_NAMES[kind]} record with count {count} and {n} payload bytes"
        if detail is None and not synced_max <= synced <= off:
            detail = f"record claims {synced} bytes synced (previous claim {synced_max}, record offset {off})"
        if detail is not None:
            res.error = CorruptLogError(path, off, expect, detail)
            break
        chain.update(mv[-TRAILER_SIZE:])
        synced_max = synced
        append(RecordInfo(off, kind, seq, count, n, synced))
        expect = seq + count
        last_kind = kind
        head = ch
        off += RECORD_OVERHEAD + n
    res.end = off
    res.next_seq = expect
    res.chain = chain
    res.chain_head = head.hex()
    res.synced = synced_max
    if damaged:
        pos, claim = _last_claim_after(buf, off, size, cap)
        if claim > off:
            res.error = CorruptLogError(
                path, off, expect,
                f"damaged record inside the synced part of the log (the intact record at offset {pos} "
                f"proves the first {claim} bytes were synced)",
            )
        else:
            res.torn_at = off
            res.torn_bytes = size - off
    res.closed = res.error is None and not damaged and last_kind == KIND_CLOSE
    if res.error is not None:
        res.chain = None  # the hash saw bytes of a bad record: no base for appends
    return res


# ---------------------------------------------------------------------- payloads

_EVENTS = msgspec.msgpack.Decoder(list[Event])
_CHECKPOINT = msgspec.msgpack.Decoder(Checkpoint)


def decode_events(buf, rec: RecordInfo, path: str = "<memory>") -> list:
    """The events of a verified events record. Raises ``CorruptLogError`` naming offset and seq."""
    start = rec.offset + PREFIX_SIZE
    try:
        events = _EVENTS.decode(buf[start : start + rec.length])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptLogError(path, rec.offset, rec.seq, f"events payload does not decode: {exc}") from None
    if len(events) != rec.count:
        raise CorruptLogError(path, rec.offset, rec.seq, f"record holds {len(events)} events, its header says {rec.count}")
    return events


def decode_checkpoint(buf, rec: RecordInfo, path: str = "<memory>") -> Checkpoint:
    start = rec.offset + PREFIX_SIZE
    try:
        cp = _CHECKPOINT.decode(buf[start : start + rec.length])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptLogError(path, rec.offset, rec.seq, f"checkpoint payload does not decode: {exc}") from None
    if cp.seq != rec.seq:
        raise CorruptLogError(path, rec.offset, rec.seq, f"checkpoint payload names seq {cp.seq}")
    return cp
