"""Per-rank executors: run each step plan on the rank's model stream, in order.

    engine ──(bounded stream of jobs)──► RankExecutor.serve  (one task per rank)
                                             │ for each job, on the model stream:
                                             │   1. input copies   dst.copy_(src, non_blocking=True)
                                             │   2. clears         backend.clear(plan.clear_list)
                                             │   3. step graph     graph(ctx, step, inputs)
                                             │   4. completion     CUDA: an event, polled / awaited
                                             │                     in a worker thread; CPU: done
    engine ◄──(job.reply: RankOutcome)───────┘

An executor never lets a job's failure escape its task: an exception from a copy,
the clear or the graph becomes a failed ``RankOutcome`` (the engine turns it into
``StepFailedError`` naming the rank) and the executor goes on serving. A job is
cancelled through its own cancel scope (the engine cancels it when another rank
failed or the caller gave up on the step); a job cancelled before it started runs
nothing. Cancellation of the executor's own task is re-raised after a cancelled
outcome is sent.

This module imports torch only when a rank has CUDA planes (lazily, at construction).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from ..core import checks
from ..core.errors import ConfigurationError, InvalidArgumentError
from ..core.events import StepPlan

__all__ = [
    "RankContext",
    "RankExecutor",
    "RankOutcome",
    "RankTiming",
    "StepInputs",
    "StepJob",
    "StepReplies",
]

# Completion of CUDA work: poll the event on the loop for a short while, then wait
# for it in a worker thread (never synchronize on the event-loop thread).
_SPIN_S = 200e-6


@dataclasses.dataclass(frozen=True, slots=True)
class StepInputs:
    """What one rank gets for one step.

    ``copies``: ``(src, dst)`` tensor pairs, run as ``dst.copy_(src, non_blocking=True)``
    on the model stream before the clears (host -> device staging, usually).
    ``data``: anything; handed to the graph untouched.

    Raises ``InvalidArgumentError`` when ``copies`` is not a sequence of pairs.
    """

    copies: Sequence[tuple[Any, Any]] = ()
    data: Any = None

    def __post_init__(self) -> None:
        copies = self.copies
        try:
            pairs = tuple(tuple(c) for c in copies)
        except TypeError:
            raise InvalidArgumentError(f"copies must be a sequence of (src, dst) pairs, got {copies!r}") from None
        for c in pairs:
            if len(c) != 2:
                raise InvalidArgumentError(f"each copy is a (src, dst) pair, got {len(c)} items")
        object.__setattr__(self, "copies", pairs)


NO_INPUTS = StepInputs()


@dataclasses.dataclass(frozen=True, slots=True)
class RankContext:
    """What a step graph is told about its rank: ``graph(ctx, step, inputs)``.

    ``stream`` is the model stream (``None`` on the CPU); an async graph that launches
    CUDA work after an ``await`` must do so under ``torch.cuda.stream(ctx.stream)``.
    """

    rank: int
    world_size: int
    device: Any
    stream: Any
    planes: tuple[Any, ...]
    backend: Any


class RankTiming(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where one rank spent one step, in seconds.

    ``copies_s``/``clear_s``/``graph_s``: the three phases (CUDA event time on the
    model stream for CUDA ranks; host time on the CPU, where the work is synchronous).
    ``total_s``: host time from the executor taking the plan to seeing it complete.
    """

    rank: int
    copies_s: float
    clear_s: float
    graph_s: float
    total_s: float


class RankOutcome(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A rank's answer to one job: ``status`` is ``"ok"``, ``"failed"`` or ``"cancelled"``."""

    rank: int
    step: int
    status: str
    timing: RankTiming | None = None
    error: BaseException | None = None


class StepReplies:
    """Where the ranks answer one step: each rank's ``RankOutcome`` is appended;
    ``event`` is set once every rank answered or any rank did not complete.
    ``close()`` makes later answers vanish (the engine gave up on the step)."""

    __slots__ = ("outcomes", "expected", "event", "closed")

    def __init__(self, expected: int) -> None:
        self.outcomes: list[RankOutcome] = []
        self.expected = expected
        self.event = anyio.Event()
        self.closed = False

    def send_nowait(self, outcome: RankOutcome) -> None:
        if self.closed:
            return
        self.outcomes.append(outcome)
        if outcome.status != "ok" or len(self.outcomes) >= self.expected:
            self.event.set()

    def rearm(self) -> None:
        """A fresh event for waiting on the remaining answers (after a failure woke us)."""
        self.event = anyio.Event()
        if len(self.outcomes) >= self.expected:
            self.event.set()

    def close(self) -> None:
        self.closed = True


class StepJob:
    """One plan for one rank. ``scope`` cancels this rank's part of the step only;
    ``reply`` (a ``StepReplies``) receives exactly one ``RankOutcome``, never blocking."""

    __slots__ = ("plan", "inputs", "scope", "reply")

    def __init__(self, plan: StepPlan, inputs: StepInputs, scope: anyio.CancelScope, reply: StepReplies) -> None:
        self.plan = plan
        self.inputs = inputs
        self.scope = scope
        self.reply = reply


class RankExecutor:
    """Runs step plans for one rank: input copies -> clears -> graph, on the model stream.

    ``backend``: a ``ClearBackend`` over the rank's planes, or ``None`` for a rank with no
    cache planes (the clear list is still validated against ``num_pages``).
    ``graph``: ``graph(ctx, step, inputs)``, sync or async, or ``None``.
    ``device``/``stream``: where the work runs; for a CUDA device and no stream, the
    device's current stream at construction is the model stream.

    Raises ``ConfigurationError`` for a negative rank or a rank outside ``world_size``.
    """

    def __init__(
        self,
        rank: int,
        *,
        num_pages: int,
        backend: Any = None,
        graph: Callable[..., Any] | None = None,
        planes: Sequence[Any] = (),
        device: Any = None,
        stream: Any = None,
        world_size: int = 1,
    ) -> None:
        if type(rank) is not int or not 0 <= rank < world_size:
            raise ConfigurationError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if graph is not None and not callable(graph):
            raise ConfigurationError(f"graph must be callable, got {graph!r}")
        self.rank = rank
        self.num_pages = num_pages
        self.backend = backend
        self.graph = graph
        self._torch: Any = None  # the torch module, for CUDA ranks
        self._cuda = device is not None and getattr(device, "type", None) == "cuda"
        if self._cuda:
            import torch

            self._torch = torch
            if stream is None:
                stream = torch.cuda.current_stream(device)
        self.context = RankContext(
            rank=rank, world_size=world_size, device=device, stream=stream, planes=tuple(planes), backend=backend
        )
        self._ok = self._failed = self._cancelled = self._pages = 0

    def statistics(self) -> dict[str, int]:
        """Plans run to completion, failed, cancelled; pages this rank zeroed."""
        return {
            "plans_completed": self._ok,
            "plans_failed": self._failed,
            "plans_cancelled": self._cancelled,
            "pages_cleared": self._pages,
        }

    async def serve(
        self, jobs: MemoryObjectReceiveStream[StepJob], *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Consume jobs until ``jobs`` is closed by the sender. Start it with ``tg.start``.

        Every job gets exactly one outcome on ``job.reply``. Returns when the stream
        ends; re-raises cancellation of its own task (after answering the job in hand).
        """
        async with jobs:
            task_status.started()
            while True:
                try:
                    job = jobs.receive_nowait()
                except anyio.WouldBlock:
                    try:
                        job = await jobs.receive()
                    except anyio.EndOfStream:
                        return
                except anyio.EndOfStream:
                    return
                await self.run_job(job)

    async def run_job(self, job: StepJob) -> RankOutcome:
        """Run one job and send its outcome to ``job.reply``; also return it."""
        step = job.plan.step
        scope = job.scope
        if scope.cancel_called:
            return self._answer(job, RankOutcome(rank=self.rank, step=step, status="cancelled"))
        t0 = time.perf_counter()
        timing: RankTiming | None = None
        error: Exception | None = None
        try:
            with scope:
                try:
                    timing = await self._execute(job.plan, job.inputs, t0)
                except Exception as exc:  # a rank failure, reported, never escapes the task
                    error = exc
        except BaseException:
            # Our own task is being cancelled (or interrupted): answer, then re-raise.
            self._cancelled += 1
            self._answer(job, RankOutcome(rank=self.rank, step=step, status="cancelled"))
            raise
        if error is not None:
            self._failed += 1
            return self._answer(job, RankOutcome(rank=self.rank, step=step, status="failed", error=error))
        if timing is None:  # the job's scope was cancelled mid-way
            self._cancelled += 1
            return self._answer(job, RankOutcome(rank=self.rank, step=step, status="cancelled"))
        self._ok += 1
        self._pages += len(job.plan.clear_list)
        return self._answer(job, RankOutcome(rank=self.rank, step=step, status="ok", timing=timing))

    @staticmethod
    def _answer(job: StepJob, outcome: RankOutcome) -> RankOutcome:
        job.reply.send_nowait(outcome)  # never blocks; dropped if the engine gave up on the step
        return outcome

    # ------------------------------------------------------------------ one plan

    async def _execute(self, plan: StepPlan, inputs: StepInputs, t0: float) -> RankTiming:
        if self._cuda:
            return await self._execute_cuda(plan, inputs, t0)
        clear_list = plan.clear_list
        for src, dst in inputs.copies:
            dst.copy_(src, non_blocking=True)
        t1 = time.perf_counter()
        self._clear(clear_list)
        t2 = time.perf_counter()
        graph = self.graph
        if graph is not None:
            result = graph(self.context, plan.step, inputs)
            if inspect.isawaitable(result):
                await result
        t3 = time.perf_counter()
        return RankTiming(rank=self.rank, copies_s=t1 - t0, clear_s=t2 - t1, graph_s=t3 - t2, total_s=t3 - t0)

    def _clear(self, clear_list: Sequence[int]) -> None:
        backend = self.backend
        if backend is not None:
            if clear_list:
                backend.clear(clear_list)
        elif clear_list:
            checks.page_ids(clear_list, self.num_pages)

    async def _execute_cuda(self, plan: StepPlan, inputs: StepInputs, t0: float) -> RankTiming:
        torch = self._torch
        stream = self.context.stream
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        result = None
        with torch.cuda.stream(stream):
            marks[0].record(stream)
            for src, dst in inputs.copies:
                dst.copy_(src, non_blocking=True)
            marks[1].record(stream)
            self._clear(plan.clear_list)
            marks[2].record(stream)
            graph = self.graph
            if graph is not None:
                result = graph(self.context, plan.step, inputs)
            if not inspect.isawaitable(result):
                marks[3].record(stream)
        if inspect.isawaitable(result):
            await result
            marks[3].record(stream)
        await wait_cuda_event(marks[3])
        total = time.perf_counter() - t0
        ms = (marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2]), marks[2].elapsed_time(marks[3]))
        return RankTiming(
            rank=self.rank, copies_s=ms[0] * 1e-3, clear_s=ms[1] * 1e-3, graph_s=ms[2] * 1e-3, total_s=total
        )


async def wait_cuda_event(event: Any, spin_s: float = _SPIN_S) -> None:
    """Wait until a recorded CUDA event has completed without blocking the event loop.

    Polls ``event.query()`` between loop iterations for ``spin_s``, then waits in a
    worker thread (``event.synchronize()``). Cancellable: a cancelled wait abandons
    the worker thread, which ends on its own when the event completes.
    """
    if event.query():
        return
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        await anyio.sleep(0)
        if event.query():
            return
    await anyio.to_thread.run_sync(event.synchronize, abandon_on_cancel=True)
