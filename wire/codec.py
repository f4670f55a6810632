"""The wire codec, layout 7: frames in, bytes out, bytes in, frames out. No I/O.

Every frame is a fixed 24-byte header followed by ``body_len`` bytes of body.
All integers are little-endian; page ids are unsigned 32-bit.

    offset  size  field
    ------  ----  -----------------------------------------------------------
         0     4  magic       b"KVLW"
         4     1  layout      7 (a layout-6 rank has no clear list: refused)
         5     1  kind        FrameKind: 1 HELLO 2 PREPARE 3 READY 4 REJECT
                              5 ABORT 6 LAUNCH
         6     2  flags       reserved, must be 0
         8     4  body_len    bytes after the header (checked against the
                              decoder's cap and the kind's size BEFORE any
                              body byte is buffered)
        12     8  step        the step the frame is about (HELLO: the first
                              step the sender will send / expects)
        20     4  checksum    CRC32 of bytes [0, 20) of the header, then the body
        24     -  body

    +------+---+---+-----+--------+----------------+--------+=============+
    | KVLW | 7 | k | 0 0 | len    | step           | crc32  | body ...    |
    +------+---+---+-----+--------+----------------+--------+=============+
     0      4   5   6     8        12               20       24

Bodies (``<`` little-endian ``struct`` formats):

    HELLO    <II32s   rank, world_size, geometry digest (BLAKE2b-256 of the
                      page geometry; ``geometry_digest``)                 40 B
    PREPARE  <II      n_ids, payload_len, then n_ids x u32 page ids, then
                      payload_len opaque payload bytes  (body_len must be
                      exactly 8 + 4 * n_ids + payload_len)             >= 8 B
    READY    <II      rank, checksum of the PREPARE frame it validated     8 B
    REJECT   <IHH     rank, code (RejectCode), detail_len, then detail_len
                      bytes of UTF-8 detail                            >= 8 B
    ABORT    <IHH     culprit rank (NO_RANK if none), code, reserved 0     8 B
    LAUNCH   <I       checksum of the PREPARE frame being launched         4 B

LAUNCH is the commit frame this layout adds to SPEC's five (see
``kvledger.wire.protocol`` for why a READY alone cannot be the commit point).

The decoder (``FrameDecoder``) is incremental: ``feed`` bytes as they come,
``next_frame`` returns a frame or ``None`` (need more bytes). Anything that is
not a well-formed layout-7 frame raises ``FrameError`` (a ``WireProtocolError``
with ``remote=True`` and a ``RejectCode``) and leaves the decoder broken: a byte
stream whose framing cannot be trusted is not resynchronised, it is closed.
Nothing else escapes the decoder, whatever the bytes.

Page-id checks (``page_ids_problem``) take the raw little-endian id bytes and
answer with a ``RejectCode`` and a REJECT detail; the check itself is
``kvledger.core.checks.u32_page_ids_problem`` (a strictly ascending list, what
the leader sends, is proven distinct and in range without a Python int per id).
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
import zlib
from enum import IntEnum
from typing import Optional, Union

import msgspec

from ..core import checks
from ..core.errors import FrameError, InvalidArgumentError

__all__ = [
    "MAGIC",
    "LAYOUT",
    "HEADER",
    "HEADER_SIZE",
    "NO_RANK",
    "MAX_DETAIL_BYTES",
    "DEFAULT_MAX_BODY",
    "FrameKind",
    "RejectCode",
    "Hello",
    "Prepare",
    "Ready",
    "Reject",
    "Abort",
    "Launch",
    "Frame",
    "encode",
    "encode_frame",
    "encode_prepare",
    "encode_prepare_raw",
    "pack_page_ids",
    "decode",
    "frame_checksum",
    "FrameDecoder",
    "geometry_digest",
    "page_ids_problem",
    "reject_for",
    "max_body_for",
]

MAGIC = b"KVLW"
LAYOUT = 7
HEADER = struct.Struct("<4sBBHIQI")
HEADER_SIZE = HEADER.size  # 24
NO_RANK = 0xFFFFFFFF
MAX_DETAIL_BYTES = 1024
DEFAULT_MAX_BODY = 8 << 20  # 8 MiB: two million page ids

_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_HELLO = struct.Struct("<II32s")
_COUNTS = struct.Struct("<II")
_READY = struct.Struct("<II")
_REJECT = struct.Struct("<IHH")
_ABORT = struct.Struct("<IHH")
_LAUNCH = struct.Struct("<I")
_crc32 = zlib.crc32

# array typecode holding unsigned 32-bit ints here ('I' on every mainstream ABI).
_ID_CODE = next(c for c in "ILH" if array.array(c).itemsize == 4)
_LITTLE = sys.byteorder == "little"


class FrameKind(IntEnum):
    HELLO = 1
    PREPARE = 2
    READY = 3
    REJECT = 4
    ABORT = 5
    LAUNCH = 6


class RejectCode(IntEnum):
    """Why a frame, a PREPARE or a whole step was refused (REJECT and ABORT bodies)."""

    BAD_MAGIC = 1  # not a kvledger frame: framing lost
    BAD_LAYOUT = 2  # layout byte is not 7 (e.g. a layout-6 rank)
    BAD_KIND = 3  # unknown frame kind
    BAD_FLAGS = 4  # reserved flag bits set
    FRAME_TOO_LARGE = 5  # body_len over the receiver's cap
    BAD_LENGTH = 6  # body_len or a length inside the body is inconsistent
    BAD_CHECKSUM = 7  # CRC32 mismatch
    TRUNCATED = 8  # the stream ended inside a frame
    BAD_BODY = 9  # reserved field not zero, invalid UTF-8, ...
    BAD_STEP = 10  # not the step the receiver expects
    PAGE_OUT_OF_RANGE = 11  # a page id >= num_pages
    DUPLICATE_PAGE = 12  # a page id listed twice
    GEOMETRY_MISMATCH = 13  # HELLO: different page geometry
    WORLD_SIZE_MISMATCH = 14  # HELLO: different world size
    BAD_RANK = 15  # HELLO/READY: rank out of range, taken, or not the link's
    UNEXPECTED_FRAME = 16  # a frame this state does not allow
    CONFLICT = 17  # same step, different content or a contradicting decision
    STALE_STEP = 18  # a frame for a step already decided
    TIMEOUT = 19  # ABORT: a rank did not answer in time
    PEER_LOST = 20  # ABORT: a rank's link closed or broke
    PEER_FAILED = 21  # a rank refused for a local reason (its executor, ...)


_KIND_NAMES = {k.value: k.name for k in FrameKind}


def _kind_name(kind) -> str:
    return _KIND_NAMES.get(kind, "kind " + str(kind))





# ---------------------------------------------------------------------------- frames


class _Frame(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class Hello(_Frame):
    """Who is on this link: ``rank`` of ``world_size``, over the geometry ``geometry_digest``.

    ``step``: the leader's HELLO names the first step it will PREPARE; a peer's
    names the step it expects (informational). ``layout`` is the header byte.
    """

    step: int
    rank: int
    world_size: int
    geometry_digest: bytes
    layout: int = LAYOUT


class Prepare(_Frame):
    """The step plan: zero ``clear_pages`` (distinct u32 page ids), run with ``payload``.

    Decoded frames carry ``clear_pages`` as a read-only ``memoryview`` of format
    ``'I'`` over the frame's bytes (``.tolist()`` for a list) and ``checksum``,
    the frame's CRC32 as received; the encoder takes any sequence of ints and
    ignores ``checksum``.
    """

    step: int
    clear_pages: object = ()
    payload: bytes = b""
    checksum: int = 0

    def __repr__(self) -> str:
        ids = self.clear_pages
        head = list(ids[:8]) if len(ids) else []
        more = ", ..." if len(ids) > 8 else ""
        return (
            "Prepare(step=" + str(self.step) + ", clear_pages=" + str(head)[:-1] + more + "] ("
            + str(len(ids)) + " ids), payload=" + str(len(self.payload)) + " bytes, checksum="
            + hex(self.checksum) + ")"
        )


class Ready(_Frame):
    """Rank ``rank`` validated the PREPARE of ``step`` whose frame checksum was ``prepare_checksum``."""

    step: int
    rank: int
    prepare_checksum: int


class Reject(_Frame):
    """Rank ``rank`` refuses ``step`` (or the link): ``code`` is a ``RejectCode``."""

    step: int
    rank: int
    code: int
    detail: str = ""


class Abort(_Frame):
    """The leader aborts ``step`` on every rank: nothing of it is cleared or launched.

    ``code`` says why (the REJECT code, TIMEOUT or PEER_LOST); ``rank`` names the
    rank that caused it, ``NO_RANK`` if none.
    """

    step: int
    code: int
    rank: int = NO_RANK


class Launch(_Frame):
    """The leader commits ``step``: every rank answered READY for ``prepare_checksum``."""

    step: int
    prepare_checksum: int


Frame = Union[Hello, Prepare, Ready, Reject, Abort, Launch]


# ---------------------------------------------------------------------------- encoding


def _bad(what: str, value) -> InvalidArgumentError:
    return InvalidArgumentError(what + " must fit its wire field, got " + repr(value))


def _u32(value, what: str) -> int:
    if not isinstance(value, int) or not 0 <= value <= _U32:
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
        raise InvalidArgumentError("frame header field out of range: " + str(exc)) from None
    crc = _crc32(body, _crc32(memoryview(head)[:20]))
    return head[:20] + crc.to_bytes(4, "little") + bytes(body)


def pack_page_ids(page_ids) -> bytes:
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
            raise InvalidArgumentError(
                "page ids must be ints in [0, 2**32), got " + repr(bad[:8] or page_ids)
            ) from None
    if _LITTLE:
        return arr.tobytes()
    arr = array.array(_ID_CODE, arr)
    arr.byteswap()
    return arr.tobytes()


def _iter_or_empty(obj):
    try:
        return list(obj)
    except TypeError:
        return []


def encode_prepare(step: int, page_ids, payload: bytes = b"") -> bytes:
    """PREPARE frame bytes for ``step`` without building a ``Prepare`` first (the hot path)."""
    return encode_prepare_raw(step, pack_page_ids(page_ids), payload)


def encode_prepare_raw(step: int, raw: bytes, payload: bytes = b"") -> bytes:
    """PREPARE frame bytes from ids already packed by ``pack_page_ids``."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError("payload must be bytes, got " + type(payload).__name__)
    if len(raw) & 3:
        raise InvalidArgumentError("packed page ids must be a multiple of 4 bytes, got " + str(len(raw)))
    return encode_frame(FrameKind.PREPARE, step, _COUNTS.pack(len(raw) >> 2, len(payload)) + bytes(raw) + bytes(payload))


def _detail_bytes(detail: str) -> bytes:
    if type(detail) is not str:
        raise InvalidArgumentError("detail must be a str, got " + repr(detail))
    raw = detail.encode("utf-8", "replace")
    if len(raw) > MAX_DETAIL_BYTES:
        raw = raw[:MAX_DETAIL_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return raw


def _enc_hello(f: Hello) -> bytes:
    digest = f.geometry_digest
    if type(digest) is not bytes or len(digest) != 32:
        raise InvalidArgumentError("geometry_digest must be 32 bytes, got " + repr(digest))
    body = _HELLO.pack(_u32(f.rank, "rank"), _u32(f.world_size, "world_size"), digest)
    if not isinstance(f.layout, int) or not 0 <= f.layout <= 255:
        raise _bad("layout", f.layout)
    return encode_frame(FrameKind.HELLO, f.step, body, layout=f.layout)


def _enc_prepare(f: Prepare) -> bytes:
    return encode_prepare(f.step, f.clear_pages, f.payload)


def _enc_ready(f: Ready) -> bytes:
    body = _READY.pack(_u32(f.rank, "rank"), _u32(f.prepare_checksum, "prepare_checksum"))
    return encode_frame(FrameKind.READY, f.step, body)


def _enc_reject(f: Reject) -> bytes:
    raw = _detail_bytes(f.detail)
    code = f.code
    if not isinstance(code, int) or not 0 <= code <= 0xFFFF:
        raise _bad("code", code)
    return encode_frame(FrameKind.REJECT, f.step, _REJECT.pack(_u32(f.rank, "rank"), code, len(raw)) + raw)


def _enc_abort(f: Abort) -> bytes:
    code = f.code
    if not isinstance(code, int) or not 0 <= code <= 0xFFFF:
        raise _bad("code", code)
    return encode_frame(FrameKind.ABORT, f.step, _ABORT.pack(_u32(f.rank, "rank"), code, 0))


def _enc_launch(f: Launch) -> bytes:
    return encode_frame(FrameKind.LAUNCH, f.step, _LAUNCH.pack(_u32(f.prepare_checksum, "prepare_checksum")))


_ENCODERS = {
    Hello: _enc_hello,
    Prepare: _enc_prepare,
    Ready: _enc_ready,
    Reject: _enc_reject,
    Abort: _enc_abort,
    Launch: _enc_launch,
}


def encode(frame: Frame) -> bytes:
    """The bytes of one frame. Raises ``InvalidArgumentError`` for a field that does not fit."""
    enc = _ENCODERS.get(type(frame))
    if enc is None:
        raise InvalidArgumentError("not a wire frame: " + repr(frame))
    return enc(frame)


def frame_checksum(data) -> int:
    """The CRC32 stored in an encoded frame's header (what READY and LAUNCH echo)."""
    return int.from_bytes(bytes(data[20:24]), "little")


def geometry_digest(geometry) -> bytes:
    """BLAKE2b-256 of the page geometry as every rank must share it (HELLO checks it)."""
    n, t = geometry.num_pages, geometry.page_tokens
    return hashlib.blake2b(b"kvledger.wire.geometry/1" + struct.pack("<QQ", n, t), digest_size=32).digest()


def max_body_for(num_pages: int, max_payload: int = 1 << 20) -> int:
    """The largest legal body for a geometry: a PREPARE listing every page plus ``max_payload``."""
    return _COUNTS.size + 4 * num_pages + max_payload


# ---------------------------------------------------------------------------- page-id checks


def page_ids_problem(raw, num_pages: int) -> tuple[RejectCode, str] | None:
    """``None`` if the u32 ids in ``raw`` are all ``< num_pages`` and distinct.

    Otherwise ``(RejectCode, detail)``: PAGE_OUT_OF_RANGE or DUPLICATE_PAGE and a
    REJECT detail naming the offending ids. ``raw`` is the little-endian u32
    bytes (any bytes-like) or a decoded ``Prepare.clear_pages`` (a ``memoryview``
    of format ``'I'``). The check itself is ``core.checks.u32_page_ids_problem``
    (no Python int per id on the ascending path). Pure.
    """
    problem = checks.u32_page_ids_problem(raw, num_pages)
    if problem is None:
        return None
    return reject_for(problem, num_pages)


def reject_for(problem: checks.Problem, num_pages: int) -> tuple[RejectCode, str]:
    """The REJECT code and detail for a page-list ``Problem``."""
    if problem.kind == checks.OUT_OF_RANGE:
        return RejectCode.PAGE_OUT_OF_RANGE, f"page ids {_few(problem.page_ids)} out of range [0, {num_pages})"
    return RejectCode.DUPLICATE_PAGE, f"page ids {_few(problem.page_ids)} listed more than once"


def _few(ids, limit: int = 8) -> str:
    head = ", ".join(str(i) for i in ids[:limit])
    more = f", ... ({len(ids)} in all)" if len(ids) > limit else ""
    return f"[{head}{more}]"


# ---------------------------------------------------------------------------- decoding

# Exact body size per kind (None: variable, at least _MIN_BODY).
_FIXED_BODY = {
    FrameKind.HELLO: _HELLO.size,
    FrameKind.READY: _READY.size,
    FrameKind.ABORT: _ABORT.size,
    FrameKind.LAUNCH: _LAUNCH.size,
}
_MIN_BODY = {FrameKind.PREPARE: _COUNTS.size, FrameKind.REJECT: _REJECT.size}


def _dec_hello(step, body, layout, crc):
    rank, world, digest = _HELLO.unpack(body)
    return Hello(step=step, rank=rank, world_size=world, geometry_digest=digest, layout=layout)


def _dec_prepare(step, body, layout, crc):
    n, plen = _COUNTS.unpack_from(body, 0)
    if 8 + 4 * n + plen != len(body):
        raise FrameError(
            RejectCode.BAD_LENGTH,
            "PREPARE lists " + str(n) + " ids and " + str(plen) + " payload bytes, which is "
            + str(8 + 4 * n + plen) + " body bytes, but body_len is " + str(len(body)),
            step=step, kind=FrameKind.PREPARE,
        )
    end = 8 + 4 * n
    ids = checks.u32_ids(memoryview(body)[8:end])
    return Prepare(step=step, clear_pages=ids, payload=body[end:], checksum=crc)


def _dec_ready(step, body, layout, crc):
    rank, checksum = _READY.unpack(body)
    return Ready(step=step, rank=rank, prepare_checksum=checksum)


def _dec_reject(step, body, layout, crc):
    rank, code, dlen = _REJECT.unpack_from(body, 0)
    if 8 + dlen != len(body):
        raise FrameError(
            RejectCode.BAD_LENGTH,
            "REJECT detail_len " + str(dlen) + " does not match body_len " + str(len(body)),
            step=step, kind=FrameKind.REJECT,
        )
    try:
        detail = body[8:].decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError(RejectCode.BAD_BODY, "REJECT detail is not UTF-8", step=step, kind=FrameKind.REJECT) from None
    return Reject(step=step, rank=rank, code=code, detail=detail)


def _dec_abort(step, body, layout, crc):
    rank, code, reserved = _ABORT.unpack(body)
    if reserved:
        raise FrameError(RejectCode.BAD_BODY, "ABORT reserved field is " + str(reserved), step=step, kind=FrameKind.ABORT)
    return Abort(step=step, code=code, rank=rank)


def _dec_launch(step, body, layout, crc):
    (checksum,) = _LAUNCH.unpack(body)
    return Launch(step=step, prepare_checksum=checksum)


_DECODERS = {
    FrameKind.HELLO: _dec_hello,
    FrameKind.PREPARE: _dec_prepare,
    FrameKind.READY: _dec_ready,
    FrameKind.REJECT: _dec_reject,
    FrameKind.ABORT: _dec_abort,
    FrameKind.LAUNCH: _dec_launch,
}


class FrameDecoder:
    """Incremental frame decoder for one byte stream.

        feed(bytes) ──► [buffer] ──► next_frame() ─► Frame | None (need more bytes)
        feed_eof()  ──► next_frame() ─► None at a frame boundary, FrameError(TRUNCATED) inside one

    The header is checked as soon as its 24 bytes are in: magic, layout, kind,
    flags, then ``body_len`` against ``max_body`` and the kind's size, so an
    oversized or misdeclared frame fails before its body is buffered. Memory is
    bounded by what the caller feeds between ``next_frame`` calls plus one frame
    (<= ``HEADER_SIZE + max_body``): feed a chunk, drain, feed the next.

    Raises ``FrameError`` only; after one, the decoder is broken and every later
    ``next_frame`` raises the same error (``error`` holds it).
    """

    __slots__ = ("max_body", "_buf", "_pos", "_eof", "error", "frames")

    def __init__(self, *, max_body: int = DEFAULT_MAX_BODY) -> None:
        if type(max_body) is not int or max_body < 64:
            raise InvalidArgumentError("max_body must be an int >= 64, got " + repr(max_body))
        self.max_body = max_body
        self._buf = bytearray()
        self._pos = 0
        self._eof = False
        self.error: Optional[FrameError] = None
        self.frames = 0

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet consumed by a frame."""
        return len(self._buf) - self._pos

    @property
    def at_eof(self) -> bool:
        return self._eof

    def feed(self, data) -> None:
        """Append received bytes. Raises ``InvalidArgumentError`` after ``feed_eof``."""
        if self._eof:
            raise InvalidArgumentError("feed() after feed_eof()")
        if data:
            self._buf += data

    def feed_eof(self) -> None:
        """The stream ended; a partial frame left in the buffer becomes a TRUNCATED error."""
        self._eof = True

    def _fail(self, code: int, detail: str, step=None, kind=None) -> FrameError:
        err = FrameError(code, detail, step=step, kind=kind)
        self.error = err
        return err

    def next_frame(self) -> Optional[Frame]:
        """The next complete frame, or ``None`` if more bytes are needed (or the stream ended cleanly)."""
        if self.error is not None:
            raise self.error
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < HEADER_SIZE:
            if avail and buf[pos : pos + 4] != MAGIC[: min(avail, 4)]:
                raise self._fail(RejectCode.BAD_MAGIC, "bad magic " + bytes(buf[pos : pos + 4]).hex())
            if self._eof and avail:
                raise self._fail(
                    RejectCode.TRUNCATED, "stream ended " + str(avail) + " bytes into a frame header"
                )
            if not avail and pos:
                buf.clear()
                self._pos = 0
            return None
        magic, layout, kind, flags, body_len, step, crc = HEADER.unpack_from(buf, pos)
        if magic != MAGIC:
            raise self._fail(RejectCode.BAD_MAGIC, "bad magic " + magic.hex() + ", expected " + MAGIC.hex())
        if layout != LAYOUT:
            raise self._fail(
                RejectCode.BAD_LAYOUT,
                _kind_name(kind) + " frame of layout " + str(layout) + "; this rank speaks layout "
                + str(LAYOUT) + (" (a layout-6 rank has no clear list and cannot join)" if layout == 6 else ""),
                step, kind,
            )
        decoder = _DECODERS.get(kind)
        if decoder is None:
            raise self._fail(RejectCode.BAD_KIND, "unknown frame kind " + str(kind), step, kind)
        name = _KIND_NAMES[kind]
        if flags:
            raise self._fail(RejectCode.BAD_FLAGS, name + " flags " + hex(flags) + " (reserved, must be 0)", step, kind)
        if body_len > self.max_body:
            raise self._fail(
                RejectCode.FRAME_TOO_LARGE,
                name + " body_len " + str(body_len) + " over the cap of " + str(self.max_body) + " bytes",
                step, kind,
            )
        fixed = _FIXED_BODY.get(kind)
        if fixed is not None:
            if body_len != fixed:
                raise self._fail(
                    RejectCode.BAD_LENGTH, name + " body_len " + str(body_len) + ", must be " + str(fixed), step, kind
                )
        elif body_len < _MIN_BODY[kind]:
            raise self._fail(
                RejectCode.BAD_LENGTH,
                name + " body_len " + str(body_len) + ", must be at least " + str(_MIN_BODY[kind]),
                step, kind,
            )
        end = pos + HEADER_SIZE + body_len
        if len(buf) < end:
            if self._eof:
                raise self._fail(
                    RejectCode.TRUNCATED,
                    "stream ended " + str(avail) + " bytes into a " + str(HEADER_SIZE + body_len) + "-byte "
                    + name + " frame",
                    step, kind,
                )
            return None
        body = bytes(buf[pos + HEADER_SIZE : end])
        got = _crc32(body, _crc32(memoryview(buf)[pos : pos + 20]))
        if got != crc:
            raise self._fail(
                RejectCode.BAD_CHECKSUM,
                name + " checksum " + format(crc, "08x") + " but the frame hashes to " + format(got, "08x"),
                step, kind,
            )
        try:
            frame = decoder(step, body, layout, crc)
        except FrameError as exc:
            self.error = exc
            raise
        if end == len(buf):
            buf.clear()
            self._pos = 0
        elif end > 65536 and end > (len(buf) >> 1):
            del buf[:end]
            self._pos = 0
        else:
            self._pos = end
        self.frames += 1
        return frame


def decode(data) -> Frame:
    """Exactly one whole frame from ``data``. Raises ``FrameError`` otherwise (also for extra bytes)."""
    dec = FrameDecoder(max_body=max(64, len(data)))
    dec.feed(data)
    dec.feed_eof()
    frame = dec.next_frame()
    if frame is None:
        raise FrameError(RejectCode.TRUNCATED, "no frame in " + str(len(data)) + " bytes")
    if dec.buffered:
        raise FrameError(RejectCode.BAD_LENGTH, str(dec.buffered) + " bytes after the frame")
    return frame
