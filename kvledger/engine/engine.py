"""``Engine``: the ledger's commands, awaited, and ``run_step``'s entry (see ``kvledger.engine``)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup

from kvledger.core.errors import ConfigurationError, InvalidArgumentError
from kvledger.core.events import Geometry
from kvledger.core.ledger import Ledger
from kvledger.durable import DurableLedger
from kvledger.executors.backend import ClearBackend
from kvledger.executors.executor import NO_INPUTS, RankContext, RankExecutor, StepInputs
from kvledger.logs import Logger, get_logger

from .access import YIELD_EVERY_S, LedgerAccess
from .plugins import EventPublisher, MetricsHooks, StepHook
from .ranks import RankStrategy
from .recorder import StepRecorder
from .records import StepResult
from .steps import InFlight, OneStep, StepRunner

if TYPE_CHECKING:  # pragma: no cover
    from kvledger.wire.rank import WireLeader

__all__ = ["Engine", "Graph", "RankSpec", "StepInputsArg", "forward"]

P = ParamSpec("P")
R = TypeVar("R")

Graph = Callable[[RankContext, int, StepInputs], object]
"""A rank's step graph: ``graph(ctx, step, inputs)``, a plain function or ``async def`` (its
result, awaited if awaitable, is dropped)."""
StepInputsArg = StepInputs | Sequence[StepInputs | None] | Mapping[int, StepInputs | None] | None
"""``run_step``'s ``inputs``: none, one for every rank, or one per rank (a sequence or a mapping)."""


def forward(command: Callable[Concatenate[Ledger, P], R]) -> Callable[Concatenate[Engine, P], Awaitable[R]]:
    """The engine's form of one of the ledger's commands: the same parameters, awaited, and the
    same result or error (nothing changed on an error). Its body, for ``Ledger.reserve``::

        async def reserve(self, request, n, *, tenant=None):
            if self._access.fast():
                return self._ledger.reserve(request, n, tenant=tenant)
            return await self._access.call(self._ledger.reserve, request, n, tenant=tenant)

    ``access.fast()``: the ledger may be called right here (open, cannot block, nothing in the
    worker thread) and the loop had its turn lately: a plain call on the loop, no await in
    between (it cannot interleave with another call). Else ``access.call``: the loop's turn when
    it is due (a cancellation point), then the call, here or in the worker thread.

    The body is generated from the command's signature (as ``dataclasses`` generates
    ``__init__``): written out, each call costs what a hand-written one does, where a
    ``*args, **kwargs`` forwarder costs about 0.2 us more a command (bench/bench_engine.py's
    commands). Type checkers see the command's own parameters (``ParamSpec``)."""
    name = command.__name__
    params = list(inspect.signature(command).parameters.values())[1:]  # (without self)
    defaults = {f"_d{k}": p.default for k, p in enumerate(params) if p.default is not p.empty}
    heads, passes, keyword = [], [], False
    for k, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"forward: Ledger.{name} has a parameter of kind {p.kind.description}")
        if p.kind is p.KEYWORD_ONLY and not keyword:
            heads.append("*")
            keyword = True
        heads.append(p.name if p.default is p.empty else f"{p.name}=_d{k}")
        passes.append(f"{p.name}={p.name}" if keyword else p.name)
    args = ", ".join(passes)
    source = (f"async def {name}(self, {', '.join(heads)}):\n"
              f"    if self._access.fast():\n"
              f"        return self._ledger.{name}({args})\n"
              f"    return await self._access.call(self._ledger.{name}{', ' if args else ''}{args})\n")
    namespace: dict[str, object] = dict(defaults)
    exec(compile(source, f"<kvledger.engine.forward {name}>", "exec"), namespace)  # noqa: S102
    forwarded = namespace[name]
    assert isinstance(forwarded, types.FunctionType)
    functools.update_wrapper(forwarded, command)  # the name, the signature (__wrapped__), the docstring
    forwarded.__qualname__ = f"Engine.{name}"
    summary = (command.__doc__ or "").strip().split("\n\n")[0]
    forwarded.__doc__ = f"``Ledger.{name}``, awaited (``Engine``'s commands): {summary}"
    return forwarded


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """One in-process rank.

    ``planes``: the rank's cache planes (torch tensors ``[num_pages, ...]``,
    contiguous, or byte buffers whose first dimension is the page's:
    ``kvledger.executors.bytes_backend.byte_plane``); none for a rank that holds no
    cache (its clear lists are still validated). ``graph``: ``graph(ctx, step, inputs)``, sync or async, run after the
    clears; when every rank's planes are on the CPU and its graph is a plain function
    (or none), or when there is one rank, the ranks' jobs run inline in ``run_step``'s
    task, rank after rank (a graph that awaits anything is declared ``async def``);
    otherwise each rank's in its executor task. ``stream``: the model stream
    for CUDA planes (default: the device's current stream). ``backend``: a backend
    name (see ``kvledger.executors.backend``) or a ready ``ClearBackend``; ``None``
    takes the engine's ``backend``.
    """

    planes: Sequence[object] = ()
    graph: Graph | None = None
    stream: object = None
    backend: str | ClearBackend | None = None


class Engine:
    """The async face of a ``Ledger`` plus one executor per rank. Built by ``open_engine``,
    which picks how a step reaches the ranks (``ranks``: a ``RankStrategy``, ``ranks.py``),
    the order of steps (``depth``) and the step hooks (``plugins.py``).

    Commands mirror the ledger's and raise what it raises (nothing changed). They are
    cancellation points: on the loop, the loop gets a turn at least every
    ``yield_every_s`` of commands (``open_engine``'s option; 0: at every command), where
    deadlines fire and cancellations are delivered; a worker-thread hop always is one.
    They reach the ledger through one serialized path (``access.py``): on the loop when the ledger cannot
    block (in memory, or a log that writes in the background); in the engine's one worker
    thread for a log that writes and fsyncs inline. After the engine began closing they
    raise ``EngineClosedError``.
    """

    def __init__(
        self,
        ledger: Ledger,
        executors: Sequence[RankExecutor],
        ranks: RankStrategy,
        *,
        depth: int = 1,
        hooks: Sequence[StepHook] = (),
        logger: Logger | None = None,
        leader: WireLeader | None = None,
        publisher: EventPublisher | None = None,
        metrics: MetricsHooks | None = None,
        sanitize: bool = False,
        remote_address: tuple[str, int] | None = None,
        yield_every_s: float = YIELD_EVERY_S,
    ) -> None:
        self._ledger = ledger
        self._executors = tuple(executors)
        self.world_size = len(self._executors)
        durable = ledger if isinstance(ledger, DurableLedger) else None
        self._access = LedgerAccess(ledger, durable.log if durable is not None else None,
                                    durable.close if durable is not None else None)
        self.depth = depth
        self._ranks = ranks
        self._recorder = StepRecorder(self._access, hooks, logger if logger is not None
                                      else get_logger("kvledger.engine"))
        self._runner = StepRunner(self._access, ranks, self._recorder, hooks)
        self._order: OneStep | InFlight = (OneStep(self._runner, self._access) if depth == 1
                                           else InFlight(self._runner, self._access, depth))
        # run_step's cancellation point: a cancelled caller is looked for before the seal; ranks
        # that always wait (dispatched, remote) yield anyway, after it; before inline ones the
        # loop gets its turn as for commands (every yield_every_s, access.py)
        self._yields = not ranks.always_yields
        self._access.yield_every_s = yield_every_s
        self._no_inputs = [NO_INPUTS] * self.world_size
        self._leader = leader
        self._kv_events = publisher
        self._metrics = metrics
        self._sanitize = sanitize
        self.remote_address = remote_address

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
    def kv_events(self) -> EventPublisher | None:
        """The KV event publisher (``kvledger.kvevents.KVEventPublisher``) of ``open_engine(...,
        extras=ExtraOptions(kv_events=...))``, or None; ``kv_events.endpoint`` is the PUB endpoint
        as bound."""
        return self._kv_events

    @property
    def sanitize(self) -> bool:
        """Whether the engine runs in sanitize mode (``ExtraOptions(sanitize=True)``)."""
        return self._sanitize

    @property
    def leader(self) -> WireLeader | None:
        """The wire leader (``kvledger.wire.WireLeader``) driving the remote ranks, or ``None``."""
        return self._leader

    @property
    def remote_ranks(self) -> frozenset[int]:
        """Engine rank numbers of the remote peers whose links are live (empty without ``remote``)."""
        leader = self._leader
        if leader is None:
            return frozenset()
        base = self.world_size - 1
        return frozenset(base + w for w in leader.ranks)

    async def wait_remote(self, timeout: float) -> None:
        """Wait up to ``timeout`` s until every remote peer has joined. Raises ``TimeoutError``
        (nothing changes; a step run now aborts naming a missing rank), and
        ``ConfigurationError`` for an engine without ``remote``."""
        leader = self._leader
        if leader is None:
            raise ConfigurationError("this engine has no remote ranks")
        with anyio.fail_after(timeout):
            await leader.wait_joined()

    def statistics(self) -> dict[str, int]:
        """Steps completed on every rank, steps aborted, pages zeroed by completed steps."""
        r = self._recorder
        return {"steps_completed": r.steps_completed, "steps_aborted": r.steps_aborted,
                "pages_cleared": r.pages_cleared}

    # ------------------------------------------------------------------ commands
    #
    # Each is the ledger's command of the same name, awaited, declared once (``forward``).

    reserve = forward(Ledger.reserve)
    return_reservation = forward(Ledger.return_reservation)
    commit = forward(Ledger.commit)
    cancel = forward(Ledger.cancel)
    finish = forward(Ledger.finish)
    alias_snapshot = forward(Ledger.alias_snapshot)
    release_snapshot = forward(Ledger.release_snapshot)
    start_restore = forward(Ledger.start_restore)
    complete_restore = forward(Ledger.complete_restore)
    publish = forward(Ledger.publish)
    share = forward(Ledger.share)
    evict = forward(Ledger.evict)

    async def lookup(self, hashes: Iterable[int | bytes], *, tenant: str | None = None) -> int:
        """``Ledger.lookup``: how many leading blocks of ``hashes`` are ready to ``share`` (the
        metrics, when given, count the blocks asked and found: ``prefix_lookup``)."""
        metrics = self._metrics
        if metrics is not None and not isinstance(hashes, Sized):
            hashes = tuple(hashes)
        if self._access.fast():
            found = self._ledger.lookup(hashes, tenant=tenant)
        else:
            found = await self._access.call(self._ledger.lookup, hashes, tenant=tenant)
        if metrics is not None:
            metrics.prefix_lookup(len(hashes), found)  # type: ignore[arg-type]
        return found

    async def call(self, fn: Callable[Concatenate[Ledger, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run ``fn(ledger, *args, **kwargs)`` with exclusive access to the ledger, where its commands
        run (on the loop, or in the worker thread for a log that fsyncs inline): several
        commands for one thread hop, or a consistent query. Do not seal, complete or abort
        steps here (``run_step`` does), nor wait for the disk (``flush`` does)."""
        result: R = await self._access.call(fn, self._ledger, *args, **kwargs)
        return result

    async def digest(self) -> str:
        """The ledger state's digest (equal to a replay of its events / its log)."""
        digest: str = await self._access.call(self._ledger.digest)
        return digest

    async def flush(self) -> None:
        """Make every event so far durable (``DurableLedger.sync``), waiting in the worker
        thread. Raises ``ConfigurationError`` for an engine without a log, ``LogIOError``
        when the write or fsync fails (the log then refuses appends: the engine's next
        step breaks it), ``EngineClosedError`` once closing began."""
        durable = self._durable()
        await self._access.blocking(durable.sync)

    async def wait_durable(self, seq: int) -> None:
        """Wait, without blocking the loop and without writing anything, until event ``seq`` is
        on stable storage (``DurableLedger.wait_durable_async``): with the log's writer thread,
        a sealed step's events are durable shortly after the seal. Cancellable.

        Raises ``ConfigurationError`` for an engine without a log, ``InvalidArgumentError``
        for a ``seq`` not yet appended (``0 <= seq < engine.seq``), ``EngineClosedError``
        once closing began, ``LogIOError`` when the writer failed, and ``LogClosedError``
        when the log will not make ``seq`` durable by itself (a log that fsyncs inline:
        its events become durable at the next seal or ``flush``)."""
        durable = self._durable()
        if type(seq) is not int or not 0 <= seq < self._ledger.seq:
            raise InvalidArgumentError(f"seq must be an event of the log, 0 <= seq < {self._ledger.seq}; got {seq!r}")
        self._access.check_open()
        await durable.wait_durable_async(seq)

    def _durable(self) -> DurableLedger:
        ledger = self._ledger
        if not isinstance(ledger, DurableLedger):
            raise ConfigurationError("this engine has no log (open_engine(..., log=path))")
        return ledger

    # ------------------------------------------------------------------ steps

    async def run_step(self, step: int, inputs: StepInputsArg = None, *, payload: bytes = b"") -> StepResult:
        """Seal ``step`` and run its plan on every rank: input copies -> clears -> graph.

        ``inputs``: ``None``; one ``StepInputs`` for every rank; or one per rank (a
        sequence of ``world_size`` entries, or a mapping rank -> ``StepInputs``; a
        missing or ``None`` entry means no inputs for that rank).

        Returns a ``StepResult`` once every rank reported completion and the ledger
        recorded ``StepCompleted(step, rank)`` for each. Raises ``InvalidArgumentError``
        for bad ``inputs`` and the ledger's ``StepOrderError`` for a step that is not
        the open one (nothing changed either way), and ``StepFailedError`` when a rank
        failed (see ``kvledger.engine`` for what is recorded). It is a cancellation
        point: a cancelled caller is refused at its entry, and the loop gets a turn in
        it (at least every ``yield_every_s``, as for commands; dispatched and remote
        ranks always wait). A cancellation that lands before the step is sealed (the
        call's entry, waiting for the previous step or for the ledger's worker thread)
        records nothing and leaves the step open, to be run again; one that lands after
        the seal records the step as aborted first, then is re-raised.

        With ``depth`` > 1 (``open_engine``), the call holds one of ``depth`` slots from
        the seal until the step settled: the next step may be sealed meanwhile, and its
        ranks run once this one settled; if an earlier step's abort reached this one,
        it runs nothing and raises ``StepFailedError`` naming that step.

        With remote ranks, ``payload`` (bytes) travels in the PREPARE to every peer
        (its ``on_launch`` gets it); the step runs locally only once every peer is
        READY (see ``kvledger.engine``).
        """
        per_rank = self._inputs_for_ranks(inputs)
        if type(payload) is not bytes:
            if not isinstance(payload, (bytes, bytearray)):
                raise InvalidArgumentError(f"payload must be bytes, got {type(payload).__name__}")
            payload = bytes(payload)
        access = self._access
        if self._yields and time.perf_counter() >= access.yield_at:
            await access.checkpoint()
            access.yield_at = time.perf_counter() + access.yield_every_s
        else:
            await access.checkpoint_if_cancelled()
        if not access.is_open:
            access.check_open()
        return await self._order.run(step, per_rank, payload)

    def _inputs_for_ranks(self, inputs: object) -> list[StepInputs]:
        n = self.world_size
        if inputs is None:
            return self._no_inputs
        if isinstance(inputs, StepInputs):
            return [inputs] * n
        out = list(self._no_inputs)
        items: Iterable[tuple[object, object]]
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

    async def start_ranks(self, tg: TaskGroup) -> None:
        """Start what serves the ranks (the executors' tasks, for dispatched ranks) in ``tg``."""
        await self._ranks.start(tg)

    async def settle_in_flight(self, *, abort: bool) -> None:
        """Closing, step 1 (call shielded): refuse new commands and steps, then wait until
        the steps in flight (if any) are recorded. ``abort``: cancel the running one first (it
        is recorded as aborted, "engine closed"); else it runs to its end. Steps that were
        waiting for it raise ``EngineClosedError`` without being sealed."""
        self._access.begin_close()
        if abort:
            self._runner.abort_in_flight()
        await self._order.wait_settled()

    def stop_ranks(self) -> None:
        """Closing, step 2: no more plans; the executors stop after their current one. The wire
        leader's links close next: ``leader`` is None from now on."""
        self._access.begin_close()
        self._ranks.stop()
        self._leader = None

    async def close_ledger(self) -> None:
        """Closing, step 3 (shielded): the last call on the ledger's path; nothing after it."""
        await self._access.close()
