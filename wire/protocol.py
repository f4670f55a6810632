"""The PREPARE/READY handshake as pure state machines, one per link (h11 style).

Nothing here does I/O or keeps time. A link takes bytes in (``receive_data``),
hands events out (``next_event``) and queues the bytes it must send
(``data_to_send``); the drivers in ``kvledger.wire.rank`` move the bytes and
decide timeouts, which they feed back in as events (``Leader.expire``).

Why a fifth message. SPEC's promise is that no rank clears or launches a step
that any rank rejected or that timed out. A peer that launched on its own READY
could not keep it: it cannot know whether another rank rejected, or whether the
leader's deadline passed before its READY arrived. So READY is a vote, and the
leader's decision is a frame of its own: LAUNCH(step) after every READY, or
ABORT(step) after any REJECT, a timeout or a lost link. A peer clears and runs a
step only on LAUNCH, and only in the READY state for that step with the same
PREPARE checksum; that single rule is what the R11-R13 tests hammer.

    leader (rank 0)                                   peer (rank r)
    ───────────────                                   ─────────────
                       ◄────── HELLO(r, W, geometry)       connect
    check layout, W,
    geometry, rank      ─────► HELLO(0, W, geometry,
                                     first step s)         joined at step s
    seal_step(s) ─► validate plan locally
                        ─────► PREPARE(s, ids, payload)
                                                           validate: step, lengths,
                                                           checksum, ids < num_pages,
                                                           no duplicates
                       ◄────── READY(s, r, crc)   or   REJECT(s, r, code, detail)
    all READY (same crc) ─────► LAUNCH(s, crc)             clear ids, run the step
    any REJECT, timeout,
    lost link            ─────► ABORT(s, code, rank)       clear nothing, run nothing

Peer link states (``PeerState``); ``k`` is the link's current step:

    CONNECTING ─start()─► HELLO_SENT ─HELLO ok─► IDLE(k)
    IDLE(k)     ─PREPARE(k) valid──► READY(k)      (READY sent)
    IDLE(k)     ─PREPARE(k) bad────► REJECTED(k)   (REJECT sent)
    READY(k)    ─LAUNCH(k, crc)────► IDLE(k+1)     event RunStep
    any of them ─ABORT(k)──────────► IDLE(k+1)     event DropStep
    any         ─broken frame──────► ERROR         (REJECT sent, link must close)
    any         ─end of stream─────► CLOSED

Leader link states (``LeaderState``): HANDSHAKE ─HELLO─► JOINING ─accept()─►
IDLE(k) ─prepare(k)─► AWAITING(k) ─READY/REJECT─► VOTED(k) ─decide(k)─► IDLE(k+1);
``refuse()`` or a broken frame ─► ERROR. The leader's decision rule over all
links is ``Leader`` (also pure).

The allowed transitions live in three tables at the end of the link classes
(``_PEER_STEP``, ``_PEER_TABLE``, ``_LEADER_TABLE``: (state, frame type) ->
handler); a frame that is not in them is a lookup miss, raised as a protocol
error that names the state and the frame.

Duplicated, stale, replayed and reordered frames are settled by step number:

    frame at the peer      step < k (decided)          step == k              step > k
    PREPARE                REJECT STALE_STEP           same crc: READY again   REJECT BAD_STEP and
                                                       other crc: REJECT        veto that step
                                                       CONFLICT (state kept)    (never READY it)
    LAUNCH                 launched: ignored;          only in READY(k) with   broken (a LAUNCH
                           aborted: broken (CONFLICT)  the same crc            cannot precede READY)
    ABORT                  aborted: ignored;           DropStep                held until step k
                           launched: broken (CONFLICT)                          reaches it
    HELLO                  identical: ignored; different: broken

    frame at the leader    step decided                step in flight          step never prepared
    READY                  ignored (stale)             a vote; with another    broken
                                                       crc it counts as
                                                       REJECT CONFLICT
    REJECT                 ignored (stale)             a vote (it sticks)      a vote against the step
                                                                               in flight (its PREPARE
                                                                               came garbled); ignored
                                                                               when none is in flight

"Broken" raises ``RemoteProtocolError`` from ``next_event`` after queueing a
REJECT naming the code; the link is then in ERROR and its transport must close.
Decisions for the last ``memory`` steps are remembered to tell a harmless
duplicate from a contradiction; older stale frames are ignored.

What a failure leaves behind: a rank whose link breaks or closes after LAUNCH
was sent may or may not have run that step (the usual two-phase-commit window,
here only when a rank or the leader dies); the leader sees the link gone and
aborts every later step until the group is re-formed. A peer never launches
anything without a LAUNCH it can match, so a lost leader costs liveness, never
safety.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Optional, Union

import msgspec

from ..core import checks
from ..core.errors import (
    FrameError,
    HandshakeRefused,
    InvalidArgumentError,
    LocalProtocolError,
    RemoteProtocolError,
    StepOrderError,
)

from .codec import (
    NO_RANK,
    Abort,
    Hello,
    Launch,
    Prepare,
    Ready,
    Reject,
    RejectCode,
    encode,
    encode_prepare_raw,
    frame_checksum,
    geometry_digest,
    max_body_for,
    pack_page_ids,
)
from .decoder import FrameDecoder, page_ids_problem

__all__ = [
    "NEED_DATA",
    "PeerState",
    "LeaderState",
    "Joined",
    "PeerHello",
    "Answered",
    "RunStep",
    "DropStep",
    "ConnectionClosed",
    "Decision",
    "PeerLink",
    "LeaderLink",
    "Leader",
]


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()
"""``next_event`` returns this when it needs more bytes."""



# ---------------------------------------------------------------------------- events


class _Event(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class Joined(_Event):
    """Peer: the leader accepted our HELLO; its first PREPARE will be for ``step``."""

    step: int
    world_size: int


class PeerHello(_Event):
    """Leader link: a peer introduced itself. Call ``accept(step)`` or ``refuse(...)``."""

    rank: int
    world_size: int
    step: int


class Answered(_Event):
    """Peer: how we answered PREPARE(step): READY (``ready``) or REJECT ``code``/``detail``."""

    step: int
    ready: bool
    code: int = 0
    detail: str = ""
    n_pages: int = 0


class RunStep(_Event):
    """Peer: the leader launched ``step``. Clear ``clear_pages`` in every plane, then run it."""

    step: int
    clear_pages: object
    payload: bytes

    def __repr__(self) -> str:
        ids = self.clear_pages
        head = ", ".join(str(p) for p in ids[:8]) + (", ..." if len(ids) > 8 else "")
        return "RunStep(step=" + str(self.step) + ", clear_pages=[" + head + "] (" + str(len(ids)) + " ids), payload=" + str(len(self.payload)) + " bytes)"


class DropStep(_Event):
    """Peer: ``step`` was aborted (``code``, culprit ``rank``). Clear nothing, run nothing."""

    step: int
    code: int
    rank: int = NO_RANK


class ConnectionClosed(_Event):
    """The other side ended the stream at a frame boundary."""


class Decision(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The leader's verdict on ``step``: ``launch`` or abort (``code``, culprit ``rank``, ``detail``).

    ``data`` is the LAUNCH or ABORT frame to send on every link.
    """

    step: int
    launch: bool
    code: int = 0
    rank: int = NO_RANK
    detail: str = ""
    data: bytes = b""


# ---------------------------------------------------------------------------- shared


class _Decided:
    """The last ``memory`` decisions, by step (True: launched, False: aborted)."""

    __slots__ = ("memory", "_by_step", "_order")

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self._by_step: dict[int, bool] = {}
        self._order: deque[int] = deque()

    def add(self, step: int, launched: bool) -> None:
        self._by_step[step] = launched
        self._order.append(step)
        if len(self._order) > self.memory:
            self._by_step.pop(self._order.popleft(), None)

    def get(self, step: int) -> Optional[bool]:
        return self._by_step.get(step)


def _check_world(rank: int, world_size: int, *, leader: bool) -> None:
    if type(world_size) is not int or world_size < 1 or world_size > 0xFFFFFFFF:
        raise InvalidArgumentError("world_size must be an int >= 1, got " + repr(world_size))
    if type(rank) is not int or not 0 <= rank < world_size or (rank == 0) != leader:
        raise InvalidArgumentError(
            ("the leader is rank 0" if leader else "a peer's rank must be in [1, world_size)")
            + ", got rank " + repr(rank) + " of " + repr(world_size)
        )


class _Link:
    """What both ends share: the decoder, the outbox and counters."""

    def __init__(self, geometry, world_size: int, max_payload: int) -> None:
        self.num_pages = checks.geometry(geometry).num_pages
        self.geometry = geometry
        self.world_size = world_size
        self.digest = geometry_digest(geometry)
        self._decoder = FrameDecoder(max_body=max(64, max_body_for(self.num_pages, max_payload)))
        self._out: list[bytes] = []
        self._error: Optional[BaseException] = None
        self._closed_seen = False
        self._stats = {
            "frames_in": 0,
            "frames_out": 0,
            "bytes_in": 0,
            "duplicates": 0,
            "stale": 0,
        }

    # -- bytes in / out
    def receive_data(self, data: bytes) -> None:
        """Bytes from the transport; ``b""`` means the stream ended. Never raises for bad bytes."""
        if not data:
            if not self._decoder.at_eof:
                self._decoder.feed_eof()
            return
        if self._decoder.at_eof:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, "receive_data() after the end of the stream")
        self._stats["bytes_in"] += len(data)
        self._decoder.feed(data)

    def data_to_send(self) -> bytes:
        """Everything queued for the other side since the last call (possibly ``b""``)."""
        if not self._out:
            return b""
        out = self._out
        self._out = []
        return out[0] if len(out) == 1 else b"".join(out)

    def _send(self, data: bytes) -> None:
        self._out.append(data)
        self._stats["frames_out"] += 1

    @property
    def buffered(self) -> int:
        """Received bytes not yet consumed as frames."""
        return self._decoder.buffered

    def statistics(self) -> dict:
        """Counters: frames and bytes in/out, duplicates and stale frames absorbed, and more."""
        return dict(self._stats)

    def _next_frame(self):
        frame = self._decoder.next_frame()
        if frame is not None:
            self._stats["frames_in"] += 1
        return frame


# ---------------------------------------------------------------------------- peer


class PeerState(Enum):
    CONNECTING = "connecting"
    HELLO_SENT = "hello_sent"
    IDLE = "idle"
    READY = "ready"
    REJECTED = "rejected"
    CLOSED = "closed"
    ERROR = "error"


_P = PeerState


class PeerLink(_Link):
    """A peer's end of its link to the leader (rank ``rank`` of ``world_size``).

        link = PeerLink(geometry, rank=1, world_size=4)
        link.start()                          # queues HELLO
        send(link.data_to_send())
        link.receive_data(recv())
        while (ev := link.next_event()) is not NEED_DATA:
            RunStep -> clear ev.clear_pages, run ev.step     DropStep -> nothing
        send(link.data_to_send())             # READY / REJECT answers

    READY and REJECT are answered by the link itself: validation is protocol, not
    policy. ``next_event`` raises ``RemoteProtocolError`` (or ``HandshakeRefused``)
    when the leader broke the protocol, after queueing a REJECT; flush
    ``data_to_send`` and close. ``step`` is the link's current step.
    """

    def __init__(
        self,
        geometry,
        *,
        rank: int,
        world_size: int,
        max_payload: int = 1 << 20,
        memory: int = 1024,
        held_limit: int = 64,
    ) -> None:
        _check_world(rank, world_size, leader=False)
        super().__init__(geometry, world_size, max_payload)
        self.rank = rank
        self.state = _P.CONNECTING
        self.step: Optional[int] = None
        self._hello: Optional[Hello] = None
        self._prepared: Optional[Prepare] = None
        self._answer = b""
        self._decided = _Decided(memory)
        self._held_aborts: dict[int, Abort] = {}
        self._vetoed: dict[int, bytes] = {}
        self._held_limit = held_limit
        self._events: deque = deque()
        self._stats.update(ready=0, rejected=0, launched=0, aborted=0, held=0)

    # -- local actions
    def start(self, step: int = 0) -> None:
        """Queue our HELLO (``step``: the step we expect, informational)."""
        if self.state is not _P.CONNECTING:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, "start() in state " + self.state.value)
        self._send(encode(Hello(step=step, rank=self.rank, world_size=self.world_size, geometry_digest=self.digest)))
        self.state = _P.HELLO_SENT

    # -- events
    def next_event(self):
        """The next event, ``NEED_DATA``, or ``ConnectionClosed`` once the stream ended cleanly.

        Raises ``RemoteProtocolError`` (incl. ``FrameError``, ``HandshakeRefused``)
        when the leader broke the protocol; the link is then in ERROR.
        """
        if self._error is not None:
            raise self._error
        while not self._events:
            if self.state is _P.CLOSED:
                return ConnectionClosed()
            try:
                frame = self._next_frame()
            except FrameError as exc:
                self._fail(exc, reply=True)
            if frame is None:
                if self._decoder.at_eof:
                    self.state = _P.CLOSED
                    return ConnectionClosed()
                return NEED_DATA
            try:
                self._dispatch(frame)
            except HandshakeRefused as exc:
                self._fail(exc, reply=False)
            except RemoteProtocolError as exc:
                self._fail(exc, reply=True)
        return self._events.popleft()

    def _fail(self, exc: RemoteProtocolError, *, reply: bool):
        if reply:
            step = self.step if self.step is not None else 0
            self._send(encode(Reject(step=step, rank=self.rank, code=exc.code, detail=exc.detail)))
        self.state = _P.ERROR
        self._error = exc
        raise exc

    def _dispatch(self, f) -> None:
        kind = type(f)
        if kind in _STEP_FRAMES and self.state in _JOINED:
            return self._on_step_frame(f)
        handler = _PEER_TABLE.get((self.state, kind))
        if handler is None:
            raise RemoteProtocolError(
                RejectCode.UNEXPECTED_FRAME, "a peer in state " + self.state.value + " does not accept " + kind.__name__.upper()
            )
        return handler(self, f)

    def _refused(self, f: Reject) -> None:
        raise HandshakeRefused(f.code, "the leader refused this rank: " + f.detail)

    def _hello_again(self, f: Hello) -> None:
        if f != self._hello:
            raise RemoteProtocolError(RejectCode.CONFLICT, "a second, different HELLO from the leader")
        self._stats["duplicates"] += 1

    def _on_hello(self, f: Hello) -> None:
        if f.rank != 0:
            raise RemoteProtocolError(RejectCode.BAD_RANK, "HELLO from rank " + str(f.rank) + ", expected the leader (0)")
        if f.world_size != self.world_size:
            raise RemoteProtocolError(
                RejectCode.WORLD_SIZE_MISMATCH,
                "leader's world size is " + str(f.world_size) + ", this rank's is " + str(self.world_size),
            )
        if f.geometry_digest != self.digest:
            raise RemoteProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                "leader's geometry digest " + f.geometry_digest.hex()[:16] + " != this rank's "
                + self.digest.hex()[:16] + " (" + str(self.geometry) + ")",
            )
        self._hello = f
        self.step = f.step
        self.state = _P.IDLE
        self._events.append(Joined(step=f.step, world_size=f.world_size))

    def _on_step_frame(self, f) -> None:
        s, k, kind = f.step, self.step, type(f)
        if s < k:
            return self._on_stale(f)
        if s > k:
            if kind is Prepare:
                # Not the step we expect: refuse it and never READY it later.
                prev = self._vetoed.get(s)
                if prev is not None:
                    self._stats["duplicates"] += 1
                    self._send(prev)
                    return None
                if len(self._vetoed) >= self._held_limit:
                    raise RemoteProtocolError(RejectCode.BAD_STEP, "too many PREPAREs ahead of step " + str(k))
                detail = "PREPARE for step " + str(s) + " while this rank expects step " + str(k)
                data = encode(Reject(step=s, rank=self.rank, code=RejectCode.BAD_STEP, detail=detail))
                self._vetoed[s] = data
                self._stats["rejected"] += 1
                self._send(data)
                self._events.append(Answered(step=s, ready=False, code=RejectCode.BAD_STEP, detail=detail))
                return None
            if kind is Abort:
                # Overtook the frames of earlier steps: apply it when we get there.
                if len(self._held_aborts) >= self._held_limit:
                    raise RemoteProtocolError(RejectCode.BAD_STEP, "too many ABORTs ahead of step " + str(k))
                if s in self._held_aborts:
                    self._stats["duplicates"] += 1
                else:
                    self._held_aborts[s] = f
                    self._stats["held"] += 1
                return None
            raise RemoteProtocolError(
                RejectCode.UNEXPECTED_FRAME, "LAUNCH of step " + str(s) + " which this rank never answered (at step " + str(k) + ")"
            )
        handler = _PEER_STEP.get((self.state, kind))
        if handler is None:
            raise RemoteProtocolError(
                _PEER_STEP_MISS.get((self.state, kind), RejectCode.UNEXPECTED_FRAME),
                kind.__name__.upper() + " of step " + str(s) + " in state " + self.state.value
                + (" (this rank rejected it)" if self.state is _P.REJECTED else " (never prepared here)"),
            )
        return handler(self, f)

    def _repeat(self, f: Prepare) -> None:
        """The same PREPARE again: the same answer. Another one after READY: REJECT, state kept."""
        self._stats["duplicates"] += 1
        if self.state is _P.READY and f.checksum != self._prepared.checksum:
            detail = "a second, different PREPARE for step " + str(f.step) + " after READY"
            self._send(encode(Reject(step=f.step, rank=self.rank, code=RejectCode.CONFLICT, detail=detail)))
            return None
        self._send(self._answer)
        return None

    def _launch(self, f: Launch) -> None:
        p = self._prepared
        if f.prepare_checksum != p.checksum:
            raise RemoteProtocolError(
                RejectCode.CONFLICT,
                "LAUNCH of step " + str(f.step) + " for PREPARE checksum " + format(f.prepare_checksum, "08x")
                + ", this rank validated " + format(p.checksum, "08x"),
            )
        self._stats["launched"] += 1
        self._events.append(RunStep(step=f.step, clear_pages=p.clear_pages, payload=p.payload))
        return self._advance(True)

    def _abort(self, f: Abort) -> None:
        self._stats["aborted"] += 1
        self._events.append(DropStep(step=f.step, code=f.code, rank=f.rank))
        return self._advance(False)

    def _prepare(self, f: Prepare) -> None:
        s = f.step
        problem = page_ids_problem(f.clear_pages, self.num_pages)
        if problem is None:
            self._prepared = f
            self._answer = encode(Ready(step=s, rank=self.rank, prepare_checksum=f.checksum))
            self.state = _P.READY
            self._stats["ready"] += 1
            self._send(self._answer)
            self._events.append(Answered(step=s, ready=True, n_pages=len(f.clear_pages)))
            return None
        code, detail = problem
        self._reject_current(code, "PREPARE step " + str(s) + ": " + detail)

    def _reject_current(self, code: int, detail: str) -> None:
        s = self.step
        self._answer = encode(Reject(step=s, rank=self.rank, code=code, detail=detail))
        self._prepared = None
        self.state = _P.REJECTED
        self._stats["rejected"] += 1
        self._send(self._answer)
        self._events.append(Answered(step=s, ready=False, code=code, detail=detail))

    def reject(self, code: int = RejectCode.PEER_FAILED, detail: str = "") -> None:
        """Refuse the current step for a local reason, before its PREPARE is answered.

        Allowed in IDLE only: the REJECT goes out now and is repeated when the
        PREPARE arrives, so the step cannot launch. After READY a rank has given
        its word; one that then cannot run the step must close its link (the
        leader aborts whatever is undecided). Raises ``LocalProtocolError`` in
        any other state.
        """
        if self.state is not _P.IDLE:
            raise LocalProtocolError(
                RejectCode.UNEXPECTED_FRAME,
                "reject() in state " + self.state.value + (": READY was sent, close the link instead" if self.state is _P.READY else ""),
            )
        self._reject_current(code, detail or "rank " + str(self.rank) + " refused step " + str(self.step))
        self._events.pop()  # the caller knows; no Answered event for its own call

    def _on_stale(self, f) -> None:
        self._stats["stale"] += 1
        s, kind = f.step, type(f)
        if kind is Prepare:
            detail = "PREPARE for step " + str(s) + ", already decided (this rank is at step " + str(self.step) + ")"
            self._send(encode(Reject(step=s, rank=self.rank, code=RejectCode.STALE_STEP, detail=detail)))
            self._events.append(Answered(step=s, ready=False, code=RejectCode.STALE_STEP, detail=detail))
            return None
        known = self._decided.get(s)
        if known is None:
            return None
        if (kind is Launch) == known:
            self._stats["duplicates"] += 1
            return None
        raise RemoteProtocolError(
            RejectCode.CONFLICT,
            kind.__name__.upper() + " of step " + str(s) + " which this rank " + ("launched" if known else "aborted"),
        )

    def _advance(self, launched: bool) -> None:
        k = self.step
        self._decided.add(k, launched)
        self._prepared = None
        self._answer = b""
        self.step = k = k + 1
        self.state = _P.IDLE
        while True:
            veto = self._vetoed.pop(k, None)
            if veto is not None:
                self.state = _P.REJECTED
                self._answer = veto
            held = self._held_aborts.pop(k, None)
            if held is None:
                break
            self._stats["aborted"] += 1
            self._events.append(DropStep(step=k, code=held.code, rank=held.rank))
            self._decided.add(k, False)
            self.step = k = k + 1
            self.state = _P.IDLE
            self._answer = b""
        if self._vetoed:
            for s in [s for s in self._vetoed if s < k]:
                del self._vetoed[s]


_JOINED = frozenset((_P.IDLE, _P.READY, _P.REJECTED))
_STEP_FRAMES = frozenset((Prepare, Launch, Abort))

# A peer's transitions, one table (h11's _state.py in small). Frames about the
# link's current step, by state; anything else about that step is a lookup miss,
# raised as a protocol error naming the state and the frame.
_PEER_STEP = {
    (_P.IDLE, Prepare): PeerLink._prepare,  # validate -> READY or REJECT
    (_P.READY, Prepare): PeerLink._repeat,
    (_P.REJECTED, Prepare): PeerLink._repeat,
    (_P.READY, Launch): PeerLink._launch,  # -> RunStep, next step
    (_P.IDLE, Abort): PeerLink._abort,  # -> DropStep, next step
    (_P.READY, Abort): PeerLink._abort,
    (_P.REJECTED, Abort): PeerLink._abort,
}
_PEER_STEP_MISS = {(_P.REJECTED, Launch): RejectCode.CONFLICT}  # default UNEXPECTED_FRAME

# Every other frame a peer may get: the leader's HELLO, a refusal, a repeated HELLO.
_PEER_TABLE = {
    (_P.HELLO_SENT, Hello): PeerLink._on_hello,
    (_P.HELLO_SENT, Reject): PeerLink._refused,
    **{(st, Hello): PeerLink._hello_again for st in _JOINED},
    **{(st, Reject): PeerLink._refused for st in _JOINED},
}


# ---------------------------------------------------------------------------- leader link


class LeaderState(Enum):
    HANDSHAKE = "handshake"
    JOINING = "joining"
    IDLE = "idle"
    AWAITING = "awaiting"
    VOTED = "voted"
    CLOSED = "closed"
    ERROR = "error"


_L = LeaderState


class LeaderLink(_Link):
    """The leader's end of the link to one peer (whose rank it learns from HELLO).

        link = LeaderLink(geometry, world_size=4)
        link.receive_data(recv())
        ev = link.next_event()          # PeerHello(rank, ...)
        link.accept(step)               # or link.refuse(code, detail)
        link.prepare(step, data, crc)   # the PREPARE bytes, encoded once for all links
        ev = link.next_event()          # Ready / Reject (the peer's vote)
        link.decide(decision)           # LAUNCH or ABORT

    ``next_event`` returns ``PeerHello``, the peer's ``Ready`` or ``Reject`` vote
    for the step in flight (a READY for another PREPARE checksum is turned into a
    ``Reject`` with code CONFLICT), ``ConnectionClosed`` or ``NEED_DATA``; stale
    and duplicate votes are absorbed. It raises ``RemoteProtocolError`` when the
    peer broke the protocol (the link is then in ERROR; a REJECT is queued when
    the peer is still in its handshake).
    """

    def __init__(self, geometry, *, world_size: int) -> None:
        _check_world(0, world_size, leader=True)
        # A peer sends only small frames; cap its bodies accordingly.
        super().__init__(geometry, world_size, 0)
        self._decoder.max_body = 4096
        self.rank: Optional[int] = None
        self.state = _L.HANDSHAKE
        self.step: Optional[int] = None
        self._checksum = 0
        self._vote: Optional[Union[Ready, Reject]] = None
        self._stats.update(votes=0)

    def next_event(self):
        if self._error is not None:
            raise self._error
        while True:
            if self.state is _L.CLOSED:
                return ConnectionClosed()
            try:
                frame = self._next_frame()
            except FrameError as exc:
                self._fail(exc)
            if frame is None:
                if self._decoder.at_eof:
                    self.state = _L.CLOSED
                    return ConnectionClosed()
                return NEED_DATA
            try:
                ev = self._dispatch(frame)
            except RemoteProtocolError as exc:
                self._fail(exc)
            if ev is not None:
                return ev

    def _fail(self, exc: RemoteProtocolError):
        if self.state in (_L.HANDSHAKE, _L.JOINING) and not isinstance(exc, HandshakeRefused):
            self._send(encode(Reject(step=0, rank=0, code=exc.code, detail=exc.detail)))
        self.state = _L.ERROR
        self._error = exc
        raise exc

    def _dispatch(self, f):
        kind = type(f)
        handler = _LEADER_TABLE.get((self.state, kind))
        if handler is None:
            raise RemoteProtocolError(
                RejectCode.UNEXPECTED_FRAME,
                "the leader's link in state " + self.state.value + " does not accept " + kind.__name__.upper(),
            )
        return handler(self, f)

    def _refused(self, f: Reject):
        raise HandshakeRefused(f.code, "peer rank " + str(self.rank) + " refused the link: " + f.detail)

    def _hello_again(self, f: Hello):
        if f.rank != self.rank or f.world_size != self.world_size or f.geometry_digest != self.digest:
            raise RemoteProtocolError(RejectCode.CONFLICT, "a second, different HELLO from rank " + str(self.rank))
        self._stats["duplicates"] += 1
        return None

    def _on_hello(self, f: Hello):
        if not 1 <= f.rank < self.world_size:
            raise RemoteProtocolError(
                RejectCode.BAD_RANK, "HELLO from rank " + str(f.rank) + ", peers are ranks 1.." + str(self.world_size - 1)
            )
        if f.world_size != self.world_size:
            raise RemoteProtocolError(
                RejectCode.WORLD_SIZE_MISMATCH,
                "rank " + str(f.rank) + " has world size " + str(f.world_size) + ", the leader " + str(self.world_size),
            )
        if f.geometry_digest != self.digest:
            raise RemoteProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                "rank " + str(f.rank) + " geometry digest " + f.geometry_digest.hex()[:16] + " != the leader's "
                + self.digest.hex()[:16] + " (" + str(self.geometry) + ")",
            )
        self.rank = f.rank
        self.state = _L.JOINING
        return PeerHello(rank=f.rank, world_size=f.world_size, step=f.step)

    def _on_vote(self, f):
        s = f.step
        if f.rank != self.rank:
            raise RemoteProtocolError(
                RejectCode.BAD_RANK, type(f).__name__.upper() + " from rank " + str(f.rank) + " on rank " + str(self.rank) + "'s link"
            )
        st = self.state
        in_flight = st is _L.AWAITING or st is _L.VOTED
        if s < self.step:
            self._stats["stale"] += 1
            return None
        if not in_flight or s != self.step:
            if type(f) is Reject:
                if not in_flight:  # nothing to vote on; the peer repeats it when the PREPARE comes
                    self._stats["stale"] += 1
                    return None
                # A REJECT naming a step we never sent (its PREPARE arrived garbled): still a no.
                f = Reject(step=self.step, rank=f.rank, code=f.code, detail="(for step " + str(s) + ") " + f.detail)
            else:
                raise RemoteProtocolError(
                    RejectCode.BAD_STEP,
                    "READY for step " + str(s) + " which was never prepared (link at step "
                    + str(self.step) + ", " + st.value + ")",
                )
        if type(f) is Ready and f.prepare_checksum != self._checksum:
            f = Reject(
                step=s,
                rank=f.rank,
                code=RejectCode.CONFLICT,
                detail="READY for PREPARE checksum " + format(f.prepare_checksum, "08x") + ", sent "
                + format(self._checksum, "08x"),
            )
        prev = self._vote
        if prev is not None and (type(prev) is Reject or type(f) is Ready):
            self._stats["duplicates"] += 1  # a REJECT sticks; a second READY adds nothing
            return None
        self._vote = f
        self.state = _L.VOTED
        self._stats["votes"] += 1
        return f

    # -- local actions
    def accept(self, step: int) -> None:
        """Welcome the peer: queue our HELLO naming the first step we will PREPARE."""
        if self.state is not _L.JOINING:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, "accept() in state " + self.state.value)
        self._send(encode(Hello(step=step, rank=0, world_size=self.world_size, geometry_digest=self.digest)))
        self.step = step
        self.state = _L.IDLE

    def refuse(self, code: int, detail: str) -> None:
        """Turn the peer away (e.g. its rank is taken): queue REJECT; the link is done."""
        if self.state not in (_L.HANDSHAKE, _L.JOINING, _L.IDLE):
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, "refuse() in state " + self.state.value)
        self._send(encode(Reject(step=self.step or 0, rank=0, code=code, detail=detail)))
        self.state = _L.ERROR
        self._error = LocalProtocolError(code, "refused: " + detail)

    def prepare(self, step: int, data: bytes, checksum: int) -> None:
        """Queue the PREPARE frame ``data`` (encoded once by ``Leader.begin``) for ``step``."""
        if self.state is not _L.IDLE or step != self.step:
            raise LocalProtocolError(
                RejectCode.UNEXPECTED_FRAME,
                "prepare(step " + str(step) + ") with the link at step " + str(self.step) + ", " + self.state.value,
            )
        self._checksum = checksum
        self._vote = None
        self._send(data)
        self.state = _L.AWAITING

    @property
    def vote(self):
        """The peer's vote on the step in flight: ``Ready``, ``Reject`` or ``None``."""
        return self._vote

    def decide(self, decision: Decision) -> None:
        """Queue LAUNCH or ABORT for ``decision.step`` and move to the next step.

        LAUNCH needs this peer's READY; ABORT is allowed whether or not the
        PREPARE went out (so the peer's step counter follows). Raises
        ``LocalProtocolError`` otherwise.
        """
        s = decision.step
        st = self.state
        if st not in (_L.IDLE, _L.AWAITING, _L.VOTED) or s != self.step:
            raise LocalProtocolError(
                RejectCode.UNEXPECTED_FRAME,
                "decide(step " + str(s) + ") with the link at step " + str(self.step) + ", " + st.value,
            )
        if decision.launch and type(self._vote) is not Ready:
            raise LocalProtocolError(
                RejectCode.UNEXPECTED_FRAME, "LAUNCH of step " + str(s) + " without READY from rank " + str(self.rank)
            )
        self._send(decision.data)
        self._vote = None
        self.step = s + 1
        self.state = _L.IDLE


# The leader link's transitions, one table; a miss is a protocol error naming both.
_LEADER_TABLE = {
    (_L.HANDSHAKE, Hello): LeaderLink._on_hello,
    (_L.HANDSHAKE, Reject): LeaderLink._refused,
    (_L.JOINING, Reject): LeaderLink._refused,
    **{(st, k): LeaderLink._on_vote for st in (_L.IDLE, _L.AWAITING, _L.VOTED) for k in (Ready, Reject)},
    **{(st, Hello): LeaderLink._hello_again for st in (_L.IDLE, _L.AWAITING, _L.VOTED)},
}


# ---------------------------------------------------------------------------- leader rule


class Leader:
    """The leader's decision rule over peers ``1..world_size-1`` (pure, no links inside).

        leader = Leader(geometry, world_size=4, next_step=0)
        leader.join(rank) for each peer
        data, crc = leader.begin(plan)            # validate locally, encode once
        decision = leader.vote(ready_or_reject)   # None until decided
        decision = leader.expire()                # the driver's deadline passed
        decision = leader.lose(rank)              # a link closed or broke

    LAUNCH only when every joined peer answered READY for this PREPARE; ABORT on
    the first REJECT, a lost or missing rank, or expiry. One decision per step;
    after it, votes for that step are ignored.
    """

    def __init__(self, geometry, *, world_size: int, next_step: int = 0) -> None:
        _check_world(0, world_size, leader=True)
        self.num_pages = checks.geometry(geometry).num_pages
        self.geometry = geometry
        self.world_size = world_size
        if type(next_step) is not int or next_step < 0:
            raise InvalidArgumentError("next_step must be an int >= 0, got " + repr(next_step))
        self.next_step = next_step
        self.joined: set[int] = set()
        self.lost: set[int] = set()
        self.step: Optional[int] = None  # step in flight
        self.checksum = 0
        self._ready: set[int] = set()
        self.decision: Optional[Decision] = None
        self._stats = {"launched": 0, "aborted": 0}

    @property
    def peers(self) -> frozenset:
        return frozenset(range(1, self.world_size))

    def join(self, rank: int) -> None:
        """Register a peer whose HELLO was accepted. Raises ``InvalidArgumentError`` if taken or out of range."""
        if type(rank) is not int or not 1 <= rank < self.world_size:
            raise InvalidArgumentError("rank " + repr(rank) + " is not a peer rank of " + str(self.world_size))
        if rank in self.joined and rank not in self.lost:
            raise InvalidArgumentError("rank " + str(rank) + " already joined")
        self.lost.discard(rank)
        self.joined.add(rank)

    def begin(self, plan, payload: bytes = b"", *, sort: bool = True) -> tuple[bytes, int]:
        """Start ``plan.step``: validate its clear list, return ``(PREPARE bytes, checksum)``.

        ``sort`` sends the ids ascending (zeroing is order-free; peers then check
        distinctness without hashing). Raises ``StepOrderError`` (not the next
        step, or one still in flight), ``PageOutOfRangeError`` /
        ``DuplicatePageError`` (a bad clear list) or ``InvalidArgumentError``
        before anything is sent. If a peer is missing or lost, ``decision`` is
        already an ABORT when this returns: send ``data`` nowhere, send the ABORT.
        """
        step = plan.step
        if self.step is not None:
            raise StepOrderError(step, self.step, "a step is still in flight")
        if step != self.next_step:
            raise StepOrderError(step, self.next_step, "the leader's next step is " + str(self.next_step))
        raw = pack_page_ids(sorted(plan.clear_list) if sort else plan.clear_list)
        problem = checks.u32_page_ids_problem(raw, self.num_pages)
        if problem is not None:
            checks.raise_problem(problem, self.num_pages)
        data = encode_prepare_raw(step, raw, payload)
        self.step = step
        self.checksum = frame_checksum(data)
        self._ready = set()
        self.decision = None
        missing = self.peers - (self.joined - self.lost)
        if missing:
            r = min(missing)
            self._decide(False, RejectCode.PEER_LOST, r, "rank " + str(r) + " is not connected")
        elif self.world_size == 1:
            self._decide(True)  # nobody else to ask
        return data, self.checksum

    def _decide(self, launch: bool, code: int = 0, rank: int = NO_RANK, detail: str = "") -> Decision:
        s = self.step
        if launch:
            data = encode(Launch(step=s, prepare_checksum=self.checksum))
            self._stats["launched"] += 1
        else:
            data = encode(Abort(step=s, code=code, rank=rank))
            self._stats["aborted"] += 1
        self.decision = Decision(step=s, launch=launch, code=code, rank=rank, detail=detail, data=data)
        return self.decision

    def vote(self, frame) -> Optional[Decision]:
        """Count a peer's ``Ready`` / ``Reject`` (as ``LeaderLink`` returned it).

        Returns the decision once there is one (also on later calls, unchanged).
        """
        if self.step is None or frame.step != self.step or self.decision is not None:
            return self.decision
        if type(frame) is Reject:
            return self._decide(False, frame.code, frame.rank, "rank " + str(frame.rank) + ": " + frame.detail)
        if frame.rank in self.joined and frame.rank not in self.lost:
            self._ready.add(frame.rank)
        if len(self._ready) == self.world_size - 1:
            return self._decide(True)
        return None

    def lose(self, rank: int) -> Optional[Decision]:
        """Rank ``rank``'s link closed or broke: abort the step in flight (if undecided)."""
        self.lost.add(rank)
        if self.step is not None and self.decision is None:
            return self._decide(False, RejectCode.PEER_LOST, rank, "rank " + str(rank) + " lost")
        return self.decision

    def expire(self) -> Decision:
        """The deadline for the step in flight passed: abort it unless already decided."""
        if self.step is None:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, "expire() with no step in flight")
        if self.decision is None:
            missing = sorted(self.peers - self._ready)
            r = missing[0] if missing else NO_RANK
            return self._decide(False, RejectCode.TIMEOUT, r, "no READY from ranks " + str(missing) + " in time")
        return self.decision

    @property
    def waiting_on(self) -> list[int]:
        """Peers whose READY for the step in flight has not arrived."""
        return sorted(self.peers - self._ready) if self.step is not None else []

    def finish(self) -> Decision:
        """Close the step in flight once its decision went out; the next step may begin."""
        if self.decision is None or self.step is None:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, "finish() before a decision")
        d = self.decision
        self.next_step = self.step + 1
        self.step = None
        return d

    def statistics(self) -> dict:
        return dict(self._stats, next_step=self.next_step, joined=len(self.joined), lost=len(self.lost))
