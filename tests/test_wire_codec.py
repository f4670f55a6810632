"""Wire codec, layout 7: golden bytes, round trips, the incremental decoder, page-id
checks, and R7 (fuzzing the frame decoder: hypothesis bytes + mutated valid frames).

R7 figures are printed: executions (>= 10**4 in the quick profile) and crashes (0).
KVLEDGER_HYPOTHESIS=heavy multiplies the mutation loop by 100.
"""

from __future__ import annotations

import array
import os
import random
import struct
import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger import Geometry, InvalidArgumentError, WireProtocolError
from kvledger.wire.codec import (
    DEFAULT_MAX_BODY,
    HEADER_SIZE,
    LAYOUT,
    MAGIC,
    NO_RANK,
    Abort,
    FrameKind,
    Hello,
    Launch,
    Prepare,
    Ready,
    Reject,
    RejectCode,
    encode,
    encode_frame,
    encode_prepare,
    frame_checksum,
    geometry_digest,
    pack_page_ids,
)
from kvledger.wire.decoder import FrameDecoder, decode, page_ids_problem
from kvledger.core.errors import FrameError

HEAVY = os.environ.get("KVLEDGER_HYPOTHESIS") == "heavy"
G = Geometry(num_pages=1024, page_tokens=16)

# ---------------------------------------------------------------------------- golden bytes

GEOMETRY_DIGEST = "2e6a243801ce9e7eb420fcbe8f16ed4bd3b2c65fdad9d9913cd8a8fd43b461cc"
PREPARE_CRC = 0xE23F4C98

GOLDEN = [
    (
        Hello(step=0, rank=1, world_size=4, geometry_digest=bytes.fromhex(GEOMETRY_DIGEST)),
        "4b564c5707010000280000000000000000000000accfd955"
        "01000000040000002e6a243801ce9e7eb420fcbe8f16ed4bd3b2c65fdad9d9913cd8a8fd43b461cc",
    ),
    (
        Prepare(step=7, clear_pages=[3, 1, 4], payload=b"kv"),
        "4b564c5707020000160000000700000000000000984c3fe2"
        "03000000020000000300000001000000040000006b76",
    ),
    (
        Ready(step=7, rank=2, prepare_checksum=PREPARE_CRC),
        "4b564c5707030000080000000700000000000000e82da946" "02000000984c3fe2",
    ),
    (
        Reject(step=7, rank=3, code=RejectCode.DUPLICATE_PAGE, detail="page ids [4] listed more than once"),
        "4b564c57070400002a0000000700000000000000723e3002"
        "030000000c0022007061676520696473205b345d206c6973746564206d6f7265207468616e206f6e6365",
    ),
    (
        Abort(step=7, code=RejectCode.TIMEOUT, rank=3),
        "4b564c5707050000080000000700000000000000fab3cb32" "0300000013000000",
    ),
    (
        Launch(step=7, prepare_checksum=PREPARE_CRC),
        "4b564c5707060000040000000700000000000000881badd4" "984c3fe2",
    ),
]


def test_geometry_digest_is_pinned():
    assert geometry_digest(G).hex() == GEOMETRY_DIGEST
    assert geometry_digest(Geometry(num_pages=1025, page_tokens=16)).hex() != GEOMETRY_DIGEST


@pytest.mark.parametrize("frame,hexbytes", GOLDEN, ids=[type(f).__name__ for f, _ in GOLDEN])
def test_golden_bytes(frame, hexbytes):
    data = encode(frame)
    assert data.hex() == hexbytes
    # The header layout, field by field, from the module docstring.
    magic, layout, kind, flags, body_len, step, crc = struct.unpack_from("<4sBBHIQI", data)
    assert (magic, layout, flags) == (MAGIC, 7, 0)
    assert FrameKind(kind).name == type(frame).__name__.upper()
    assert body_len == len(data) - 24 and step == frame.step
    # The checksum is CRC32 over header bytes [0, 20) then the body, independently recomputed.
    assert crc == zlib.crc32(data[:20] + data[24:])
    back = decode(data)
    assert type(back) is type(frame)
    assert encode(back) == data


def test_every_kind_has_a_golden_frame():
    assert {FrameKind[type(f).__name__.upper()] for f, _ in GOLDEN} == set(FrameKind)


def test_prepare_checksum_is_what_ready_and_launch_echo():
    data = encode(GOLDEN[1][0])
    assert frame_checksum(data) == PREPARE_CRC
    assert decode(data).checksum == PREPARE_CRC


def test_decoded_prepare_fields():
    f = decode(encode(Prepare(step=9, clear_pages=[5, 0, 2**32 - 1], payload=b"\x00\xff")))
    assert f.step == 9 and f.clear_pages.tolist() == [5, 0, 2**32 - 1] and f.payload == b"\x00\xff"
    assert f.clear_pages.readonly and len(f.clear_pages) == 3
    assert "3 ids" in repr(f)


# ---------------------------------------------------------------------------- round trips


frames_st = st.one_of(
    st.builds(
        Hello,
        step=st.integers(0, 2**64 - 1),
        rank=st.integers(0, 2**32 - 1),
        world_size=st.integers(0, 2**32 - 1),
        geometry_digest=st.binary(min_size=32, max_size=32),
    ),
    st.builds(
        Prepare,
        step=st.integers(0, 2**64 - 1),
        clear_pages=st.lists(st.integers(0, 2**32 - 1), max_size=300),
        payload=st.binary(max_size=300),
    ),
    st.builds(Ready, step=st.integers(0, 2**64 - 1), rank=st.integers(0, 2**32 - 1), prepare_checksum=st.integers(0, 2**32 - 1)),
    st.builds(
        Reject,
        step=st.integers(0, 2**64 - 1),
        rank=st.integers(0, 2**32 - 1),
        code=st.integers(0, 0xFFFF),
        detail=st.text(max_size=200),
    ),
    st.builds(Abort, step=st.integers(0, 2**64 - 1), code=st.integers(0, 0xFFFF), rank=st.integers(0, 2**32 - 1)),
    st.builds(Launch, step=st.integers(0, 2**64 - 1), prepare_checksum=st.integers(0, 2**32 - 1)),
)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is Prepare:
        return (a.step, list(a.clear_pages), a.payload) == (b.step, list(b.clear_pages), b.payload)
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
    assert all(_same(a, b) for a, b in zip(frames, out))
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
    assert pack_page_ids(array.array("I", ids)) == pack_page_ids(ids) == pack_page_ids(memoryview(array.array("I", ids)))


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
    ],
)
def test_encoder_refuses_fields_that_do_not_fit(frame):
    with pytest.raises(InvalidArgumentError):
        encode(frame)


def test_encode_refuses_non_frames():
    with pytest.raises(InvalidArgumentError):
        encode("HELLO")


def test_reject_detail_is_capped_at_a_utf8_boundary():
    f = decode(encode(Reject(step=1, rank=1, code=1, detail="é" * 2000)))
    assert len(f.detail.encode()) <= 1024 and set(f.detail) == {"é"}


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


def test_bad_magic():
    assert _codes(b"XXXX" + PREP[4:]).code == RejectCode.BAD_MAGIC
    # detected from the first wrong byte, before a whole header is in
    dec = FrameDecoder()
    dec.feed(b"KVX")
    with pytest.raises(FrameError) as info:
        dec.next_frame()
    assert info.value.code == RejectCode.BAD_MAGIC


def test_layout_6_frame_is_refused_naming_the_layout():
    hello6 = encode(Hello(step=0, rank=1, world_size=2, geometry_digest=bytes(32), layout=6))
    err = _codes(hello6)
    assert err.code == RejectCode.BAD_LAYOUT and "layout 6" in err.detail and "HELLO" in err.detail
    assert err.step == 0 and err.kind == FrameKind.HELLO


def test_unknown_kind_flags_and_lengths():
    assert _codes(encode_frame(9, 1, b"")).code == RejectCode.BAD_KIND
    assert _codes(encode_frame(FrameKind.LAUNCH, 1, b"\0" * 4, flags=1)).code == RejectCode.BAD_FLAGS
    assert _codes(encode_frame(FrameKind.READY, 1, b"\0" * 9)).code == RejectCode.BAD_LENGTH
    assert _codes(encode_frame(FrameKind.PREPARE, 1, b"\0" * 4)).code == RejectCode.BAD_LENGTH
    # inner lengths disagree with body_len (checksum fixed, so only the length is wrong)
    body = bytearray(PREP[24:])
    body[0] = 4
    assert _codes(_fix_crc(PREP[:24] + bytes(body))).code == RejectCode.BAD_LENGTH
    rej = bytearray(encode(Reject(step=1, rank=1, code=1, detail="abc")))
    rej[30] = 9
    assert _codes(_fix_crc(bytes(rej))).code == RejectCode.BAD_LENGTH


def test_bad_body_fields():
    abort = bytearray(encode(Abort(step=1, code=1)))
    abort[30] = 1
    assert _codes(_fix_crc(bytes(abort))).code == RejectCode.BAD_BODY
    rej = bytearray(encode(Reject(step=1, rank=1, code=1, detail="ab")))
    rej[-1] = 0xFF
    assert _codes(_fix_crc(bytes(rej))).code == RejectCode.BAD_BODY


def test_checksum_covers_header_and_body():
    for i in list(range(12, 24)) + list(range(24, len(PREP))):
        bad = bytearray(PREP)
        bad[i] ^= 0x10
        assert _codes(bytes(bad)).code == RejectCode.BAD_CHECKSUM, i


def test_truncated_at_every_length():
    for n in range(1, len(PREP)):
        assert _codes(PREP[:n]).code == RejectCode.TRUNCATED
        dec = FrameDecoder()
        dec.feed(PREP[:n])
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


# ---------------------------------------------------------------------------- R7: fuzzing


def _valid_frames(rng: random.Random) -> list[bytes]:
    out = [encode(f) for f, _ in GOLDEN]
    for _ in range(40):
        n = rng.choice([0, 1, 5, 60, 300])
        out.append(encode_prepare(rng.randrange(1 << 20), rng.sample(range(1 << 16), n), rng.randbytes(rng.randrange(40))))
    return out


def _mutate(rng: random.Random, pool: list[bytes]) -> bytes:
    data = bytearray(rng.choice(pool))
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
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
    return bytes(data)


class _Run:
    def __init__(self):
        self.executions = 0
        self.frames = 0
        self.errors = 0
        self.max_buffered = 0


def _exercise(data: bytes, rng: random.Random, run: _Run, max_body: int = 4096) -> None:
    """Feed ``data`` in random chunks; only FrameError may escape; the buffer stays under the cap."""
    run.executions += 1
    dec = FrameDecoder(max_body=max_body)
    pos = 0
    try:
        while pos < len(data):
            n = rng.randint(1, 96)
            dec.feed(data[pos : pos + n])
            pos += n
            while (f := dec.next_frame()) is not None:
                run.frames += 1
                enc = encode(f)  # a decoded frame re-encodes to the bytes it came from
                assert decode(enc) is not None
            run.max_buffered = max(run.max_buffered, dec.buffered)
            assert dec.buffered <= HEADER_SIZE + max_body + 96
        dec.feed_eof()
        while dec.next_frame() is not None:
            run.frames += 1
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
        "errors raised", run.errors, "max buffered", run.max_buffered, "crashes 0",
    )
    assert run.executions >= 10_000 and run.errors > run.executions // 2


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
    print("R7 hypothesis bytes: executions", _r7_hyp.executions, "frames", _r7_hyp.frames, "errors", _r7_hyp.errors, "crashes 0")


def test_r7_oversized_declarations_never_buffer_past_the_cap():
    rng = random.Random(3)
    run = _Run()
    for _ in range(2000):
        body_len = rng.randrange(4097, 1 << 32)
        head = struct.pack("<4sBBHIQI", MAGIC, LAYOUT, rng.choice(list(FrameKind)), 0, body_len, rng.randrange(1 << 63), 0)
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
