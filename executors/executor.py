"""Per-rank executors: run each step plan on the rank's model stream, in order.

    engine ──(bounded stream of jobs)──► RankExecutor.serve  (one task per rank)
                                             │ for each job, on the model stream:
                                             │   1. input copies   dst.copy_(src, non_blocking=True)
                                             │                     (CUDA: a driver copy where it can:
                                             │                     ``cuda_rank.CudaRank.copy_all``)
                                             │   2. clears         backend.clear_checked(plan.clear_list)
                                             │   3. step graph     graph(ctx, step, inputs)
                                             │   4. completion     CUDA: an event, polled / awaited
                                             │                     in a worker thread; CPU: done
    engine ◄──(job.reply: RankOutcome)───────┘

With ``sanitize=True`` (a debug mode, SPEC "The sanitizer") each plan runs
input copies -> poison(job.poison) -> clears -> check(clear_list, job.committed)
-> the graph, and the graph runs only when the device check found nothing; a
violation fails the job with ``InvariantViolation`` (invariant 2, on the device)
and the outcome's ``violations`` name each (plane, page, kind). With it off the
job's poison and committed lists are never looked at.

An executor never lets a job's failure escape its task: an exception from a copy,
the clear or the graph becomes a failed ``RankOutcome`` (the engine turns it into
``StepFailedError`` naming the rank) and the executor goes on serving. A job is
cancelled through its own cancel scope (the engine cancels it when another rank
failed or the caller gave up on the step); a job cancelled before it started runs
nothing. Cancellation of the executor's own task is re-raised after a cancelled
outcome is sent.

A lone rank (or CPU ranks with plain-function graphs) is not served by a task: the
engine awaits ``run_job`` in ``run_step``'s own task (``kvledger.engine.ranks.InlineRanks``).
The job's types (``StepInputs``, ``StepJob``, ``RankOutcome``, ...) live in ``jobs.py``
and are exported here too. This module imports torch only when a rank has CUDA planes
(lazily, at construction).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from ..core import checks
from ..core.errors import ConfigurationError, InvariantViolation
from .backend import ClearBackend, as_clear_backend
from .cuda_rank import CudaRank
from .jobs import NO_INPUTS, RankContext, RankOutcome, RankTiming, StepInputs, StepJob, StepReplies
from .sanitize import Violation

__all__ = [
    "NO_INPUTS",
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
_BUSY_S = 20e-6  # of which the first, polled without a turn of the loop in between


class RankExecutor:
    """Runs step plans for one rank: input copies -> clears -> graph, on the model stream.

    ``backend``: a ``ClearBackend`` over the rank's planes (an object with only ``clear``
    is wrapped: ``as_clear_backend``), or ``None`` for a rank with no cache planes (the
    clear list is still validated against ``num_pages``).
    ``graph``: ``graph(ctx, step, inputs)``, sync or async, or ``None``.
    ``device``/``stream``: where the work runs; for a CUDA device and no stream, the
    device's current stream at construction is the model stream. The stream context,
    its device and the CUDA events are made once, here, never per plan.
    ``sanitize``: poison, clear, check, then the graph (module docstring); the
    backend must be able to (``can_sanitize``: every kvledger backend is).
    ``timings``: on a CUDA rank, time the phases with CUDA events on the model stream
    (``RankTiming``'s copies_s, clear_s, graph_s, sanitize_s); off, only the completion
    event is recorded, those phases read 0.0, and ``total_s`` / ``clear_host_s`` are
    still measured on the host. CPU ranks always time their phases (on the host).

    Raises ``ConfigurationError`` for a negative rank or a rank outside ``world_size``,
    a backend with no ``clear``, and ``sanitize`` with a backend that cannot poison and check.
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
        sanitize: bool = False,
        timings: bool = True,
    ) -> None:
        if type(rank) is not int or not 0 <= rank < world_size:
            raise ConfigurationError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if graph is not None and not callable(graph):
            raise ConfigurationError(f"graph must be callable, got {graph!r}")
        clearer = as_clear_backend(backend, num_pages) if backend is not None else None
        if sanitize and clearer is not None and not clearer.can_sanitize:
            raise ConfigurationError(f"sanitize=True needs a backend with poison and start_verify, got {backend!r}")
        self.rank = rank
        self.num_pages = num_pages
        self.backend: ClearBackend | None = clearer
        self.graph = graph
        self.sanitize = bool(sanitize) and clearer is not None
        self.timings = bool(timings)
        self._cuda: CudaRank | None = None
        if device is not None and getattr(device, "type", None) == "cuda":
            self._cuda = CudaRank(device, stream, sanitize=self.sanitize, timings=self.timings)
            stream = self._cuda.stream
        self.context = RankContext(
            rank=rank, world_size=world_size, device=device, stream=stream, planes=tuple(planes), backend=clearer
        )
        self._ok = self._failed = self._cancelled = self._pages = self._violations = 0

    @property
    def cuda(self) -> bool:
        """Whether the rank's work runs on a CUDA stream (its completion is awaited)."""
        return self._cuda is not None

    def statistics(self) -> dict[str, int]:
        """Plans run to completion, failed, cancelled; pages this rank zeroed; sanitizer violations seen."""
        return {
            "plans_completed": self._ok,
            "plans_failed": self._failed,
            "plans_cancelled": self._cancelled,
            "pages_cleared": self._pages,
            "sanitizer_violations": self._violations,
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
        """Run one job and send its outcome to ``job.reply``; also return it.

        A job with a scope runs under it (a cancelled scope: "cancelled", before or while
        it runs); one without runs under its caller's scopes. A cancellation of the
        caller (its task or scope) is answered "cancelled" and re-raised."""
        step = job.plan.step
        scope = job.scope
        t0 = time.perf_counter()
        ran: tuple[RankTiming, tuple[Violation, ...]] | None = None
        error: Exception | None = None
        try:
            if scope is None:
                try:
                    cu = self._cuda
                    ran = await (self._execute(job, t0) if cu is None else self._execute_cuda(cu, job, t0))
                except Exception as exc:  # a rank failure, reported, never escapes the task
                    error = exc
            else:
                if scope.cancel_called:
                    self._cancelled += 1
                    return self._answer(job, RankOutcome(rank=self.rank, step=step, status="cancelled"))
                with scope:
                    try:
                        cu = self._cuda
                        ran = await (self._execute(job, t0) if cu is None else self._execute_cuda(cu, job, t0))
                    except Exception as exc:  # a rank failure, reported, never escapes the task
                        error = exc
        except BaseException:
            # The caller (or our own task) is being cancelled or interrupted: answer, then re-raise.
            self._cancelled += 1
            self._answer(job, RankOutcome(rank=self.rank, step=step, status="cancelled"))
            raise
        if error is not None:
            self._failed += 1
            return self._answer(job, RankOutcome(rank=self.rank, step=step, status="failed", error=error))
        if ran is None:  # the job's scope was cancelled mid-way
            self._cancelled += 1
            return self._answer(job, RankOutcome(rank=self.rank, step=step, status="cancelled"))
        timing, found = ran
        if found:
            self._failed += 1
            self._violations += len(found)
            return self._answer(job, RankOutcome(rank=self.rank, step=step, status="failed", timing=timing,
                                                 error=_violation_error(self.rank, step, found), violations=found))
        self._ok += 1
        self._pages += len(job.plan.clear_list)
        outcome = RankOutcome(rank=self.rank, step=step, status="ok", timing=timing)
        job.reply.send_nowait(outcome)  # (_answer, inlined on the usual path)
        return outcome

    def skip(self, job: StepJob) -> RankOutcome:
        """Answer a job that will not run (another rank of its step failed first): "cancelled"."""
        self._cancelled += 1
        return self._answer(job, RankOutcome(rank=self.rank, step=job.plan.step, status="cancelled"))

    @staticmethod
    def _answer(job: StepJob, outcome: RankOutcome) -> RankOutcome:
        job.reply.send_nowait(outcome)  # never blocks; dropped if the engine gave up on the step
        return outcome

    # ------------------------------------------------------------------ one plan

    async def _execute(self, job: StepJob, t0: float) -> tuple[RankTiming, tuple[Violation, ...]]:
        """The plan on the host (CPU planes, or none): copies, [poison], clear, [check], graph."""
        plan, inputs = job.plan, job.inputs
        for src, dst in inputs.copies:
            dst.copy_(src, non_blocking=True)
        perf = time.perf_counter
        t1 = perf()
        backend = self.backend
        if self.sanitize and backend is not None:
            return await self._execute_sanitized(backend, job, t0, t1)
        clear_list = plan.clear_list
        if clear_list:
            self._clear(clear_list, job.checked)
            t3 = perf()
        else:
            t3 = t1
        graph = self.graph
        if graph is not None:
            result = graph(self.context, plan.step, inputs)
            if result is not None and inspect.isawaitable(result):
                await result
            t5 = perf()
        else:
            t5 = t3
        return RankTiming(rank=self.rank, copies_s=t1 - t0, clear_s=t3 - t1, graph_s=t5 - t3, total_s=t5 - t0,
                          clear_host_s=t3 - t1), ()

    async def _execute_sanitized(self, backend: ClearBackend, job: StepJob, t0: float, t1: float
                                 ) -> tuple[RankTiming, tuple[Violation, ...]]:
        """``_execute`` in sanitize mode: poison, clear, check, then the graph if the check found nothing."""
        plan, inputs = job.plan, job.inputs
        backend.poison(job.poison)
        t2 = time.perf_counter()
        self._clear(plan.clear_list, job.checked)
        t3 = time.perf_counter()
        found = backend.start_verify(plan.clear_list, job.committed).result()
        t4 = time.perf_counter()
        graph = self.graph
        if graph is not None and not found:
            result = graph(self.context, plan.step, inputs)
            if result is not None and inspect.isawaitable(result):
                await result
        t5 = time.perf_counter()
        return RankTiming(rank=self.rank, copies_s=t1 - t0, clear_s=t3 - t2, graph_s=t5 - t4, total_s=t5 - t0,
                          clear_host_s=t3 - t2, sanitize_s=(t2 - t1) + (t4 - t3)), found

    def _clear(self, clear_list: Sequence[int], checked: bool = False) -> None:
        backend = self.backend
        if not clear_list:
            return
        if backend is None:
            checks.page_ids(clear_list, self.num_pages)
        elif checked:
            backend.clear_checked(clear_list)  # type: ignore[arg-type]  # (checked: a sealed plan's tuple)
        else:
            backend.clear(clear_list)

    async def _execute_cuda(self, cu: CudaRank, job: StepJob, t0: float) -> tuple[RankTiming, tuple[Violation, ...]]:
        """The plan on the model stream: one stream switch around everything enqueued before
        the wait (``CudaRank.switch``, about 1 us); copies by the driver where they can be
        (``CudaRank.copy_all``); events only where asked for (``timings``) or needed
        (completion, the check). The usual step (no timings, no sanitizer) takes a path of
        its own, inline: about a microsecond less of host work on the H100 host."""
        plan, inputs = job.plan, job.inputs
        backend = self.backend
        sanitize = self.sanitize and backend is not None
        marks = cu.marks
        stream = cu.stream
        graph = self.graph
        if marks is None and not sanitize:  # the usual step: copies, clear, graph, one event
            try:
                with cu.switch:
                    if inputs.copies:
                        cu.copy_all(inputs.copies)
                    clear_list = plan.clear_list
                    if clear_list:
                        h0 = time.perf_counter()
                        if backend is None:
                            checks.page_ids(clear_list, self.num_pages)
                        elif job.checked:
                            backend.clear_checked(clear_list)  # (a sealed plan's tuple)
                        else:
                            backend.clear(clear_list)
                        clear_host = time.perf_counter() - h0
                    else:
                        clear_host = 0.0
                    result = graph(self.context, plan.step, inputs) if graph is not None else None
            except Exception:
                await anyio.lowlevel.cancel_shielded_checkpoint()  # (the step yields, failed or not)
                raise
            if result is not None and inspect.isawaitable(result):
                await result
            cu.done.record(stream)
            await wait_cuda_event(cu.done)
            return RankTiming(rank=self.rank, copies_s=0.0, clear_s=0.0, graph_s=0.0,
                              total_s=time.perf_counter() - t0, clear_host_s=clear_host), ()
        try:
            result, check, clear_host = self._enqueue_cuda(cu, job, sanitize)
        except Exception:
            await anyio.lowlevel.cancel_shielded_checkpoint()  # (the step yields, failed or not: wait_cuda_event)
            raise
        found: tuple[Violation, ...] = ()
        if check is not None:
            await wait_cuda_event(check)  # the graph runs only on pages the check passed
            found = check.result()
            if graph is not None and not found:
                with cu.switch:
                    result = graph(self.context, plan.step, inputs)
        if result is not None and inspect.isawaitable(result):
            await result
        cu.done.record(stream)
        await wait_cuda_event(cu.done)
        total = time.perf_counter() - t0
        if marks is None:
            return RankTiming(rank=self.rank, copies_s=0.0, clear_s=0.0, graph_s=0.0, total_s=total,
                              clear_host_s=clear_host), found
        copies_s, clear_s, graph_s, sanitize_s = cu.phases(sanitize)
        return RankTiming(rank=self.rank, copies_s=copies_s, clear_s=clear_s, graph_s=graph_s, total_s=total,
                          clear_host_s=clear_host, sanitize_s=sanitize_s), found

    def _enqueue_cuda(self, cu: CudaRank, job: StepJob, sanitize: bool) -> tuple[Any, Any, float]:
        """Everything of the plan that is enqueued before the first wait, under one stream switch:
        ``(the graph's result, the pending check (sanitize mode), the clear's host time)``."""
        plan, inputs = job.plan, job.inputs
        backend = self.backend
        marks = cu.marks
        stream = cu.stream
        check = result = None
        with cu.switch:
            if marks is not None:
                marks[0].record(stream)
            if inputs.copies:
                cu.copy_all(inputs.copies)
            if marks is not None:
                marks[1].record(stream)
            if sanitize:
                backend.poison(job.poison)  # type: ignore[union-attr]
                if marks is not None:
                    marks[2].record(stream)
            h0 = time.perf_counter()
            self._clear(plan.clear_list, job.checked)
            clear_host = time.perf_counter() - h0
            if marks is not None:
                marks[3].record(stream)
            if sanitize:
                check = backend.start_verify(plan.clear_list, job.committed)  # type: ignore[union-attr]
                if marks is not None:
                    marks[4].record(stream)
            elif self.graph is not None:
                result = self.graph(self.context, plan.step, inputs)
        return result, check, clear_host


def _violation_error(rank: int, step: int, found: Sequence[Violation]) -> InvariantViolation:
    """The error of a job whose sanitizer check failed: invariant 2, checked on the device."""
    shown = ", ".join(f"plane {v.plane} page {v.page} {v.kind}" for v in found[:8])
    more = f" (+{len(found) - 8} more)" if len(found) > 8 else ""
    return InvariantViolation(2, f"sanitizer on rank {rank}, step {step}: {shown}{more}")


async def wait_cuda_event(event: Any, spin_s: float = _SPIN_S) -> None:
    """Wait until a recorded CUDA event has completed without blocking the event loop.

    Always gives the loop one turn first (a checkpoint: a CUDA rank's step always yields,
    so ``run_step`` needs no turn of its own for it); then polls ``event.query()`` without
    yielding for ``_BUSY_S`` (the device's few microseconds of latency, seen as they end
    rather than at the next turn of the loop), then between loop iterations until
    ``spin_s`` has passed, then waits in a worker thread (``event.synchronize()``).
    Cancellable: a cancelled wait abandons the worker thread, which ends on its own when
    the event completes.
    """
    await anyio.sleep(0)
    query = event.query
    if query():
        return
    now = time.perf_counter
    t = now()
    busy_until = t + _BUSY_S
    while now() < busy_until:
        if query():
            return
    deadline = t + spin_s
    while now() < deadline:
        await anyio.sleep(0)
        if query():
            return
    await anyio.to_thread.run_sync(event.synchronize, abandon_on_cancel=True)
