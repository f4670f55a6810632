"""A peer's end of its link to the leader: a pure state machine (see ``protocol``).

One piece: ``PeerLink``'s handlers share its fields (h11's ``Connection`` is one class too).

Peer link states (``PeerState``); ``k`` is the link's current step:

    CONNECTING ─start()─► HELLO_SENT ─CHALLENGE, the leader's proof ok─► AUTH_SENT (AUTH sent)
    AUTH_SENT  ─HELLO ok (its nonce the CHALLENGE's)─► IDLE(k)
    HELLO_SENT ─CHALLENGE with a bad proof─► ERROR (REJECT BAD_AUTH sent: this rank proves nothing)
    IDLE(k)     ─PREPARE(k) valid──► READY(k)      (READY sent)
    IDLE(k)     ─PREPARE(k) bad────► REJECTED(k)   (REJECT sent)
    READY(k)    ─LAUNCH(k, crc)────► IDLE(k+1)     event RunStep; step k is running
    any of them ─ABORT(k)──────────► IDLE(k+1)     event DropStep
    any         ─broken frame──────► ERROR         (REJECT sent, link must close)
    any         ─end of stream─────► CLOSED

A launched step runs beside the link's state (the link validates the next
PREPARE meanwhile); ``complete(k, ok, detail)``, the rank's report that it ran
step k, queues COMPLETE(k) once (``_running`` -> done; anything else is a
local error: a step never launched here, or one already completed).

A PREPARE with the SANITIZE flag is READY only at a rank built with
``sanitize=True`` (its executor poisons, clears and checks); any other rank
answers REJECT UNSUPPORTED, so a sanitize step never runs as a plain one.

The transitions for frames about step ``k`` are ``_PEER_STEP``; the others
(HELLO, a refusal) are ``_PEER_TABLE``. Frames about other steps are settled by
step number:

    frame at the peer      step < k (decided)          step == k              step > k
    PREPARE                REJECT STALE_STEP           same crc: READY again   REJECT BAD_STEP and
                                                       other crc: REJECT        veto that step
                                                       CONFLICT (state kept)    (never READY it)
    LAUNCH                 launched: ignored;          only in READY(k) with   broken (a LAUNCH
                           aborted: broken (CONFLICT)  the same crc            cannot precede READY)
    ABORT                  aborted: ignored;           DropStep                held until step k
                           launched: broken (CONFLICT)                          reaches it
    HELLO, CHALLENGE       identical: ignored; different: broken
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any, cast

from ..core import checks
from ..core.errors import FrameError, HandshakeRefused, InvalidArgumentError, LocalProtocolError, RemoteProtocolError
from ..core.events import Geometry
from .auth import check_key, check_nonce, leader_proof, peer_proof, proofs_match
from .codec import (
    DEFAULT_MAX_PAYLOAD,
    Abort,
    Auth,
    Challenge,
    Complete,
    Hello,
    Launch,
    Prepare,
    Ready,
    Reject,
    RejectCode,
    encode,
    max_body_for,
)
from .decoder import page_ids_problem
from .protocol import (
    NEED_DATA,
    Answered,
    ConnectionClosed,
    Decided,
    DropStep,
    Joined,
    Link,
    RunStep,
    check_world,
)

__all__ = ["PeerState", "PeerLink"]


class PeerState(Enum):
    CONNECTING = "connecting"
    HELLO_SENT = "hello_sent"
    AUTH_SENT = "auth_sent"
    IDLE = "idle"
    READY = "ready"
    REJECTED = "rejected"
    CLOSED = "closed"
    ERROR = "error"


_P = PeerState


class PeerLink(Link):
    """A peer's end of its link to the leader (rank ``rank`` of ``world_size``).

        link = PeerLink(geometry, rank=1, world_size=4, key=job_key, nonce=auth.new_nonce())
        link.start()                          # queues HELLO; CHALLENGE / AUTH are answered by the link
        send(link.data_to_send())
        link.receive_data(recv())
        while (ev := link.next_event()) is not NEED_DATA:
            RunStep -> clear ev.clear_pages, run ev.step     DropStep -> nothing
        send(link.data_to_send())             # READY / REJECT answers

    READY and REJECT are answered by the link itself: validation is protocol, not
    policy. ``next_event`` raises ``RemoteProtocolError`` (or ``HandshakeRefused``)
    when the leader broke the protocol, after queueing a REJECT; flush
    ``data_to_send`` and close. ``step`` is the link's current step.

    ``max_payload`` is the largest PREPARE payload this rank accepts: a PREPARE
    with a larger one is answered REJECT FRAME_TOO_LARGE (the step aborts, the
    link stays). The decoder's body cap follows from it (``max_body_for``: every
    page listed plus ``max_payload``), so a larger frame breaks the link from its
    header. ``sanitize``: this rank can run sanitize-mode steps (see above).
    After each ``RunStep`` call ``complete(step, ok, detail)``. Raises
    ``InvalidArgumentError`` for a bad rank, world size, ``max_payload``, key or
    nonce, ``ConfigurationError`` for a bad geometry.

    ``key``: the job's shared key; ``nonce``: ``NONCE_BYTES`` fresh random bytes,
    never used for another link (``kvledger.wire.auth``: the handshake proves the
    key both ways; the link joins only after the leader proved it first).
    """

    def __init__(
        self,
        geometry: Geometry,
        *,
        rank: int,
        world_size: int,
        key: bytes,
        nonce: bytes,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        sanitize: bool = False,
        memory: int = 1024,
        held_limit: int = 64,
    ) -> None:
        check_world(rank, world_size, leader=False)
        self._key = check_key(key)
        self._nonce = check_nonce(nonce)
        if type(max_payload) is not int or max_payload < 0:
            raise InvalidArgumentError(f"max_payload must be an int >= 0, got {max_payload!r}")
        if type(sanitize) is not bool:
            raise InvalidArgumentError(f"sanitize must be a bool, got {sanitize!r}")
        num_pages = checks.geometry(geometry).num_pages
        super().__init__(geometry, world_size, max_body_for(num_pages, max_payload, sanitize=sanitize))
        self.rank = rank
        self.max_payload = max_payload
        self.sanitize = sanitize
        self.state = _P.CONNECTING
        self.step: int | None = None
        self._hello: Hello | None = None  # the leader's welcome HELLO
        self._sent_hello: Hello | None = None  # ours (what both proofs cover)
        self._challenge: bytes | None = None  # the leader's nonce
        self._challenge_frame: Challenge | None = None
        self._prepared: Prepare | None = None
        self._answer = b""
        self._decided: Decided[bool] = Decided(memory)
        self._held_aborts: dict[int, Abort] = {}
        self._vetoed: dict[int, bytes] = {}
        self._held_limit = held_limit
        self._memory = memory
        self._running: dict[int, int] = {}  # launched, not completed: step -> PREPARE checksum (the last `memory`)
        self._completed: Decided[bool] = Decided(memory)  # step -> ok, as reported
        self._events: deque[Any] = deque()
        self._stats.update(ready=0, rejected=0, launched=0, aborted=0, held=0, completed=0, failed=0, auth_failed=0)

    # -- local actions
    def start(self, step: int = 0) -> None:
        """Queue our HELLO (``step``: the step we expect, informational)."""
        if self.state is not _P.CONNECTING:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, f"start() in state {self.state.value}")
        hello = Hello(step=step, rank=self.rank, world_size=self.world_size, geometry_digest=self.digest,
                      nonce=self._nonce)
        self._send(encode(hello))
        self._sent_hello = hello
        self.state = _P.HELLO_SENT

    def reject(self, code: int = RejectCode.PEER_FAILED, detail: str = "") -> None:
        """Refuse the current step for a local reason, before its PREPARE is answered.

        Allowed in IDLE only: the REJECT goes out now and is repeated when the
        PREPARE arrives, so the step cannot launch. After READY a rank has given
        its word; one that then cannot run the step must close its link (the
        leader aborts whatever is undecided). Raises ``LocalProtocolError`` in
        any other state.
        """
        if self.state is not _P.IDLE:
            why = ": READY was sent, close the link instead" if self.state is _P.READY else ""
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, f"reject() in state {self.state.value}{why}")
        self._reject_current(code, detail or f"rank {self.rank} refused step {self.step}")
        self._events.pop()  # the caller knows; no Answered event for its own call

    def complete(self, step: int, ok: bool = True, detail: str = "") -> None:
        """Report that launched ``step`` ran (``ok``) or failed (``detail`` says why): queue COMPLETE.

        Allowed once per launched step, in any state but ERROR (the link may have
        moved on to later steps, or seen the end of the stream). Raises
        ``LocalProtocolError`` for a step never launched here or already
        completed, or a broken link; ``InvalidArgumentError`` for an ``ok`` that
        is not a bool. Nothing is queued then.
        """
        if type(ok) is not bool:
            raise InvalidArgumentError(f"ok must be a bool, got {ok!r}")
        if self.state is _P.ERROR:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, f"complete(step {step!r}) on a broken link")
        crc = self._running.get(step)
        if crc is None:
            done = self._completed.get(step)
            why = f"was already completed (ok={done})" if done is not None else (
                f"was never launched here (or is older than the last {self._memory} launched)"
            )
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, f"complete(step {step!r}): the step {why}")
        self._send(encode(Complete(step=step, rank=self.rank, prepare_checksum=crc, ok=ok, detail=detail)))
        del self._running[step]
        self._completed.add(step, ok)
        self._stats["completed" if ok else "failed"] += 1

    @property
    def running(self) -> list[int]:
        """Launched steps not completed yet (``complete`` not called), oldest first."""
        return list(self._running)

    # -- events
    def next_event(self) -> Any:
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

    def _fail(self, exc: RemoteProtocolError, *, reply: bool) -> None:
        if reply:
            step = self.step if self.step is not None else 0
            self._send(encode(Reject(step=step, rank=self.rank, code=exc.code, detail=exc.detail)))
        self.state = _P.ERROR
        self._error = exc
        raise exc

    def _dispatch(self, f: Any) -> None:
        kind = type(f)
        if kind in _STEP_FRAMES and self.state in _JOINED:
            return self._on_step_frame(f)
        handler = _PEER_TABLE.get((self.state, kind))
        if handler is None:
            raise RemoteProtocolError(
                RejectCode.UNEXPECTED_FRAME,
                f"a peer in state {self.state.value} does not accept {kind.__name__.upper()}",
            )
        return handler(self, f)

    # -- the handshake
    def _refused(self, f: Reject) -> None:
        raise HandshakeRefused(f.code, f"the leader refused this rank: {f.detail}")

    def _hello_again(self, f: Hello) -> None:
        if f != self._hello:
            raise RemoteProtocolError(RejectCode.CONFLICT, "a second, different HELLO from the leader")
        self._stats["duplicates"] += 1

    def _on_challenge(self, f: Challenge) -> None:
        """The leader's nonce and its proof of the key: check it, then answer with ours (AUTH)."""
        hello = self._sent_hello
        assert hello is not None  # HELLO_SENT
        if not proofs_match(leader_proof(self._key, hello, f.nonce), f.proof):
            self._stats["auth_failed"] += 1
            raise RemoteProtocolError(RejectCode.BAD_AUTH, "the leader did not prove the job's key "
                                      "(another key, or a replayed CHALLENGE): this rank proves nothing to it")
        self._challenge = f.nonce
        self._challenge_frame = f
        self._send(encode(Auth(step=0, rank=self.rank, proof=peer_proof(self._key, hello, f.nonce))))
        self.state = _P.AUTH_SENT

    def _challenge_again(self, f: Challenge) -> None:
        """The same CHALLENGE again on this link (a duplicated frame): absorbed; another: broken."""
        if f != self._challenge_frame:
            raise RemoteProtocolError(RejectCode.CONFLICT, "a second, different CHALLENGE from the leader")
        self._stats["duplicates"] += 1

    def _on_hello(self, f: Hello) -> None:
        if f.nonce != self._challenge:
            raise RemoteProtocolError(RejectCode.BAD_AUTH, "the leader's HELLO does not carry its CHALLENGE's nonce")
        if f.rank != 0:
            raise RemoteProtocolError(RejectCode.BAD_RANK, f"HELLO from rank {f.rank}, expected the leader (0)")
        if f.world_size != self.world_size:
            raise RemoteProtocolError(
                RejectCode.WORLD_SIZE_MISMATCH,
                f"leader's world size is {f.world_size}, this rank's is {self.world_size}",
            )
        if f.geometry_digest != self.digest:
            raise RemoteProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                f"leader's geometry digest {f.geometry_digest.hex()[:16]} != this rank's "
                f"{self.digest.hex()[:16]} ({self.geometry})",
            )
        self._hello = f
        self.step = f.step
        self.state = _P.IDLE
        self._events.append(Joined(step=f.step, world_size=f.world_size))

    # -- frames about a step
    def _on_step_frame(self, f: Prepare | Launch | Abort) -> None:
        s, k, kind = f.step, self.step, type(f)
        assert k is not None  # joined states have a step
        if s < k:
            return self._on_stale(f)
        if s > k:
            return self._on_ahead(f, k)
        handler = _PEER_STEP.get((self.state, kind))
        if handler is None:
            why = " (this rank rejected it)" if self.state is _P.REJECTED else " (never prepared here)"
            raise RemoteProtocolError(
                _PEER_STEP_MISS.get((self.state, kind), RejectCode.UNEXPECTED_FRAME),
                f"{kind.__name__.upper()} of step {s} in state {self.state.value}{why}",
            )
        return handler(self, f)

    def _on_ahead(self, f: Prepare | Launch | Abort, k: int) -> None:
        """A frame for a step after ``k``: veto a PREPARE, hold an ABORT, refuse a LAUNCH."""
        s = f.step
        if type(f) is Prepare:
            # Not the step we expect: refuse it and never READY it later.
            prev = self._vetoed.get(s)
            if prev is not None:
                self._stats["duplicates"] += 1
                self._send(prev)
                return None
            if len(self._vetoed) >= self._held_limit:
                raise RemoteProtocolError(RejectCode.BAD_STEP, f"too many PREPAREs ahead of step {k}")
            detail = f"PREPARE for step {s} while this rank expects step {k}"
            data = encode(Reject(step=s, rank=self.rank, code=RejectCode.BAD_STEP, detail=detail))
            self._vetoed[s] = data
            self._stats["rejected"] += 1
            self._send(data)
            self._events.append(Answered(step=s, ready=False, code=RejectCode.BAD_STEP, detail=detail))
            return None
        if type(f) is Abort:
            # Overtook the frames of earlier steps: apply it when we get there.
            if len(self._held_aborts) >= self._held_limit:
                raise RemoteProtocolError(RejectCode.BAD_STEP, f"too many ABORTs ahead of step {k}")
            if s in self._held_aborts:
                self._stats["duplicates"] += 1
            else:
                self._held_aborts[s] = f
                self._stats["held"] += 1
            return None
        raise RemoteProtocolError(
            RejectCode.UNEXPECTED_FRAME, f"LAUNCH of step {s} which this rank never answered (at step {k})"
        )

    def _prepare(self, f: Prepare) -> None:
        s = f.step
        if len(f.payload) > self.max_payload:
            detail = f"PREPARE step {s}: payload of {len(f.payload)} bytes, this rank's cap is {self.max_payload}"
            return self._reject_current(RejectCode.FRAME_TOO_LARGE, detail)
        problem = self._check_lists(f)
        if problem is None:
            self._prepared = f
            self._answer = encode(Ready(step=s, rank=self.rank, prepare_checksum=f.checksum))
            self.state = _P.READY
            self._stats["ready"] += 1
            self._send(self._answer)
            self._events.append(Answered(step=s, ready=True, n_pages=len(f.clear_pages)))
            return None
        code, detail = problem
        return self._reject_current(code, f"PREPARE step {s}: {detail}")

    def _check_lists(self, f: Prepare) -> tuple[int, str] | None:
        """The first problem with the PREPARE's page lists (clear, then poison and committed), or None."""
        # a decoded PREPARE carries its ids as memoryviews of format 'I' over the frame
        problem = page_ids_problem(cast(memoryview, f.clear_pages), self.num_pages)
        lists = f.sanitize
        if problem is not None or lists is None:
            return problem
        if not self.sanitize:
            return RejectCode.UNSUPPORTED, "sanitize mode, and this rank has no sanitizer"
        for name, ids in (("poison", lists.poison_pages), ("committed", lists.committed_pages)):
            problem = page_ids_problem(cast(memoryview, ids), self.num_pages)
            if problem is not None:
                return problem[0], f"{name} list: {problem[1]}"
        return None

    def _reject_current(self, code: int, detail: str) -> None:
        s = self.step
        assert s is not None  # only in IDLE(k)
        self._answer = encode(Reject(step=s, rank=self.rank, code=code, detail=detail))
        self._prepared = None
        self.state = _P.REJECTED
        self._stats["rejected"] += 1
        self._send(self._answer)
        self._events.append(Answered(step=s, ready=False, code=code, detail=detail))

    def _repeat(self, f: Prepare) -> None:
        """The same PREPARE again: the same answer. Another one after READY: REJECT, state kept."""
        self._stats["duplicates"] += 1
        p = self._prepared
        if self.state is _P.READY and p is not None and f.checksum != p.checksum:
            detail = f"a second, different PREPARE for step {f.step} after READY"
            self._send(encode(Reject(step=f.step, rank=self.rank, code=RejectCode.CONFLICT, detail=detail)))
            return None
        self._send(self._answer)
        return None

    def _launch(self, f: Launch) -> None:
        p = self._prepared
        assert p is not None  # READY(k) holds the PREPARE it validated
        if f.prepare_checksum != p.checksum:
            raise RemoteProtocolError(
                RejectCode.CONFLICT,
                f"LAUNCH of step {f.step} for PREPARE checksum {f.prepare_checksum:08x}, "
                f"this rank validated {p.checksum:08x}",
            )
        self._stats["launched"] += 1
        self._running[f.step] = p.checksum
        if len(self._running) > self._memory:  # never completed: forgotten, oldest first
            del self._running[next(iter(self._running))]
        self._events.append(RunStep(step=f.step, clear_pages=p.clear_pages, payload=p.payload, sanitize=p.sanitize))
        return self._advance(True)

    def _abort(self, f: Abort) -> None:
        self._stats["aborted"] += 1
        self._events.append(DropStep(step=f.step, code=f.code, rank=f.rank))
        return self._advance(False)

    def _on_stale(self, f: Prepare | Launch | Abort) -> None:
        self._stats["stale"] += 1
        s, kind = f.step, type(f)
        if kind is Prepare:
            detail = f"PREPARE for step {s}, already decided (this rank is at step {self.step})"
            self._send(encode(Reject(step=s, rank=self.rank, code=RejectCode.STALE_STEP, detail=detail)))
            self._events.append(Answered(step=s, ready=False, code=RejectCode.STALE_STEP, detail=detail))
            return None
        known = self._decided.get(s)
        if known is None:
            return None
        if (kind is Launch) == known:
            self._stats["duplicates"] += 1
            return None
        done = "launched" if known else "aborted"
        raise RemoteProtocolError(RejectCode.CONFLICT, f"{kind.__name__.upper()} of step {s} which this rank {done}")

    def _advance(self, launched: bool) -> None:
        """Step ``k`` is decided: move to ``k + 1``, then apply a veto or held ABORT waiting there."""
        k = self.step
        assert k is not None  # joined states have a step
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
_Handler = Callable[[PeerLink, Any], None]

# A peer's transitions, one table (h11's _state.py in small). Frames about the
# link's current step, by state; anything else about that step is a lookup miss,
# raised as a protocol error naming the state and the frame.
_PEER_STEP: dict[tuple[PeerState, type], _Handler] = {
    (_P.IDLE, Prepare): PeerLink._prepare,  # validate -> READY or REJECT
    (_P.READY, Prepare): PeerLink._repeat,
    (_P.REJECTED, Prepare): PeerLink._repeat,
    (_P.READY, Launch): PeerLink._launch,  # -> RunStep, next step
    (_P.IDLE, Abort): PeerLink._abort,  # -> DropStep, next step
    (_P.READY, Abort): PeerLink._abort,
    (_P.REJECTED, Abort): PeerLink._abort,
}
# The code for a lookup miss when it is not UNEXPECTED_FRAME.
_PEER_STEP_MISS: dict[tuple[PeerState, type], int] = {(_P.REJECTED, Launch): RejectCode.CONFLICT}

# Every other frame a peer may get: the leader's CHALLENGE and HELLO, a refusal, a repeated HELLO.
_PEER_TABLE: dict[tuple[PeerState, type], _Handler] = {
    (_P.HELLO_SENT, Challenge): PeerLink._on_challenge,
    (_P.HELLO_SENT, Reject): PeerLink._refused,
    (_P.AUTH_SENT, Hello): PeerLink._on_hello,
    (_P.AUTH_SENT, Reject): PeerLink._refused,
    **{(st, Hello): PeerLink._hello_again for st in _JOINED},
    **{(st, Challenge): PeerLink._challenge_again for st in (_P.AUTH_SENT, *_JOINED)},
    **{(st, Reject): PeerLink._refused for st in _JOINED},
}
