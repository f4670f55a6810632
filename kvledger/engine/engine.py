"""``Engine``: the ledger's commands, awaited, and ``run_step``'s entry (see ``kvledger.engine``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import anyio

from kvledger.core.errors import ConfigurationError, EngineClosedError, InvalidArgumentError
from kvledger.core.events import Geometry
from kvledger.core.ledger import Ledger
from kvledger.executors.executor import NO_INPUTS, RankExecutor, StepInputs, StepJob
from kvledger.logs import get_logger

from .steps import StepResult, StepRunner

__all__ = ["Engine", "RankSpec"]


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """One in-process rank.

    ``planes``: the rank's cache planes (torch tensors ``[num_pages, ...]``,
    contiguous); none for a rank that holds no cache (its clear lists are still
    validated). ``graph``: ``graph(ctx, step, inputs)``, sync or async, run after the
    clears. ``stream``: the model stream for CUDA planes (default: the device's
    current stream). ``backend``: a backend name (see ``kvledger.executors.backend``)
    or a ready ``ClearBackend``; ``None`` takes the engine's ``backend``.
    """

    planes: Sequence[Any] = ()
    graph: Callable | None = None
    stream: Any = None
    backend: Any = None


class Engine:
    """The async face of a ``Ledger`` plus one executor per rank. Built by ``open_engine``.

    Commands mirror the ledger's and raise what it raises (nothing changed). With a
    log they run in a worker thread, one at a time; in memory they run on the loop
    without yielding (they take microseconds).
    """

    def __init__(
        self,
        ledger: Ledger,
        executors: Sequence[RankExecutor],
        *,
        threaded: bool,
        queue_size: int = 1,
        drain_timeout_s: float = 10.0,
        logger: Any = None,
    ) -> None:
        self._ledger = ledger
        self._executors = tuple(executors)
        self.world_size = len(self._executors)
        self._threaded = threaded
        self._limiter = anyio.CapacityLimiter(1) if threaded else None
        try:
            self._step_lock = anyio.Lock(fast_acquire=True)  # anyio >= 4.5: no yield when free
        except TypeError:
            self._step_lock = anyio.Lock()
        self._closed: BaseException | None = None
        pairs = [anyio.create_memory_object_stream[StepJob](queue_size) for _ in self._executors]
        self._job_receivers = [r for _, r in pairs]
        self._no_inputs = [NO_INPUTS] * self.world_size
        self._steps = StepRunner(
            ledger, [s for s, _ in pairs], call=self._call, threaded=threaded, limiter=self._limiter,
            drain_timeout_s=drain_timeout_s, logger=logger if logger is not None else get_logger("kvledger.engine"),
            on_broken=self._broken,
        )
        self.remote_address: tuple[str, int] | None = None

    # ------------------------------------------------------------------ plumbing

    @property
    def ledger(self) -> Ledger:
        """The ledger itself. Read it only while no command or step is in flight (tests,
        tools); change it only through the engine."""
        return self._ledger

    @property
    def geometry(self) -> Geometry:
        return self._ledger.geometry

    @property
    def seq(self) -> int:
        return self._ledger.seq

    @property
    def open_step(self) -> int:
        return self._ledger.open_step

    @property
    def free_count(self) -> int:
        return self._ledger.free_count

    @property
    def executors(self) -> tuple[RankExecutor, ...]:
        return self._executors

    @property
    def leader(self) -> Any:
        """The wire leader (``kvledger.wire.WireLeader``) driving the remote ranks, or ``None``."""
        return self._steps.leader

    @property
    def remote_ranks(self) -> frozenset:
        """Engine rank numbers of the remote peers whose links are live (empty without ``remote``)."""
        leader = self._steps.leader
        if leader is None:
            return frozenset()
        base = self.world_size - 1
        return frozenset(base + w for w in leader.ranks)

    async def wait_remote(self, timeout: float) -> None:
        """Wait up to ``timeout`` s until every remote peer has joined. Raises ``TimeoutError``
        (nothing changes; a step run now aborts naming a missing rank), and
        ``ConfigurationError`` for an engine without ``remote``."""
        leader = self._steps.leader
        if leader is None:
            raise ConfigurationError("this engine has no remote ranks")
        with anyio.fail_after(timeout):
            await leader.wait_joined()

    def statistics(self) -> dict[str, int]:
        """Steps completed on every rank, steps aborted, pages zeroed by completed steps."""
        s = self._steps
        return {"steps_completed": s.steps_completed, "steps_aborted": s.steps_aborted,
                "pages_cleared": s.pages_cleared}

    def _check_open(self) -> None:
        if self._closed is not None:
            closed = self._closed
            what = "closed" if isinstance(closed, EngineClosedError) else f"broken: {closed!r}"
            raise EngineClosedError(f"the engine is {what}") from closed

    def _broken(self, exc: BaseException) -> None:
        """Recording a step's outcome failed: every later call raises ``EngineClosedError``."""
        if self._closed is None:
            self._closed = exc

    async def _call(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """One ledger call, exclusive: in a worker thread with a log, else directly."""
        if self._closed is not None:
            self._check_open()
        if self._threaded:
            if kwargs:
                fn = functools.partial(fn, **kwargs)
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        return fn(*args, **kwargs)

    # ------------------------------------------------------------------ commands
    #
    # In memory a command is a plain call on the loop (microseconds, no await inside):
    # it cannot interleave with another command, and a caller cancelled meanwhile sees
    # the cancellation at its next checkpoint, with the command done and recorded.
    # With a log it is one job for the engine's single worker-thread limiter.

    async def reserve(self, request: int, n: int, *, tenant: str | None = None) -> tuple[int, ...]:
        """``Ledger.reserve``: ``n`` free pages for ``request``. ``OutOfPagesError`` under pressure."""
        if self._threaded or self._closed is not None:
            return await self._call(self._ledger.reserve, request, n, tenant=tenant)
        return self._ledger.reserve(request, n, tenant=tenant)

    async def return_reservation(self, request: int, pages: Iterable[int] | None = None) -> tuple[int, ...]:
        if self._threaded or self._closed is not None:
            return await self._call(self._ledger.return_reservation, request, pages)
        return self._ledger.return_reservation(request, pages)

    async def commit(
        self, request: int, step: int, n: int | None = None, *, pages: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        """``Ledger.commit``: returns the page ids that joined ``step``'s clear list."""
        if self._threaded or self._closed is not None:
            return await self._call(self._ledger.commit, request, step, n, pages=pages)
        return self._ledger.commit(request, step, n, pages=pages)

    async def cancel(self, request: int) -> None:
        if self._threaded or self._closed is not None:
            return await self._call(self._ledger.cancel, request)
        self._ledger.cancel(request)

    async def finish(self, request: int) -> None:
        if self._threaded or self._closed is not None:
            return await self._call(self._ledger.finish, request)
        self._ledger.finish(request)

    async def alias_snapshot(
        self, snapshot: int, n: int | None = None, *, pages: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        return await self._call(self._ledger.alias_snapshot, snapshot, n, pages=pages)

    async def release_snapshot(self, snapshot: int) -> None:
        await self._call(self._ledger.release_snapshot, snapshot)

    async def start_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        await self._call(self._ledger.start_restore, pages, request=request, snapshot=snapshot)

    async def complete_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        await self._call(self._ledger.complete_restore, pages, request=request, snapshot=snapshot)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(ledger, *args)`` with exclusive access to the ledger (in the worker
        thread when there is a log): several commands for one thread hop, or a
        consistent query. Do not seal, complete or abort steps here: ``run_step`` does."""
        return await self._call(fn, self._ledger, *args)

    async def digest(self) -> str:
        """The ledger state's digest (equal to a replay of its events / its log)."""
        return await self._call(self._ledger.digest)

    # ------------------------------------------------------------------ steps

    async def run_step(self, step: int, inputs: Any = None, *, payload: bytes = b"") -> StepResult:
        """Seal ``step`` and run its plan on every rank: input copies -> clears -> graph.

        ``inputs``: ``None``; one ``StepInputs`` for every rank; or one per rank (a
        sequence of ``world_size`` entries, or a mapping rank -> ``StepInputs``; a
        missing or ``None`` entry means no inputs for that rank).

        Returns a ``StepResult`` once every rank reported completion and the ledger
        recorded ``StepCompleted(step, rank)`` for each. Raises ``InvalidArgumentError``
        for bad ``inputs`` and the ledger's ``StepOrderError`` for a step that is not
        the open one (nothing changed either way), and ``StepFailedError`` when a rank
        failed (see ``kvledger.engine`` for what is recorded). A cancellation is
        re-raised: one that lands before the step is sealed (waiting for the previous
        step, or for the ledger's worker thread) records nothing and leaves the step
        open, to be run again; one that lands after the seal records the step as
        aborted first.

        With remote ranks, ``payload`` (bytes) travels in the PREPARE to every peer
        (its ``on_launch`` gets it); the step runs locally only once every peer is
        READY (see ``kvledger.engine``).
        """
        per_rank = self._inputs_for_ranks(inputs)
        if not isinstance(payload, (bytes, bytearray)):
            raise InvalidArgumentError(f"payload must be bytes, got {type(payload).__name__}")
        self._check_open()
        async with self._step_lock:
            return await self._steps.run(step, per_rank, bytes(payload))

    def _inputs_for_ranks(self, inputs: Any) -> list[StepInputs]:
        n = self.world_size
        if inputs is None:
            return self._no_inputs
        if isinstance(inputs, StepInputs):
            return [inputs] * n
        out = list(self._no_inputs)
        items: Iterable[tuple[Any, Any]]
        if isinstance(inputs, Mapping):
            items = inputs.items()
        elif isinstance(inputs, (list, tuple)):
            if len(inputs) != n:
                raise InvalidArgumentError(f"inputs has {len(inputs)} entries for {n} ranks")
            items = enumerate(inputs)
        else:
            raise InvalidArgumentError(
                f"inputs must be None, a StepInputs, a sequence or a mapping of them, got {type(inputs).__name__!r}"
            )
        for rank, value in items:
            if type(rank) is not int or not 0 <= rank < n:
                raise InvalidArgumentError(f"inputs for rank {rank!r}: no such rank (world size {n})")
            if value is None:
                continue
            if not isinstance(value, StepInputs):
                raise InvalidArgumentError(f"inputs for rank {rank} must be a StepInputs, got {type(value).__name__}")
            out[rank] = value
        return out

    # ------------------------------------------------------------------ lifecycle

    def _shutdown(self) -> None:
        if self._closed is None:
            self._closed = EngineClosedError("closed")
        self._steps.close()
