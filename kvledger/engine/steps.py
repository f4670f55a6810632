"""``StepRunner``: one step across the ranks, and what is recorded when it does not complete.

    run(step) ─► seal (a ledger call) ─► [remote: PREPARE/READY/LAUNCH with the peers]
              ─► the ranks' parts:
                   inline ranks (CPU planes, a plain-function graph): each rank's job in this
                   task, in rank order (no stream hop, no task switch); after a failure the
                   later ranks' jobs are cancelled before they start
                   otherwise: one StepJob per rank over its bounded stream, wait for the outcomes
                   a rank failed: cancel the others, wait for them (drain_timeout_s at most)
                   the caller cancelled: the same, shielded, then the cancellation re-raised
                   the engine closes after an error: the same, then EngineClosedError
              ─► record (shielded): StepCompleted per rank that finished, StepAborted if any did not
              ─► StepResult, or StepFailedError naming the first failed rank

Nothing is recorded before the seal: a caller cancelled while the seal waits
for the worker thread leaves the step open. After the seal every exit records
the step's outcome (see ``kvledger.engine``), through the engine's one path to
the ledger (``access.py``); a failure to record it breaks the engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NoReturn

import anyio
import anyio.lowlevel
import msgspec

from kvledger.core.errors import EngineClosedError, StepFailedError, WireProtocolError
from kvledger.core.events import StepPlan
from kvledger.executors.executor import RankExecutor, RankOutcome, RankTiming, StepInputs, StepJob, StepReplies

from .access import LedgerAccess

__all__ = ["StepResult", "StepRunner"]


class StepResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A step that completed on every rank: its clear list, per-rank timings (by rank)
    and the engine's wall time from seal to the last completion recorded."""

    step: int
    clear_list: tuple[int, ...]
    ranks: tuple[RankTiming, ...]
    wall_s: float


class StepRunner:
    """Runs the engine's steps, one at a time (the engine holds its step lock around ``run``).

    ``inline``: every local rank runs synchronously (planes on the CPU, a graph that
    is a plain function or none): its job runs in ``run``'s own task, rank after
    rank, instead of going through the rank's stream to its executor task.
    """

    def __init__(self, access: LedgerAccess, executors: Sequence[RankExecutor], senders: Sequence[Any], *,
                 inline: bool, drain_timeout_s: float, logger: Any) -> None:
        self._access = access
        self._ledger = access.ledger
        self._executors = tuple(executors)
        self._senders = list(senders)
        self.world_size = len(self._senders)
        self._all_ranks = tuple(range(self.world_size))
        self._inline = inline
        self._drain_timeout_s = drain_timeout_s
        self._log = logger
        self._scope: anyio.CancelScope | None = None  # the running step's, while it may wait
        self._aborting = False  # the engine is closing after an error: abort what is in flight
        self._replies: StepReplies | None = None  # the dispatched step's, while it waits for answers
        self._gone: set[int] = set()  # ranks whose executor task ended
        self._sink: StepReplies | None = None  # where inline jobs answer (run_job also returns the outcome)
        self._new_scope: Any = anyio.CancelScope
        self.leader: Any = None  # the wire leader, while remote ranks are attached
        self.remote: Any = None  # their RemoteRanks
        self.steps_completed = self.steps_aborted = self.pages_cleared = 0

    def close(self) -> None:
        """No more plans: the executors stop after their current one."""
        for s in self._senders:
            s.close()

    def abort_in_flight(self) -> None:
        """The engine closes after an error: cancel the step in flight (it is recorded as
        aborted, its caller gets ``EngineClosedError``), and any step sealed from now on."""
        self._aborting = True
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, step: int, per_rank: list[StepInputs], payload: bytes = b"") -> StepResult:
        """Seal ``step``, run it on every rank, record the outcome: a ``StepResult``, or
        ``StepFailedError`` / ``EngineClosedError`` once the abort is recorded."""
        t0 = time.perf_counter()
        plan = await self._seal(step)
        if self._aborting:  # sealed while the engine began closing after an error
            await self._settle(step, (), "engine closed")
            raise EngineClosedError(f"the engine closed before step {step} ran; it was recorded as aborted")
        if self._inline and self.leader is None:
            outcomes = await self._run_inline(plan, per_rank)
        else:
            outcomes = await self._run_waiting(plan, per_rank, payload)
        if len(outcomes) == self.world_size:
            for o in outcomes:
                if o.status != "ok":
                    break
            else:
                return await self._complete(plan, outcomes, t0)
        ok_ranks = tuple(sorted(o.rank for o in outcomes if o.status == "ok"))
        await self._fail(plan, outcomes, ok_ranks)

    async def _complete(self, plan: StepPlan, outcomes: list[RankOutcome], t0: float) -> StepResult:
        """Every rank completed: record it, and the ``StepResult``."""
        await self._settle(plan.step, self._all_ranks, None)
        self.pages_cleared += len(plan.clear_list)
        timings: list[Any] = [o.timing for o in outcomes]
        if not self._inline:
            timings.sort(key=_by_rank)
        return StepResult(step=plan.step, clear_list=plan.clear_list, ranks=tuple(timings),
                          wall_s=time.perf_counter() - t0)

    async def _seal(self, step: int) -> StepPlan:
        access = self._access
        if access.direct:
            return self._ledger.seal_step(step)
        box: list = []
        try:
            return await access.call(self._seal_into, step, box)
        except BaseException:
            if box:  # sealed in the worker thread, but our caller was cancelled meanwhile
                if self.leader is not None:
                    with anyio.CancelScope(shield=True):
                        await self._wire_catch_up(box[0])
                await self._settle(step, (), "cancelled before dispatch")
            raise  # not sealed (StepOrderError, closed, or cancelled before the seal): nothing recorded

    def _seal_into(self, step: int, box: list) -> StepPlan:
        plan = self._ledger.seal_step(step)
        box.append(plan)
        return plan

    async def _run_waiting(self, plan: StepPlan, per_rank: list[StepInputs], payload: bytes) -> list[RankOutcome]:
        """The handshake with the peers and the ranks' parts, in a scope the engine's close
        may cancel (the step is then recorded as aborted and this raises ``EngineClosedError``)."""
        with anyio.CancelScope() as scope:
            self._scope = scope
            try:
                if self.leader is not None:
                    await self._remote_handshake(plan, payload)
                if self._inline:
                    return await self._run_inline(plan, per_rank)
                return await self._dispatch(plan, per_rank)
            finally:
                self._scope = None
        await anyio.lowlevel.checkpoint_if_cancelled()  # our caller's own cancellation comes first
        raise EngineClosedError(f"the engine closed while step {plan.step} ran; it was recorded as aborted")

    async def _run_inline(self, plan: StepPlan, per_rank: list[StepInputs]) -> list[RankOutcome]:
        """Every rank's job here, in rank order, through its executor's ``run_job`` (the same
        copies -> clears -> graph, counters and outcomes). After a rank failed, the later
        ranks' jobs are cancelled before they start (they answer "cancelled", run nothing)."""
        sink, new_scope = self._sink, self._new_scope
        if sink is None:
            sink = self._sink = StepReplies(0)
            sink.close()  # the outcomes come back from run_job
            # anyio.CancelScope() looks the backend up on every call; its class, once, is the same scope
            new_scope = self._new_scope = type(anyio.CancelScope())
        outcomes: list[RankOutcome] = []
        stop = False
        try:
            for rank, ex in enumerate(self._executors):
                scope = new_scope()
                if stop:
                    scope.cancel()
                outcome = await ex.run_job(StepJob(plan, per_rank[rank], scope, sink))
                outcomes.append(outcome)
                if outcome.status != "ok":
                    stop = True
        except BaseException as exc:  # only a graph that awaited can be interrupted
            with anyio.CancelScope(shield=True):
                ok = tuple(o.rank for o in outcomes if o.status == "ok")
                await self._settle(plan.step, ok, self._reason(exc))
            raise
        return outcomes

    def _reason(self, exc: BaseException) -> str:
        if not isinstance(exc, anyio.get_cancelled_exc_class()):
            return repr(exc)
        return "engine closed" if self._aborting else "cancelled"

    async def _dispatch(self, plan: StepPlan, per_rank: list[StepInputs]) -> list[RankOutcome]:
        """Hand every rank its job and collect the outcomes; on cancellation, settle and re-raise."""
        n = self.world_size
        scopes = [anyio.CancelScope() for _ in range(n)]
        replies = self._replies = StepReplies(n)
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
            await replies.event.wait()  # every rank answered, one did not complete, or one is gone
            if len(replies.outcomes) < n:
                await self._stop_the_others(scopes, replies)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._drain(scopes, replies, sent)
                ok = tuple(sorted(o.rank for o in replies.outcomes if o.status == "ok"))
                await self._settle(plan.step, ok, self._reason(exc))
            raise
        finally:
            self._replies = None
        replies.close()
        return replies.outcomes

    async def _stop_the_others(self, scopes: list[anyio.CancelScope], replies: StepReplies) -> None:
        """A rank failed: stop the others and wait for their answers, but not for ever (a rank
        stuck where cancellation cannot reach, e.g. a worker thread waiting on a collective
        the failed rank never joins)."""
        for scope in scopes:
            scope.cancel()
        await self._wait_answers(replies, self.world_size)

    async def _drain(self, scopes: list[anyio.CancelScope], replies: StepReplies, sent: int) -> None:
        """The caller gave up (call shielded): stop every rank, wait for the ones that got a job."""
        for scope in scopes:
            scope.cancel()
        replies.expected = sent
        await self._wait_answers(replies, sent)
        replies.close()

    async def _wait_answers(self, replies: StepReplies, sent: int) -> None:
        """Wait until ranks ``0 .. sent - 1`` answered, or their executor task ended without
        answering (cancelled with the job still in its stream: no answer will come), for
        ``drain_timeout_s`` at most."""
        with anyio.move_on_after(self._drain_timeout_s):
            while len(replies.outcomes) < sent:
                answered = {o.rank for o in replies.outcomes}
                if all(r in answered or r in self._gone for r in range(sent)):
                    return
                replies.rearm()
                await replies.event.wait()

    def rank_gone(self, rank: int) -> None:
        """Rank ``rank``'s executor task ended: it answers nothing more (wakes a waiting step)."""
        self._gone.add(rank)
        if self._replies is not None:
            self._replies.event.set()

    async def _fail(self, plan: StepPlan, outcomes: list[RankOutcome], ok_ranks: tuple[int, ...]) -> NoReturn:
        """Record a step some rank did not complete, and raise ``StepFailedError`` naming it."""
        step = plan.step
        failures = [(o.rank, o.error) for o in outcomes if o.status == "failed" and o.error is not None]
        if failures:
            first_rank, first = failures[0]
            reason = f"rank {first_rank} failed: {type(first).__name__}: {first}"
        else:  # a rank answered "cancelled" unasked, or its executor task ended without answering
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
        """Record a sealed step's outcome through the engine's one path to the ledger, shielded
        from cancellation (in place when the ledger cannot block). A failure here breaks the engine."""
        try:
            await self._access.record(self._record, step, ok_ranks, reason)
        except BaseException as exc:
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
