"""The leader's decision rule over all its links: LAUNCH or ABORT, once per step. Pure.

    begin(plan) ──► step in flight ──┬─ READY from every joined peer ─────► LAUNCH
                                     ├─ any REJECT ────────────────────────► ABORT(code, rank)
                                     ├─ lose(rank): a link closed or broke ─► ABORT PEER_LOST
                                     ├─ a peer missing at begin ───────────► ABORT PEER_LOST
                                     └─ expire(): the driver's deadline ───► ABORT TIMEOUT
    finish() ──► no step in flight; next_step = step + 1

The links (``LeaderLink``) turn frames into votes; this object only counts them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core import checks
from ..core.errors import InvalidArgumentError, LocalProtocolError, StepOrderError
from ..core.events import Geometry, StepPlan
from .codec import (
    NO_RANK,
    Abort,
    Launch,
    Ready,
    Reject,
    RejectCode,
    Sanitize,
    encode,
    encode_prepare_raw,
    frame_checksum,
    pack_page_ids,
)
from .protocol import Decision, check_world

__all__ = ["Leader"]


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
    after it, votes for that step are ignored. Raises ``InvalidArgumentError``
    for a bad world size or ``next_step``, ``ConfigurationError`` for a bad geometry.
    """

    def __init__(self, geometry: Geometry, *, world_size: int, next_step: int = 0) -> None:
        check_world(0, world_size, leader=True)
        self.num_pages = checks.geometry(geometry).num_pages
        self.geometry = geometry
        self.world_size = world_size
        if type(next_step) is not int or next_step < 0:
            raise InvalidArgumentError(f"next_step must be an int >= 0, got {next_step!r}")
        self.next_step = next_step
        self.joined: set[int] = set()
        self.lost: set[int] = set()
        self.step: int | None = None  # step in flight
        self.checksum = 0
        self._ready: set[int] = set()
        self.decision: Decision | None = None
        self._stats = {"launched": 0, "aborted": 0}

    @property
    def peers(self) -> frozenset[int]:
        return frozenset(range(1, self.world_size))

    def join(self, rank: int) -> None:
        """Register a peer whose HELLO was accepted. Raises ``InvalidArgumentError`` if taken or out of range."""
        if type(rank) is not int or not 1 <= rank < self.world_size:
            raise InvalidArgumentError(f"rank {rank!r} is not a peer rank of {self.world_size}")
        if rank in self.joined and rank not in self.lost:
            raise InvalidArgumentError(f"rank {rank} already joined")
        self.lost.discard(rank)
        self.joined.add(rank)

    def begin(
        self, plan: StepPlan, payload: bytes = b"", *, sort: bool = True, sanitize: Sanitize | None = None
    ) -> tuple[bytes, int]:
        """Start ``plan.step``: validate its clear list, return ``(PREPARE bytes, checksum)``.

        ``sort`` sends the ids ascending (zeroing is order-free; peers then check
        distinctness without hashing). ``sanitize``: a sanitize-mode step's poison
        and committed lists, checked like the clear list and sent with the SANITIZE
        flag. Raises ``StepOrderError`` (not the next step, or one still in
        flight), ``PageOutOfRangeError`` / ``DuplicatePageError`` (a bad list) or
        ``InvalidArgumentError`` before anything is sent. If a peer is missing or
        lost, ``decision`` is already an ABORT when this returns: send ``data``
        nowhere, send the ABORT.
        """
        step = plan.step
        if self.step is not None:
            raise StepOrderError(step, self.step, "a step is still in flight")
        if step != self.next_step:
            raise StepOrderError(step, self.next_step, f"the leader's next step is {self.next_step}")
        raw = self._checked(plan.clear_list, sort)
        lists = None
        if sanitize is not None:
            if type(sanitize) is not Sanitize:
                raise InvalidArgumentError(f"sanitize must be a Sanitize or None, got {sanitize!r}")
            lists = (self._checked(sanitize.poison_pages, sort), self._checked(sanitize.committed_pages, sort))
        data = encode_prepare_raw(step, raw, payload, sanitize_raw=lists)
        self.step = step
        self.checksum = frame_checksum(data)
        self._ready = set()
        self.decision = None
        missing = self.peers - (self.joined - self.lost)
        if missing:
            r = min(missing)
            self._decide(False, RejectCode.PEER_LOST, r, f"rank {r} is not connected")
        elif self.world_size == 1:
            self._decide(True)  # nobody else to ask
        return data, self.checksum

    def _checked(self, page_ids: Sequence[int], sort: bool) -> bytes:
        """A page list packed as u32 (ascending when ``sort``); raises the library's error for a bad one."""
        raw = pack_page_ids(sorted(page_ids) if sort else page_ids)
        problem = checks.u32_page_ids_problem(raw, self.num_pages)
        if problem is not None:
            checks.raise_problem(problem, self.num_pages)
        return raw

    def _decide(self, launch: bool, code: int = 0, rank: int = NO_RANK, detail: str = "") -> Decision:
        s = self.step
        assert s is not None  # only called with a step in flight
        if launch:
            data = encode(Launch(step=s, prepare_checksum=self.checksum))
            self._stats["launched"] += 1
        else:
            data = encode(Abort(step=s, code=code, rank=rank))
            self._stats["aborted"] += 1
        self.decision = Decision(step=s, launch=launch, code=code, rank=rank, detail=detail, data=data)
        return self.decision

    def vote(self, frame: Ready | Reject) -> Decision | None:
        """Count a peer's ``Ready`` / ``Reject`` (as ``LeaderLink`` returned it).

        Returns the decision once there is one (also on later calls, unchanged).
        """
        if self.step is None or frame.step != self.step or self.decision is not None:
            return self.decision
        if type(frame) is Reject:
            return self._decide(False, frame.code, frame.rank, f"rank {frame.rank}: {frame.detail}")
        if frame.rank in self.joined and frame.rank not in self.lost:
            self._ready.add(frame.rank)
        if len(self._ready) == self.world_size - 1:
            return self._decide(True)
        return None

    def lose(self, rank: int) -> Decision | None:
        """Rank ``rank``'s link closed or broke: abort the step in flight (if undecided)."""
        self.lost.add(rank)
        if self.step is not None and self.decision is None:
            return self._decide(False, RejectCode.PEER_LOST, rank, f"rank {rank} lost")
        return self.decision

    def expire(self) -> Decision:
        """The deadline for the step in flight passed: abort it unless already decided.

        Raises ``LocalProtocolError`` with no step in flight."""
        if self.step is None:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, "expire() with no step in flight")
        if self.decision is None:
            missing = sorted(self.peers - self._ready)
            r = missing[0] if missing else NO_RANK
            return self._decide(False, RejectCode.TIMEOUT, r, f"no READY from ranks {missing} in time")
        return self.decision

    @property
    def waiting_on(self) -> list[int]:
        """Peers whose READY for the step in flight has not arrived."""
        return sorted(self.peers - self._ready) if self.step is not None else []

    def finish(self) -> Decision:
        """Close the step in flight once its decision went out; the next step may begin.

        Raises ``LocalProtocolError`` before a decision."""
        if self.decision is None or self.step is None:
            raise LocalProtocolError(RejectCode.UNEXPECTED_FRAME, "finish() before a decision")
        d = self.decision
        self.next_step = self.step + 1
        self.step = None
        return d

    def statistics(self) -> dict[str, int]:
        return dict(self._stats, next_step=self.next_step, joined=len(self.joined), lost=len(self.lost))
