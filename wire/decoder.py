"""The receiving half of the layout-9 codec: bytes in, frames out, checked. No I/O.

The frame layout is drawn in ``kvledger.wire.codec`` (with the frame values
and the encoders). Here:

    feed(bytes) ──► FrameDecoder ──► next_frame() ─► Frame | None (need more bytes)
                                                   └ FrameError (RejectCode, detail)
    decode(bytes) ─► exactly one Frame
    page_ids_problem(clear_pages, num_pages) ─► None | (RejectCode, REJECT detail)

The decoder (``FrameDecoder``) is incremental: ``feed`` bytes as they come,
``next_frame`` returns a frame or ``None`` (need more bytes). Anything that is
not a well-formed layout-9 frame raises ``FrameError`` (a ``WireProtocolError``
with ``remote=True`` and a ``RejectCode``) and leaves the decoder broken: a byte
stream whose framing cannot be trusted is not resynchronised, it is closed.
Nothing else escapes the decoder, whatever the bytes.

Page-id checks (``page_ids_problem``) take the raw little-endian id bytes and
answer with a ``RejectCode`` and a REJECT detail; the check itself is
``kvledger.core.checks.u32_page_ids_problem`` (a strictly ascending list, what
the leader sends, is proven distinct and in range without a Python int per id).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from ..core import checks
from ..core.errors import FrameError, InvalidArgumentError
from .codec import (
    ABORT_BODY,
    AUTH_BODY,
    CHALLENGE_BODY,
    COMPLETE_BODY,
    COMPLETE_FAILED,
    DEFAULT_MAX_BODY,
    FLAG_SANITIZE,
    HEADER,
    HEADER_SIZE,
    HELLO_BODY,
    LAUNCH_BODY,
    LAYOUT,
    MAGIC,
    MAX_DETAIL_BYTES,
    PREPARE_COUNTS,
    READY_BODY,
    REJECT_BODY,
    SANITIZE_COUNTS,
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
    "FrameDecoder",
    "decode",
    "page_ids_problem",
    "reject_for",
]

_crc32 = zlib.crc32
_KIND_NAMES = {k.value: k.name for k in FrameKind}


def _kind_name(kind: int) -> str:
    return _KIND_NAMES.get(kind, f"kind {kind}")


# ---------------------------------------------------------------------------- page-id checks


def page_ids_problem(raw: bytes | bytearray | memoryview, num_pages: int) -> tuple[RejectCode, str] | None:
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


def _few(ids: Sequence[int], limit: int = 8) -> str:
    head = ", ".join(str(i) for i in ids[:limit])
    more = f", ... ({len(ids)} in all)" if len(ids) > limit else ""
    return f"[{head}{more}]"


# ---------------------------------------------------------------------------- bodies

# Exact body size per kind (None: variable, at least _MIN_BODY).
_FIXED_BODY: dict[int, int] = {
    FrameKind.HELLO: HELLO_BODY.size,
    FrameKind.CHALLENGE: CHALLENGE_BODY.size,
    FrameKind.AUTH: AUTH_BODY.size,
    FrameKind.READY: READY_BODY.size,
    FrameKind.ABORT: ABORT_BODY.size,
    FrameKind.LAUNCH: LAUNCH_BODY.size,
}
_MIN_BODY: dict[int, int] = {
    FrameKind.PREPARE: PREPARE_COUNTS.size,
    FrameKind.REJECT: REJECT_BODY.size,
    FrameKind.COMPLETE: COMPLETE_BODY.size,
}
# Flag bits a kind may carry; every other bit is reserved (BAD_FLAGS).
_FLAGS: dict[int, int] = {FrameKind.PREPARE: FLAG_SANITIZE}
# Why an older layout's rank cannot join (BAD_LAYOUT details).
_OLD_LAYOUTS = {
    6: "a layout-6 rank has no clear list",
    7: "a layout-7 rank sends no COMPLETE and has no sanitizer lists",
    8: "a layout-8 rank cannot prove the job's key",
}


def _dec_hello(step: int, body: bytes, layout: int, flags: int, crc: int) -> Hello:
    rank, world, digest, nonce = HELLO_BODY.unpack(body)
    return Hello(step=step, rank=rank, world_size=world, geometry_digest=digest, nonce=nonce, layout=layout)


def _dec_challenge(step: int, body: bytes, layout: int, flags: int, crc: int) -> Challenge:
    nonce, proof = CHALLENGE_BODY.unpack(body)
    return Challenge(step=step, nonce=nonce, proof=proof)


def _dec_auth(step: int, body: bytes, layout: int, flags: int, crc: int) -> Auth:
    rank, proof = AUTH_BODY.unpack(body)
    return Auth(step=step, rank=rank, proof=proof)


def _bad_length(step: int, kind: int, detail: str) -> FrameError:
    return FrameError(RejectCode.BAD_LENGTH, detail, step=step, kind=kind)


def _dec_prepare(step: int, body: bytes, layout: int, flags: int, crc: int) -> Prepare:
    if flags:  # the header allowed only FLAG_SANITIZE
        return _dec_prepare_sanitize(step, body, crc)
    n, plen = PREPARE_COUNTS.unpack_from(body, 0)
    if 8 + 4 * n + plen != len(body):
        raise _bad_length(
            step,
            FrameKind.PREPARE,
            f"PREPARE lists {n} ids and {plen} payload bytes, which is {8 + 4 * n + plen} body bytes, "
            f"but body_len is {len(body)}",
        )
    end = 8 + 4 * n
    ids = checks.u32_ids(memoryview(body)[8:end])
    return Prepare(step=step, clear_pages=ids, payload=body[end:], checksum=crc)


def _dec_prepare_sanitize(step: int, body: bytes, crc: int) -> Prepare:
    n, plen, npoison, ncommitted = SANITIZE_COUNTS.unpack_from(body, 0)
    want = 16 + 4 * (n + npoison + ncommitted) + plen
    if want != len(body):
        raise _bad_length(
            step,
            FrameKind.PREPARE,
            f"sanitize PREPARE lists {n} clear, {npoison} poison and {ncommitted} committed ids and {plen} "
            f"payload bytes, which is {want} body bytes, but body_len is {len(body)}",
        )
    view = memoryview(body)
    a = 16 + 4 * n
    b = a + 4 * npoison
    c = b + 4 * ncommitted
    lists = Sanitize(poison_pages=checks.u32_ids(view[a:b]), committed_pages=checks.u32_ids(view[b:c]))
    return Prepare(step=step, clear_pages=checks.u32_ids(view[16:a]), payload=body[c:], checksum=crc, sanitize=lists)


def _detail(step: int, kind: int, body: bytes, start: int) -> str:
    try:
        return body[start:].decode("utf-8")
    except UnicodeDecodeError:
        name = FrameKind(kind).name
        raise FrameError(RejectCode.BAD_BODY, f"{name} detail is not UTF-8", step=step, kind=kind) from None


def _dec_ready(step: int, body: bytes, layout: int, flags: int, crc: int) -> Ready:
    rank, checksum = READY_BODY.unpack(body)
    return Ready(step=step, rank=rank, prepare_checksum=checksum)


def _dec_reject(step: int, body: bytes, layout: int, flags: int, crc: int) -> Reject:
    rank, code, dlen = REJECT_BODY.unpack_from(body, 0)
    if 8 + dlen != len(body) or dlen > MAX_DETAIL_BYTES:
        raise _bad_length(
            step,
            FrameKind.REJECT,
            f"REJECT detail_len {dlen} does not match body_len {len(body)} or is over {MAX_DETAIL_BYTES}",
        )
    return Reject(step=step, rank=rank, code=code, detail=_detail(step, FrameKind.REJECT, body, 8))


def _dec_abort(step: int, body: bytes, layout: int, flags: int, crc: int) -> Abort:
    rank, code, reserved = ABORT_BODY.unpack(body)
    if reserved:
        raise FrameError(RejectCode.BAD_BODY, f"ABORT reserved field is {reserved}", step=step, kind=FrameKind.ABORT)
    return Abort(step=step, code=code, rank=rank)


def _dec_launch(step: int, body: bytes, layout: int, flags: int, crc: int) -> Launch:
    (checksum,) = LAUNCH_BODY.unpack(body)
    return Launch(step=step, prepare_checksum=checksum)


def _dec_complete(step: int, body: bytes, layout: int, flags: int, crc: int) -> Complete:
    rank, checksum, status, dlen = COMPLETE_BODY.unpack_from(body, 0)
    if 12 + dlen != len(body) or dlen > MAX_DETAIL_BYTES:
        raise _bad_length(
            step,
            FrameKind.COMPLETE,
            f"COMPLETE detail_len {dlen} does not match body_len {len(body)} or is over {MAX_DETAIL_BYTES}",
        )
    if status > COMPLETE_FAILED:
        raise FrameError(RejectCode.BAD_BODY, f"COMPLETE status {status}", step=step, kind=FrameKind.COMPLETE)
    detail = _detail(step, FrameKind.COMPLETE, body, 12)
    return Complete(step=step, rank=rank, prepare_checksum=checksum, ok=status != COMPLETE_FAILED, detail=detail)


_Decoder = Callable[[int, bytes, int, int, int], Frame]
_DECODERS: dict[int, _Decoder] = {
    FrameKind.HELLO: _dec_hello,
    FrameKind.CHALLENGE: _dec_challenge,
    FrameKind.AUTH: _dec_auth,
    FrameKind.PREPARE: _dec_prepare,
    FrameKind.READY: _dec_ready,
    FrameKind.REJECT: _dec_reject,
    FrameKind.ABORT: _dec_abort,
    FrameKind.LAUNCH: _dec_launch,
    FrameKind.COMPLETE: _dec_complete,
}


# ---------------------------------------------------------------------------- the decoder


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
            raise InvalidArgumentError(f"max_body must be an int >= 64, got {max_body!r}")
        self.max_body = max_body
        self._buf = bytearray()
        self._pos = 0
        self._eof = False
        self.error: FrameError | None = None
        self.frames = 0

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet consumed by a frame."""
        return len(self._buf) - self._pos

    @property
    def at_eof(self) -> bool:
        return self._eof

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes. Raises ``InvalidArgumentError`` after ``feed_eof``."""
        if self._eof:
            raise InvalidArgumentError("feed() after feed_eof()")
        if data:
            self._buf += data

    def feed_eof(self) -> None:
        """The stream ended; a partial frame left in the buffer becomes a TRUNCATED error."""
        self._eof = True

    def _fail(self, code: int, detail: str, step: int | None = None, kind: int | None = None) -> FrameError:
        err = FrameError(code, detail, step=step, kind=kind)
        self.error = err
        return err

    def next_frame(self) -> Frame | None:
        """The next complete frame, or ``None`` if more bytes are needed (or the stream ended cleanly).

        Raises ``FrameError`` for bytes that are not a well-formed layout-9 frame,
        and the same error on every later call (the stream must be closed).
        """
        if self.error is not None:
            raise self.error
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < HEADER_SIZE:
            self._short(avail)
            return None
        magic, layout, kind, flags, body_len, step, crc = HEADER.unpack_from(buf, pos)
        decoder = self._check_header(magic, layout, kind, flags, body_len, step)
        end = pos + HEADER_SIZE + body_len
        if len(buf) < end:
            if self._eof:
                raise self._fail(
                    RejectCode.TRUNCATED,
                    f"stream ended {avail} bytes into a {HEADER_SIZE + body_len}-byte {_KIND_NAMES[kind]} frame",
                    step,
                    kind,
                )
            return None
        body = bytes(buf[pos + HEADER_SIZE : end])
        got = _crc32(body, _crc32(memoryview(buf)[pos : pos + 20]))
        if got != crc:
            raise self._fail(
                RejectCode.BAD_CHECKSUM,
                f"{_KIND_NAMES[kind]} checksum {crc:08x} but the frame hashes to {got:08x}",
                step,
                kind,
            )
        try:
            frame = decoder(step, body, layout, flags, crc)
        except FrameError as exc:
            self.error = exc
            raise
        if end == len(buf):  # all consumed: reset; a large consumed head: compact
            buf.clear()
            self._pos = 0
        elif end > 65536 and end > (len(buf) >> 1):
            del buf[:end]
            self._pos = 0
        else:
            self._pos = end
        self.frames += 1
        return frame

    def _short(self, avail: int) -> None:
        """Fewer than a header's bytes buffered: wait for more (an empty buffer is reset), or
        raise ``FrameError`` (the bytes so far are not a magic prefix, or the stream ended)."""
        buf, pos = self._buf, self._pos
        if avail and buf[pos : pos + 4] != MAGIC[: min(avail, 4)]:
            raise self._fail(RejectCode.BAD_MAGIC, f"bad magic {bytes(buf[pos : pos + 4]).hex()}")
        if self._eof and avail:
            raise self._fail(RejectCode.TRUNCATED, f"stream ended {avail} bytes into a frame header")
        if not avail and pos:
            buf.clear()
            self._pos = 0

    def _check_header(self, magic: bytes, layout: int, kind: int, flags: int, body_len: int, step: int) -> _Decoder:
        """The body decoder for a sound header; ``FrameError`` for the first field that is not."""
        if magic != MAGIC:
            raise self._fail(RejectCode.BAD_MAGIC, f"bad magic {magic.hex()}, expected {MAGIC.hex()}")
        if layout != LAYOUT:
            why = f" ({_OLD_LAYOUTS[layout]} and cannot join)" if layout in _OLD_LAYOUTS else ""
            raise self._fail(
                RejectCode.BAD_LAYOUT,
                f"{_kind_name(kind)} frame of layout {layout}; this rank speaks layout {LAYOUT}{why}",
                step,
                kind,
            )
        decoder = _DECODERS.get(kind)
        if decoder is None:
            raise self._fail(RejectCode.BAD_KIND, f"unknown frame kind {kind}", step, kind)
        name = _KIND_NAMES[kind]
        if flags and flags & ~_FLAGS.get(kind, 0):
            raise self._fail(RejectCode.BAD_FLAGS, f"{name} flags {flags:#x} (reserved bits set)", step, kind)
        if body_len > self.max_body:
            detail = f"{name} body_len {body_len} over the cap of {self.max_body} bytes"
            raise self._fail(RejectCode.FRAME_TOO_LARGE, detail, step, kind)
        fixed = _FIXED_BODY.get(kind)
        if fixed is not None:
            if body_len != fixed:
                raise self._fail(RejectCode.BAD_LENGTH, f"{name} body_len {body_len}, must be {fixed}", step, kind)
            return decoder
        least = SANITIZE_COUNTS.size if flags else _MIN_BODY[kind]
        if body_len < least:
            raise self._fail(RejectCode.BAD_LENGTH, f"{name} body_len {body_len}, must be at least {least}", step, kind)
        return decoder


def decode(data: bytes | bytearray | memoryview) -> Frame:
    """Exactly one whole frame from ``data``. Raises ``FrameError`` otherwise (also for extra bytes)."""
    dec = FrameDecoder(max_body=max(64, len(data)))
    dec.feed(data)
    dec.feed_eof()
    frame = dec.next_frame()
    if frame is None:
        raise FrameError(RejectCode.TRUNCATED, f"no frame in {len(data)} bytes")
    if dec.buffered:
        raise FrameError(RejectCode.BAD_LENGTH, f"{dec.buffered} bytes after the frame")
    return frame
