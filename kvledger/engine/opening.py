"""``open_engine``: a ledger, one executor task per rank, and (optionally) the wire leader.

    open_engine(...) ─► check the options ─► Extras: the step hooks and the ledger observer
                        (extras.py) ─► start the KV event publisher (kv_events)
                     ─► open the ledger (durable: in a worker thread; a cancellation meanwhile
                        closes it, _Opening)
                     ─► build one RankExecutor per RankSpec (planes must fit the geometry)
                     ─► choose how a step reaches the ranks, once (ranks.py):
                           one rank, or every rank inline-able (CPU planes, a plain-function
                           graph)                               InlineRanks
                           otherwise                            DispatchedRanks
                           remote=RemoteRanks(...)              WireRanks around either, on a
                                                                wire leader opened here
                        and the order of steps: depth 1 OneStep, depth > 1 InFlight (steps.py)
                     ─► Engine(...) ─► metrics.track_engine(engine) ─► task group: the
                        dispatched ranks' executor tasks started ─► yield engine
                     ─► on exit (shielded): commands and new steps refused; the step in flight
                        waited for (clean exit) or cancelled and recorded as aborted (error,
                        cancellation); the executors stopped; the leader's links closed;
                        the log closed, the last call on the ledger's path; the publisher
                        stopped (it sends its last batch)

The options of ``open_engine``:

    ranks            an int (that many ranks with no cache planes) or a sequence of RankSpec
    policy           the clear policy (default "released_aliases"; an existing log keeps its
                     own, and naming another raises ConfigurationError)
    backend          the clear backend for ranks that name none: "torch", "cuda", "triton"
    log              a path: the log is created (geometry required) or reopened and replayed
                     (geometry may be None); ledger calls run on the loop for a log that writes
                     in the background, in the engine's worker thread for one that fsyncs inline
    fsync, background   kvledger.durable.open_ledger's (None: its defaults)
    log_options      other open_ledger options (max_lag_bytes, segment_bytes, retain_bytes,
                     retain_segments, checkpoint_every, max_pages, layer)
    check            every invariant after every command (tests, debugging)
    record           keep the events in engine.ledger.events (in-memory ledgers only)
    queue_size       bounds each rank's plan stream
    drain_timeout_s  how long a failed or cancelled step waits for its other ranks to stop
                     before recording the abort (a rank that has not answered by then is not
                     recorded as completed; its late answer is dropped)
    logger           a structlog logger for the engine's (the durable log's, the wire
                     leader's) events; default kvledger.logs.get_logger under
                     "kvledger.engine" ("kvledger" for the log, "kvledger.wire" for the leader)
    remote           a RemoteRanks (remote.py): the engine becomes the wire leader of
                     remote.world_size - 1 peers, listening on remote.listen
                     (engine.remote_address); a peer counts once it proved the job's key
                     (remote.key, else $KVLEDGER_WIRE_KEY, else a fresh one:
                     engine.leader.key); every step then needs all of them READY; on
                     exit the links are closed (peers see the end of the stream and return)
    sanitize         debug mode (SPEC "The sanitizer", sanitizer.py): every local rank with
                     planes runs copies -> poison -> clear -> check -> graph; a violation is
                     recorded (SanitizerViolation), the step aborted, and run_step raises
                     SanitizerError with the page's lifecycle. Its backends must poison and
                     check (every kvledger backend does). Off: nothing of it runs
    metrics          a kvledger.metrics.LedgerMetrics: its observer on the ledger,
                     track_engine, step_completed / step_failed per step, wire_decision per
                     remote handshake, sanitizer_violation; with a log, its timed file layer
                     (unless log_options names a layer)
    kv_events        a kvledger.kvevents.KVEventPublisher, or a ZMQ endpoint, vLLM's
                     --kv-events-config JSON or a mapping of its fields to build one on
                     (kvledger.kvevents.make_publisher; disabled there: none):
                     started (if new) before the ledger opens, its observer on the ledger,
                     flushed after each step's outcome is recorded, stopped at close
    observers        more Ledger observers (seq, event, effects), called after the engine's
                     own, in order; they must not raise
    depth            steps in flight together (1 to MAX_IN_FLIGHT; default 1): up to depth
                     run_step calls hold a sealed step at once, so the caller can issue step
                     k+1's commands and seal it while step k runs; the ranks run them one
                     after the other, in step order. A step that fails aborts itself and
                     every later sealed step (one StepAborted, recorded before the failed
                     step's completions; their clear lists all carry into the next step);
                     each later one runs nothing and raises StepFailedError naming the step
                     that failed. Local ranks only (with remote: ConfigurationError)
    timings          CUDA ranks time every phase with CUDA events (RankTiming's copies_s,
                     clear_s, graph_s, sanitize_s); default off: only the completion event is
                     recorded and those read 0.0 (total_s and clear_host_s are host times,
                     always there; CPU ranks always time their phases). On with metrics
                     or sanitize
    yield_every_s    commands and steps run on the loop give it a turn (a full checkpoint:
                     deadlines fire, cancellations are delivered, other tasks run) at least
                     this often (default 200 us; 0: at every call, trio's rule, about 3 to 10
                     us a call on asyncio); run_step also refuses a caller already cancelled;
                     a call in the worker thread, or a step on dispatched ranks, always yields
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import anyio

from kvledger.core.errors import ConfigurationError, InvalidArgumentError
from kvledger.core.events import CLEAR_POLICIES, Geometry
from kvledger.core.ledger import EventObserver, Ledger
from kvledger.core.state import MAX_IN_FLIGHT
from kvledger.durable import DurableLedger
from kvledger.executors.backend import ClearBackend, as_clear_backend, make_backend
from kvledger.executors.executor import RankExecutor
from kvledger.logs import get_logger

from .access import YIELD_EVERY_S
from .engine import Engine, RankSpec
from .extras import Extras
from .ranks import DispatchedRanks, InlineRanks, RankStrategy, runs_inline
from .remote import RemoteRanks
from .remote_steps import WireRanks

__all__ = ["open_engine"]


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
    fsync: str | None = None,
    background: bool | None = None,
    queue_size: int = 1,
    drain_timeout_s: float = 10.0,
    logger: Any = None,
    remote: RemoteRanks | None = None,
    sanitize: bool = False,
    metrics: Any = None,
    kv_events: Any = None,
    observers: Sequence[EventObserver] = (),
    log_options: Mapping[str, Any] | None = None,
    depth: int = 1,
    timings: bool = False,
    yield_every_s: float = YIELD_EVERY_S,
) -> AsyncIterator[Engine]:
    """Open the embedded engine: a ledger (durable when ``log`` is a path) and one
    executor per rank, in a task group that lives as long as the ``async with``.
    The options are described in this module's docstring.

    Raises ``InvalidArgumentError`` / ``ConfigurationError`` for bad arguments or
    planes that do not fit the geometry (nothing opened), ``ConfigurationError`` for
    a KV event endpoint that cannot be bound, and what opening the log raises
    (``CorruptLogError``, ...). Cancelled while it opens (asyncio's ``task.cancel()``
    too), it closes what it opened. On exit (shielded) the step in flight is waited
    for, or cancelled and recorded as aborted when the body raised or was cancelled;
    then the executors stop, the log is closed (``kvledger.engine`` says what
    callers see; nothing is written after it) and the KV event publisher stops.
    """
    specs = _rank_specs(ranks)
    _check_options(remote, policy, queue_size, depth, timings, yield_every_s)
    extras = Extras(sanitize=sanitize, metrics=metrics, kv_events=kv_events, observers=observers)
    extras.start()
    try:
        ledger = await _open_ledger(geometry, log, policy, check, record, fsync, background, logger,
                                    extras.observer, extras.log_options(log_options) if log is not None else None)
        engine: Engine | None = None
        try:
            executors = _build_executors(specs, ledger.geometry.num_pages, backend, sanitize,
                                         timings or sanitize or extras.metrics is not None)
            local = _local_ranks(executors, queue_size, drain_timeout_s)
            async with _wire(ledger, local, remote, extras, logger) as (ranks, leader, address):
                engine = Engine(ledger, executors, ranks, depth=depth, hooks=extras.hooks, logger=logger,
                                leader=leader, publisher=extras.publisher, metrics=extras.metrics,
                                sanitize=sanitize, remote_address=address, yield_every_s=float(yield_every_s))
                extras.attach(engine)
                async with _running(engine):
                    yield engine
        finally:
            await _close(engine, ledger)
    finally:
        await extras.stop()


def _local_ranks(executors: list[RankExecutor], queue_size: int, drain_timeout_s: float) -> RankStrategy:
    """How a step reaches the local ranks: in run_step's own task when there is one rank or
    every rank is inline-able (CPU planes, a plain-function graph), else dispatched."""
    if len(executors) == 1 or all(map(runs_inline, executors)):
        return InlineRanks(executors)
    return DispatchedRanks(executors, queue_size=queue_size, drain_timeout_s=drain_timeout_s)


async def _close(engine: Engine | None, ledger: Ledger) -> None:
    """The last call on the ledger (shielded): through the engine's path, or directly if
    no engine was built (a rank spec did not fit, the wire leader did not open)."""
    with anyio.CancelScope(shield=True):
        if engine is not None:
            await engine.close_ledger()
        elif isinstance(ledger, DurableLedger):
            await anyio.to_thread.run_sync(ledger.close)


def _check_options(remote: Any, policy: str | None, queue_size: Any, depth: Any, timings: Any,
                   yield_every_s: Any) -> None:
    if remote is not None and not isinstance(remote, RemoteRanks):
        raise InvalidArgumentError(f"remote must be a RemoteRanks or None, got {type(remote).__name__}")
    if policy is not None and policy not in CLEAR_POLICIES:
        raise ConfigurationError(f"unknown clear policy {policy!r}; one of {CLEAR_POLICIES}")
    if type(queue_size) is not int or queue_size < 1:
        raise InvalidArgumentError(f"queue_size must be an int >= 1, got {queue_size!r}")
    if type(depth) is not int or not 1 <= depth <= MAX_IN_FLIGHT:
        raise InvalidArgumentError(f"depth must be an int from 1 to {MAX_IN_FLIGHT}, got {depth!r}")
    if depth > 1 and remote is not None:
        raise ConfigurationError("steps in flight together (depth > 1) run on local ranks only, not with remote ranks")
    if type(timings) is not bool:
        raise InvalidArgumentError(f"timings must be True or False, got {timings!r}")
    if type(yield_every_s) not in (int, float) or not 0 <= yield_every_s <= 1:
        raise InvalidArgumentError(f"yield_every_s must be a number of seconds from 0 to 1, got {yield_every_s!r}")


def _rank_specs(ranks: Any) -> list[RankSpec]:
    if type(ranks) is int:
        if ranks < 1:
            raise InvalidArgumentError(f"ranks must be >= 1, got {ranks}")
        return [RankSpec() for _ in range(ranks)]
    if isinstance(ranks, RankSpec):
        return [ranks]
    try:
        specs = list(ranks)
    except TypeError:
        raise InvalidArgumentError(f"ranks must be an int or a sequence of RankSpec, got {ranks!r}") from None
    if not specs:
        raise InvalidArgumentError("ranks must name at least one rank")
    for i, s in enumerate(specs):
        if not isinstance(s, RankSpec):
            raise InvalidArgumentError(f"ranks[{i}] must be a RankSpec, got {type(s).__name__}")
    return specs


def _build_executors(specs: list[RankSpec], num_pages: int, default_backend: Any,
                     sanitize: bool = False, timings: bool = False) -> list[RankExecutor]:
    world = len(specs)
    out = []
    for rank, spec in enumerate(specs):
        planes = tuple(spec.planes)
        device = planes[0].device if planes else None
        stream = _model_stream(device, spec.stream)
        chosen = spec.backend if spec.backend is not None else default_backend
        backend: ClearBackend | None
        if isinstance(chosen, str):
            backend = make_backend(chosen, planes, stream=stream) if planes else None
        else:
            try:
                backend = as_clear_backend(chosen, num_pages)
            except ConfigurationError as exc:
                raise ConfigurationError(f"rank {rank}: {exc}") from None
        if backend is not None and backend.num_pages != num_pages:
            raise ConfigurationError(f"rank {rank}: planes hold {backend.num_pages} pages but the geometry has "
                                     f"{num_pages}")
        out.append(RankExecutor(rank, num_pages=num_pages, backend=backend, graph=spec.graph, planes=planes,
                                device=device, stream=stream, world_size=world, sanitize=sanitize,
                                timings=timings))
    return out


def _model_stream(device: Any, stream: Any) -> Any:
    """A rank's model stream, resolved once: the one given, or for CUDA planes the device's
    current stream now (what the executor takes by default), handed to the backend too, so
    that no clear looks the current stream up (a device lookup and a new stream object each)."""
    if stream is not None or device is None or getattr(device, "type", None) != "cuda":
        return stream
    import torch

    return torch.cuda.current_stream(device)


async def _open_ledger(geometry, log, policy, check, record, fsync, background, logger, observer,
                       log_options) -> Ledger:
    """The ledger: in memory, or durable when ``log`` is a path (opened in a worker thread),
    with ``observer`` (the engine's composed one, or None). Cancelled while the log opens
    (asyncio's ``task.cancel()`` reaches through anyio's shield), the ledger the thread
    opens is closed, in that thread, and never leaks (``_Opening``)."""
    if log is None:
        if not isinstance(geometry, Geometry):
            raise InvalidArgumentError("geometry must be a Geometry (it may be omitted only with an existing log)")
        return Ledger(geometry, policy=policy or "released_aliases", check=check, record=record, observer=observer)
    from kvledger.durable import open_ledger

    options: dict[str, Any] = dict(log_options or {})
    clash = {"policy", "check", "logger", "fsync", "background", "observer", "path", "geometry"} & options.keys()
    if clash:
        raise InvalidArgumentError(f"log_options may not name {sorted(clash)}: they are open_engine's own options")
    options.update(policy=policy, check=check, logger=logger, observer=observer)
    if fsync is not None:
        options["fsync"] = fsync
    if background is not None:
        options["background"] = background
    opening = _Opening(functools.partial(open_ledger, log, geometry, **options))
    try:
        await anyio.to_thread.run_sync(opening.run)
    except BaseException:
        started, opened = opening.abandon()
        if opened is not None:  # the thread opened it before the cancellation landed: close it here
            opened.close()
        elif started:  # the thread is opening it: it closes it; wait for that
            await opening.wait_finished()
        raise
    return opening.result()


class _Opening:
    """A durable ledger opened in a worker thread, whose caller may be cancelled meanwhile
    (asyncio's own ``task.cancel()`` reaches through anyio's shield around the thread). The
    cancelled caller marks it abandoned (``abandon``) and, if the thread had begun, waits for
    it (``wait_finished``): a thread that finds it abandoned before it opens opens nothing;
    one that finds it abandoned once it opened closes what it opened. So nothing is left
    once the cancellation goes on (a retry finds the log unlocked)."""

    def __init__(self, opener: Callable[[], DurableLedger]) -> None:
        self._opener = opener
        self._lock = threading.Lock()
        self._ledger: DurableLedger | None = None
        self._error: BaseException | None = None
        self._abandoned = self._started = False
        self._finished = threading.Event()

    def run(self) -> None:
        """In the worker thread: open (unless abandoned already); keep the ledger for the caller,
        or close it when the caller went away meanwhile."""
        try:
            with self._lock:
                if self._abandoned:
                    return
                self._started = True
            try:
                ledger = self._opener()
            except BaseException as exc:
                self._error = exc
                return
            with self._lock:
                if not self._abandoned:
                    self._ledger = ledger
                    return
            ledger.close()
        finally:
            self._finished.set()

    def abandon(self) -> tuple[bool, DurableLedger | None]:
        """The caller goes away: ``(started, ledger)``: whether the thread had begun to open,
        and the ledger if it had opened it already (the caller closes it; else the thread
        closes what it opens)."""
        with self._lock:
            self._abandoned = True
            ledger, self._ledger = self._ledger, None
            return self._started, ledger

    async def wait_finished(self) -> None:
        """Until the thread is done (shielded; a cancellation landing again meanwhile is waited
        through: the open takes milliseconds). Another exception leaves at once."""
        cancelled = (anyio.get_cancelled_exc_class(), asyncio.CancelledError)
        with anyio.CancelScope(shield=True):
            while not self._finished.is_set():
                try:
                    await anyio.to_thread.run_sync(self._finished.wait, 0.05)
                except cancelled:
                    continue

    def result(self) -> DurableLedger:
        if self._error is not None:
            raise self._error
        assert self._ledger is not None
        return self._ledger


@contextlib.asynccontextmanager
async def _wire(ledger: Ledger, local: RankStrategy, remote: RemoteRanks | None, extras: Extras, logger: Any
                ) -> AsyncIterator[tuple[RankStrategy, Any, tuple[str, int] | None]]:
    """The ranks' strategy: ``local``, or, with remote ranks, the wire leader's around it
    (``WireRanks``), listening on ``remote.listen``; yields (strategy, leader, address). On
    exit the leader's links close (peers see the end of the stream and return)."""
    if remote is None:
        yield local, None, None
        return
    from kvledger.wire.rank import open_leader

    async with open_leader(
        ledger.geometry,
        world_size=remote.world_size,
        next_step=ledger.open_step,
        close_grace=remote.close_grace,
        logger=logger if logger is not None else get_logger("kvledger.wire"),
        key=remote.key,
        handshake_timeout=remote.handshake_timeout,
        max_pending=remote.max_pending,
        pinned=remote.pinned,
    ) as leader:
        address = await leader.listen_tcp(*remote.listen) if remote.listen is not None else None
        yield WireRanks(local, leader, remote, extras.decided, logger if logger is not None
                        else get_logger("kvledger.engine")), leader, address


@contextlib.asynccontextmanager
async def _running(engine: Engine) -> AsyncIterator[None]:
    """The executors' task group around the body.

    On exit: new commands and steps are refused and the step in flight is waited for
    (the body returned) or cancelled and recorded as aborted (the body raised or was
    cancelled), shielded; then the executors stop. Executors never raise (they report
    failures), so a task group error that holds only the body's own exception is that
    exception: it comes out as it was raised.
    """
    body_error: BaseException | None = None
    unwrap = False
    try:
        async with anyio.create_task_group() as tg:
            try:
                await engine.start_ranks(tg)
                try:
                    yield
                except BaseException as exc:
                    body_error = exc
                    raise
                finally:
                    with anyio.CancelScope(shield=True):
                        await engine.settle_in_flight(abort=body_error is not None)
            except BaseException as exc:
                if body_error is None:
                    body_error = exc
                raise
            finally:
                engine.stop_ranks()
    except BaseExceptionGroup as group:
        if body_error is None or group.split(lambda e: e is body_error)[1] is not None:
            raise
        unwrap = True
    if unwrap and body_error is not None:
        raise body_error
