"""The scan: verify a log's records in a buffer, and tell a torn tail from corruption.

Sans-I/O, like ``format.py`` (whose docstring has the byte layout and the rules
this module applies): ``scan(buf)`` walks the records from the header on,
checking each one's structure, CRC, chain value, seq and ``synced`` claim, and
classifies what ends the walk:

    clean end      the buffer ends on a record boundary
    torn tail      damage that nothing proves was synced: no intact record
                   anywhere after it (the largest claim decides, stale copies of
                   earlier records included) claims its bytes, the sync stamp (or,
                   for a segment, its successor) does not reach it; truncated by
                   open, reported
    corruption     anything else (``CorruptLogError`` naming offset and seq):
                   an intact record that breaks the chain or the sequence, damage
                   before a proof of sync, a file shorter than its stamp

It never raises for record bytes (only ``decode_header`` raises, for the header);
what it found is in the ``Scan``.
"""

from __future__ import annotations

import zlib
from typing import Any

from ..errors import CorruptLogError
from .format import (
    U32,
    DEFAULT_MAX_PAGES,
    KIND_CHECKPOINT,
    KIND_CLOSE,
    KIND_EVENTS,
    KIND_NAMES,
    PREFIX,
    PREFIX_SIZE,
    RECORD_MAGIC,
    RECORD_OVERHEAD,
    TRAILER_SIZE,
    LogHeader,
    RecordInfo,
    SyncStamp,
    decode_header,
    max_record_bytes,
    new_chain,
)

__all__ = ["Scan", "scan"]


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
    if zlib.crc32(memoryview(rec)[:-4]) != U32.unpack_from(rec, len(rec) - 4)[0]:
        return -1
    return synced


def _largest_claim_after(buf, off: int, size: int, cap: int) -> tuple[int, int]:
    """(offset, synced) of the intact record after ``off`` with the largest ``synced`` claim, or (-1, -1).

    Every intact record counts, not only the last one: stale bytes past the end of a crashed file
    can hold an intact copy of an earlier record, whose small claim must not hide a later record's
    proof that the damage was synced."""
    best = (-1, -1)
    pos = buf.find(RECORD_MAGIC, off + 1, size)
    while pos >= 0:
        claim = _intact(buf, pos, size, cap)
        if claim > best[1]:
            best = (pos, claim)
        pos = buf.find(RECORD_MAGIC, pos + 1, size)
    return best


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
        if crc32(mv[:-4]) != U32.unpack_from(rec, n + PREFIX_SIZE + 8)[0]:
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
        pos, claim = _largest_claim_after(buf, off, size, max_record_bytes(res.header.geometry.num_pages))
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
