"""The leader's end of the link to one peer: a pure state machine (see ``protocol``).

Leader link states (``LeaderState``); ``k`` is the link's current step:

    HANDSHAKE ─HELLO ok─► CHALLENGED (CHALLENGE sent: our nonce, our proof of the key)
    CHALLENGED ─AUTH, the peer's proof ok─► JOINING    event PeerHello: only now a rank
    JOINING ─accept(k)─► IDLE(k)                      (our HELLO sent)
    HANDSHAKE / CHALLENGED ─AUTH bad or missing─► ERROR  (REJECT BAD_AUTH sent; the driver's
                                                        deadline closes a link that never proves it)
    IDLE(k)      ─prepare(k)──────────► AWAITING(k)    (PREPARE sent)
    AWAITING(k)  ─READY / REJECT──────► VOTED(k)       event: the vote
    IDLE / AWAITING / VOTED(k) ─decide(k)─► IDLE(k+1)  (LAUNCH or ABORT sent;
                                                        a launched k awaits COMPLETE)
    IDLE / AWAITING / VOTED ─COMPLETE(j)─► unchanged    event Completed (j launched)
    joined ─the same HELLO or AUTH again─► unchanged     (a duplicate; a different one is broken)
    HANDSHAKE / CHALLENGED / JOINING / IDLE ─refuse()─► ERROR   (REJECT sent)
    any          ─broken frame────────► ERROR          (REJECT sent in the handshake)
    any          ─end of stream───────► CLOSED

The transitions are ``_LEADER_TABLE``. Votes about other steps are settled by
step number:

    frame at the leader    step decided                step in flight          step never prepared
    READY                  ignored (stale)             a vote; with another    broken
                                                       crc it counts as
                                                       REJECT CONFLICT
    REJECT                 ignored (stale)             a vote (it sticks)      a vote against the step
                                                                               in flight (its PREPARE
                                                                               came garbled); ignored
                                                                               when none is in flight

    COMPLETE(j) at the leader, by what this link knows of step j:
    launched, awaiting COMPLETE   same crc: event Completed; another crc: broken CONFLICT
    completed                     same (ok, crc): ignored (duplicate); another: broken CONFLICT
    aborted                       broken CONFLICT (the peer ran a step nobody launched)
    in flight or never prepared   broken UNEXPECTED_FRAME (no LAUNCH yet) / BAD_STEP (ahead)
    older than the link's memory  ignored (stale)

The decision over all links is ``kvledger.wire.decision.Leader``.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from ..core.errors import FrameError, HandshakeRefused, LocalProtocolError, RemoteProtocolError
from ..core.events import Geometry
from .auth import check_key, check_nonce, leader_proof, peer_proof, proofs_match
from .codec import Auth, Challenge, Complete, Hello, Ready, Reject, RejectCode, encode
from .protocol import NEED_DATA, Completed, ConnectionClosed, Decided, Decision, Link, PeerHello, check_world

__all__ = ["LeaderState", "LeaderLink"]

# A peer sends only small frames (HELLO, AUTH, READY, a REJECT or COMPLETE with at most 1 KiB of detail).
_PEER_MAX_BODY = 4096


class LeaderState(Enum):
    HANDSHAKE = "handshake"
    CHALLENGED = "challenged"
    JOINING = "joining"
    IDLE = "idle"
    AWAITING = "awaiting"
    VOTED = "voted"
    CLOSED = "closed"
    ERROR = "error"


_L = LeaderState
_IN_STEP = (_L.IDLE, _L.AWAITING, _L.VOTED)
_UNJOINED = (_L.HANDSHAKE, _L.CHALLENGED, _L.JOINING)


class LeaderLink(Link):
    """The leader's end of the link to one peer (whose rank it learns from HELLO).

        link = LeaderLink(geometry, world_size=4, key=job_key, nonce=auth.new_nonce())
        link.receive_data(recv())
        ev = link.next_event()          # PeerHello(rank, ...) once HELLO and AUTH proved the key
        link.accept(step)               # or link.refuse(code, detail)
        link.prepare(step, data, crc)   # the PREPARE bytes, encoded once for all links
        ev = link.next_event()          # Ready / Reject (the peer's vote)
        link.decide(decision)           # LAUNCH or ABORT

    ``next_event`` returns ``PeerHello``, the peer's ``Ready`` or ``Reject`` vote
    for the step in flight (a READY for another PREPARE checksum is turned into a
    ``Reject`` with code CONFLICT), ``Completed`` for a launched step the peer
    ran, ``ConnectionClosed`` or ``NEED_DATA``; stale and duplicate votes and
    COMPLETEs are absorbed. It raises ``RemoteProtocolError`` when the peer broke
    the protocol (the link is then in ERROR; a REJECT is queued when the peer is
    still in its handshake). ``memory``: how many decided steps the link
    remembers to tell a duplicate from a contradiction.

    ``key``: the job's shared key; ``nonce``: ``NONCE_BYTES`` fresh random bytes,
    never used for another link (``kvledger.wire.auth``). ``PeerHello`` comes only
    after the peer proved the key over this nonce: a peer without the key, or one
    replaying another link's handshake, never becomes a rank. Raises
    ``InvalidArgumentError`` for a bad world size, key or nonce.
    """

    def __init__(self, geometry: Geometry, *, world_size: int, key: bytes, nonce: bytes,
                 memory: int = 1024) -> None:
        check_world(0, world_size, leader=True)
        super().__init__(geometry, world_size, _PEER_MAX_BODY)
        self._key = check_key(key)
        self._nonce = check_nonce(nonce)
        self._peer_hello: Hello | None = None
        self._auth: Auth | None = None
        self.rank: int | None = None
        self.state = _L.HANDSHAKE
        self.step: int | None = None
        self._checksum = 0
        self._vote: Ready | Reject | None = None
        self._memory = memory
        self._outcomes: Decided[bool] = Decided(memory)  # step -> launched?
        self._awaiting: dict[int, int] = {}  # launched, no COMPLETE yet: step -> PREPARE checksum
        self._done: Decided[tuple[bool, int]] = Decided(memory)  # step -> (ok, checksum) as completed
        self._stats.update(votes=0, completed=0, failed=0, auth_failed=0)

    def next_event(self) -> Any:
        """The next event (``PeerHello``, a vote), ``NEED_DATA``, or ``ConnectionClosed``.

        Raises ``RemoteProtocolError`` (incl. ``FrameError``, ``HandshakeRefused``)
        when the peer broke the protocol or refused the link; the link is then in ERROR.
        """
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

    def _fail(self, exc: RemoteProtocolError) -> None:
        if self.state in _UNJOINED and not isinstance(exc, HandshakeRefused):
            self._send(encode(Reject(step=0, rank=0, code=exc.code, detail=exc.detail)))
        self.state = _L.ERROR
        self._error = exc
        raise exc

    def _dispatch(self, f: Any) -> Any:
        kind = type(f)
        handler = _LEADER_TABLE.get((self.state, kind))
        if handler is None:
            raise RemoteProtocolError(
                RejectCode.UNEXPECTED_FRAME,
                f"the leader's link in state {self.state.value} does not accept {kind.__name__.upper()}",
            )
        return handler(self, f)

    # -- the handshake
    def _refused(self, f: Reject) -> None:
        who = f"peer rank {self.rank}" if self.rank is not None else "a peer in its handshake"
        raise HandshakeRefused(f.code, f"{who} refused the link: {f.detail}")

    def _hello_again(self, f: Hello) -> None:
        if f != self._peer_hello:
            raise RemoteProtocolError(RejectCode.CONFLICT, f"a second, different HELLO from rank {self.rank}")
        self._stats["duplicates"] += 1
        return None

    def _on_hello(self, f: Hello) -> None:
        """A peer's HELLO: check what it claims, then challenge it (our nonce, our proof of the key)."""
        if not 1 <= f.rank < self.world_size:
            raise RemoteProtocolError(
                RejectCode.BAD_RANK, f"HELLO from rank {f.rank}, peers are ranks 1..{self.world_size - 1}"
            )
        if f.world_size != self.world_size:
            raise RemoteProtocolError(
                RejectCode.WORLD_SIZE_MISMATCH,
                f"rank {f.rank} has world size {f.world_size}, the leader {self.world_size}",
            )
        if f.geometry_digest != self.digest:
            raise RemoteProtocolError(
                RejectCode.GEOMETRY_MISMATCH,
                f"rank {f.rank} geometry digest {f.geometry_digest.hex()[:16]} != the leader's "
                f"{self.digest.hex()[:16]} ({self.geometry})",
            )
        self._peer_hello = f
        self._send(encode(Challenge(step=0, nonce=self._nonce, proof=leader_proof(self._key, f, self._nonce))))
        self.state = _L.CHALLENGED
        return None

    def _on_auth(self, f: Auth) -> PeerHello:
        """The peer's proof of the key over its HELLO and our nonce: only now is it a rank."""
        hello = self._peer_hello
        assert hello is not None  # CHALLENGED
        if f.rank != hello.rank or not proofs_match(peer_proof(self._key, hello, self._nonce), f.proof):
            self._stats["auth_failed"] += 1
            raise RemoteProtocolError(
                RejectCode.BAD_AUTH,
                f"HELLO as rank {hello.rank}, but no proof of the job's key (another key, or a replayed handshake)",
            )
        self.rank = hello.rank
        self._auth = f
        self.state = _L.JOINING
        return PeerHello(rank=hello.rank, world_size=hello.world_size, step=hello.step)

    def _auth_again(self, f: Auth) -> None:
        """The same AUTH again on this link (a duplicated frame): absorbed; another one: broken."""
        if f != self._auth:
            raise RemoteProtocolError(RejectCode.CONFLICT, f"a second, different AUTH from rank {self.rank}")
        self._stats["duplicates"] += 1

    # -- votes
    def _on_vote(self, f: Ready | Reject) -> Ready | Reject | None:
        s, k = f.step, self.step
        assert k is not None  # accepted links have a step
        if f.rank != self.rank:
            raise RemoteProtocolError(
                RejectCode.BAD_RANK, f"{type(f).__name__.upper()} from rank {f.rank} on rank {self.rank}'s link"
            )
        st = self.state
        in_flight = st is _L.AWAITING or st is _L.VOTED
        if s < k:
            self._stats["stale"] += 1
            return None
        if not in_flight or s != k:
            if type(f) is not Reject:
                raise RemoteProtocolError(
                    RejectCode.BAD_STEP, f"READY for step {s} which was never prepared (link at step {k}, {st.value})"
                )
            if not in_flight:  # nothing to vote on; the peer repeats it when the PREPARE comes
                self._stats["stale"] += 1
                return None
            # A REJECT naming a step we never sent (its PREPARE arrived garbled): still a no.
            f = Reject(step=k, rank=f.rank, code=f.code, detail=f"(for step {s}) {f.detail}")
        if type(f) is Ready and f.prepare_checksum != self._checksum:
            f = Reject(
                step=s,
                rank=f.rank,
                code=RejectCode.CONFLICT,
                detail=f"READY for PREPARE checksum {f.prepare_checksum:08x}, sent {self._checksum:08x}",
            )
        prev = self._vote
        if prev is not None and (type(prev) is Reject or type(f) is Ready):
            self._stats["duplicates"] += 1  # a REJECT sticks; a second READY adds nothing
            return None
        self._vote = f
        self.state = _L.VOTED
        self._stats["votes"] += 1
        return f

    # -- completions
    def _on_complete(self, f: Complete) -> Completed | None:
        s, k = f.step, self.step
        assert k is not None  # accepted links have a step
        if f.rank != self.rank:
            raise RemoteProtocolError(RejectCode.BAD_RANK, f"COMPLETE from rank {f.rank} on rank {self.rank}'s link")
        crc = self._awaiting.get(s)
        if crc is not None:
            if f.prepare_checksum != crc:
                raise RemoteProtocolError(
                    RejectCode.CONFLICT,
                    f"COMPLETE of step {s} for PREPARE checksum {f.prepare_checksum:08x}, launched {crc:08x}",
                )
            del self._awaiting[s]
            self._done.add(s, (f.ok, crc))
            self._stats["completed" if f.ok else "failed"] += 1
            return Completed(step=s, rank=f.rank, ok=f.ok, detail=f.detail)
        done = self._done.get(s)
        if done is not None:
            if done != (f.ok, f.prepare_checksum):
                raise RemoteProtocolError(RejectCode.CONFLICT, f"a second, different COMPLETE of step {s}")
            self._stats["duplicates"] += 1
            return None
        if self._outcomes.get(s) is False:
            raise RemoteProtocolError(RejectCode.CONFLICT, f"COMPLETE of step {s}, which was aborted")
        if s >= k:
            code = RejectCode.UNEXPECTED_FRAME if s == k else RejectCode.BAD_STEP
            raise RemoteProtocolError(code, f"COMPLETE of step {s}, never launched (link at step {k})")
        self._stats["stale"] += 1  # launched longer ago than the link remembers
        return None

    @property
    def awaiting(self) -> list[int]:
        """Steps launched on this link whose COMPLETE has not arrived, oldest first."""
        return list(self._awaiting)

    # -- local actions
    def accept(self, step: int) -> None:
        """Welcome the peer: queue our HELLO naming the first step we will PREPARE."""
        if self.state is not _L.JOINING:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, f"accept() in state {self.state.value}")
        self._send(encode(Hello(step=step, rank=0, world_size=self.world_size, geometry_digest=self.digest,
                                nonce=self._nonce)))
        self.step = step
        self.state = _L.IDLE

    def refuse(self, code: int, detail: str) -> None:
        """Turn the peer away (e.g. its rank is taken): queue REJECT; the link is done."""
        if self.state not in (*_UNJOINED, _L.IDLE):
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, f"refuse() in state {self.state.value}")
        self._send(encode(Reject(step=self.step or 0, rank=0, code=code, detail=detail)))
        self.state = _L.ERROR
        self._error = LocalProtocolError(code, f"refused: {detail}")

    def prepare(self, step: int, data: bytes, checksum: int) -> None:
        """Queue the PREPARE frame ``data`` (encoded once by ``Leader.begin``) for ``step``."""
        if self.state is not _L.IDLE or step != self.step:
            raise LocalProtocolError(
                RejectCode.UNEXPECTED_FRAME,
                f"prepare(step {step}) with the link at step {self.step}, {self.state.value}",
            )
        self._checksum = checksum
        self._vote = None
        self._send(data)
        self.state = _L.AWAITING

    @property
    def vote(self) -> Ready | Reject | None:
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
        if st not in _IN_STEP or s != self.step:
            raise LocalProtocolError(
                RejectCode.UNEXPECTED_FRAME, f"decide(step {s}) with the link at step {self.step}, {st.value}"
            )
        if decision.launch and type(self._vote) is not Ready:
            raise LocalProtocolError(
                RejectCode.UNEXPECTED_FRAME, f"LAUNCH of step {s} without READY from rank {self.rank}"
            )
        self._send(decision.data)
        self._outcomes.add(s, decision.launch)
        if decision.launch:
            self._awaiting[s] = self._checksum
            if len(self._awaiting) > self._memory:
                del self._awaiting[next(iter(self._awaiting))]
        self._vote = None
        self.step = s + 1
        self.state = _L.IDLE


_Handler = Callable[[LeaderLink, Any], Any]

# The leader link's transitions, one table; a miss is a protocol error naming both.
_LEADER_TABLE: dict[tuple[LeaderState, type], _Handler] = {
    (_L.HANDSHAKE, Hello): LeaderLink._on_hello,
    (_L.HANDSHAKE, Reject): LeaderLink._refused,
    (_L.CHALLENGED, Auth): LeaderLink._on_auth,
    (_L.CHALLENGED, Reject): LeaderLink._refused,
    (_L.JOINING, Reject): LeaderLink._refused,
    **{(st, k): LeaderLink._on_vote for st in _IN_STEP for k in (Ready, Reject)},
    **{(st, Hello): LeaderLink._hello_again for st in _IN_STEP},
    **{(st, Auth): LeaderLink._auth_again for st in (_L.JOINING, *_IN_STEP)},
    **{(st, Complete): LeaderLink._on_complete for st in _IN_STEP},
}
