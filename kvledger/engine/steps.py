"""``StepRunner``: one step across the ranks, and what is recorded when it does not complete.

    run(step) ─► seal (a ledger call) ─► [remote: PREPARE/READY/LAUNCH with the peers]
              ─► dispatch: one StepJob per rank (bounded streams) ─► wait for the outcomes
                   a rank failed: cancel the others, wait for them (drain_timeout_s at most)
                   the caller cancelled: the same, shielded, then the cancellation re-raised
              ─► record (shielded): StepCompleted per rank that finished, StepAborted if any did not
              ─► StepResult, or StepFailedError naming the first failed rank

Nothing is recorded before the seal: a caller cancelled while the seal waits
for the worker thread leaves the step open. After the seal every exit records
the step's outcome (see ``kvledger.engine``); a failure to record it breaks the
engine (``on_broken``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import anyio
import msgspec

from kvledger.core.errors import StepFailedError, WireProtocolError
from kvledger.core.events import StepPlan
from kvledger.core.ledger import Ledger
from kvledger.executors.executor import RankOutcome, RankTiming, StepInputs, StepJob, StepReplies

__all__ = ["StepResult", "StepRunner"]


class StepResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A step that completed on every rank: its clear list, per-rank timings (by rank)
    and the engine's wall time from seal to the last completion recorded."""

    step: int
    clear_list: tuple[int, ...]
    ranks: tuple[RankTiming, ...]
    wall_s: float


class StepRunner:
    """Runs the engine's steps, one at a time (the engine holds its step lock around ``run``)."""

    def __init__(self, ledger: Ledger, senders: Sequence[Any], *, call: Callable, threaded: bool,
                 limiter: Any, drain_timeout_s: float, logger: Any,
                 on_broken: Callable[[BaseException], None]) -> None:
        self._ledger = ledger
        self._senders = list(senders)
        self.world_size = len(self._senders)
        self._call = call
        self._threaded = threaded
        self._limiter = limiter
        self._drain_timeout_s = drain_timeout_s
        self._log = logger
        self._on_broken = on_broken
        self.leader: Any = None  # the wire leader, while remote ranks are attached
        self.remote: Any = None  # their RemoteRanks
        self.steps_completed = self.steps_aborted = self.pages_cleared = 0

    def close(self) -> None:
        """No more plans: the executors stop after their current one."""
        for s in self._senders:
            s.close()

    async def run(self, step: int, per_rank: list[StepInputs], payload: bytes = b"") -> StepResult:
        """Seal ``step``, run it on every rank, record the outcome: a ``StepResult`` or ``StepFailedError``."""
        t0 = time.perf_counter()
        plan = await self._seal(step)
        if self.leader is not None:
            await self._remote_handshake(plan, payload)
        outcomes = await self._dispatch(plan, per_rank)
        ok_ranks = tuple(sorted(o.rank for o in outcomes if o.status == "ok"))
        if len(ok_ranks) == self.world_size:
            await self._settle(step, ok_ranks, None)
            self.pages_cleared += len(plan.clear_list)
            timings = sorted((o.timing for o in outcomes), key=_by_rank)
            return StepResult(step=step, clear_list=plan.clear_list, ranks=tuple(timings),
                              wall_s=time.perf_counter() - t0)
        await self._fail(plan, outcomes, ok_ranks)

    async def _seal(self, step: int) -> StepPlan:
        box: list = []
        try:
            return await self._call(self._seal_into, step, box)
        except BaseException:
            if box:  # sealed in the worker thread, but our caller was cancelled meanwhile
                if self.leader is not None:
                    with anyio.CancelScope(shield=True):
                        await self._wire_catch_up(box[0])
                await self._settle(step, (), "cancelled before dispatch")
            raise  # not sealed (StepOrderError, or cancelled before the seal): nothing recorded

    def _seal_into(self, step: int, box: list) -> StepPlan:
        plan = self._ledger.seal_step(step)
        box.append(plan)
        return plan

    async def _dispatch(self, plan: StepPlan, per_rank: list[StepInputs]) -> list[RankOutcome]:
        """Hand every rank its job and collect the outcomes; on cancellation, settle and re-raise."""
        n = self.world_size
        scopes = [anyio.CancelScope() for _ in range(n)]
        replies = StepReplies(n)
        sent = 0
        try:
            for rank in range(n):
                job = StepJob(plan, per_rank[rank], scopes[rank], replies)
                sender = self._senders[rank]
                try:
                    sender.send_nowait(job)
                except anyio.WouldBlock:
                    await sender.send(job)  # the rank is still busy: backpressure
                sent += 1
            await replies.event.wait()
            if len(replies.outcomes) < n:
                await self._stop_the_others(scopes, replies)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._drain(scopes, replies, sent)
                ok = tuple(sorted(o.rank for o in replies.outcomes if o.status == "ok"))
                reason = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else repr(exc)
                await self._settle(plan.step, ok, reason)
            raise
        replies.close()
        return replies.outcomes

    async def _stop_the_others(self, scopes: list[anyio.CancelScope], replies: StepReplies) -> None:
        """A rank failed: stop the others and wait for their answers, but not for ever (a rank
        stuck where cancellation cannot reach, e.g. a worker thread waiting on a collective
        the failed rank never joins)."""
        for scope in scopes:
            scope.cancel()
        with anyio.move_on_after(self._drain_timeout_s):
            while len(replies.outcomes) < self.world_size:
                replies.rearm()
                await replies.event.wait()

    async def _drain(self, scopes: list[anyio.CancelScope], replies: StepReplies, sent: int) -> None:
        """The caller gave up (call shielded): stop every rank, wait for the ones that got a job."""
        for scope in scopes:
            scope.cancel()
        if len(replies.outcomes) < sent:
            replies.expected = sent
            replies.rearm()
            with anyio.move_on_after(self._drain_timeout_s):
                while len(replies.outcomes) < sent:
                    await replies.event.wait()
                    replies.rearm()
        replies.close()

    async def _fail(self, plan: StepPlan, outcomes: list[RankOutcome], ok_ranks: tuple[int, ...]) -> NoReturn:
        """Record a step some rank did not complete, and raise ``StepFailedError`` naming it."""
        step = plan.step
        failures = [(o.rank, o.error) for o in outcomes if o.status == "failed"]  # in order of report
        if failures:
            first_rank, first = failures[0]
            reason = f"rank {first_rank} failed: {type(first).__name__}: {first}"
        else:  # a rank answered "cancelled" without being asked to stop (its own task ended)
            first_rank = min(set(range(self.world_size)).difference(ok_ranks))
            reason = f"rank {first_rank} cancelled"
        await self._settle(step, ok_ranks, reason)
        err = StepFailedError(step, first_rank, failures, "" if failures else "cancelled", plan.clear_list)
        if failures:
            raise err from failures[0][1]
        raise err

    # ------------------------------------------------------------------ recording

    def _record(self, step: int, ok_ranks: tuple[int, ...], reason: str | None) -> None:
        """A failed step is aborted first, then the ranks that did run their part are recorded
        (once every reporting rank has completed a step, it can no longer be aborted)."""
        ledger = self._ledger
        if reason is not None:
            ledger.abort_step(step, reason)
        for rank in ok_ranks:
            ledger.complete_step(step, rank)

    async def _settle(self, step: int, ok_ranks: tuple[int, ...], reason: str | None) -> None:
        """Record a sealed step's outcome, shielded from cancellation (in memory it is a
        plain call: nothing to shield). A failure here breaks the engine."""
        try:
            if self._threaded:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._record, step, ok_ranks, reason, limiter=self._limiter)
            else:
                self._record(step, ok_ranks, reason)
        except BaseException as exc:
            self._on_broken(exc)
            self._log.error("step_outcome_not_recorded", step=step, error=repr(exc))
            raise
        if reason is None:
            self.steps_completed += 1
        else:
            self.steps_aborted += 1
            self._log.warning("step_aborted", step=step, reason=reason, completed_ranks=list(ok_ranks))

    # ------------------------------------------------------------------ remote ranks

    async def _remote_handshake(self, plan: StepPlan, payload: bytes) -> None:
        """PREPARE/READY with every peer; returns on LAUNCH. On anything else the step
        is recorded as aborted (no rank ran it) and this raises: ``StepFailedError``
        naming the culprit rank for an ABORT, or what interrupted it (cancellation)."""
        step = plan.step
        try:
            decision = await self.leader.run_step(plan, payload, timeout=self.remote.timeout)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._wire_catch_up(plan)
                reason = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else repr(exc)
                await self._settle(step, (), f"remote handshake: {reason}")
            raise
        if decision.launch:
            return
        from kvledger.wire.codec import NO_RANK

        base = self.world_size - 1
        rank = base + decision.rank if decision.rank != NO_RANK else self.world_size
        cause = WireProtocolError(decision.code, decision.detail or "aborted", remote=True)
        reason = f"rank {rank} aborted the step over the wire: code {int(decision.code)}: {decision.detail}"
        await self._settle(step, (), reason)
        raise StepFailedError(step, rank, [(rank, cause)], reason, plan.clear_list) from cause

    async def _wire_catch_up(self, plan: StepPlan) -> None:
        """A sealed step that never reached the wire (the caller was cancelled first):
        put it through the handshake with a deadline that is already over, so the
        peers see PREPARE then ABORT and their step numbers stay in line with the
        ledger's. Call shielded. Should a LAUNCH go out all the same, the ledger
        still records the step as aborted and its clear list is cleared again next
        step (zeroing is idempotent)."""
        leader = self.leader
        if leader is None or leader.next_step != plan.step:
            return
        try:
            await leader.run_step(plan, b"", timeout=1e-9)
        except Exception as exc:  # the peers will refuse the next step: it aborts, naming them
            self._log.error("wire_catch_up_failed", step=plan.step, error=repr(exc))


def _by_rank(t: RankTiming) -> int:
    return t.rank
