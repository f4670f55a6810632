"""``Engine``: the ledger's commands, awaited, and ``run_step``'s entry (see ``kvledger.engine``)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence, Sized
from typing import Any

import anyio

from kvledger.core.errors import ConfigurationError, InvalidArgumentError
from kvledger.core.events import Geometry
from kvledger.core.ledger import Ledger
from kvledger.executors.executor import NO_INPUTS, RankExecutor, StepInputs, StepJob
from kvledger.logs import get_logger

from .access import LedgerAccess
from .extras import Extras
from .steps import StepResult, StepRunner

__all__ = ["Engine", "RankSpec"]


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """One in-process rank.

    ``planes``: the rank's cache planes (torch tensors ``[num_pages, ...]``,
    contiguous); none for a rank that holds no cache (its clear lists are still
    validated). ``graph``: ``graph(ctx, step, inputs)``, sync or async, run after the
    clears; when every rank's planes are on the CPU and its graph is a plain function
    (or none), the ranks' jobs run inline in ``run_step``'s task, rank after rank (a
    graph that awaits anything is declared ``async def``). ``stream``: the model stream
    for CUDA planes (default: the device's current stream). ``backend``: a backend
    name (see ``kvledger.executors.backend``) or a ready ``ClearBackend``; ``None``
    takes the engine's ``backend``.
    """

    planes: Sequence[Any] = ()
    graph: Callable | None = None
    stream: Any = None
    backend: Any = None


class Engine:
    """The async face of a ``Ledger`` plus one executor per rank. Built by ``open_engine``.

    Commands mirror the ledger's and raise what it raises (nothing changed). They
    reach the ledger through one serialized path (``access.py``): on the loop,
    without yielding, when the ledger cannot block (in memory, or a log that writes
    in the background); in the engine's one worker thread for a log that writes
    and fsyncs inline. After the engine began closing they raise ``EngineClosedError``.
    """

    def __init__(
        self,
        ledger: Ledger,
        executors: Sequence[RankExecutor],
        *,
        queue_size: int = 1,
        drain_timeout_s: float = 10.0,
        logger: Any = None,
        extras: Extras | None = None,
        depth: int = 1,
    ) -> None:
        self._ledger = ledger
        self._executors = tuple(executors)
        self.world_size = len(self._executors)
        self._access = LedgerAccess(ledger)
        self.depth = depth
        self._slots: Any  # steps sealed and not yet settled: at most ``depth``
        try:  # anyio >= 4.5: no yield when free
            self._slots = anyio.Lock(fast_acquire=True) if depth == 1 else anyio.Semaphore(depth, fast_acquire=True)
        except TypeError:
            self._slots = anyio.Lock() if depth == 1 else anyio.Semaphore(depth)
        pairs = [anyio.create_memory_object_stream[StepJob](queue_size) for _ in self._executors]
        self._job_receivers = [r for _, r in pairs]
        self._no_inputs = [NO_INPUTS] * self.world_size
        self._steps = StepRunner(
            self._access, self._executors, [s for s, _ in pairs], inline=all(map(_runs_inline, self._executors)),
            drain_timeout_s=drain_timeout_s, logger=logger if logger is not None else get_logger("kvledger.engine"),
            metrics=extras.metrics if extras is not None else None,
            kv_flush=extras.kv_flush if extras is not None else None,
            sanitizer=extras.tracker if extras is not None else None, depth=depth,
        )
        self.remote_address: tuple[str, int] | None = None
        self._kv_events = extras.publisher if extras is not None else None
        self._metrics = extras.metrics if extras is not None else None

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
    def kv_events(self) -> Any:
        """The KV event publisher (``kvledger.kvevents.KVEventPublisher``) of ``open_engine(...,
        kv_events=...)``, or None; ``kv_events.endpoint`` is the PUB endpoint as bound."""
        return self._kv_events

    @property
    def sanitize(self) -> bool:
        """Whether the engine runs in sanitize mode (``open_engine(..., sanitize=True)``)."""
        return self._steps.sanitizer is not None

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

    # ------------------------------------------------------------------ commands
    #
    # ``access.direct``: the ledger may be called right here (open, cannot block, nothing
    # in the worker thread). Such a command is a plain call on the loop (microseconds, no
    # await inside): it cannot interleave with another call, and a caller cancelled
    # meanwhile sees the cancellation at its next checkpoint, with the command done and
    # recorded. Otherwise it goes through ``access.call``.

    async def reserve(self, request: int, n: int, *, tenant: str | None = None) -> tuple[int, ...]:
        """``Ledger.reserve``: ``n`` free pages for ``request``. ``OutOfPagesError`` under pressure."""
        if self._access.direct:
            return self._ledger.reserve(request, n, tenant=tenant)
        return await self._access.call(self._ledger.reserve, request, n, tenant=tenant)

    async def return_reservation(self, request: int, pages: Iterable[int] | None = None) -> tuple[int, ...]:
        if self._access.direct:
            return self._ledger.return_reservation(request, pages)
        return await self._access.call(self._ledger.return_reservation, request, pages)

    async def commit(
        self, request: int, step: int, n: int | None = None, *, pages: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        """``Ledger.commit``: returns the page ids that joined ``step``'s clear list."""
        if self._access.direct:
            return self._ledger.commit(request, step, n, pages=pages)
        return await self._access.call(self._ledger.commit, request, step, n, pages=pages)

    async def cancel(self, request: int) -> None:
        if self._access.direct:
            return self._ledger.cancel(request)
        return await self._access.call(self._ledger.cancel, request)

    async def finish(self, request: int) -> None:
        if self._access.direct:
            return self._ledger.finish(request)
        return await self._access.call(self._ledger.finish, request)

    async def alias_snapshot(
        self, snapshot: int, n: int | None = None, *, pages: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        if self._access.direct:
            return self._ledger.alias_snapshot(snapshot, n, pages=pages)
        return await self._access.call(self._ledger.alias_snapshot, snapshot, n, pages=pages)

    async def release_snapshot(self, snapshot: int) -> None:
        if self._access.direct:
            self._ledger.release_snapshot(snapshot)
            return
        await self._access.call(self._ledger.release_snapshot, snapshot)

    async def start_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        if self._access.direct:
            self._ledger.start_restore(pages, request=request, snapshot=snapshot)
            return
        await self._access.call(self._ledger.start_restore, pages, request=request, snapshot=snapshot)

    async def complete_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        if self._access.direct:
            self._ledger.complete_restore(pages, request=request, snapshot=snapshot)
            return
        await self._access.call(self._ledger.complete_restore, pages, request=request, snapshot=snapshot)

    async def publish(self, request: int, hashes: Sequence[int | bytes], token_ids: Sequence[int], *,
                      start: int | None = None, parent_hash: int | bytes | None = None, lora_id: int | None = None,
                      lora_name: str | None = None) -> tuple[int, ...]:
        """``Ledger.publish``: full KV pages of ``request`` (written in a completed step) gain block
        hashes; a KV event publisher sends them with the next batch."""
        kw: dict[str, Any] = {"start": start, "parent_hash": parent_hash, "lora_id": lora_id, "lora_name": lora_name}
        if self._access.direct:
            return self._ledger.publish(request, hashes, token_ids, **kw)
        return await self._access.call(self._ledger.publish, request, hashes, token_ids, **kw)

    async def lookup(self, hashes: Iterable[int | bytes], *, tenant: str | None = None) -> int:
        """``Ledger.lookup``: how many leading blocks of ``hashes`` are ready to ``share`` (the
        metrics, when given, count the blocks asked and found: ``prefix_lookup``)."""
        if self._metrics is not None and not isinstance(hashes, Sized):
            hashes = tuple(hashes)
        if self._access.direct:
            found = self._ledger.lookup(hashes, tenant=tenant)
        else:
            found = await self._access.call(self._ledger.lookup, hashes, tenant=tenant)
        if self._metrics is not None:
            self._metrics.prefix_lookup(len(hashes), found)  # type: ignore[arg-type]
        return found

    async def share(self, request: int, hashes: Sequence[int | bytes], *, tenant: str | None = None
                    ) -> tuple[int, ...]:
        """``Ledger.share``: the pages holding ``hashes`` join ``request``'s block table."""
        if self._access.direct:
            return self._ledger.share(request, hashes, tenant=tenant)
        return await self._access.call(self._ledger.share, request, hashes, tenant=tenant)

    async def evict(self, n: int | None = None, *, pages: Iterable[int] | None = None) -> tuple[int, ...]:
        """``Ledger.evict``: cached pages go free (the ``n`` least recently used, the named ones, or all)."""
        if self._access.direct:
            return self._ledger.evict(n, pages=pages)
        return await self._access.call(self._ledger.evict, n, pages=pages)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(ledger, *args)`` with exclusive access to the ledger, where its commands
        run (on the loop, or in the worker thread for a log that fsyncs inline): several
        commands for one thread hop, or a consistent query. Do not seal, complete or abort
        steps here (``run_step`` does), nor wait for the disk (``flush`` does)."""
        return await self._access.call(fn, self._ledger, *args)

    async def digest(self) -> str:
        """The ledger state's digest (equal to a replay of its events / its log)."""
        return await self._access.call(self._ledger.digest)

    async def flush(self) -> None:
        """Make every event so far durable (``DurableLedger.sync``), waiting in the worker
        thread. Raises ``ConfigurationError`` for an engine without a log, ``LogIOError``
        when the write or fsync fails (the log then refuses appends: the engine's next
        step breaks it), ``EngineClosedError`` once closing began."""
        if not self._access.durable:
            raise ConfigurationError("this engine has no log to flush")
        await self._access.blocking(self._ledger.sync)  # type: ignore[attr-defined]

    async def wait_durable(self, seq: int) -> None:
        """Wait, without blocking the loop and without writing anything, until event ``seq`` is
        on stable storage (``DurableLedger.wait_durable_async``): with the log's writer thread,
        a sealed step's events are durable shortly after the seal. Cancellable.

        Raises ``ConfigurationError`` for an engine without a log, ``InvalidArgumentError``
        for a ``seq`` not yet appended (``0 <= seq < engine.seq``), ``EngineClosedError``
        once closing began, ``LogIOError`` when the writer failed, and ``LogClosedError``
        when the log will not make ``seq`` durable by itself (a log that fsyncs inline:
        its events become durable at the next seal or ``flush``)."""
        if not self._access.durable:
            raise ConfigurationError("this engine has no log to wait for")
        if type(seq) is not int or not 0 <= seq < self._ledger.seq:
            raise InvalidArgumentError(f"seq must be an event of the log, 0 <= seq < {self._ledger.seq}; got {seq!r}")
        self._access.check_open()
        await self._ledger.wait_durable_async(seq)  # type: ignore[attr-defined]

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

        With ``depth`` > 1 (``open_engine``), the call holds one of ``depth`` slots from
        the seal until the step settled: the next step may be sealed meanwhile, and its
        ranks run once this one settled; if an earlier step's abort reached this one,
        it runs nothing and raises ``StepFailedError`` naming that step.

        With remote ranks, ``payload`` (bytes) travels in the PREPARE to every peer
        (its ``on_launch`` gets it); the step runs locally only once every peer is
        READY (see ``kvledger.engine``).
        """
        per_rank = self._inputs_for_ranks(inputs)
        if not isinstance(payload, (bytes, bytearray)):
            raise InvalidArgumentError(f"payload must be bytes, got {type(payload).__name__}")
        access = self._access
        if access.state != "open":
            access.check_open()
        async with self._slots:  # at most depth steps sealed; cancelled before it holds a slot: nothing sealed
            if access.state != "open":  # closing began while this call waited for a slot
                access.check_open()
            return await self._steps.run(step, per_rank, payload if type(payload) is bytes else bytes(payload))

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

    # ------------------------------------------------------------------ lifecycle (open_engine drives it)

    async def _settle_in_flight(self, *, abort: bool) -> None:
        """Closing, step 1 (call shielded): refuse new commands and steps, then wait until
        the step in flight (if any) is recorded. ``abort``: cancel it first (it is recorded
        as aborted, "engine closed"); else it runs to its end. Steps that were waiting
        for it raise ``EngineClosedError`` without being sealed."""
        self._access.begin_close()
        if abort:
            self._steps.abort_in_flight()
        if self.depth == 1:
            async with self._slots:
                pass
        else:
            await self._steps.wait_settled()

    async def _serve_rank(self, rank: int, jobs: Any, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Rank ``rank``'s executor task (``RankExecutor.serve``); a step waiting on it learns when it ends."""
        try:
            await self._executors[rank].serve(jobs, task_status=task_status)
        finally:
            self._steps.rank_gone(rank)

    def _stop_executors(self) -> None:
        """Closing, step 2: no more plans; the executors stop after their current one."""
        self._access.begin_close()
        self._steps.close()

    async def _close_ledger(self) -> None:
        """Closing, step 3 (shielded): the last call on the ledger's path; nothing after it."""
        await self._access.close()


def _runs_inline(ex: RankExecutor) -> bool:
    """Whether a rank's job runs to its end without awaiting: CPU (or no) planes and a
    graph that is a plain function (or none). Such a job can run in ``run_step``'s task."""
    if getattr(ex.context.device, "type", None) == "cuda":
        return False
    graph = ex.graph
    if graph is None:
        return True
    call = graph if inspect.isroutine(graph) else type(graph).__call__  # an object: its class's __call__
    return not (inspect.iscoroutinefunction(graph) or inspect.iscoroutinefunction(call))
