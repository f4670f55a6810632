"""Wire codec, layout 8: golden bytes, round trips, the incremental decoder, page-id
checks, the layout-7 decoder's refusal of a sanitize PREPARE, and R7 (fuzzing the
frame decoder: hypothesis bytes + mutated valid frames, COMPLETE and the sanitize
PREPARE included).

R7 figures are printed: executions (>= 10**4 in the quick profile) and crashes (0).
KVLEDGER_HYPOTHESIS=heavy multiplies the mutation loop by 100.
"""

from __future__ import annotations

import array
import importlib
import io
import random
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support import HEAVY
from kvledger import Geometry, InvalidArgumentError, WireProtocolError
from kvledger.wire.codec import (
    DEFAULT_MAX_BODY,
    Auth,
    Challenge,
    FLAG_SANITIZE,
    HEADER_SIZE,
    LAYOUT,
    MAGIC,
    MAX_DETAIL_BYTES,
    NO_RANK,
    Abort,
    Complete,
    FrameKind,
    Hello,
    Launch,
    Prepare,
    Ready,
    Reject,
    RejectCode,
    Sanitize,
    encode,
    encode_frame,
    encode_prepare,
    frame_checksum,
    geometry_digest,
    pack_page_ids,
)
from kvledger.wire.decoder import FrameDecoder, decode, page_ids_problem
from kvledger.core.errors import FrameError

G = Geometry(num_pages=1024, page_tokens=16)

# ---------------------------------------------------------------------------- golden bytes

GEOMETRY_DIGEST = "2e6a243801ce9e7eb420fcbe8f16ed4bd3b2c65fdad9d9913cd8a8fd43b461cc"
PREPARE_CRC = 0xCE8EB6C0
SANITIZE_CRC = 0x086B4D8C
SANITIZE = Sanitize(poison_pages=[5, 9], committed_pages=[1])
NONCE = bytes(range(0x40, 0x60))
PROOF = bytes(range(0xA0, 0xC0))

# Layout 9: a versioned change from layout 8, decided in issue 32 (the handshake proves the job's
# key): the layout byte (so every CRC below moved), the HELLO's nonce (body 40 -> 72 bytes) and two
# new kinds, CHALLENGE (8) and AUTH (9). Layout 8 itself was the layout byte, the COMPLETE kind and
# the SANITIZE flag of PREPARE over layout 7. Every frame type, with its header and body bytes.
GOLDEN = [
    (
        Hello(step=0, rank=1, world_size=4, geometry_digest=bytes.fromhex(GEOMETRY_DIGEST), nonce=NONCE),
        "4b564c57090100004800000000000000000000009efe1244"
        "01000000040000002e6a243801ce9e7eb420fcbe8f16ed4bd3b2c65fdad9d9913cd8a8fd43b461cc"
        "404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f",
    ),
    (
        # the leader's nonce, then its HMAC-SHA256 proof (wire/auth.py)
        Challenge(step=0, nonce=NONCE, proof=PROOF),
        "4b564c570908000040000000000000000000000056b861f1"
        "404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f"
        "a0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf",
    ),
    (
        # rank 1, its proof
        Auth(step=0, rank=1, proof=PROOF),
        "4b564c57090900002400000000000000000000002858c3fe"
        "01000000a0a1a2a3a4a5a6a7a8a9aaabacadaeafb0b1b2b3b4b5b6b7b8b9babbbcbdbebf",
    ),
    (
        Prepare(step=7, clear_pages=[3, 1, 4], payload=b"kv"),
        "4b564c5709020000160000000700000000000000c0b68ece"
        "03000000020000000300000001000000040000006b76",
    ),
    (
        # flags 0x0001; counts 2 clear, 2 payload bytes, 2 poison, 1 committed; ids 3 1 | 5 9 | 1; "kv"
        Prepare(step=8, clear_pages=[3, 1], payload=b"kv", sanitize=SANITIZE),
        "4b564c57090201002600000008000000000000008c4d6b08"
        "0200000002000000020000000100000003000000010000000500000009000000010000006b76",
    ),
    (
        Ready(step=7, rank=2, prepare_checksum=PREPARE_CRC),
        "4b564c57090300000800000007000000000000005761755d" "02000000c0b68ece",
    ),
    (
        Reject(step=7, rank=3, code=RejectCode.DUPLICATE_PAGE, detail="page ids [4] listed more than once"),
        "4b564c57090400002a0000000700000000000000026f785c"
        "030000000c0022007061676520696473205b345d206c6973746564206d6f7265207468616e206f6e6365",
    ),
    (
        Abort(step=7, code=RejectCode.TIMEOUT, rank=3),
        "4b564c570905000008000000070000000000000014ddfb50" "0300000013000000",
    ),
    (
        Launch(step=7, prepare_checksum=PREPARE_CRC),
        "4b564c5709060000040000000700000000000000be72b9b4" "c0b68ece",
    ),
    (
        # rank 2, PREPARE crc, status 0 (ok), detail_len 0
        Complete(step=7, rank=2, prepare_checksum=PREPARE_CRC),
        "4b564c57090700000c0000000700000000000000f01c5e71" "02000000c0b68ece00000000",
    ),
    (
        # rank 3, PREPARE crc, status 1 (failed), detail_len 16, "poison at page 5"
        Complete(step=8, rank=3, prepare_checksum=SANITIZE_CRC, ok=False, detail="poison at page 5"),
        "4b564c57090700001c0000000800000000000000af1c1234"
        "030000008c4d6b0801001000706f69736f6e20617420706167652035",
    ),
]
GOLDEN_IDS = [
    "Hello", "Challenge", "Auth", "Prepare", "Prepare-sanitize", "Ready", "Reject", "Abort", "Launch", "Complete",
    "Complete-failed",
]


def test_geometry_digest_is_pinned():
    assert geometry_digest(G).hex() == GEOMETRY_DIGEST
    assert geometry_digest(Geometry(num_pages=1025, page_tokens=16)).hex() != GEOMETRY_DIGEST


@pytest.mark.parametrize("frame,hexbytes", GOLDEN, ids=GOLDEN_IDS)
def test_golden_bytes(frame, hexbytes):
    data = encode(frame)
    assert data.hex() == hexbytes
    # The header layout, field by field, from the module docstring.
    magic, layout, kind, flags, body_len, step, crc = struct.unpack_from("<4sBBHIQI", data)
    assert (magic, layout, LAYOUT) == (MAGIC, 9, 9)
    assert flags == (FLAG_SANITIZE if getattr(frame, "sanitize", None) is not None else 0)
    assert FrameKind(kind).name == type(frame).__name__.upper()
    assert body_len == len(data) - 24 and step == frame.step
    # The checksum is CRC32 over header bytes [0, 20) then the body, independently recomputed.
    assert crc == zlib.crc32(data[:20] + data[24:])
    back = decode(data)
    assert type(back) is type(frame) and _same(back, frame)
    assert encode(back) == data


def test_every_kind_has_a_golden_frame():
    assert {FrameKind[type(f).__name__.upper()] for f, _ in GOLDEN} == set(FrameKind)
    assert len(FrameKind) == 9 and FrameKind.COMPLETE == 7 and FrameKind.AUTH == 9


def test_prepare_checksum_is_what_ready_launch_and_complete_echo():
    golden = dict(zip(GOLDEN_IDS, GOLDEN, strict=True))
    data = encode(golden["Prepare"][0])
    assert frame_checksum(data) == PREPARE_CRC
    assert decode(data).checksum == PREPARE_CRC
    sanitize = encode(golden["Prepare-sanitize"][0])
    assert frame_checksum(sanitize) == decode(sanitize).checksum == SANITIZE_CRC


def test_sanitize_prepare_fields():
    f = decode(encode(Prepare(step=9, clear_pages=[5, 0], payload=b"p", sanitize=Sanitize(poison_pages=[2**32 - 1]))))
    assert f.clear_pages.tolist() == [5, 0] and f.payload == b"p"
    assert f.sanitize.poison_pages.tolist() == [2**32 - 1] and f.sanitize.committed_pages.tolist() == []
    assert f.sanitize.poison_pages.readonly and "sanitize=Sanitize(poison_pages=[4294967295] (1 ids)" in repr(f)
    # a sanitize step with both lists empty still carries the flag: the check runs all the same
    empty = encode(Prepare(step=1, clear_pages=[1], sanitize=Sanitize()))
    assert struct.unpack_from("<H", empty, 6)[0] == FLAG_SANITIZE and decode(empty).sanitize is not None
    assert decode(encode(Prepare(step=1, clear_pages=[1]))).sanitize is None


def test_decoded_prepare_fields():
    f = decode(encode(Prepare(step=9, clear_pages=[5, 0, 2**32 - 1], payload=b"\x00\xff")))
    assert f.step == 9 and f.clear_pages.tolist() == [5, 0, 2**32 - 1] and f.payload == b"\x00\xff"
    assert f.clear_pages.readonly and len(f.clear_pages) == 3
    assert "3 ids" in repr(f)


# ---------------------------------------------------------------------------- round trips


ids_st = st.lists(st.integers(0, 2**32 - 1), max_size=300)
frames_st = st.one_of(
    st.builds(
        Hello,
        step=st.integers(0, 2**64 - 1),
        rank=st.integers(0, 2**32 - 1),
        world_size=st.integers(0, 2**32 - 1),
        geometry_digest=st.binary(min_size=32, max_size=32),
        nonce=st.binary(min_size=32, max_size=32),
    ),
    st.builds(Challenge, step=st.integers(0, 2**64 - 1), nonce=st.binary(min_size=32, max_size=32),
              proof=st.binary(min_size=32, max_size=32)),
    st.builds(Auth, step=st.integers(0, 2**64 - 1), rank=st.integers(0, 2**32 - 1),
              proof=st.binary(min_size=32, max_size=32)),
    st.builds(
        Prepare,
        step=st.integers(0, 2**64 - 1),
        clear_pages=ids_st,
        payload=st.binary(max_size=300),
        sanitize=st.none() | st.builds(Sanitize, poison_pages=ids_st, committed_pages=ids_st),
    ),
    st.builds(
        Ready,
        step=st.integers(0, 2**64 - 1),
        rank=st.integers(0, 2**32 - 1),
        prepare_checksum=st.integers(0, 2**32 - 1),
    ),
    st.builds(
        Reject,
        step=st.integers(0, 2**64 - 1),
        rank=st.integers(0, 2**32 - 1),
        code=st.integers(0, 0xFFFF),
        detail=st.text(max_size=200),
    ),
    st.builds(Abort, step=st.integers(0, 2**64 - 1), code=st.integers(0, 0xFFFF), rank=st.integers(0, 2**32 - 1)),
    st.builds(Launch, step=st.integers(0, 2**64 - 1), prepare_checksum=st.integers(0, 2**32 - 1)),
    st.builds(
        Complete,
        step=st.integers(0, 2**64 - 1),
        rank=st.integers(0, 2**32 - 1),
        prepare_checksum=st.integers(0, 2**32 - 1),
        ok=st.booleans(),
        detail=st.text(max_size=200),
    ),
)


def _lists(s):
    return None if s is None else (list(s.poison_pages), list(s.committed_pages))


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is Prepare:
        return (a.step, list(a.clear_pages), a.payload, _lists(a.sanitize)) == (
            b.step, list(b.clear_pages), b.payload, _lists(b.sanitize))
    return a == b


@given(frames=st.lists(frames_st, min_size=1, max_size=6), cuts=st.lists(st.integers(1, 64), max_size=20))
def test_round_trip_any_chunking(frames, cuts):
    """decode(encode(f)) == f and encode(decode(b)) == b, with the stream cut anywhere."""
    data = b"".join(encode(f) for f in frames)
    dec = FrameDecoder()
    out, pos, i = [], 0, 0
    while pos < len(data):
        n = cuts[i % len(cuts)] if cuts else len(data)
        i += 1
        dec.feed(data[pos : pos + n])
        pos += n
        while (f := dec.next_frame()) is not None:
            out.append(f)
    dec.feed_eof()
    assert dec.next_frame() is None
    assert len(out) == len(frames)
    assert all(_same(a, b) for a, b in zip(frames, out, strict=True))
    assert b"".join(encode(f) for f in out) == data


def test_byte_by_byte_decoding_and_buffer_compaction():
    frames = [f for f, _ in GOLDEN] * 50
    data = b"".join(encode(f) for f in frames)
    dec = FrameDecoder()
    n = 0
    for b in data:
        dec.feed(bytes([b]))
        while dec.next_frame() is not None:
            n += 1
        assert dec.buffered < 200
    assert n == len(frames) and dec.buffered == 0 and dec.frames == n


def test_large_prepare_round_trip():
    ids = random.Random(1).sample(range(1 << 32), 16384)
    f = decode(encode_prepare(3, ids, b"p" * 1000))
    assert f.clear_pages.tolist() == ids and f.payload == b"p" * 1000
    as_array = array.array("I", ids)
    assert pack_page_ids(as_array) == pack_page_ids(ids) == pack_page_ids(memoryview(as_array))


# ---------------------------------------------------------------------------- encoder: local errors


@pytest.mark.parametrize(
    "frame",
    [
        Prepare(step=1, clear_pages=[-1]),
        Prepare(step=1, clear_pages=[2**32]),
        Prepare(step=1, clear_pages=["3"]),
        Prepare(step=-1, clear_pages=[1]),
        Prepare(step=2**64, clear_pages=[1]),
        Prepare(step=1, clear_pages=[1], payload="text"),
        Ready(step=1, rank=2**32, prepare_checksum=0),
        Reject(step=1, rank=1, code=70000),
        Reject(step=1, rank=1, code=1, detail=b"bytes"),
        Hello(step=0, rank=1, world_size=2, geometry_digest=b"short"),
        Abort(step=1, code=-1),
        Prepare(step=1, clear_pages=[1], sanitize=Sanitize(poison_pages=[2**32])),
        Prepare(step=1, clear_pages=[1], sanitize=Sanitize(committed_pages=[-1])),
        Prepare(step=1, clear_pages=[1], sanitize=([1], [2])),
        Complete(step=1, rank=2**32, prepare_checksum=0),
        Complete(step=1, rank=1, prepare_checksum=2**32),
        Complete(step=1, rank=1, prepare_checksum=0, ok=1),
        Complete(step=1, rank=1, prepare_checksum=0, ok=False, detail=b"bytes"),
    ],
)
def test_encoder_refuses_fields_that_do_not_fit(frame):
    with pytest.raises(InvalidArgumentError):
        encode(frame)


def test_encode_refuses_non_frames():
    with pytest.raises(InvalidArgumentError):
        encode("HELLO")


def test_reject_and_complete_details_are_capped_at_a_utf8_boundary():
    f = decode(encode(Reject(step=1, rank=1, code=1, detail="é" * 2000)))
    assert len(f.detail.encode()) <= 1024 and set(f.detail) == {"é"}
    c = decode(encode(Complete(step=1, rank=1, prepare_checksum=5, ok=False, detail="é" * 2000)))
    assert len(c.detail.encode()) <= MAX_DETAIL_BYTES and set(c.detail) == {"é"} and c.ok is False


# ---------------------------------------------------------------------------- decoder errors


def _fix_crc(frame: bytes) -> bytes:
    crc = zlib.crc32(frame[24:], zlib.crc32(frame[:20]))
    return frame[:20] + crc.to_bytes(4, "little") + frame[24:]


def _codes(data: bytes, *, eof=True, max_body=DEFAULT_MAX_BODY):
    dec = FrameDecoder(max_body=max_body)
    dec.feed(data)
    if eof:
        dec.feed_eof()
    with pytest.raises(FrameError) as info:
        while dec.next_frame() is not None:
            pass
    err = info.value
    assert isinstance(err, WireProtocolError) and err.remote
    # broken for good: the same error again
    with pytest.raises(FrameError):
        dec.next_frame()
    return err


PREP = encode(Prepare(step=5, clear_pages=[1, 2, 3], payload=b"xyz"))
SAN = encode(Prepare(step=5, clear_pages=[1, 2, 3], payload=b"xyz",
                     sanitize=Sanitize(poison_pages=[4, 5], committed_pages=[1])))


def test_bad_magic():
    assert _codes(b"XXXX" + PREP[4:]).code == RejectCode.BAD_MAGIC
    # detected from the first wrong byte, before a whole header is in
    dec = FrameDecoder()
    dec.feed(b"KVX")
    with pytest.raises(FrameError) as info:
        dec.next_frame()
    assert info.value.code == RejectCode.BAD_MAGIC


@pytest.mark.parametrize("old,why", [(6, "no clear list"), (7, "sends no COMPLETE"), (8, "cannot prove the job's key")])
def test_older_layout_frames_are_refused_naming_the_layout(old, why):
    hello = encode(Hello(step=0, rank=1, world_size=2, geometry_digest=bytes(32), layout=old))
    err = _codes(hello)
    assert err.code == RejectCode.BAD_LAYOUT and f"layout {old}" in err.detail and "HELLO" in err.detail
    assert why in err.detail and "speaks layout 9" in err.detail
    assert err.step == 0 and err.kind == FrameKind.HELLO


def test_unknown_kind_flags_and_lengths():
    assert _codes(encode_frame(11, 1, b"")).code == RejectCode.BAD_KIND
    assert _codes(encode_frame(10, 1, b"")).code == RejectCode.BAD_KIND  # the next kind is not AUTH
    assert _codes(encode_frame(FrameKind.AUTH, 1, b"\0" * 35)).code == RejectCode.BAD_LENGTH
    assert _codes(encode_frame(FrameKind.CHALLENGE, 1, b"\0" * 65)).code == RejectCode.BAD_LENGTH
    assert _codes(encode_frame(FrameKind.HELLO, 1, b"\0" * 40)).code == RejectCode.BAD_LENGTH  # a layout-8 body
    assert _codes(encode_frame(FrameKind.LAUNCH, 1, b"\0" * 4, flags=1)).code == RejectCode.BAD_FLAGS
    # SANITIZE is a PREPARE flag only; every other bit is reserved everywhere
    for kind in FrameKind:
        if kind is not FrameKind.PREPARE:
            assert _codes(encode_frame(kind, 1, b"\0" * 64, flags=FLAG_SANITIZE)).code == RejectCode.BAD_FLAGS
    for bit in range(1, 16):
        assert _codes(encode_frame(FrameKind.PREPARE, 1, b"\0" * 16, flags=1 << bit)).code == RejectCode.BAD_FLAGS
    assert _codes(encode_frame(FrameKind.READY, 1, b"\0" * 9)).code == RejectCode.BAD_LENGTH
    assert _codes(encode_frame(FrameKind.PREPARE, 1, b"\0" * 4)).code == RejectCode.BAD_LENGTH
    # a sanitize PREPARE needs its four counts: 8 bytes of plain counts are not enough
    assert _codes(encode_frame(FrameKind.PREPARE, 1, b"\0" * 8, flags=FLAG_SANITIZE)).code == RejectCode.BAD_LENGTH
    assert _codes(encode_frame(FrameKind.COMPLETE, 1, b"\0" * 11)).code == RejectCode.BAD_LENGTH
    # inner lengths disagree with body_len (checksum fixed, so only the length is wrong)
    body = bytearray(PREP[24:])
    body[0] = 4
    assert _codes(_fix_crc(PREP[:24] + bytes(body))).code == RejectCode.BAD_LENGTH
    rej = bytearray(encode(Reject(step=1, rank=1, code=1, detail="abc")))
    rej[30] = 9
    assert _codes(_fix_crc(bytes(rej))).code == RejectCode.BAD_LENGTH
    for i in (24, 28, 32, 36):  # each of the sanitize PREPARE's four counts
        bad = bytearray(SAN)
        bad[i] += 1
        assert _codes(_fix_crc(bytes(bad))).code == RejectCode.BAD_LENGTH, i
    comp = bytearray(encode(Complete(step=1, rank=1, prepare_checksum=0, ok=False, detail="abc")))
    comp[34] = 9  # detail_len
    assert _codes(_fix_crc(bytes(comp))).code == RejectCode.BAD_LENGTH
    big = encode_frame(FrameKind.COMPLETE, 1, struct.pack("<IIHH", 1, 0, 1, 1025) + b"x" * 1025)
    err = _codes(big)
    assert err.code == RejectCode.BAD_LENGTH and "1024" in err.detail  # the detail's bound, not just body_len


def test_bad_body_fields():
    abort = bytearray(encode(Abort(step=1, code=1)))
    abort[30] = 1
    assert _codes(_fix_crc(bytes(abort))).code == RejectCode.BAD_BODY
    rej = bytearray(encode(Reject(step=1, rank=1, code=1, detail="ab")))
    rej[-1] = 0xFF
    assert _codes(_fix_crc(bytes(rej))).code == RejectCode.BAD_BODY
    comp = bytearray(encode(Complete(step=1, rank=1, prepare_checksum=0, ok=False, detail="ab")))
    comp[-1] = 0xFF
    assert _codes(_fix_crc(bytes(comp))).code == RejectCode.BAD_BODY
    for status in (2, 7, 0xFFFF):  # 0 ok and 1 failed only
        comp = bytearray(encode(Complete(step=1, rank=1, prepare_checksum=0)))
        comp[32:34] = status.to_bytes(2, "little")
        err = _codes(_fix_crc(bytes(comp)))
        assert err.code == RejectCode.BAD_BODY and f"status {status}" in err.detail


def test_checksum_covers_header_and_body():
    for frame in (PREP, SAN, encode(GOLDEN[-1][0])):
        for i in list(range(12, 24)) + list(range(24, len(frame))):
            bad = bytearray(frame)
            bad[i] ^= 0x10
            assert _codes(bytes(bad)).code == RejectCode.BAD_CHECKSUM, i


def test_truncated_at_every_length():
    for frame in (PREP, SAN, encode(GOLDEN[-1][0])):
        for n in range(1, len(frame)):
            assert _codes(frame[:n]).code == RejectCode.TRUNCATED
            dec = FrameDecoder()
            dec.feed(frame[:n])
            assert dec.next_frame() is None  # without EOF it just waits


def test_cap_is_enforced_before_the_body_is_buffered():
    head = struct.pack("<4sBBHIQI", MAGIC, LAYOUT, FrameKind.PREPARE, 0, 2**32 - 1, 1, 0)
    dec = FrameDecoder(max_body=4096)
    dec.feed(head)  # only the header: no body byte has arrived
    with pytest.raises(FrameError) as info:
        dec.next_frame()
    assert info.value.code == RejectCode.FRAME_TOO_LARGE and dec.buffered == HEADER_SIZE


def test_decode_refuses_trailing_bytes_and_feed_after_eof():
    with pytest.raises(FrameError):
        decode(PREP + b"\0")
    with pytest.raises(FrameError):
        decode(b"")
    dec = FrameDecoder()
    dec.feed_eof()
    assert dec.next_frame() is None
    with pytest.raises(InvalidArgumentError):
        dec.feed(b"x")
    with pytest.raises(InvalidArgumentError):
        FrameDecoder(max_body=10)


# ---------------------------------------------------------------------------- page-id checks


def _ref_problem(ids, num_pages):
    if any(p >= num_pages for p in ids):
        return RejectCode.PAGE_OUT_OF_RANGE
    if len(set(ids)) != len(ids):
        return RejectCode.DUPLICATE_PAGE
    return None


def test_page_id_check_matches_a_plain_reference():
    """The lane trick for ascending lists against plain Python, on the edge values of 32 bits."""
    rng = random.Random(7)
    edges = [0, 1, 2, 0x7FFFFFFE, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xFFFFFFFE, 0xFFFFFFFF]
    checked = 0
    for trial in range(6000):
        n = rng.choice([0, 1, 2, 3, 47, 48, 49, 64, 100, 300])
        mode = trial % 4
        if mode == 0:
            ids = sorted(rng.sample(range(1 << 32), n))
        elif mode == 1:
            ids = sorted(rng.choice(edges + [rng.randrange(1 << 32)]) for _ in range(n))
        elif mode == 2:
            ids = [rng.choice(edges + [rng.randrange(1 << 32)]) for _ in range(n)]
        else:
            ids = sorted(rng.sample(range(4096), min(n, 4096)))
            if ids and rng.random() < 0.5:
                i = rng.randrange(len(ids))
                ids[i] = ids[i - 1] if i else ids[0]
        num_pages = rng.choice([1, 4096, 0x80000000, 0x80000001, 1 << 32, rng.randrange(1, 1 << 32)])
        want = _ref_problem(ids, num_pages)
        got = page_ids_problem(pack_page_ids(ids), num_pages)
        assert (got[0] if got else None) == want, (ids, num_pages)
        got = page_ids_problem(decode(encode_prepare(0, ids)).clear_pages, num_pages)  # as a peer sees it
        assert (got[0] if got else None) == want, (ids, num_pages)
        checked += 1
    print("page-id checks compared with the reference:", checked)


def test_page_id_problem_names_the_ids():
    code, detail = page_ids_problem(pack_page_ids(list(range(100)) + [5000]), 1000)
    assert code == RejectCode.PAGE_OUT_OF_RANGE and "5000" in detail
    code, detail = page_ids_problem(pack_page_ids([9] + list(range(100))), 1000)
    assert code == RejectCode.DUPLICATE_PAGE and "[9]" in detail


# ---------------------------------------------------------------------------- a layout-7 rank refuses, never ignores

LAYOUT7_COMMIT = "4b3035a72cc2752b23bd91eadafed94773785320"  # the tree before layout 8: wire/ at layout 7
LAYOUT8_COMMIT = "e388c64ec352e5d1d8988b1f296089d2fa911e10"  # the tree before layout 9: wire/ at layout 8
ROOT = Path(__file__).resolve().parents[2]


def _old_wire(tmp_path_factory, commit: str, layout: int):
    """The wire of ``layout`` as it shipped: ``core/`` and ``wire/`` of ``commit`` out of git,
    imported as the package ``kvl{layout}`` (its modules are dropped again afterwards)."""
    name = f"kvl{layout}"
    probe = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"commit {commit[:12]} (layout {layout}) is not in this checkout (a shallow clone?)")
    dest = tmp_path_factory.mktemp(f"layout{layout}")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "core", "wire"],
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest / name, filter="data")
    (dest / name / "__init__.py").write_text("")
    sys.path.insert(0, str(dest))
    try:
        old = importlib.import_module(f"{name}.wire")
    finally:
        sys.path.remove(str(dest))
    assert layout == old.LAYOUT
    yield old
    for mod in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[mod]


@pytest.fixture(scope="module")
def layout7(tmp_path_factory):
    for old in _old_wire(tmp_path_factory, LAYOUT7_COMMIT, 7):
        assert not hasattr(old, "Complete")
        yield old


@pytest.fixture(scope="module")
def layout8(tmp_path_factory):
    for old in _old_wire(tmp_path_factory, LAYOUT8_COMMIT, 8):
        assert not hasattr(old, "Auth")
        yield old


def _old_verdict(old, data: bytes):
    """What the layout-7 decoder makes of ``data``: its frame, or the code of the error it raises."""
    dec = old.FrameDecoder(max_body=1 << 20)
    dec.feed(data)
    dec.feed_eof()
    try:
        return dec.next_frame()
    except old.decoder.FrameError as exc:
        return RejectCode(exc.code)


def _relabel(data: bytes, *, layout: int | None = None, flags: int | None = None) -> bytes:
    raw = bytearray(data)
    if layout is not None:
        raw[4] = layout
    if flags is not None:
        raw[6:8] = flags.to_bytes(2, "little")
    return _fix_crc(bytes(raw))


def test_a_layout_7_decoder_refuses_a_sanitize_prepare_at_every_layer(layout7):
    """A sanitize PREPARE can never pass for a plain one at a layout-7 rank: its own decoder
    refuses it for the layout byte; relabelled 7, for the SANITIZE flag (a reserved bit
    there); with the flag cleared too, for its length arithmetic. The control shows the
    same relabelling of a plain PREPARE is a frame the layout-7 decoder takes."""
    rng = random.Random(78)
    verdicts = {"as sent": set(), "relabelled 7": set(), "flag cleared": set()}
    trials = 400
    for _ in range(trials):
        step = rng.randrange(1 << 40)
        ids, poison, committed = (rng.sample(range(1 << 16), rng.choice([0, 1, 3, 60])) for _ in range(3))
        payload = rng.randbytes(rng.randrange(12))
        data = encode_prepare(step, ids, payload, sanitize=Sanitize(poison_pages=poison, committed_pages=committed))
        verdicts["as sent"].add(_old_verdict(layout7, data))
        as7 = _relabel(data, layout=7)
        verdicts["relabelled 7"].add(_old_verdict(layout7, as7))
        verdicts["flag cleared"].add(_old_verdict(layout7, _relabel(as7, flags=0)))
        control = _old_verdict(layout7, _relabel(encode_prepare(step, ids, payload), layout=7))
        assert control.clear_pages.tolist() == ids and control.payload == payload
    assert verdicts == {
        "as sent": {RejectCode.BAD_LAYOUT},
        "relabelled 7": {RejectCode.BAD_FLAGS},
        "flag cleared": {RejectCode.BAD_LENGTH},
    }
    named = {k: sorted(c.name for c in v) for k, v in verdicts.items()}
    print("layout-7 decoder on", trials, "sanitize PREPAREs:", named)


@pytest.mark.parametrize("old_layout", [7, 8])
def test_an_older_peer_and_a_layout_9_leader_refuse_each_other_at_hello(old_layout, request):
    """A layout-7 or layout-8 build (the real code of that commit) and this one refuse each other
    at the first frame: neither can join the other's group, whatever its key."""
    from support.wirekeys import leader_link, peer_link

    old = request.getfixturevalue(f"layout{old_layout}")
    g_old = old.codec.Geometry(num_pages=G.num_pages, page_tokens=G.page_tokens)  # its own core's Geometry
    assert old.geometry_digest(g_old) == geometry_digest(G)  # the geometry is not what differs
    old_peer = old.PeerLink(g_old, rank=1, world_size=2)
    old_peer.start()
    leader = leader_link(G, 2)
    leader.receive_data(old_peer.data_to_send())  # the older build's own HELLO
    with pytest.raises(WireProtocolError) as info:
        leader.next_event()
    assert info.value.code == RejectCode.BAD_LAYOUT and f"layout {old_layout}" in info.value.detail
    assert leader.statistics()["frames_out"] == 1  # the REJECT; no CHALLENGE for it
    # and an older leader cannot take our HELLO for a peer's
    peer = peer_link(G, 1, 2)
    peer.start()
    old_leader = old.LeaderLink(g_old, world_size=2)
    old_leader.receive_data(peer.data_to_send())
    with pytest.raises(old.decoder.FrameError) as info_old:
        old_leader.next_event()
    assert info_old.value.code == RejectCode.BAD_LAYOUT and "layout 9" in info_old.value.detail


# ---------------------------------------------------------------------------- R7: fuzzing


def _valid_frames(rng: random.Random) -> list[bytes]:
    out = [encode(f) for f, _ in GOLDEN]
    def ids(n):
        return rng.sample(range(1 << 16), n)

    for _ in range(40):
        n = rng.choice([0, 1, 5, 60, 300])
        out.append(encode_prepare(rng.randrange(1 << 20), ids(n), rng.randbytes(rng.randrange(40))))
    for _ in range(40):
        n, p, c = (rng.choice([0, 1, 5, 60]) for _ in range(3))
        lists = Sanitize(poison_pages=ids(p), committed_pages=ids(c))
        out.append(encode_prepare(rng.randrange(1 << 20), ids(n), rng.randbytes(rng.randrange(40)), sanitize=lists))
    for _ in range(20):
        detail = rng.choice(["", "x", "é" * rng.randrange(600), "RuntimeError: " + "z" * rng.randrange(1100)])
        crc = rng.randrange(1 << 32)
        f = Complete(step=rng.randrange(1 << 20), rank=rng.randrange(8), prepare_checksum=crc, ok=rng.random() < 0.5,
                     detail=detail)
        out.append(encode(f))
    return out


def _mutate(rng: random.Random, pool: list[bytes]) -> bytes:
    data = bytearray(rng.choice(pool))
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op == 0 and data:  # flip a bit
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and data:  # set a byte
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 2:  # truncate
            del data[rng.randrange(len(data) + 1) :]
        elif op == 3:  # insert junk
            i = rng.randrange(len(data) + 1)
            data[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 4:  # splice another frame in
            other = rng.choice(pool)
            i = rng.randrange(len(data) + 1)
            data[i:] = other[rng.randrange(len(other) + 1) :]
        elif op == 5 and len(data) >= 24:  # a header field, then a correct checksum
            field = rng.choice([(4, 1), (5, 1), (6, 2), (8, 4), (12, 8)])
            off, size = field
            data[off : off + size] = rng.randbytes(size)
            data[:] = _fix_crc(bytes(data))
        elif op == 6 and len(data) >= 24:  # body bytes, then a correct checksum
            if len(data) > 24:
                data[rng.randrange(24, len(data))] = rng.randrange(256)
            data[:] = _fix_crc(bytes(data))
        elif op == 7 and len(data) >= 24:  # the SANITIZE flag toggled or the kind swapped, then a correct checksum
            if rng.random() < 0.5:
                data[6] ^= FLAG_SANITIZE
            else:
                data[5] = rng.choice(list(FrameKind))
            data[:] = _fix_crc(bytes(data))
    return bytes(data)


class _Run:
    def __init__(self):
        self.executions = 0
        self.frames = 0
        self.errors = 0
        self.max_buffered = 0
        self.kinds: dict[str, int] = {}


def _kind(f) -> str:
    name = type(f).__name__
    return f"{name}+sanitize" if name == "Prepare" and f.sanitize is not None else name


def _exercise(data: bytes, rng: random.Random, run: _Run, max_body: int = 4096) -> None:
    """Feed ``data`` in random chunks; only FrameError may escape; the buffer stays under the cap;
    every frame decoded re-encodes to exactly the bytes it came from."""
    run.executions += 1
    dec = FrameDecoder(max_body=max_body)
    pos = off = 0

    def took(f):
        nonlocal off
        size = HEADER_SIZE + int.from_bytes(data[off + 8 : off + 12], "little")
        assert encode(f) == data[off : off + size]  # the round trip is the identity
        off += size
        run.frames += 1
        run.kinds[_kind(f)] = run.kinds.get(_kind(f), 0) + 1

    try:
        while pos < len(data):
            n = rng.randint(1, 96)
            dec.feed(data[pos : pos + n])
            pos += n
            while (f := dec.next_frame()) is not None:
                took(f)
            run.max_buffered = max(run.max_buffered, dec.buffered)
            assert dec.buffered <= HEADER_SIZE + max_body + 96
        dec.feed_eof()
        while (f := dec.next_frame()) is not None:
            took(f)
    except FrameError as exc:
        assert isinstance(exc.code, int) and exc.detail
        run.errors += 1


def test_r7_mutated_valid_frames():
    rng = random.Random(20240607)
    pool = _valid_frames(rng)
    run = _Run()
    # identity first: every valid frame decodes and re-encodes byte for byte
    for data in pool:
        assert encode(decode(data)) == data
    n = 20_000 * (100 if HEAVY else 1)
    for _ in range(n):
        _exercise(_mutate(rng, pool), rng, run)
    print(
        "R7 mutated frames: executions", run.executions, "frames decoded", run.frames,
        "by kind", sorted(run.kinds.items()), "errors raised", run.errors, "max buffered", run.max_buffered,
        "crashes 0",
    )
    assert run.executions >= 10_000 and run.errors > run.executions // 2
    # the new layout-8 shapes were decoded (and round-tripped) by the fuzzer, not only refused
    assert run.kinds.get("Complete", 0) > 100 and run.kinds.get("Prepare+sanitize", 0) > 100


_r7_hyp = _Run()


@settings(max_examples=20_000 if HEAVY else 2_000)
@given(data=st.binary(max_size=512), seed=st.integers(0, 2**16))
def test_r7_hypothesis_bytes(data, seed):
    rng = random.Random(seed)
    _exercise(data, rng, _r7_hyp)
    # and the same bytes behind a valid frame prefix
    _exercise(encode(GOLDEN[2][0]) + data, rng, _r7_hyp)


def test_r7_hypothesis_report():
    # runs after test_r7_hypothesis_bytes in file order; reports its counts
    print("R7 hypothesis bytes: executions", _r7_hyp.executions, "frames", _r7_hyp.frames, "by kind",
          sorted(_r7_hyp.kinds.items()), "errors", _r7_hyp.errors, "crashes 0")


def test_r7_oversized_declarations_never_buffer_past_the_cap():
    rng = random.Random(3)
    run = _Run()
    for _ in range(2000):
        body_len = rng.randrange(4097, 1 << 32)
        kind, step = rng.choice(list(FrameKind)), rng.randrange(1 << 63)
        head = struct.pack("<4sBBHIQI", MAGIC, LAYOUT, kind, 0, body_len, step, 0)
        _exercise(head + rng.randbytes(rng.randrange(200)), rng, run)
    assert run.errors == run.executions and run.max_buffered <= HEADER_SIZE + 4096 + 96
    print("R7 oversized declarations:", run.executions, "all refused; max buffered", run.max_buffered)


def test_no_rank_constant():
    assert NO_RANK == 2**32 - 1


# ---------------------------------------------------------------------------- the package face


def test_import_wire_is_sans_io_and_every_name_resolves():
    """``import kvledger.wire`` loads the codec and the state machines without anyio or
    structlog (the drivers and transports load on first use), and every name in
    ``kvledger.wire.__all__`` resolves, the lazy ones pulling their module in then."""
    code = (
        "import sys, kvledger.wire as w\n"
        "early = sorted(m for m in ('anyio', 'structlog', 'torch') if m in sys.modules)\n"
        "missing = [n for n in w.__all__ if getattr(w, n, None) is None]\n"
        "print(early, missing, 'anyio' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "[]", "True"], out
