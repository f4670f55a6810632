"""The wire's frame values and codes: small frozen msgspec Structs, no bytes. Pure.

    FrameKind    the header's kind byte      RejectCode   why something was refused
    Hello  Challenge  Auth  Prepare (+ Sanitize)  Ready  Reject  Abort  Launch  Complete

Their byte layout, the encoders and the constants of the header are in
``kvledger.wire.codec`` (which re-exports every name here); the decoder, which
builds these values from bytes, is ``kvledger.wire.decoder``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import msgspec

__all__ = [
    "LAYOUT",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "NO_RANK",
    "FrameKind",
    "RejectCode",
    "Hello",
    "Challenge",
    "Auth",
    "Sanitize",
    "Prepare",
    "Ready",
    "Reject",
    "Abort",
    "Launch",
    "Complete",
    "Frame",
]

LAYOUT = 9  # the header's layout byte: 8 had no key proof in the handshake, 7 no COMPLETE nor sanitizer lists
NONCE_BYTES = 32  # a handshake nonce (HELLO, CHALLENGE)
PROOF_BYTES = 32  # an HMAC-SHA256 proof of the job's key (CHALLENGE, AUTH)
NO_RANK = 0xFFFFFFFF  # ABORT: no culprit rank


class FrameKind(IntEnum):
    HELLO = 1
    PREPARE = 2
    READY = 3
    REJECT = 4
    ABORT = 5
    LAUNCH = 6
    COMPLETE = 7
    CHALLENGE = 8  # layout 9: the leader's nonce and its proof of the job's key
    AUTH = 9  # layout 9: the peer's proof of the job's key


class RejectCode(IntEnum):
    """Why a frame, a PREPARE or a whole step was refused (REJECT and ABORT bodies)."""

    BAD_MAGIC = 1  # not a kvledger frame: framing lost
    BAD_LAYOUT = 2  # layout byte is not 8 (e.g. a layout-7 or layout-6 rank)
    BAD_KIND = 3  # unknown frame kind
    BAD_FLAGS = 4  # reserved flag bits set
    FRAME_TOO_LARGE = 5  # body_len, or a PREPARE's payload, over the receiver's cap
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
    UNSUPPORTED = 22  # the PREPARE asks for what this rank cannot do (sanitize mode, no sanitizer)
    BAD_AUTH = 23  # handshake: no proof of the job's key (wrong key, a replayed handshake), or a pinned
    #               rank connecting from another address


# ---------------------------------------------------------------------------- frames


class _Frame(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class Hello(_Frame, frozen=True):
    """Who is on this link: ``rank`` of ``world_size``, over the geometry ``geometry_digest``.

    ``step``: the leader's HELLO names the first step it will PREPARE; a peer's
    names the step it expects (informational). ``nonce``: the sender's fresh
    handshake nonce (``NONCE_BYTES``; the leader's welcome HELLO repeats the one
    of its CHALLENGE). ``layout`` is the header byte.
    """

    step: int
    rank: int
    world_size: int
    geometry_digest: bytes
    nonce: bytes = bytes(NONCE_BYTES)
    layout: int = LAYOUT


class Challenge(_Frame, frozen=True):
    """The leader's answer to a peer's HELLO: its own fresh ``nonce`` and ``proof``, an HMAC of
    the job's key over the peer's HELLO and that nonce (``kvledger.wire.auth``), so the peer knows
    it talks to a holder of the key before it proves its own. ``step`` is 0."""

    step: int
    nonce: bytes
    proof: bytes

    def __repr__(self) -> str:  # (the proof is no secret, but it is noise in a log line)
        return f"Challenge(step={self.step}, nonce={self.nonce.hex()[:16]}...)"


class Auth(_Frame, frozen=True):
    """Peer ``rank``'s proof of the job's key: an HMAC over its HELLO and the leader's CHALLENGE
    nonce (``kvledger.wire.auth``). Only after it does the rank count. ``step`` is 0."""

    step: int
    rank: int
    proof: bytes

    def __repr__(self) -> str:
        return f"Auth(step={self.step}, rank={self.rank})"


def _ids_repr(ids: Sequence[int]) -> str:
    head = ", ".join(str(p) for p in ids[:8]) + (", ..." if len(ids) > 8 else "")
    return f"[{head}] ({len(ids)} ids)"


class Sanitize(_Frame, frozen=True):
    """A sanitize-mode PREPARE's two extra lists (SPEC, "The sanitizer").

    ``poison_pages``: pages to fill with 0xFF before the clear; ``committed_pages``:
    pages committed this step, which must hold no poison after it. Each list holds
    distinct u32 page ids; decoded frames carry them as read-only memoryviews of
    format ``'I'``, like ``Prepare.clear_pages``.
    """

    poison_pages: Sequence[int] = ()
    committed_pages: Sequence[int] = ()

    def __repr__(self) -> str:
        poison, committed = _ids_repr(self.poison_pages), _ids_repr(self.committed_pages)
        return f"Sanitize(poison_pages={poison}, committed_pages={committed})"


class Prepare(_Frame, frozen=True):
    """The step plan: zero ``clear_pages`` (distinct u32 page ids), run with ``payload``.

    Decoded frames carry ``clear_pages`` as a read-only ``memoryview`` of format
    ``'I'`` over the frame's bytes (``.tolist()`` for a list) and ``checksum``,
    the frame's CRC32 as received; the encoder takes any sequence of ints and
    ignores ``checksum``. ``sanitize`` is set for a sanitize-mode step (the
    SANITIZE flag): its poison and committed lists.
    """

    step: int
    clear_pages: Sequence[int] = ()
    payload: bytes = b""
    checksum: int = 0
    sanitize: Sanitize | None = None

    def __repr__(self) -> str:
        extra = "" if self.sanitize is None else f", sanitize={self.sanitize!r}"
        return (
            f"Prepare(step={self.step}, clear_pages={_ids_repr(self.clear_pages)}, "
            f"payload={len(self.payload)} bytes, checksum={self.checksum:#x}{extra})"
        )


class Ready(_Frame, frozen=True):
    """Rank ``rank`` validated the PREPARE of ``step`` whose frame checksum was ``prepare_checksum``."""

    step: int
    rank: int
    prepare_checksum: int


class Reject(_Frame, frozen=True):
    """Rank ``rank`` refuses ``step`` (or the link): ``code`` is a ``RejectCode``."""

    step: int
    rank: int
    code: int
    detail: str = ""


class Abort(_Frame, frozen=True):
    """The leader aborts ``step`` on every rank: nothing of it is cleared or launched.

    ``code`` says why (the REJECT code, TIMEOUT or PEER_LOST); ``rank`` names the
    rank that caused it, ``NO_RANK`` if none.
    """

    step: int
    code: int
    rank: int = NO_RANK


class Launch(_Frame, frozen=True):
    """The leader commits ``step``: every rank answered READY for ``prepare_checksum``."""

    step: int
    prepare_checksum: int


class Complete(_Frame, frozen=True):
    """Rank ``rank`` ran the launched ``step`` (PREPARE ``prepare_checksum``): its clears and
    graph are done (``ok``), or it failed (``ok`` false, ``detail`` says why; at most
    ``MAX_DETAIL_BYTES`` of UTF-8 on the wire)."""

    step: int
    rank: int
    prepare_checksum: int
    ok: bool = True
    detail: str = ""


Frame = Hello | Challenge | Auth | Prepare | Ready | Reject | Abort | Launch | Complete
