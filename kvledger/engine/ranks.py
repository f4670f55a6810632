"""How a sealed step reaches the ranks: one strategy, chosen once by ``open_engine``.

    RankStrategy.run(sealed, inputs, replies) -> outcomes     every rank's RankOutcome, in replies too

    InlineRanks       every rank's job in run_step's own task, rank after rank (no task hop,
                      no stream of jobs): CPU ranks whose graph is a plain function (they
                      never yield), and a lone rank of any kind (its awaits, a CUDA event,
                      an async graph, are run_step's own). After a rank failed, the later
                      ranks answer "cancelled" and run nothing
    DispatchedRanks   one executor task per rank, fed over a bounded stream; wait for the
                      outcomes; a rank that failed stops the others (each job has its own
                      scope), waited for drain_timeout_s at most
    WireRanks         remote peers around either of them (remote_steps.py): PREPARE / READY /
                      LAUNCH before the local ranks run, the peers' COMPLETEs after

A strategy never records anything: the outcomes (``replies.outcomes``, filled as the
ranks answer) tell the runner (``steps.py``) what to record. Interrupted (the caller
cancelled, the engine closes), a strategy stops what it started, waits for it
(shielded) and re-raises; the outcomes so far are in ``replies``. ``may_yield``: whether
``run`` can wait for anything unbounded (a graph's own awaits, another task, a peer: the
runner then runs it in a scope the engine's close may cancel; a CUDA rank's wait for the
work it enqueued is bounded and does not count); ``always_yields``: whether every ``run``
waits (then ``run_step`` needs no cancellation point of its own).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream

from kvledger.core.events import StepPlan
from kvledger.executors.executor import RankExecutor, RankOutcome, StepInputs, StepJob, StepReplies

from .records import SealedStep, jobs_for

__all__ = ["DispatchedRanks", "InlineRanks", "RankStrategy", "runs_inline"]


class RankStrategy(Protocol):
    """How a step reaches the ranks (module docstring)."""

    world_size: int
    may_yield: bool
    always_yields: bool

    async def start(self, tg: TaskGroup) -> None:
        """Start what serves the ranks (executor tasks) in ``tg``; returns once they serve."""

    def stop(self) -> None:
        """No more steps: what serves the ranks ends after its current plan."""

    async def run(self, sealed: SealedStep, inputs: Sequence[StepInputs], replies: StepReplies
                  ) -> list[RankOutcome]:
        """Run ``sealed`` on every rank; their outcomes, as ``replies.outcomes``."""
        ...

    async def abandoned(self, plan: StepPlan) -> None:
        """A sealed step that will never run (its caller was cancelled first); call shielded."""


def runs_inline(ex: RankExecutor) -> bool:
    """Whether a rank's job runs to its end without awaiting: CPU (or no) planes and a graph
    that is a plain function (or none)."""
    return not ex.cuda and not awaits_in_graph(ex)


def awaits_in_graph(ex: RankExecutor) -> bool:
    """Whether a rank's graph is a coroutine function (an object: its class's ``__call__``):
    it may await anything, for as long as it likes."""
    graph = ex.graph
    if graph is None:
        return False
    call = graph if inspect.isroutine(graph) else type(graph).__call__  # an object: its class's __call__
    return inspect.iscoroutinefunction(graph) or inspect.iscoroutinefunction(call)


class InlineRanks:
    """Every rank's job in the caller's task, rank after rank (module docstring). ``may_yield``
    only with a graph that awaits: a CUDA rank's wait for its device work is bounded by that
    work, and its caller's own cancellation reaches it there; the engine's close then waits
    for it rather than paying a cancel scope per step (about 4 us)."""

    def __init__(self, executors: Sequence[RankExecutor]) -> None:
        self._executors = tuple(executors)
        self.world_size = len(self._executors)
        self.may_yield = any(map(awaits_in_graph, self._executors))
        # CUDA ranks wait for their device work, always with a turn of the loop (wait_cuda_event),
        # failed or not; a CPU rank's graph may return without awaiting
        self.always_yields = all(ex.cuda for ex in self._executors)

    async def start(self, tg: TaskGroup) -> None:
        return None

    def stop(self) -> None:
        return None

    async def abandoned(self, plan: StepPlan) -> None:
        return None

    async def run(self, sealed: SealedStep, inputs: Sequence[StepInputs], replies: StepReplies
                  ) -> list[RankOutcome]:
        if self.world_size == 1:  # (jobs_for, inlined for the usual case)
            await self._executors[0].run_job(StepJob(sealed.plan, inputs[0], None, replies, poison=sealed.poison,
                                                     committed=sealed.committed, checked=True))
            return replies.outcomes
        jobs = jobs_for(sealed, inputs, replies)
        for ex, job in zip(self._executors, jobs, strict=True):
            outcome = await ex.run_job(job)
            if outcome.status != "ok":  # the later ranks run nothing
                for later, skipped in zip(self._executors[ex.rank + 1:], jobs[ex.rank + 1:], strict=True):
                    later.skip(skipped)
                break
        return replies.outcomes


class DispatchedRanks:
    """One executor task per rank, fed over a bounded stream (module docstring)."""

    may_yield = always_yields = True

    def __init__(self, executors: Sequence[RankExecutor], *, queue_size: int, drain_timeout_s: float) -> None:
        self._executors = tuple(executors)
        self.world_size = len(self._executors)
        pairs = [anyio.create_memory_object_stream[StepJob](queue_size) for _ in self._executors]
        self._senders: list[MemoryObjectSendStream[StepJob]] = [s for s, _ in pairs]
        self._receivers = [r for _, r in pairs]
        self._drain_timeout_s = drain_timeout_s
        self._gone: set[int] = set()  # ranks whose executor task ended
        self._replies: StepReplies | None = None  # the step waiting for answers

    async def start(self, tg: TaskGroup) -> None:
        """Start every rank's executor task; a start that fails leaves the streams of the
        ranks not started closed."""
        started = 0
        try:
            for rank, jobs in enumerate(self._receivers):
                await tg.start(self._serve, rank, jobs)
                started += 1
        finally:
            for jobs in self._receivers[started:]:
                jobs.close()

    async def _serve(self, rank: int, jobs: Any, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Rank ``rank``'s executor task (``RankExecutor.serve``); a step waiting on it learns when it ends."""
        try:
            await self._executors[rank].serve(jobs, task_status=task_status)
        finally:
            self._gone.add(rank)
            if self._replies is not None:
                self._replies.wake()

    def stop(self) -> None:
        for s in self._senders:
            s.close()

    async def abandoned(self, plan: StepPlan) -> None:
        return None

    async def run(self, sealed: SealedStep, inputs: Sequence[StepInputs], replies: StepReplies
                  ) -> list[RankOutcome]:
        n = self.world_size
        scopes = [anyio.CancelScope() for _ in range(n)]
        self._replies = replies
        sent = 0
        try:
            for sender, job in zip(self._senders, jobs_for(sealed, inputs, replies, scopes), strict=True):
                try:
                    sender.send_nowait(job)
                except anyio.WouldBlock:
                    await sender.send(job)  # the rank is still busy: backpressure
                sent += 1
            await replies.wait()  # every rank answered, one did not complete, or one is gone
            if len(replies.outcomes) < n:  # a rank failed: stop the others, wait for their answers
                for scope in scopes:
                    scope.cancel()
                await self._wait_answers(replies, n)
        except BaseException:
            with anyio.CancelScope(shield=True):  # the caller gave up: stop every rank, wait for those sent a job
                for scope in scopes:
                    scope.cancel()
                replies.expected = sent
                await self._wait_answers(replies, sent)
                replies.close()
            raise
        finally:
            self._replies = None
        replies.close()
        return replies.outcomes

    async def _wait_answers(self, replies: StepReplies, sent: int) -> None:
        """Wait until ranks ``0 .. sent - 1`` answered, or their executor task ended without
        answering (cancelled with the job still in its stream: no answer will come), for
        ``drain_timeout_s`` at most (a rank stuck where cancellation cannot reach, e.g. a
        worker thread waiting on a collective the failed rank never joins)."""
        with anyio.move_on_after(self._drain_timeout_s):
            while len(replies.outcomes) < sent:
                answered = {o.rank for o in replies.outcomes}
                if all(r in answered or r in self._gone for r in range(sent)):
                    return
                replies.rearm()
                await replies.wait()
