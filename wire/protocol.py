"""The PREPARE/READY handshake as pure state machines, one per link (h11 style).

Nothing here does I/O or keeps time. A link takes bytes in (``receive_data``),
hands events out (``next_event``) and queues the bytes it must send
(``data_to_send``); the drivers in ``kvledger.wire.rank`` and
``kvledger.wire.peer_driver`` move the bytes and decide timeouts, which they
feed back in as events (``Leader.expire``, ``Completions.expire``).

    protocol.py    this overview, the events both ends hand out, the link base
    peer.py        PeerLink: a peer's end of its link, its state chart and table
    leader.py      LeaderLink: the leader's end of one link, its chart and table
    decision.py    Leader: the decision rule over every link (LAUNCH or ABORT)
    completion.py  Completions: which peers completed which launched step

Why a fifth message. SPEC's promise is that no rank clears or launches a step
that any rank rejected or that timed out. A peer that launched on its own READY
could not keep it: it cannot know whether another rank rejected, or whether the
leader's deadline passed before its READY arrived. So READY is a vote, and the
leader's decision is a frame of its own: LAUNCH(step) after every READY, or
ABORT(step) after any REJECT, a timeout or a lost link. A peer clears and runs a
step only on LAUNCH, and only in the READY state for that step with the same
PREPARE checksum; that single rule is what the R11-R13 tests hammer.

Why a sixth (layout 8). A LAUNCH says a step may run, not that it ran. A peer
answers each LAUNCH, once its clears and graph are done or have failed, with
COMPLETE(step, rank, crc, ok, detail); the leader records a rank's completion
of a step from that frame only, and a peer that never sends one (lost, stuck,
partitioned) is reported missing by rank when the caller's deadline passes.

    leader (rank 0)                                   peer (rank r)
    ───────────────                                   ─────────────
                       ◄────── HELLO(r, W, geometry,       connect
                                     nonce_p)
    check layout, W,
    geometry, rank      ─────► CHALLENGE(nonce_l, proof_l) check the leader's proof
    check the peer's   ◄────── AUTH(r, proof_p)            of the job's key, prove ours
    proof: now a rank   ─────► HELLO(0, W, geometry,
                                     first step s)         joined at step s
    seal_step(s) ─► validate plan locally
                        ─────► PREPARE(s, ids, [poison,    validate: step, lengths,
                                 committed,] payload)      checksum, ids < num_pages,
                                                           no duplicates, payload size
                       ◄────── READY(s, r, crc)   or   REJECT(s, r, code, detail)
    all READY (same crc) ─────► LAUNCH(s, crc)             clear ids, run the step
    any REJECT, timeout,
    lost link            ─────► ABORT(s, code, rank)       clear nothing, run nothing
    Completed(s, r, ok)  ◄────── COMPLETE(s, r, crc, ok, detail)   after LAUNCH(s) ran

Why a key (layout 9). Rank range, world size and geometry are public
configuration: a HELLO proves nothing. A rank counts only after it proved the
job's shared key on its own connection, an HMAC challenge over both ends' fresh
nonces (``auth.py`` has the MACs, and what they protect and what they do not:
frames are not encrypted). The links compute and check the proofs with the key
and nonces their drivers pass in; the drivers bound how long and how many links
may sit unproven (``WireLeader``).

Each link's allowed transitions live in a table beside its class (h11's
``_state.py`` in small): ``_PEER_STEP`` and ``_PEER_TABLE`` in peer.py,
``_LEADER_TABLE`` in leader.py, each mapping (state, frame type) -> handler. A
frame that is not in them is a lookup miss, raised as a protocol error that
names the state and the frame. Duplicated, stale, replayed and reordered frames
are settled by step number; each module draws its half of that table (the
COMPLETE rules are in leader.py's).

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
from collections.abc import Sequence
from typing import Generic, TypeVar

import msgspec

from ..core import checks
from ..core.errors import InvalidArgumentError, LocalProtocolError
from ..core.events import Geometry
from .codec import NO_RANK, Frame, RejectCode, Sanitize, geometry_digest
from .decoder import FrameDecoder

__all__ = [
    "NEED_DATA",
    "Joined",
    "PeerHello",
    "Answered",
    "RunStep",
    "DropStep",
    "Completed",
    "ConnectionClosed",
    "Decision",
]


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


_T = TypeVar("_T")

NEED_DATA = _NeedData()
"""``next_event`` returns this when it needs more bytes."""


# ---------------------------------------------------------------------------- events


class _Event(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    pass


class Joined(_Event, frozen=True):
    """Peer: the leader accepted our HELLO; its first PREPARE will be for ``step``."""

    step: int
    world_size: int


class PeerHello(_Event, frozen=True):
    """Leader link: a peer introduced itself. Call ``accept(step)`` or ``refuse(...)``."""

    rank: int
    world_size: int
    step: int


class Answered(_Event, frozen=True):
    """Peer: how we answered PREPARE(step): READY (``ready``) or REJECT ``code``/``detail``."""

    step: int
    ready: bool
    code: int = 0
    detail: str = ""
    n_pages: int = 0


class RunStep(_Event, frozen=True):
    """Peer: the leader launched ``step``. Clear ``clear_pages`` in every plane, then run it.

    ``sanitize``: a sanitize-mode step's poison and committed lists (poison, clear,
    check, then the graph); ``None`` for a plain step. Report the outcome with
    ``PeerLink.complete(step, ok, detail)``.
    """

    step: int
    clear_pages: Sequence[int]
    payload: bytes
    sanitize: Sanitize | None = None

    def __repr__(self) -> str:
        ids = self.clear_pages
        head = ", ".join(str(p) for p in ids[:8]) + (", ..." if len(ids) > 8 else "")
        extra = "" if self.sanitize is None else f", sanitize={self.sanitize!r}"
        return (
            f"RunStep(step={self.step}, clear_pages=[{head}] ({len(ids)} ids), "
            f"payload={len(self.payload)} bytes{extra})"
        )


class DropStep(_Event, frozen=True):
    """Peer: ``step`` was aborted (``code``, culprit ``rank``). Clear nothing, run nothing."""

    step: int
    code: int
    rank: int = NO_RANK


class Completed(_Event, frozen=True):
    """Leader link: peer ``rank`` ran the launched ``step`` (``ok``), or failed at it (``detail``)."""

    step: int
    rank: int
    ok: bool
    detail: str = ""


class ConnectionClosed(_Event, frozen=True):
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


# ---------------------------------------------------------------------------- shared by both ends


class Decided(Generic[_T]):
    """The last ``memory`` outcomes, by step: decisions (True: launched, False: aborted),
    or at the leader link also COMPLETEs (``(ok, PREPARE checksum)``)."""

    __slots__ = ("memory", "_by_step", "_order")

    def __init__(self, memory: int) -> None:
        self.memory = memory
        self._by_step: dict[int, _T] = {}
        self._order: deque[int] = deque()

    def add(self, step: int, outcome: _T) -> None:
        self._by_step[step] = outcome
        self._order.append(step)
        if len(self._order) > self.memory:
            self._by_step.pop(self._order.popleft(), None)

    def get(self, step: int) -> _T | None:
        return self._by_step.get(step)


def check_world(rank: int, world_size: int, *, leader: bool) -> None:
    """Raise ``InvalidArgumentError`` unless ``rank`` of ``world_size`` suits this end
    (the leader is rank 0; a peer is one of ranks 1..world_size-1)."""
    if type(world_size) is not int or world_size < 1 or world_size > 0xFFFFFFFF:
        raise InvalidArgumentError(f"world_size must be an int >= 1, got {world_size!r}")
    if type(rank) is not int or not 0 <= rank < world_size or (rank == 0) != leader:
        which = "the leader is rank 0" if leader else "a peer's rank must be in [1, world_size)"
        raise InvalidArgumentError(f"{which}, got rank {rank!r} of {world_size!r}")


class Link:
    """What both ends of a link share: the decoder, the outbox and counters.

    ``max_body`` caps every frame body the other side may send (the decoder
    refuses a larger one from its header, before buffering it). Raises
    ``ConfigurationError`` for a geometry that is not a valid ``Geometry``.
    """

    def __init__(self, geometry: Geometry, world_size: int, max_body: int) -> None:
        self.num_pages = checks.geometry(geometry).num_pages
        self.geometry = geometry
        self.world_size = world_size
        self.digest = geometry_digest(geometry)
        self._decoder = FrameDecoder(max_body=max(64, max_body))
        self._out: list[bytes] = []
        self._error: BaseException | None = None
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

    def statistics(self) -> dict[str, int]:
        """Counters: frames and bytes in/out, duplicates and stale frames absorbed, and more."""
        return dict(self._stats)

    def _next_frame(self) -> Frame | None:
        frame = self._decoder.next_frame()
        if frame is not None:
            self._stats["frames_in"] += 1
        return frame
