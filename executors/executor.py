"""Per-rank executors: run each step plan on the rank's model stream, in order.

    engine ──(bounded stream of jobs)──► RankExecutor.serve  (one task per rank)
                                             │ for each job, on the model stream:
                                             │   1. input copies   dst.copy_(src, non_blocking=True)
                                             │   2. clears         backend.clear(plan.clear_list)
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

This module imports torch only when a rank has CUDA planes (lazily, at construction).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from ..core import checks
from ..core.errors import ConfigurationError, InvalidArgumentError, InvariantViolation
from ..core.events import StepPlan
from .backend import ClearBackend, as_clear_backend
from .cuda_rank import CudaRank
from .sanitize import Violation

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
    model stream for CUDA ranks: ``clear_s`` is the clear's device time; host time
    on the CPU, where the work is synchronous).
    ``clear_host_s``: host time spent enqueuing the clear (the backend's ``clear``
    call, id checks included), on every device.
    ``sanitize_s``: poison + check (device time on CUDA, host time on the CPU); 0
    when the sanitizer is off.
    ``total_s``: host time from the executor taking the plan to seeing it complete.
    """

    rank: int
    copies_s: float
    clear_s: float
    graph_s: float
    total_s: float
    clear_host_s: float = 0.0
    sanitize_s: float = 0.0


class RankOutcome(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A rank's answer to one job: ``status`` is ``"ok"``, ``"failed"`` or ``"cancelled"``."""

    rank: int
    step: int
    status: str
    timing: RankTiming | None = None
    error: BaseException | None = None
    violations: tuple[Violation, ...] = ()


class StepReplies:
    """Where the ranks answer one step: each rank's ``RankOutcome`` is appended to
    ``outcomes``; ``wait()`` returns once every expected rank answered, any rank did not
    complete, or ``wake()`` was called (a rank's executor task ended). ``close()`` makes
    later answers vanish (the engine gave up on the step). The event behind ``wait`` is
    made only when someone waits (inline ranks never do)."""

    __slots__ = ("outcomes", "expected", "closed", "_woken", "_event")

    def __init__(self, expected: int) -> None:
        self.outcomes: list[RankOutcome] = []
        self.expected = expected
        self.closed = False
        self._woken = False
        self._event: anyio.Event | None = None

    def send_nowait(self, outcome: RankOutcome) -> None:
        if self.closed:
            return
        self.outcomes.append(outcome)
        if outcome.status != "ok" or len(self.outcomes) >= self.expected:
            self.wake()

    def wake(self) -> None:
        """End the current ``wait``."""
        self._woken = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Until woken (see the class docstring); a checkpoint either way."""
        if self._woken:
            await anyio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()

    def rearm(self) -> None:
        """Wait afresh for the remaining answers (after a failure woke us)."""
        self._event = None
        self._woken = len(self.outcomes) >= self.expected

    def close(self) -> None:
        self.closed = True


class StepJob:
    """One plan for one rank. ``scope`` cancels this rank's part of the step only (None: the
    job runs under its caller's scopes, as inline ranks do); ``reply`` (a ``StepReplies``)
    receives exactly one ``RankOutcome``, never blocking.

    For the sanitizer: ``poison``, the pages to fill with 0xFF before the clear, and
    ``committed``, the pages committed this step (checked for poison after it); empty
    when not given. Read only by an executor with ``sanitize=True``.
    ``checked``: the plan's clear list is a sealed ledger plan's tuple (distinct ids in
    range): the backend's ``clear_checked`` skips re-checking it. Only the engine, which
    sealed the plan, sets it (a list that is not a tuple is checked all the same).
    """

    __slots__ = ("plan", "inputs", "scope", "reply", "poison", "committed", "checked")

    def __init__(self, plan: StepPlan, inputs: StepInputs, scope: anyio.CancelScope | None, reply: StepReplies, *,
                 poison: Sequence[int] | None = None, committed: Sequence[int] | None = None,
                 checked: bool = False) -> None:
        self.plan = plan
        self.checked = checked and type(plan.clear_list) is tuple
        self.inputs = inputs
        self.scope = scope
        self.reply = reply
        self.poison: Sequence[int] = () if poison is None else poison
        self.committed: Sequence[int] = () if committed is None else committed


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
                    ran = await self._execute(job, t0)
                except Exception as exc:  # a rank failure, reported, never escapes the task
                    error = exc
            else:
                if scope.cancel_called:
                    self._cancelled += 1
                    return self._answer(job, RankOutcome(rank=self.rank, step=step, status="cancelled"))
                with scope:
                    try:
                        ran = await self._execute(job, t0)
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
        return self._answer(job, RankOutcome(rank=self.rank, step=step, status="ok", timing=timing))

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
        if self._cuda is not None:
            return await self._execute_cuda(self._cuda, job, t0)
        plan, inputs = job.plan, job.inputs
        for src, dst in inputs.copies:
            dst.copy_(src, non_blocking=True)
        t1 = t2 = time.perf_counter()
        backend = self.backend
        if self.sanitize and backend is not None:
            backend.poison(job.poison)
            t2 = time.perf_counter()
        self._clear(plan.clear_list, job.checked)
        t3 = t4 = time.perf_counter()
        found: tuple[Violation, ...] = ()
        if self.sanitize and backend is not None:
            found = backend.start_verify(plan.clear_list, job.committed).result()
            t4 = time.perf_counter()
        graph = self.graph
        if graph is not None and not found:
            result = graph(self.context, plan.step, inputs)
            if inspect.isawaitable(result):
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
        the wait; events only where asked for (``timings``) or needed (completion, the check)."""
        plan, inputs = job.plan, job.inputs
        backend = self.backend
        sanitize = self.sanitize and backend is not None
        marks = cu.marks
        stream = cu.stream
        check = None
        result: Any = None
        graph = self.graph
        with cu.on_stream:
            if marks is not None:
                marks[0].record(stream)
            for src, dst in inputs.copies:
                dst.copy_(src, non_blocking=True)
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
            elif graph is not None:
                result = graph(self.context, plan.step, inputs)
        found: tuple[Violation, ...] = ()
        if check is not None:
            await wait_cuda_event(check)  # the graph runs only on pages the check passed
            found = check.result()
            if graph is not None and not found:
                with cu.on_stream:
                    result = graph(self.context, plan.step, inputs)
        if inspect.isawaitable(result):
            await result
        cu.done.record(stream)
        await wait_cuda_event(cu.done)
        total = time.perf_counter() - t0
        copies_s, clear_s, graph_s, sanitize_s = cu.phases(sanitize)
        return RankTiming(rank=self.rank, copies_s=copies_s, clear_s=clear_s, graph_s=graph_s, total_s=total,
                          clear_host_s=clear_host, sanitize_s=sanitize_s), found


def _violation_error(rank: int, step: int, found: Sequence[Violation]) -> InvariantViolation:
    """The error of a job whose sanitizer check failed: invariant 2, checked on the device."""
    shown = ", ".join(f"plane {v.plane} page {v.page} {v.kind}" for v in found[:8])
    more = f" (+{len(found) - 8} more)" if len(found) > 8 else ""
    return InvariantViolation(2, f"sanitizer on rank {rank}, step {step}: {shown}{more}")


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
