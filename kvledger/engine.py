"""The embedded async engine: one object a serving loop holds (anyio).

    async with kvledger.open(geometry, log=path, ranks=[RankSpec(planes=...), ...]) as engine:
        pages = await engine.reserve(r, 3)
        await engine.commit(r, step, 3)              # marked pages join the step's clear list
        result = await engine.run_step(step, inputs) # seal -> every rank: copies, clears, graph

    command ──► ledger (in memory: called directly; with a log: in a worker thread,
                        one call at a time, never blocking the event loop)
    run_step ─► seal_step ─► StepPlan ─┬─► rank 0 executor ─┐  (bounded streams,
                                       ├─► rank 1 executor ─┤   one task per rank,
                                       └─► ...              ┘   in the engine's task group)
               ◄── one RankOutcome per rank ──┘
               ├─ all ok:   StepCompleted(step, rank) for every rank  ─► StepResult
               └─ any not:  StepCompleted for the ranks that did finish,
                            StepAborted(step, reason)                 ─► StepFailedError

Steps run one at a time (``run_step`` waits for the previous one); commands may
interleave with a running step (a commit into the next step, say). With a log,
each awaited command is one worker-thread round trip (about 90 us measured); a
serving loop issues a step's commands in one ``await engine.call(fn)`` instead
(one round trip; bench/bench_engine.py). What a failure leaves behind:

* a command error (``OutOfPagesError``, ``PageNotHeldError``, ...) changes nothing;
* a rank that raises (a copy, the clear or the graph) fails the step: the other
  ranks' parts are cancelled, the ranks that had already finished are recorded as
  completed, nothing is recorded as completed for the failed or cancelled ranks,
  and the ledger records ``StepAborted`` so the step's clear list is carried into
  the next step (nothing of it is assumed zeroed). ``StepFailedError`` names the
  step and the rank;
* a caller that cancels ``run_step`` (``fail_after``, a cancelled scope) gets the
  same bookkeeping done under a shielded scope, then the cancellation re-raised;
  the ledger (and its log) stays consistent: its digest equals a replay of its
  events;
* if recording a step's outcome itself fails (a log write error), the engine is
  broken: every later call raises ``EngineClosedError`` chained to that error.

Remote ranks (``open_engine(..., remote=RemoteRanks(...))``, see
``kvledger.remote``): after sealing, ``run_step`` runs the wire's
PREPARE/READY/LAUNCH handshake with every peer (the engine is the wire leader)
under ``RemoteRanks.timeout``; only on LAUNCH do the local ranks run. A REJECT,
an expired deadline or a lost or missing peer aborts the step: ``StepFailedError``
names the rank (engine numbering), nothing is cleared or run anywhere, and the
ledger records ``StepAborted`` exactly as for a failing local rank.

``import kvledger.engine`` does not import torch; a rank's planes bring it in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Optional, Sequence

import anyio
import msgspec
import structlog

from kvledger.core.errors import (
    ConfigurationError,
    EngineClosedError,
    InvalidArgumentError,
    StepFailedError,
)
from kvledger.core.events import CLEAR_POLICIES, Geometry, StepPlan
from kvledger.core.ledger import Ledger
from kvledger.executors.backend import make_backend
from kvledger.remote import RemoteRanks
from kvledger.executors.executor import (
    NO_INPUTS,
    RankContext,
    RankExecutor,
    RankTiming,
    StepInputs,
    StepJob,
    StepReplies,
)

__all__ = [
    "Engine",
    "RankContext",
    "RankSpec",
    "RankTiming",
    "StepInputs",
    "StepResult",
    "open_engine",
    "RemoteRanks",
]




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
    graph: Optional[Callable] = None
    stream: Any = None
    backend: Any = None


class StepResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A step that completed on every rank: its clear list, per-rank timings (by rank)
    and the engine's wall time from seal to the last completion recorded."""

    step: int
    clear_list: tuple[int, ...]
    ranks: tuple[RankTiming, ...]
    wall_s: float


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
        self._drain_timeout_s = drain_timeout_s
        self._log = logger if logger is not None else structlog.get_logger("kvledger.engine")
        self._closed: Optional[BaseException] = None
        pairs = [anyio.create_memory_object_stream[StepJob](queue_size) for _ in self._executors]
        self._job_senders = [s for s, _ in pairs]
        self._job_receivers = [r for _, r in pairs]
        self._no_inputs = [NO_INPUTS] * self.world_size
        self._steps_completed = self._steps_aborted = self._pages_cleared = 0
        self._remote: Optional[RemoteRanks] = None
        self._leader: Any = None
        self.remote_address: Optional[tuple[str, int]] = None

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
        return self._leader

    @property
    def remote_ranks(self) -> frozenset:
        """Engine rank numbers of the remote peers whose links are live (empty without ``remote``)."""
        if self._leader is None:
            return frozenset()
        base = self.world_size - 1
        return frozenset(base + w for w in self._leader.ranks)

    async def wait_remote(self, timeout: float) -> None:
        """Wait up to ``timeout`` s until every remote peer has joined. Raises ``TimeoutError``
        (nothing changes; a step run now aborts naming a missing rank), and
        ``ConfigurationError`` for an engine without ``remote``."""
        if self._leader is None:
            raise ConfigurationError("this engine has no remote ranks")
        with anyio.fail_after(timeout):
            await self._leader.wait_joined()

    def statistics(self) -> dict[str, int]:
        """Steps completed on every rank, steps aborted, pages zeroed by completed steps."""
        return {
            "steps_completed": self._steps_completed,
            "steps_aborted": self._steps_aborted,
            "pages_cleared": self._pages_cleared,
        }

    def _check_open(self) -> None:
        if self._closed is not None:
            raise EngineClosedError("the engine is closed" if isinstance(self._closed, EngineClosedError)
                                    else "the engine is broken: %r" % (self._closed,)) from self._closed

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
        the open one (nothing changed either way), ``StepFailedError`` when a rank
        failed (see the module docstring for what is recorded), and re-raises
        cancellation after recording the step as aborted.

        With remote ranks, ``payload`` (bytes) travels in the PREPARE to every peer
        (its ``on_launch`` gets it); the step runs locally only once every peer is
        READY (see the module docstring).
        """
        per_rank = self._inputs_for_ranks(inputs)
        if not isinstance(payload, (bytes, bytearray)):
            raise InvalidArgumentError("payload must be bytes, got %s" % (type(payload).__name__,))
        self._check_open()
        async with self._step_lock:
            return await self._run_step(step, per_rank, bytes(payload))

    def _inputs_for_ranks(self, inputs: Any) -> list[StepInputs]:
        n = self.world_size
        if inputs is None:
            return self._no_inputs
        if isinstance(inputs, StepInputs):
            return [inputs] * n
        out = list(self._no_inputs)
        if isinstance(inputs, Mapping):
            items = inputs.items()
        elif isinstance(inputs, (list, tuple)):
            if len(inputs) != n:
                raise InvalidArgumentError("inputs has %d entries for %d ranks" % (len(inputs), n))
            items = enumerate(inputs)
        else:
            raise InvalidArgumentError(
                "inputs must be None, a StepInputs, a sequence or a mapping of them, got %r" % (type(inputs).__name__,)
            )
        for rank, value in items:
            if type(rank) is not int or not 0 <= rank < n:
                raise InvalidArgumentError("inputs for rank %r: no such rank (world size %d)" % (rank, n))
            if value is None:
                continue
            if not isinstance(value, StepInputs):
                raise InvalidArgumentError(
                    "inputs for rank %d must be a StepInputs, got %s" % (rank, type(value).__name__)
                )
            out[rank] = value
        return out

    def _seal(self, step: int, box: list) -> StepPlan:
        plan = self._ledger.seal_step(step)
        box.append(plan)
        return plan

    def _record(self, step: int, ok_ranks: tuple[int, ...], reason: Optional[str]) -> None:
        ledger = self._ledger
        for rank in ok_ranks:
            ledger.complete_step(step, rank)
        if reason is not None:
            ledger.abort_step(step, reason)

    async def _settle(self, step: int, ok_ranks: tuple[int, ...], reason: Optional[str]) -> None:
        """Record a sealed step's outcome, shielded from cancellation (in memory it is a
        plain call: nothing to shield). A failure here breaks the engine."""
        try:
            if self._threaded:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self._record, step, ok_ranks, reason, limiter=self._limiter)
            else:
                self._record(step, ok_ranks, reason)
        except BaseException as exc:
            if self._closed is None:
                self._closed = exc
            self._log.error("step_outcome_not_recorded", step=step, error=repr(exc))
            raise
        if reason is None:
            self._steps_completed += 1
        else:
            self._steps_aborted += 1
            self._log.warning("step_aborted", step=step, reason=reason, completed_ranks=list(ok_ranks))

    async def _remote_handshake(self, plan: StepPlan, payload: bytes) -> None:
        """PREPARE/READY with every peer; returns on LAUNCH. On anything else the step
        is recorded as aborted (no rank ran it) and this raises: ``StepFailedError``
        naming the culprit rank for an ABORT, or what interrupted it (cancellation)."""
        step = plan.step
        try:
            decision = await self._leader.run_step(plan, payload, timeout=self._remote.timeout)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._wire_catch_up(plan)
                reason = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else repr(exc)
                await self._settle(step, (), "remote handshake: " + reason)
            raise
        if decision.launch:
            return
        from kvledger.core.errors import WireProtocolError
        from kvledger.wire.codec import NO_RANK

        base = self.world_size - 1
        rank = base + decision.rank if decision.rank != NO_RANK else self.world_size
        cause = WireProtocolError(decision.code, decision.detail or "aborted", remote=True)
        reason = "rank %d aborted the step over the wire: code %d: %s" % (rank, int(decision.code), decision.detail)
        await self._settle(step, (), reason)
        raise StepFailedError(step, rank, [(rank, cause)], reason, plan.clear_list) from cause

    async def _wire_catch_up(self, plan: StepPlan) -> None:
        """A sealed step that never reached the wire (the caller was cancelled first):
        put it through the handshake with a deadline that is already over, so the
        peers see PREPARE then ABORT and their step numbers stay in line with the
        ledger's. Call shielded. Should a LAUNCH go out all the same, the ledger
        still records the step as aborted and its clear list is cleared again next
        step (zeroing is idempotent)."""
        leader = self._leader
        if leader is None or leader.next_step != plan.step:
            return
        try:
            await leader.run_step(plan, b"", timeout=1e-9)
        except Exception as exc:  # the peers will refuse the next step: it aborts, naming them
            self._log.error("wire_catch_up_failed", step=plan.step, error=repr(exc))

    async def _run_step(self, step: int, per_rank: list[StepInputs], payload: bytes = b"") -> StepResult:
        t0 = time.perf_counter()
        box: list = []
        try:
            plan = await self._call(self._seal, step, box)
        except BaseException:
            if box:  # sealed in the worker thread, but our caller was cancelled meanwhile
                if self._leader is not None:
                    with anyio.CancelScope(shield=True):
                        await self._wire_catch_up(box[0])
                await self._settle(step, (), "cancelled before dispatch")
            raise
        if self._leader is not None:
            await self._remote_handshake(plan, payload)
        n = self.world_size
        scopes = [anyio.CancelScope() for _ in range(n)]
        replies = StepReplies(n)
        outcomes = replies.outcomes
        sent = 0
        try:
            for rank in range(n):
                job = StepJob(plan, per_rank[rank], scopes[rank], replies)
                sender = self._job_senders[rank]
                try:
                    sender.send_nowait(job)
                except anyio.WouldBlock:
                    await sender.send(job)  # the rank is still busy: backpressure
                sent += 1
            await replies.event.wait()
            if len(outcomes) < n:
                # A rank failed: stop the others and wait for their answers, but not for
                # ever (a rank stuck where cancellation cannot reach, e.g. a worker thread
                # waiting on a collective the failed rank never joins).
                for scope in scopes:
                    scope.cancel()
                with anyio.move_on_after(self._drain_timeout_s):
                    while len(outcomes) < n:
                        replies.rearm()
                        await replies.event.wait()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                for scope in scopes:
                    scope.cancel()
                if len(outcomes) < sent:
                    replies.expected = sent
                    replies.rearm()
                    with anyio.move_on_after(self._drain_timeout_s):
                        while len(outcomes) < sent:
                            await replies.event.wait()
                            replies.rearm()
                replies.close()
                ok = tuple(sorted(o.rank for o in outcomes if o.status == "ok"))
                reason = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else repr(exc)
                await self._settle(step, ok, reason)
            raise
        replies.close()
        ok_ranks = tuple(sorted(o.rank for o in outcomes if o.status == "ok"))
        if len(ok_ranks) == n:
            await self._settle(step, ok_ranks, None)
            self._pages_cleared += len(plan.clear_list)
            timings = sorted((o.timing for o in outcomes), key=_by_rank)
            return StepResult(
                step=step, clear_list=plan.clear_list, ranks=tuple(timings), wall_s=time.perf_counter() - t0
            )
        failures = [(o.rank, o.error) for o in outcomes if o.status == "failed"]  # in order of report
        if failures:
            first_rank = failures[0][0]
            reason = "rank %d failed: %s: %s" % (first_rank, type(failures[0][1]).__name__, failures[0][1])
        else:  # a rank answered "cancelled" without being asked to stop (its own task ended)
            first_rank = min(set(range(n)).difference(ok_ranks))
            reason = "rank %d cancelled" % first_rank
        await self._settle(step, ok_ranks, reason)
        err = StepFailedError(step, first_rank, failures, "" if failures else "cancelled", plan.clear_list)
        if failures:
            raise err from failures[0][1]
        raise err

    # ------------------------------------------------------------------ lifecycle

    def _shutdown(self) -> None:
        if self._closed is None:
            self._closed = EngineClosedError("closed")
        for s in self._job_senders:
            s.close()


def _by_rank(t: RankTiming) -> int:
    return t.rank


# ---------------------------------------------------------------------- opening


def _rank_specs(ranks: Any) -> list[RankSpec]:
    if type(ranks) is int:
        if ranks < 1:
            raise InvalidArgumentError("ranks must be >= 1, got %d" % ranks)
        return [RankSpec() for _ in range(ranks)]
    if isinstance(ranks, RankSpec):
        return [ranks]
    try:
        specs = list(ranks)
    except TypeError:
        raise InvalidArgumentError("ranks must be an int or a sequence of RankSpec, got %r" % (ranks,)) from None
    if not specs:
        raise InvalidArgumentError("ranks must name at least one rank")
    for i, s in enumerate(specs):
        if not isinstance(s, RankSpec):
            raise InvalidArgumentError("ranks[%d] must be a RankSpec, got %s" % (i, type(s).__name__))
    return specs


def _build_executors(specs: list[RankSpec], num_pages: int, default_backend: Any) -> list[RankExecutor]:
    world = len(specs)
    out = []
    for rank, spec in enumerate(specs):
        planes = tuple(spec.planes)
        chosen = spec.backend if spec.backend is not None else default_backend
        device = None
        if isinstance(chosen, str):
            backend = make_backend(chosen, planes, stream=spec.stream) if planes else None
        else:
            if not callable(getattr(chosen, "clear", None)):
                raise ConfigurationError("rank %d: backend %r has no clear(page_ids)" % (rank, chosen))
            backend = chosen
        if planes:
            device = getattr(planes[0], "device", None)
        have = getattr(backend, "num_pages", None)
        if have is not None and have != num_pages:
            raise ConfigurationError(
                "rank %d: planes hold %d pages but the geometry has %d" % (rank, have, num_pages)
            )
        out.append(
            RankExecutor(
                rank,
                num_pages=num_pages,
                backend=backend,
                graph=spec.graph,
                planes=planes,
                device=device,
                stream=spec.stream,
                world_size=world,
            )
        )
    return out


@contextlib.asynccontextmanager
async def _open_remote(engine: Engine, remote: RemoteRanks, logger: Any) -> AsyncIterator[None]:
    from kvledger.wire.rank import open_leader

    async with open_leader(
        engine.geometry,
        world_size=remote.world_size,
        next_step=engine.open_step,
        close_grace=remote.close_grace,
        logger=logger,
    ) as leader:
        if remote.listen is not None:
            engine.remote_address = await leader.listen_tcp(*remote.listen)
        engine._remote = remote
        engine._leader = leader
        try:
            yield
        finally:
            engine._leader = None


async def _open_ledger(geometry, log, policy, check, record, fsync, logger) -> tuple[Ledger, bool]:
    if log is None:
        if not isinstance(geometry, Geometry):
            raise InvalidArgumentError("geometry must be a Geometry (it may be omitted only with an existing log)")
        return Ledger(geometry, policy=policy or "released_aliases", check=check, record=record), False
    try:
        from kvledger.durable import open_ledger
    except ImportError as exc:
        raise ConfigurationError("a log was asked for but kvledger.durable is not available: %r" % (exc,)) from exc
    opener = functools.partial(open_ledger, log, geometry, policy=policy, fsync=fsync, check=check, logger=logger)
    return await anyio.to_thread.run_sync(opener), True


@contextlib.asynccontextmanager
async def open_engine(
    geometry: Geometry | None = None,
    *,
    log: Any = None,
    ranks: Any = 1,
    policy: str | None = None,
    backend: Any = "torch",
    check: bool = False,
    record: bool = False,
    fsync: str = "per_step",
    queue_size: int = 1,
    drain_timeout_s: float = 10.0,
    logger: Any = None,
    remote: Optional[RemoteRanks] = None,
) -> AsyncIterator[Engine]:
    """Open the embedded engine: a ledger (durable when ``log`` is a path) and one
    executor task per rank, in a task group that lives as long as the ``async with``.

    ``ranks``: an int (that many ranks with no cache planes) or a sequence of
    ``RankSpec``. ``policy``: the clear policy (default ``"released_aliases"``; an
    existing log keeps its own, and naming another raises ``ConfigurationError``). ``backend``: the clear backend name for ranks that do not name one
    (``"torch"``, ``"cuda"``, ``"triton"``). ``log``: a path; the log is created
    (``geometry`` required) or reopened and replayed (``geometry`` may be ``None``);
    ledger calls then run in a worker thread. ``record`` keeps the events in
    ``engine.ledger.events`` (in-memory ledgers only). ``queue_size`` bounds each
    rank's plan stream; ``drain_timeout_s`` bounds how long a failed or cancelled
    step waits for its other ranks to stop before recording the abort (a rank that
    has not answered by then is not recorded as completed; its late answer is
    dropped and its next plan waits in its stream until it is free). ``logger``: a structlog logger
    for the engine's (and the durable log's) events; default
    ``structlog.get_logger("kvledger.engine")`` (and the log's own default).

    Raises ``InvalidArgumentError`` / ``ConfigurationError`` for bad arguments or
    planes that do not fit the geometry (nothing opened), and what opening the log
    raises (``CorruptLogError``, ...). On exit the executors stop after their
    current plan and the log is closed (shielded from cancellation).

    ``remote``: a ``RemoteRanks`` (see ``kvledger.remote``): the engine becomes the
    wire leader of ``remote.world_size - 1`` peers, listening on ``remote.listen``
    (``engine.remote_address``); every step then needs all of them READY. On exit
    the links are closed (peers see the end of the stream and return).
    """
    specs = _rank_specs(ranks)
    if remote is not None and not isinstance(remote, RemoteRanks):
        raise InvalidArgumentError("remote must be a RemoteRanks or None, got %s" % (type(remote).__name__,))
    if policy is not None and policy not in CLEAR_POLICIES:
        raise ConfigurationError("unknown clear policy %r; one of %s" % (policy, CLEAR_POLICIES))
    if type(queue_size) is not int or queue_size < 1:
        raise InvalidArgumentError("queue_size must be an int >= 1, got %r" % (queue_size,))
    ledger, threaded = await _open_ledger(geometry, log, policy, check, record, fsync, logger)
    try:
        executors = _build_executors(specs, ledger.geometry.num_pages, backend)
        engine = Engine(
            ledger,
            executors,
            threaded=threaded,
            queue_size=queue_size,
            drain_timeout_s=drain_timeout_s,
            logger=logger,
        )
        body_error: BaseException | None = None
        unwrap = False
        started = 0
        try:
            async with anyio.create_task_group() as tg:
                try:
                    for ex, jobs in zip(executors, engine._job_receivers):
                        await tg.start(ex.serve, jobs)
                        started += 1
                    if remote is None:
                        yield engine
                    else:
                        async with _open_remote(engine, remote, logger):
                            try:
                                yield engine
                            except BaseException as exc:
                                body_error = exc
                                raise
                except BaseException as exc:
                    if body_error is None:
                        body_error = exc
                    raise
                finally:
                    engine._shutdown()
                    for jobs in engine._job_receivers[started:]:
                        jobs.close()  # receivers no executor took (a start that failed)
        except BaseExceptionGroup as group:
            # Executors never raise (they report failures), so a group holding only the
            # body's own exception is that exception: hand it back as it was raised.
            if body_error is None or group.split(lambda e: e is body_error)[1] is not None:
                raise
            unwrap = True
        if unwrap:
            raise body_error
    finally:
        if threaded:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(ledger.close)

