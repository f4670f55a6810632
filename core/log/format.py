"""The on-disk format of the event log: headers, records, hash chain, sync stamps.

Sans-I/O: everything here works on a buffer (``bytes``, ``bytearray`` or an
``mmap``) and never touches a file; ``scan.py`` verifies a whole log, the
writer and readers do the I/O. ``docs/LOG-FORMAT.md`` has all of it, with the
version-2 segment header (a log directory: ``segments.py``) and the 52-byte
sync stamp (``<log>.sync``: the first ``size`` bytes, up to ``next_seq``, with
chain value ``chain``, were synced; ``SyncStamp``).

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
with a close record, then gets a sync stamp covering all of it, so damage
anywhere in a closed (or ``sync()``-ed) log is corruption; so is damage in a
segment that has a successor.

Limits (what an untrusted file can make a reader do): a header over
``max_pages`` (``DEFAULT_MAX_PAGES``) is refused before anything is allocated;
a record length must fit the file and ``max_record_bytes``; an events record's
count must fit its payload.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

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
    "encode_header",
    "decode_header",
    "new_chain",
    "max_record_bytes",
    "max_event_bytes",
    "seal_record",
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
    "U32",
]

FILE_MAGIC = b"\x89KVLOG\r\n"
FORMAT_VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sHH16sQQ16s")  # 60 bytes, then the CRC
U32 = struct.Struct("<I")

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
    return body + U32.pack(zlib.crc32(body))


def encode_segment_header(geometry: Geometry, policy: str, log_id: bytes, *, segment: int, first_seq: int,
                          prev_size: int, prev_chain: bytes) -> bytes:
    """The 96-byte version-2 header of a segment (``docs/LOG-FORMAT.md``)."""
    v1 = encode_header(geometry, policy, log_id)
    body = v1[:8] + struct.pack("<HH", SEGMENT_VERSION, SEGMENT_HEADER_SIZE) + v1[12:60] \
        + _SEGMENT.pack(segment, first_seq, prev_size, prev_chain)
    return body + U32.pack(zlib.crc32(body))


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
    (crc,) = U32.unpack_from(buf, want - 4)
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
    return body + U32.pack(zlib.crc32(body))


def decode_stamp(data: bytes | None, header: LogHeader) -> SyncStamp | None:
    """The stamp in ``data`` if it is one, intact, of this log; else None (no evidence either way)."""
    if data is None or len(data) != STAMP_SIZE or data[:8] != STAMP_MAGIC:
        return None
    if zlib.crc32(data[: STAMP_SIZE - 4]) != U32.unpack_from(data, STAMP_SIZE - 4)[0]:
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
    trailer = ch + U32.pack(zlib.crc32(ch, zlib.crc32(body)))
    chain.update(trailer)
    buf += trailer
    return ch


# ---------------------------------------------------------------------- payloads

_EVENTS = msgspec.msgpack.Decoder(list[Event])
_CHECKPOINT = msgspec.msgpack.Decoder(Checkpoint)


def _payload(decoder: msgspec.msgpack.Decoder, buf, rec: RecordInfo, path: str, what: str):
    """A verified record's payload through ``decoder``; ``CorruptLogError`` (offset, seq) if it fails."""
    start = rec.offset + PREFIX_SIZE
    try:
        return decoder.decode(buf[start : start + rec.length])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CorruptLogError(path, rec.offset, rec.seq, f"{what} payload does not decode: {exc}") from None


def decode_events(buf, rec: RecordInfo, path: str = "<memory>") -> list:
    """The events of a verified events record. Raises ``CorruptLogError`` naming offset and seq."""
    events = _payload(_EVENTS, buf, rec, path, "events")
    if len(events) != rec.count:
        raise CorruptLogError(path, rec.offset, rec.seq,
                              f"record holds {len(events)} events, its header says {rec.count}")
    return events


def decode_checkpoint(buf, rec: RecordInfo, path: str = "<memory>") -> Checkpoint:
    """The checkpoint of a verified checkpoint record, naming its own record's seq."""
    cp = _payload(_CHECKPOINT, buf, rec, path, "checkpoint")
    if cp.seq != rec.seq:
        raise CorruptLogError(path, rec.offset, rec.seq, f"checkpoint payload names seq {cp.seq}")
    return cp
