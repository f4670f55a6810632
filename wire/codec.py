"""The wire codec, layout 9: the frames, their byte layout, and the encoders. No I/O.

Every frame is a fixed 24-byte header followed by ``body_len`` bytes of body.
All integers are little-endian; page ids are unsigned 32-bit.

    offset  size  field
    ------  ----  -----------------------------------------------------------
         0     4  magic       b"KVLW"
         4     1  layout      9 (a layout-8 rank cannot prove the job's key, a
                              layout-7 one sends no COMPLETE and has no
                              sanitizer lists, a layout-6 one no clear list:
                              all refused at HELLO)
         5     1  kind        FrameKind: 1 HELLO 2 PREPARE 3 READY 4 REJECT
                              5 ABORT 6 LAUNCH 7 COMPLETE 8 CHALLENGE 9 AUTH
         6     2  flags       bit 0 SANITIZE (PREPARE only); every other bit,
                              and any bit on another kind, must be 0
         8     4  body_len    bytes after the header (checked against the
                              decoder's cap and the kind's size BEFORE any
                              body byte is buffered)
        12     8  step        the step the frame is about (HELLO: the first
                              step the sender will send / expects)
        20     4  checksum    CRC32 of bytes [0, 20) of the header, then the body
        24     -  body

    +------+---+---+-----+--------+----------------+--------+=============+
    | KVLW | 8 | k | flg | len    | step           | crc32  | body ...    |
    +------+---+---+-----+--------+----------------+--------+=============+
     0      4   5   6     8        12               20       24

Bodies (``<`` little-endian ``struct`` formats):

    HELLO     <II32s32s  rank, world_size, geometry digest (BLAKE2b-256 of
                      the page geometry; ``geometry_digest``), the sender's
                      handshake nonce (new in layout 9)                    72 B
    CHALLENGE <32s32s the leader's nonce, its proof of the job's key
                      (HMAC-SHA256; ``kvledger.wire.auth``)  new in 9      64 B
    AUTH      <I32s   rank, its proof of the job's key       new in 9      36 B
    PREPARE   <II     n_ids, payload_len, then n_ids x u32 page ids, then
                      payload_len opaque payload bytes  (body_len must be
                      exactly 8 + 4 * n_ids + payload_len)             >= 8 B
      + SANITIZE flag:
              <IIII   n_ids, payload_len, n_poison, n_committed, then the
                      clear ids, the poison ids, the committed ids (u32
                      each), then the payload (body_len exactly 16 + 4 *
                      (n_ids + n_poison + n_committed) + payload_len)  >= 16 B
    READY     <II     rank, checksum of the PREPARE frame it validated     8 B
    REJECT    <IHH    rank, code (RejectCode), detail_len, then detail_len
                      (<= 1024, new in layout 8) bytes of UTF-8 detail >= 8 B
    ABORT     <IHH    culprit rank (NO_RANK if none), code, reserved 0     8 B
    LAUNCH    <I      checksum of the PREPARE frame being launched         4 B
    COMPLETE  <IIHH   rank, checksum of the PREPARE it ran, status (0 ok,
                      1 failed), detail_len, then detail_len (<= 1024)
                      bytes of UTF-8 detail                           >= 12 B

LAUNCH is the commit frame layout 7 added to SPEC's five (see
``kvledger.wire.protocol`` for why a READY alone cannot be the commit point);
COMPLETE, new in layout 8, is a peer's report that it ran a launched step
(its clears and graph done, or failed). CHALLENGE and AUTH, new in layout 9,
make the handshake a proof of the job's shared key in both directions
(``kvledger.wire.auth`` has the MACs and what they protect; ``protocol`` the
exchange). A layout change is a versioned decision: the golden bytes in
``tests/wire/test_wire_codec.py`` change with it, and a rank of another layout
is refused at its first frame.

Why a layout-7 rank cannot take a sanitizer PREPARE for a plain one (it refuses,
it never ignores the poison list): three checks of its own decoder stand in the
way, each enough alone. The layout byte is 9, not 7 (BAD_LAYOUT; HELLO already
keeps such a rank out of the group). Relabelled 7, the SANITIZE bit is a
reserved flag (BAD_FLAGS). With the bit cleared too, its body arithmetic
``8 + 4 * n_ids + payload_len`` misses ``body_len`` by 8 + 4 * (n_poison +
n_committed) bytes, never 0 (BAD_LENGTH). ``tests/wire/test_wire_codec.py`` pins
all three against the layout-7 decoder itself.

This module holds everything that turns frames or page ids into bytes
(``encode``, ``encode_prepare``, ``pack_page_ids``) and re-exports the frame
values and codes (their home is ``kvledger.wire.frames``). Bytes back into
frames, and the checks a receiver makes, are in ``kvledger.wire.decoder``.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from typing import Any

from ..core.errors import InvalidArgumentError
from ..core.events import Geometry
from .frames import (
    LAYOUT,
    NO_RANK,
    NONCE_BYTES,
    PROOF_BYTES,
    Abort,
    Auth,
    Challenge,
    Complete,
    Frame,
    FrameKind,
    Hello,
    Launch,
    Prepare,
    Ready,
    Reject,
    RejectCode,
    Sanitize,
)

__all__ = [
    "MAGIC",
    "LAYOUT",
    "HEADER",
    "HEADER_SIZE",
    "NO_RANK",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "FLAG_SANITIZE",
    "MAX_DETAIL_BYTES",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_PAYLOAD",
    "FrameKind",
    "RejectCode",
    "Hello",
    "Challenge",
    "Auth",
    "Prepare",
    "Ready",
    "Reject",
    "Abort",
    "Launch",
    "Complete",
    "Sanitize",
    "Frame",
    "encode",
    "encode_frame",
    "encode_prepare",
    "encode_prepare_raw",
    "pack_page_ids",
    "frame_checksum",
    "geometry_digest",
    "max_body_for",
]

MAGIC = b"KVLW"
FLAG_SANITIZE = 0x0001  # PREPARE: the poison and committed lists follow the clear list
HEADER = struct.Struct("<4sBBHIQI")
HEADER_SIZE = HEADER.size  # 24
MAX_DETAIL_BYTES = 1024
DEFAULT_MAX_BODY = 8 << 20  # 8 MiB: two million page ids
DEFAULT_MAX_PAYLOAD = 1 << 20  # what a peer accepts in one PREPARE's payload unless told otherwise

# Body layouts, shared with decoder.py.
HELLO_BODY = struct.Struct("<II32s32s")
CHALLENGE_BODY = struct.Struct("<32s32s")
AUTH_BODY = struct.Struct("<I32s")
PREPARE_COUNTS = struct.Struct("<II")
SANITIZE_COUNTS = struct.Struct("<IIII")
READY_BODY = struct.Struct("<II")
REJECT_BODY = struct.Struct("<IHH")
ABORT_BODY = struct.Struct("<IHH")
LAUNCH_BODY = struct.Struct("<I")
COMPLETE_BODY = struct.Struct("<IIHH")
COMPLETE_OK, COMPLETE_FAILED = 0, 1  # COMPLETE's status field

_U16 = 0xFFFF
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_crc32 = zlib.crc32

# array typecode holding unsigned 32-bit ints here ('I' on every mainstream ABI).
_ID_CODE = next(c for c in "ILH" if array.array(c).itemsize == 4)
_LITTLE = sys.byteorder == "little"


# ---------------------------------------------------------------------------- encoding


def _bad(what: str, value: object) -> InvalidArgumentError:
    return InvalidArgumentError(f"{what} must fit its wire field, got {value!r}")


def _uint(value: object, limit: int, what: str) -> int:
    if not isinstance(value, int) or not 0 <= value <= limit:
        raise _bad(what, value)
    return int(value)


def encode_frame(kind: int, step: int, body: bytes, *, layout: int = LAYOUT, flags: int = 0) -> bytes:
    """One frame from raw parts: header (with the CRC32) + ``body``.

    Low level: no check that ``body`` suits ``kind`` (tests use it to build bad
    frames, e.g. another ``layout``). Raises ``InvalidArgumentError`` for a field
    that does not fit its width.
    """
    if not isinstance(step, int) or not 0 <= step <= _U64:
        raise _bad("step", step)
    try:
        head = HEADER.pack(MAGIC, layout, kind, flags, len(body), step, 0)
    except struct.error as exc:
        raise InvalidArgumentError(f"frame header field out of range: {exc}") from None
    crc = _crc32(body, _crc32(memoryview(head)[:20]))
    return head[:20] + crc.to_bytes(4, "little") + bytes(body)


def pack_page_ids(page_ids: Iterable[int]) -> bytes:
    """Page ids as little-endian u32 bytes. Takes any sequence of ints.

    ``array('I')`` and ``memoryview`` of format ``'I'`` take a copy-only fast path.
    Raises ``InvalidArgumentError`` for an id that is not an int in [0, 2**32).
    """
    if type(page_ids) is array.array and page_ids.typecode == _ID_CODE:
        arr = page_ids
    elif type(page_ids) is memoryview and page_ids.format == _ID_CODE and page_ids.c_contiguous:
        if _LITTLE:
            return page_ids.tobytes()
        arr = array.array(_ID_CODE, page_ids.tobytes())
    else:
        try:
            arr = array.array(_ID_CODE, page_ids)
        except (OverflowError, TypeError, ValueError):
            bad = [p for p in _iter_or_empty(page_ids) if not (isinstance(p, int) and 0 <= p <= _U32)]
            raise InvalidArgumentError(f"page ids must be ints in [0, 2**32), got {bad[:8] or page_ids!r}") from None
    if _LITTLE:
        return arr.tobytes()
    arr = array.array(_ID_CODE, arr)
    arr.byteswap()
    return arr.tobytes()


def _iter_or_empty(obj: Any) -> list[Any]:
    try:
        return list(obj)
    except TypeError:
        return []


def encode_prepare(
    step: int, page_ids: Iterable[int], payload: bytes = b"", *, sanitize: Sanitize | None = None
) -> bytes:
    """PREPARE frame bytes for ``step`` without building a ``Prepare`` first (the hot path).

    With ``sanitize`` the frame carries the SANITIZE flag and its two lists.
    Raises ``InvalidArgumentError`` for an id, payload or step that does not fit.
    """
    raw = pack_page_ids(page_ids)
    if sanitize is None:
        return encode_prepare_raw(step, raw, payload)
    if type(sanitize) is not Sanitize:
        raise InvalidArgumentError(f"sanitize must be a Sanitize or None, got {sanitize!r}")
    lists = (pack_page_ids(sanitize.poison_pages), pack_page_ids(sanitize.committed_pages))
    return encode_prepare_raw(step, raw, payload, sanitize_raw=lists)


def encode_prepare_raw(
    step: int, raw: bytes, payload: bytes = b"", *, sanitize_raw: tuple[bytes, bytes] | None = None
) -> bytes:
    """PREPARE frame bytes from ids already packed by ``pack_page_ids``.

    ``sanitize_raw``: the packed poison and committed lists of a sanitize-mode step
    (the SANITIZE flag is set then). Raises ``InvalidArgumentError`` for packed ids
    that are not whole u32s or a payload that is not bytes.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"payload must be bytes, got {type(payload).__name__}")
    if len(raw) & 3:
        raise InvalidArgumentError(f"packed page ids must be a multiple of 4 bytes, got {len(raw)}")
    if sanitize_raw is None:
        body = PREPARE_COUNTS.pack(len(raw) >> 2, len(payload)) + bytes(raw) + bytes(payload)
        return encode_frame(FrameKind.PREPARE, step, body)
    poison, committed = sanitize_raw
    if (len(poison) | len(committed)) & 3:
        raise InvalidArgumentError("packed poison and committed ids must be multiples of 4 bytes")
    counts = SANITIZE_COUNTS.pack(len(raw) >> 2, len(payload), len(poison) >> 2, len(committed) >> 2)
    body = b"".join((counts, raw, poison, committed, payload))
    return encode_frame(FrameKind.PREPARE, step, body, flags=FLAG_SANITIZE)


def _detail_bytes(detail: str) -> bytes:
    if type(detail) is not str:
        raise InvalidArgumentError(f"detail must be a str, got {detail!r}")
    raw = detail.encode("utf-8", "replace")
    if len(raw) > MAX_DETAIL_BYTES:
        raw = raw[:MAX_DETAIL_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return raw


def _fixed_bytes(value: object, size: int, what: str) -> bytes:
    if type(value) is not bytes or len(value) != size:
        raise InvalidArgumentError(f"{what} must be {size} bytes, got {value!r}")
    return value


def _enc_hello(f: Hello) -> bytes:
    digest = _fixed_bytes(f.geometry_digest, 32, "geometry_digest")
    nonce = _fixed_bytes(f.nonce, NONCE_BYTES, "nonce")
    body = HELLO_BODY.pack(_uint(f.rank, _U32, "rank"), _uint(f.world_size, _U32, "world_size"), digest, nonce)
    return encode_frame(FrameKind.HELLO, f.step, body, layout=_uint(f.layout, 0xFF, "layout"))


def _enc_challenge(f: Challenge) -> bytes:
    body = CHALLENGE_BODY.pack(_fixed_bytes(f.nonce, NONCE_BYTES, "nonce"), _fixed_bytes(f.proof, PROOF_BYTES, "proof"))
    return encode_frame(FrameKind.CHALLENGE, f.step, body)


def _enc_auth(f: Auth) -> bytes:
    body = AUTH_BODY.pack(_uint(f.rank, _U32, "rank"), _fixed_bytes(f.proof, PROOF_BYTES, "proof"))
    return encode_frame(FrameKind.AUTH, f.step, body)


def _enc_prepare(f: Prepare) -> bytes:
    return encode_prepare(f.step, f.clear_pages, f.payload, sanitize=f.sanitize)


def _enc_ready(f: Ready) -> bytes:
    body = READY_BODY.pack(_uint(f.rank, _U32, "rank"), _uint(f.prepare_checksum, _U32, "prepare_checksum"))
    return encode_frame(FrameKind.READY, f.step, body)


def _enc_reject(f: Reject) -> bytes:
    raw = _detail_bytes(f.detail)
    code = _uint(f.code, _U16, "code")
    body = REJECT_BODY.pack(_uint(f.rank, _U32, "rank"), code, len(raw)) + raw
    return encode_frame(FrameKind.REJECT, f.step, body)


def _enc_abort(f: Abort) -> bytes:
    code = _uint(f.code, _U16, "code")
    body = ABORT_BODY.pack(_uint(f.rank, _U32, "rank"), code, 0)
    return encode_frame(FrameKind.ABORT, f.step, body)


def _enc_launch(f: Launch) -> bytes:
    body = LAUNCH_BODY.pack(_uint(f.prepare_checksum, _U32, "prepare_checksum"))
    return encode_frame(FrameKind.LAUNCH, f.step, body)


def _enc_complete(f: Complete) -> bytes:
    raw = _detail_bytes(f.detail)
    if type(f.ok) is not bool:
        raise InvalidArgumentError(f"ok must be a bool, got {f.ok!r}")
    status = COMPLETE_OK if f.ok else COMPLETE_FAILED
    rank, crc = _uint(f.rank, _U32, "rank"), _uint(f.prepare_checksum, _U32, "prepare_checksum")
    body = COMPLETE_BODY.pack(rank, crc, status, len(raw)) + raw
    return encode_frame(FrameKind.COMPLETE, f.step, body)


_ENCODERS: dict[type, Callable[..., bytes]] = {
    Hello: _enc_hello,
    Challenge: _enc_challenge,
    Auth: _enc_auth,
    Prepare: _enc_prepare,
    Ready: _enc_ready,
    Reject: _enc_reject,
    Abort: _enc_abort,
    Launch: _enc_launch,
    Complete: _enc_complete,
}


def encode(frame: Frame) -> bytes:
    """The bytes of one frame. Raises ``InvalidArgumentError`` for a field that does not fit."""
    enc = _ENCODERS.get(type(frame))
    if enc is None:
        raise InvalidArgumentError(f"not a wire frame: {frame!r}")
    return enc(frame)


def frame_checksum(data: bytes | bytearray | memoryview) -> int:
    """The CRC32 stored in an encoded frame's header (what READY, LAUNCH and COMPLETE echo)."""
    return int.from_bytes(bytes(data[20:24]), "little")


def geometry_digest(geometry: Geometry) -> bytes:
    """BLAKE2b-256 of the page geometry as every rank must share it (HELLO checks it)."""
    n, t = geometry.num_pages, geometry.page_tokens
    return hashlib.blake2b(b"kvledger.wire.geometry/1" + struct.pack("<QQ", n, t), digest_size=32).digest()


def max_body_for(num_pages: int, max_payload: int = DEFAULT_MAX_PAYLOAD, *, sanitize: bool = False) -> int:
    """The largest legal PREPARE body for a geometry: every page listed, plus ``max_payload``
    payload bytes; with ``sanitize``, every page in each of the three lists. A receiver's
    decoder cap (``FrameDecoder(max_body=...)``)."""
    if sanitize:
        return SANITIZE_COUNTS.size + 12 * num_pages + max_payload
    return PREPARE_COUNTS.size + 4 * num_pages + max_payload
