"""``WireRanks``: the remote peers of a step, around the local ranks' strategy (``ranks.py``).

    run(sealed) ─► PREPARE to every peer, READY from each, LAUNCH (or ABORT: nothing ran
                   anywhere, StepFailedError names the culprit; the runner records the abort
                   with sealed.abort_reason)
                ─► the local ranks' strategy ─► every peer's COMPLETE (waited for, shielded;
                   a failed, lost or silent peer is a failed outcome naming its rank)
                ─► the local outcomes, then one per peer: the runner records them alike

A sealed step the caller abandoned before its handshake still goes through the wire
(``catch_up``: PREPARE then ABORT), so the peers' step numbers stay in line with the
ledger's. Wire rank ``w`` is engine rank ``local - 1 + w`` (``remote.engine_rank``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from kvledger.core.errors import StepFailedError, WireProtocolError
from kvledger.core.events import StepPlan
from kvledger.executors.executor import RankOutcome, StepInputs, StepReplies
from kvledger.logs import Logger, get_logger

from .ranks import RankStrategy
from .records import SealedStep
from .remote import RemoteOptions, collect_remote

if TYPE_CHECKING:  # pragma: no cover
    from kvledger.wire.protocol import Decision
    from kvledger.wire.rank import WireLeader

__all__ = ["WireRanks"]


class WireRanks:
    """The wire leader's peers around ``local`` (module docstring). ``decided``: called with
    every handshake's decision and its round trip in seconds (the metrics' ``wire_decision``)."""

    may_yield = always_yields = True

    def __init__(self, local: RankStrategy, leader: WireLeader, remote: RemoteOptions,
                 decided: Sequence[Callable[[Decision, float], None]] = (), logger: Logger | None = None) -> None:
        self.local = local
        self.leader = leader
        self.remote = remote
        self._decided = tuple(decided)
        self._log: Logger = logger if logger is not None else get_logger("kvledger.engine")
        self.world_size = local.world_size + remote.world_size - 1

    async def start(self, tg: TaskGroup) -> None:
        await self.local.start(tg)

    def stop(self) -> None:
        self.local.stop()

    async def abandoned(self, plan: StepPlan) -> None:
        await self.catch_up(plan)

    async def run(self, sealed: SealedStep, inputs: Sequence[StepInputs], replies: StepReplies
                  ) -> list[RankOutcome]:
        await self._handshake(sealed)
        replies.expected = self.local.world_size  # the local ranks answer there; the peers over the wire
        outcomes = await self.local.run(sealed, inputs, replies)
        with anyio.CancelScope(shield=True):  # the outcome is recorded from them whatever happens to the caller
            remote = await collect_remote(self.leader, self.remote, sealed.step, local_ranks=self.local.world_size)
        peers = [RankOutcome(rank=r, step=sealed.step, status="ok") for r in remote.completed]
        peers += [RankOutcome(rank=r, step=sealed.step, status="failed", error=err) for r, err in remote.failures]
        peers.sort(key=_rank)
        return list(outcomes) + peers

    async def _handshake(self, sealed: SealedStep) -> None:
        """PREPARE/READY with every peer; returns on LAUNCH. On anything else no rank ran the
        step, ``sealed.abort_reason`` says why (the runner records it) and this raises:
        ``StepFailedError`` naming the culprit rank for an ABORT, or what interrupted it
        (cancellation; the peers saw PREPARE then ABORT, ``catch_up``)."""
        plan = sealed.plan
        t0 = time.perf_counter()
        try:
            decision = await self.leader.run_step(plan, sealed.payload, timeout=self.remote.timeout)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self.catch_up(plan)
            reason = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else repr(exc)
            sealed.abort_reason = f"remote handshake: {reason}"
            raise
        for hook in self._decided:
            hook(decision, time.perf_counter() - t0)
        if decision.launch:
            return
        from kvledger.wire.codec import NO_RANK

        base = self.local.world_size - 1
        rank = base + decision.rank if decision.rank != NO_RANK else self.local.world_size
        cause = WireProtocolError(decision.code, decision.detail or "aborted", remote=True)
        reason = f"rank {rank} aborted the step over the wire: code {int(decision.code)}: {decision.detail}"
        sealed.abort_reason = reason
        raise StepFailedError(plan.step, rank, [(rank, cause)], reason, plan.clear_list) from cause

    async def catch_up(self, plan: StepPlan) -> None:
        """A sealed step that never reached the wire (the caller was cancelled first):
        put it through the handshake with a deadline that is already over, so the
        peers see PREPARE then ABORT and their step numbers stay in line with the
        ledger's. Call shielded. Should a LAUNCH go out all the same, the ledger
        still records the step as aborted and its clear list is cleared again next
        step (zeroing is idempotent)."""
        leader = self.leader
        if leader.next_step != plan.step:
            return
        try:
            await leader.run_step(plan, b"", timeout=1e-9)
        except Exception as exc:  # the peers will refuse the next step: it aborts, naming them
            self._log.error("wire_catch_up_failed", step=plan.step, error=repr(exc))


def _rank(o: RankOutcome) -> int:
    return o.rank
