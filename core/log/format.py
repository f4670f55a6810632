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
    "DEFAULT_MAX_PAGES",
    "SEGMENT_HEADER_SIZE",
    "SEGMENT_VERSION",
    "encode_segment_header",
    "STAMP_SIZE",
    "SyncStamp",
    "encode_stamp",
    "decode_stamp",
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
SEGMENT_VERSION = 2
SEGMENT_HEADER_SIZE = 96
_SEGMENT = struct.Struct("<QQQ8s")  # segment, first seq, previous segment's size and chain; at offset 60
_HEADER_SIZES = {FORMAT_VERSION: HEADER_SIZE, SEGMENT_VERSION: SEGMENT_HEADER_SIZE}
DEFAULT_MAX_PAGES = 1 << 22  # readers refuse a header claiming more pages unless given a larger max_pages
STAMP_MAGIC = b"KVSYNC\r\n"
_STAMP = struct.Struct("<8s16sQQ8s")  # 48 bytes, then the CRC
STAMP_SIZE = _STAMP.size + 4








class Checkpoint(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A state checkpoint: ``state`` is ``LedgerState.canonical_bytes()`` after ``seq`` events."""

    seq: int
    digest: str
    state: bytes


class LogHeader(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A file's header. Version 2 (a segment of a log directory) adds where the segment sits:
    its index, the seq of its first record, and the final size and chain value of the segment
    before it (zero for segment 0)."""

    version: int
    log_id: bytes
    geometry: Geometry
    policy: str
    size: int = 64  # header bytes: where records start
    segment: int = 0
    first_seq: int = 0
    prev_size: int = 0
    prev_chain: bytes = bytes(8)


class RecordInfo(msgspec.Struct, frozen=True, gc=False):
    """Where one verified record lies (positional: built once per record in the scan)."""

    offset: int
    kind: int
    seq: int
    count: int
    length: int  # payload bytes
    synced: int
    segment: int = 0  # which file of the view holds it (0 for a single-file log)

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


def encode_segment_header(geometry: Geometry, policy: str, log_id: bytes, *, segment: int, first_seq: int,
                          prev_size: int, prev_chain: bytes) -> bytes:
    """The 96-byte version-2 header of a segment (``docs/LOG-FORMAT.md``)."""
    v1 = encode_header(geometry, policy, log_id)
    body = v1[:8] + struct.pack("<HH", SEGMENT_VERSION, SEGMENT_HEADER_SIZE) + v1[12:60] \
        + _SEGMENT.pack(segment, first_seq, prev_size, prev_chain)
    return body + _U32.pack(zlib.crc32(body))


def decode_header(buf, path: str = "<memory>", *, max_pages: int = DEFAULT_MAX_PAGES) -> LogHeader:
    """Parse and check the header (version 1, or a version-2 segment's). Raises ``CorruptLogError``
    (offset 0), ``LogVersionError``, or ``LogError`` for a geometry over ``max_pages`` (nothing
    was allocated for it)."""
    size = len(buf)
    if size < 12 or bytes(buf[:8]) != FILE_MAGIC:
        if size < 8 and FILE_MAGIC.startswith(bytes(buf[:size])):
            raise CorruptLogError(path, 0, None, f"file is {size} bytes, shorter than the log header")
        raise CorruptLogError(path, 0, None, "not a kvledger log (bad magic)")
    version, hsize = struct.unpack_from("<HH", buf, 8)
    if version not in _HEADER_SIZES:
        raise LogVersionError(f"{path}: log format version {version}; this kvledger reads versions "
                              f"{sorted(_HEADER_SIZES)}")
    want = _HEADER_SIZES[version]
    if hsize != want or size < want:
        raise CorruptLogError(path, 0, None, f"header size {hsize}, file size {size}: expected a {want}-byte header")
    (crc,) = _U32.unpack_from(buf, want - 4)
    if zlib.crc32(bytes(buf[: want - 4])) != crc:
        raise CorruptLogError(path, 0, None, "header checksum mismatch")
    extra: dict = {}
    if version == SEGMENT_VERSION:
        seg, first, prev_size, prev_chain = _SEGMENT.unpack_from(buf, 60)
        if (seg == 0) != (first == 0 and prev_size == 0):
            raise CorruptLogError(path, 0, None, f"segment {seg} header names first seq {first}, previous size "
                                  f"{prev_size}")
        extra = {"size": want, "segment": seg, "first_seq": first, "prev_size": prev_size, "prev_chain": prev_chain}
    _, _, _, log_id, n, t, policy = _HEADER.unpack_from(buf, 0)
    policy_s = policy.rstrip(b"\x00").decode("ascii", "replace")
    if policy_s not in CLEAR_POLICIES or not 0 < n <= (1 << 32) or t < 1:
        raise CorruptLogError(path, 0, None, f"header names an invalid geometry ({n}, {t}) or policy {policy_s!r}")
    if n > max_pages:
        raise LogError(f"{path}: the header claims {n:,} pages, more than max_pages={max_pages:,} (the limit on "
                       "what a log may make a reader allocate; pass a larger max_pages to read it)")
    return LogHeader(version=version, log_id=log_id, geometry=Geometry(num_pages=n, page_tokens=t), policy=policy_s,
                     **extra)


# ---------------------------------------------------------------------- sync stamps


class SyncStamp(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The log's first ``size`` bytes (records up to seq ``next_seq``, chain value ``chain``) were synced."""

    log_id: bytes
    size: int
    next_seq: int
    chain: bytes


def encode_stamp(stamp: SyncStamp) -> bytes:
    body = _STAMP.pack(STAMP_MAGIC, stamp.log_id, stamp.size, stamp.next_seq, stamp.chain)
    return body + _U32.pack(zlib.crc32(body))


def decode_stamp(data: bytes | None, header: LogHeader) -> SyncStamp | None:
    """The stamp in ``data`` if it is one, intact, of this log; else None (no evidence either way)."""
    if data is None or len(data) != STAMP_SIZE or data[:8] != STAMP_MAGIC:
        return None
    if zlib.crc32(data[: STAMP_SIZE - 4]) != _U32.unpack_from(data, STAMP_SIZE - 4)[0]:
        return None
    _, log_id, size, next_seq, chain = _STAMP.unpack_from(data, 0)
    if log_id != header.log_id or size < header.size:
        return None
    return SyncStamp(log_id=log_id, size=size, next_seq=next_seq, chain=chain)


# ---------------------------------------------------------------------- records


def seal_record(buf: bytearray, start: int, chain) -> bytes:
    """Append chain and CRC to the record whose prefix and payload sit at ``buf[start:]``.

    ``chain`` has seen every byte of the log before ``start``; it sees the whole
    record (trailer included) afterwards. Returns the record's chain value.
    """
    body = buf[start:]
    chain.update(body)
    ch = chain.digest()
    trailer = ch + _U32.pack(zlib.crc32(ch, zlib.crc32(body)))
    chain.update(trailer)
    buf += trailer
    return ch


class Scan:
    """What a full verification pass found in a log's bytes.

    ``records``: every verified record, in order. ``end``: where the verified
    records end (where appends continue). ``torn_at``/``torn_bytes``: tail damage
    after ``end`` (None/0 when the file ends cleanly). ``error``: the
    ``CorruptLogError`` that stopped the scan, if any (records before it are
    verified). ``torn_events``: the events the first torn record claimed, when
    its prefix is readable (events lost past the last synced point; None: unknown).
    ``stopped``: the scan stopped early at ``until``. ``next_seq``: the seq the next event gets. ``closed``: the last
    record is a close record. ``chain``: the chain hash after ``end`` (for the
    writer). ``chain_head``: the chain value of the last record, hex.
    """

    __slots__ = ("path", "header", "records", "end", "size", "torn_at", "torn_bytes", "torn_events", "error",
                 "next_seq", "closed", "chain", "chain_head", "synced", "stopped", "segment")

    def __init__(self, path: str, header: LogHeader, size: int) -> None:
        self.path = path
        self.header = header
        self.records: list[RecordInfo] = []
        self.end = header.size
        self.size = size
        self.torn_at: int | None = None
        self.torn_bytes = 0
        self.torn_events: int | None = None
        self.stopped = False
        self.segment = 0  # index of this file in a view's list of files (``RecordInfo.segment``)
        self.error: CorruptLogError | None = None
        self.next_seq = 0
        self.closed = False
        self.chain: Any = None
        self.chain_head = ""
        self.synced = header.size

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


def _bad_content(rec, kind: int, n: int, seq: int, count: int, synced: int, expect: int, synced_max: int,
                 off: int) -> str | None:
    """What is wrong with an intact, chained record's fields (None: nothing)."""
    if seq != expect:
        return f"record has seq {seq}, expected {expect}"
    if kind == KIND_EVENTS:
        if count < 1 or n < 5 or count > n or rec[PREFIX_SIZE] != 0xDD \
                or int.from_bytes(rec[PREFIX_SIZE + 1 : PREFIX_SIZE + 5], "big") != count:
            return f"events record with count {count} and a payload that is not an array of {count}"
    elif count != 0 or (kind == KIND_CLOSE and n != 0):
        return f"{KIND_NAMES[kind]} record with count {count} and {n} payload bytes"
    if not synced_max <= synced <= off:
        return f"record claims {synced} bytes synced (previous claim {synced_max}, record offset {off})"
    return None


def _chain_error(path: str, off: int, expect: int, kind: int, seq: int) -> CorruptLogError:
    return CorruptLogError(
        path, off, expect,
        f"{KIND_NAMES[kind]} record claiming seq {seq} does not continue the log's hash chain "
        "(a record was deleted, duplicated, reordered, spliced in from another log, or edited)",
    )


def _walk(buf, res: Scan, chain, stop: int) -> bool:
    """Verify records from the header on into ``res``; True when a damaged record ended the walk."""
    size, path = res.size, res.path
    cap = max_record_bytes(res.header.geometry.num_pages)
    unpack, crc32, append = PREFIX.unpack_from, zlib.crc32, res.records.append
    hdr = res.header
    off, expect, synced_max, last_kind, head = hdr.size, hdr.first_seq, hdr.size, 0, b""
    seg = res.segment
    damaged = False
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
            res.error = _chain_error(path, off, expect, kind, seq)
            break
        detail = _bad_content(rec, kind, n, seq, count, synced, expect, synced_max, off)
        if detail is not None:
            res.error = CorruptLogError(path, off, expect, detail)
            break
        chain.update(mv[-TRAILER_SIZE:])
        synced_max = synced
        append(RecordInfo(off, kind, seq, count, n, synced, seg))
        expect = seq + count
        last_kind = kind
        head = ch
        off += RECORD_OVERHEAD + n
    res.end, res.next_seq, res.chain, res.chain_head, res.synced = off, expect, chain, head.hex(), synced_max
    res.closed = res.error is None and not damaged and last_kind == KIND_CLOSE
    return damaged


def _check_stamp(buf, res: Scan, stamp: SyncStamp) -> None:
    """The records must reach the stamp's size on a record boundary, with the stamp's chain value."""
    if res.error is not None or res.end < stamp.size:
        return
    for rec in reversed(res.records):
        if rec.end <= stamp.size:
            head = bytes(buf[rec.end - TRAILER_SIZE : rec.end - 4]) if rec.end == stamp.size else None
            break
    else:
        head = None if stamp.size != res.header.size else stamp.chain
    if head != stamp.chain:
        res.error = CorruptLogError(res.path, stamp.size, None,
                                    f"the sync stamp records the log at {stamp.size} bytes, seq {stamp.next_seq}; "
                                    "the records there differ (the synced part of the log was rewritten)")


def _torn_events(buf, off: int, size: int) -> int | None:
    """The event count a torn record at ``off`` claims, when its prefix is readable (a lower bound of the loss)."""
    if size - off < PREFIX_SIZE:
        return None
    magic, kind, flags, _, _, count, _ = PREFIX.unpack_from(buf, off)
    return count if magic == RECORD_MAGIC and kind == KIND_EVENTS and not flags else None


def _classify_end(buf, res: Scan, damaged: bool, stamp: SyncStamp | None) -> None:
    """Torn tail, corruption, or a clean end (see the module docstring: what a crash can leave)."""
    off, size, path = res.end, res.size, res.path
    floor = stamp.size if stamp is not None else res.header.size
    if damaged:
        pos, claim = _last_claim_after(buf, off, size, max_record_bytes(res.header.geometry.num_pages))
        if claim > off:
            res.error = CorruptLogError(
                path, off, res.next_seq,
                f"damaged record inside the synced part of the log (the intact record at offset {pos} "
                f"proves the first {claim} bytes were synced)",
            )
        elif floor > off:
            res.error = CorruptLogError(
                path, off, res.next_seq,
                f"damaged record inside the synced part of the log (its sync stamp says the first {floor} bytes, "
                f"seq {stamp.next_seq if stamp else 0} on, were synced): synced events were lost",
            )
        else:
            res.torn_at, res.torn_bytes, res.torn_events = off, size - off, _torn_events(buf, off, size)
    elif res.error is None and res.stopped is False and size < floor:
        res.error = CorruptLogError(
            path, size, res.next_seq,
            f"the file ends at {size} bytes but its sync stamp says {floor} bytes (seq {stamp.next_seq if stamp else 0}"
            " on) were synced: synced events were lost",
        )
    if stamp is not None:
        _check_stamp(buf, res, stamp)
    res.closed = res.closed and res.error is None
    if res.error is not None:
        res.chain = None  # the hash saw bytes of a bad record: no base for appends


def scan(buf, path: str = "<memory>", *, until: int | None = None, stamp: SyncStamp | None = None,
         max_pages: int = DEFAULT_MAX_PAGES, segment: int = 0) -> Scan:
    """Verify every record of a log held in ``buf``; never raises for bad record bytes.

    ``until``: stop after the records that hold events up to seq ``until`` (a
    partial replay need not verify the rest of a long log; ``end`` is then
    where the scan stopped and nothing after it is reported). ``stamp``: the
    log's ``SyncStamp`` (``decode_stamp``), if it has one: damage before its
    size is corruption, never a torn tail.

    Header problems raise (``CorruptLogError`` at offset 0, ``LogVersionError``,
    ``LogError`` past ``max_pages``). Record problems end the scan: tail damage
    sets ``torn_at``/``torn_bytes``, corruption sets ``error`` (see the module
    docstring for which is which). Payloads are checked but not decoded
    (``decode_events``).
    """
    header = decode_header(buf, path, max_pages=max_pages)
    res = Scan(path, header, len(buf))
    res.segment = segment
    chain = new_chain(header.log_id)
    chain.update(buf[: header.size])
    stop = (1 << 64) if until is None else until + 1  # (a checkpoint at until + 1 holds the state after until)
    damaged = _walk(buf, res, chain, stop)
    res.stopped = res.end < res.size and not damaged and res.error is None
    _classify_end(buf, res, damaged, stamp)
    if header.segment and res.records and res.records[0].kind != KIND_CHECKPOINT and res.error is None:
        res.error = CorruptLogError(path, header.size, header.first_seq, "a segment must open with a checkpoint")
        res.chain = None
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
