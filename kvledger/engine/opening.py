"""``open_engine``: a ledger, one executor task per rank, and (optionally) the wire leader.

    open_engine(...) ─► check the options ─► start the KV event publisher (kv_events)
                     ─► open the ledger (durable: in a worker thread), its observer composed
                        of the metrics', the publisher's, the sanitizer's and the caller's
                     ─► build one RankExecutor per RankSpec (planes must fit the geometry)
                     ─► metrics.track_engine(engine) ─► task group: every executor's serve()
                        started ─► [wire leader] ─► yield engine
                     ─► on exit (shielded): commands and new steps refused; the step in flight
                        waited for (clean exit) or cancelled and recorded as aborted (error,
                        cancellation); the leader's links closed; the executors stopped;
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
                     (engine.remote_address); every step then needs all of them READY; on
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
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anyio

from kvledger.core.errors import ConfigurationError, InvalidArgumentError
from kvledger.core.events import CLEAR_POLICIES, Geometry
from kvledger.core.ledger import EventObserver, Ledger
from kvledger.core.state import MAX_IN_FLIGHT
from kvledger.executors.backend import make_backend
from kvledger.executors.executor import RankExecutor
from kvledger.logs import get_logger

from .engine import Engine, RankSpec
from .extras import Extras
from .remote import RemoteRanks

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
) -> AsyncIterator[Engine]:
    """Open the embedded engine: a ledger (durable when ``log`` is a path) and one
    executor task per rank, in a task group that lives as long as the ``async with``.
    The options are described in this module's docstring.

    Raises ``InvalidArgumentError`` / ``ConfigurationError`` for bad arguments or
    planes that do not fit the geometry (nothing opened), ``ConfigurationError`` for
    a KV event endpoint that cannot be bound, and what opening the log raises
    (``CorruptLogError``, ...). On exit (shielded) the step in flight is waited
    for, or cancelled and recorded as aborted when the body raised or was cancelled;
    then the executors stop, the log is closed (``kvledger.engine`` says what
    callers see; nothing is written after it) and the KV event publisher stops.
    """
    specs = _rank_specs(ranks)
    _check_options(remote, policy, queue_size, depth)
    extras = Extras(sanitize=sanitize, metrics=metrics, kv_events=kv_events, observers=observers)
    extras.start()
    engine: Engine | None = None
    try:
        ledger = await _open_ledger(geometry, log, policy, check, record, fsync, background, logger,
                                    extras.observer, extras.log_options(log_options) if log is not None else None)
        try:
            executors = _build_executors(specs, ledger.geometry.num_pages, backend, sanitize)
            engine = Engine(ledger, executors, queue_size=queue_size, drain_timeout_s=drain_timeout_s,
                            logger=logger, extras=extras, depth=depth)
            extras.attach(engine)
            async with _running(engine, remote, logger):
                yield engine
        finally:
            await _close(engine, ledger)
    finally:
        await extras.stop()


async def _close(engine: Engine | None, ledger: Ledger) -> None:
    """The last call on the ledger (shielded): through the engine's path, or directly if
    no engine was built (a rank spec did not fit)."""
    with anyio.CancelScope(shield=True):
        if engine is not None:
            await engine._close_ledger()
        elif hasattr(ledger, "close"):
            await anyio.to_thread.run_sync(ledger.close)


def _check_options(remote: Any, policy: str | None, queue_size: Any, depth: Any) -> None:
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
                     sanitize: bool = False) -> list[RankExecutor]:
    world = len(specs)
    out = []
    for rank, spec in enumerate(specs):
        planes = tuple(spec.planes)
        chosen = spec.backend if spec.backend is not None else default_backend
        if isinstance(chosen, str):
            backend = make_backend(chosen, planes, stream=spec.stream) if planes else None
        else:
            if not callable(getattr(chosen, "clear", None)):
                raise ConfigurationError(f"rank {rank}: backend {chosen!r} has no clear(page_ids)")
            backend = chosen
        device = getattr(planes[0], "device", None) if planes else None
        have = getattr(backend, "num_pages", None)
        if have is not None and have != num_pages:
            raise ConfigurationError(f"rank {rank}: planes hold {have} pages but the geometry has {num_pages}")
        out.append(RankExecutor(rank, num_pages=num_pages, backend=backend, graph=spec.graph, planes=planes,
                                device=device, stream=spec.stream, world_size=world, sanitize=sanitize))
    return out


async def _open_ledger(geometry, log, policy, check, record, fsync, background, logger, observer,
                       log_options) -> Ledger:
    """The ledger: in memory, or durable when ``log`` is a path (opened in a worker thread),
    with ``observer`` (the engine's composed one, or None)."""
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
    opener = functools.partial(open_ledger, log, geometry, **options)
    return await anyio.to_thread.run_sync(opener)


@contextlib.asynccontextmanager
async def _running(engine: Engine, remote: RemoteRanks | None, logger: Any) -> AsyncIterator[None]:
    """The executors' task group (and the wire leader) around the body.

    On exit, before the leader's links close: new commands and steps are refused and
    the step in flight is waited for (the body returned) or cancelled and recorded as
    aborted (the body raised or was cancelled), shielded; then the executors stop.
    Executors never raise (they report failures), so a task group error that holds
    only the body's own exception is that exception: it comes out as it was raised.
    """
    body_error: BaseException | None = None
    unwrap = False
    started = 0
    try:
        async with anyio.create_task_group() as tg:
            try:
                for rank, jobs in enumerate(engine._job_receivers):
                    await tg.start(engine._serve_rank, rank, jobs)
                    started += 1
                async with _open_remote(engine, remote, logger) if remote is not None else contextlib.nullcontext():
                    try:
                        yield
                    except BaseException as exc:
                        body_error = exc
                        raise
                    finally:
                        with anyio.CancelScope(shield=True):
                            await engine._settle_in_flight(abort=body_error is not None)
            except BaseException as exc:
                if body_error is None:
                    body_error = exc
                raise
            finally:
                engine._stop_executors()
                for jobs in engine._job_receivers[started:]:
                    jobs.close()  # receivers no executor took (a start that failed)
    except BaseExceptionGroup as group:
        if body_error is None or group.split(lambda e: e is body_error)[1] is not None:
            raise
        unwrap = True
    if unwrap and body_error is not None:
        raise body_error


@contextlib.asynccontextmanager
async def _open_remote(engine: Engine, remote: RemoteRanks, logger: Any) -> AsyncIterator[None]:
    from kvledger.wire.rank import open_leader

    async with open_leader(
        engine.geometry,
        world_size=remote.world_size,
        next_step=engine.open_step,
        close_grace=remote.close_grace,
        logger=logger if logger is not None else get_logger("kvledger.wire"),
    ) as leader:
        if remote.listen is not None:
            engine.remote_address = await leader.listen_tcp(*remote.listen)
        engine._steps.leader, engine._steps.remote = leader, remote
        try:
            yield
        finally:
            engine._steps.leader = None
