"""One step across the ranks: seal, run on the ranks' strategy, record; and the order of steps.

    OneStep.run(step)         depth 1: one step at a time (a lock around seal -> settle)
    InFlight.run(step)        depth > 1: up to depth sealed steps; each seals in order, yields
                              once, then waits for the step sealed before it to settle; a step
                              an earlier one's abort reached runs nothing (StepFailedError)
      └─► StepRunner.seal     the ledger's seal (on its path) ─► SealedStep ─► hooks' sealed()
          StepRunner.run_sealed
              ─► RankStrategy.run (ranks.py: inline, dispatched; remote_steps.py: the wire
                 around either), in a scope the engine's close may cancel when it may yield
              ─► every rank ok:  StepRecorder.completed ─► StepResult
                 any rank not:   StepRecorder.aborted (violations, StepAborted, completions of
                                 the ranks that ran) ─► hooks' failed() ─► StepFailedError
                                 (or the hook's error: SanitizerError, chained to it)
                 interrupted (the caller cancelled, the engine closes): the strategy stopped
                                 its ranks; the same record, shielded; then the cancellation
                                 (or EngineClosedError) re-raised

Nothing is recorded before the seal: a caller cancelled while the seal waits for the
worker thread leaves the step open. After the seal every exit records the step's
outcome (see ``kvledger.engine``), through the engine's one path to the ledger
(``recorder.py``); a failure to record it breaks the engine. Steps in flight: an
abort recorded for step k names every later step in flight (``StepRecorder.cascaded``);
each of those, when its turn comes, runs nothing and raises ``StepFailedError`` naming k.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import anyio
import anyio.lowlevel

from kvledger.core.errors import EngineClosedError, StepFailedError
from kvledger.executors.executor import RankOutcome, RankTiming, StepInputs, StepReplies

from .access import LedgerAccess
from .plugins import StepHook
from .ranks import RankStrategy
from .recorder import StepRecorder
from .records import SealedStep, StepResult

__all__ = ["InFlight", "OneStep", "StepResult", "StepRunner"]


class StepRunner:
    """Seals steps and runs sealed ones on ``ranks``, recording through ``recorder``; ``hooks``
    hear of every seal and every failure (``plugins.StepHook``)."""

    def __init__(self, access: LedgerAccess, ranks: RankStrategy, recorder: StepRecorder,
                 hooks: Sequence[StepHook] = ()) -> None:
        self._access = access
        self._ledger = access.ledger
        self.ranks = ranks
        self.recorder = recorder
        self.hooks = tuple(hooks)
        self.world_size = ranks.world_size
        self._all_ranks = tuple(range(self.world_size))
        self._scope: anyio.CancelScope | None = None  # the running step's, while it may wait
        self.aborting = False  # the engine is closing after an error: abort what is in flight

    def abort_in_flight(self) -> None:
        """The engine closes after an error: cancel the step in flight (it is recorded as
        aborted, its caller gets ``EngineClosedError``), and any step sealed from now on."""
        self.aborting = True
        if self._scope is not None:
            self._scope.cancel()

    def seal_here(self, step: int, payload: bytes, t0: float) -> SealedStep:
        """``seal`` where the access is direct (``LedgerAccess.direct``): no coroutine."""
        sealed = SealedStep(self._ledger.seal_step(step), t0, payload)
        for hook in self.hooks:
            hook.sealed(sealed)
        return sealed

    async def seal(self, step: int, payload: bytes, t0: float) -> SealedStep:
        """Seal ``step`` (the ledger's ``StepOrderError`` when it is not the open one: nothing
        changed) and tell the hooks. A caller cancelled while a seal waits for the worker
        thread: nothing recorded, unless the seal went through meanwhile (then it is
        recorded as aborted, "cancelled before dispatch")."""
        access = self._access
        if access.direct:
            plan = self._ledger.seal_step(step)
        else:
            box: list = []
            try:
                plan = await access.call(self._seal_into, step, box)
            except BaseException:
                if box:  # sealed in the worker thread, but our caller was cancelled meanwhile
                    with anyio.CancelScope(shield=True):
                        await self.ranks.abandoned(box[0])
                        await self.recorder.aborted(step, (), "cancelled before dispatch")
                raise  # not sealed (StepOrderError, closed, or cancelled before the seal): nothing recorded
        sealed = SealedStep(plan, t0, payload)
        for hook in self.hooks:
            hook.sealed(sealed)
        return sealed

    def _seal_into(self, step: int, box: list) -> Any:
        plan = self._ledger.seal_step(step)
        box.append(plan)
        return plan

    async def run_sealed(self, sealed: SealedStep, inputs: Sequence[StepInputs]) -> StepResult:
        """Run ``sealed`` on every rank and record its outcome: a ``StepResult``, or
        ``StepFailedError`` / ``EngineClosedError`` once the abort is recorded."""
        if self.aborting:  # sealed while the engine began closing after an error
            await self.recorder.aborted(sealed.step, (), "engine closed")
            raise EngineClosedError(f"the engine closed before step {sealed.step} ran; it was recorded as aborted")
        replies = StepReplies(self.world_size)
        if self.ranks.may_yield:
            outcomes = await self._run_abortable(sealed, inputs, replies)
        else:
            try:
                outcomes = await self.ranks.run(sealed, inputs, replies)
            except BaseException as exc:  # (only a graph that awaited can be interrupted)
                await self._interrupted(sealed, replies, exc)
                raise
        if len(outcomes) == self.world_size:
            for o in outcomes:
                if o.status != "ok":
                    break
            else:
                timings = _timings(outcomes)
                if self._access.records_here():
                    return self.recorder.completed_here(sealed, self._all_ranks, timings)
                return await self.recorder.completed(sealed, self._all_ranks, timings)
        await self._fail(sealed, outcomes)

    async def _run_abortable(self, sealed: SealedStep, inputs: Sequence[StepInputs], replies: StepReplies
                             ) -> list[RankOutcome]:
        """The strategy in a scope the engine's close may cancel (the step is then recorded
        as aborted and this raises ``EngineClosedError``)."""
        with anyio.CancelScope() as scope:
            self._scope = scope
            try:
                return await self.ranks.run(sealed, inputs, replies)
            except BaseException as exc:
                await self._interrupted(sealed, replies, exc)
                raise
            finally:
                self._scope = None
        await anyio.lowlevel.checkpoint_if_cancelled()  # our caller's own cancellation comes first
        raise EngineClosedError(f"the engine closed while step {sealed.step} ran; it was recorded as aborted")

    async def _interrupted(self, sealed: SealedStep, replies: StepReplies, exc: BaseException) -> None:
        """The strategy was interrupted (it stopped its ranks): record the step as aborted,
        with the completions of the ranks that finished, shielded. A step the wire aborted
        (``StepFailedError`` from the handshake) carries its reason on ``sealed``."""
        with anyio.CancelScope(shield=True):
            ok = tuple(sorted(o.rank for o in replies.outcomes if o.status == "ok"))
            error = exc if isinstance(exc, StepFailedError) else None
            await self.recorder.aborted(sealed.step, ok, sealed.abort_reason or self._reason(exc), error=error)

    def _reason(self, exc: BaseException) -> str:
        if not isinstance(exc, anyio.get_cancelled_exc_class()):
            return repr(exc)
        return "engine closed" if self.aborting else "cancelled"

    async def _fail(self, sealed: SealedStep, outcomes: Sequence[RankOutcome]) -> NoReturn:
        """Record a step some rank did not complete, and raise ``StepFailedError`` naming it
        (or what a hook's ``failed`` returns, chained to it: ``SanitizerError`` when a rank's
        check found violations, each recorded first)."""
        plan, step = sealed.plan, sealed.step
        failures = [(o.rank, o.error) for o in outcomes if o.status == "failed" and o.error is not None]
        found = [(o.rank, v) for o in outcomes for v in o.violations]
        ok_ranks = tuple(sorted(o.rank for o in outcomes if o.status == "ok"))
        if failures:
            first_rank, first = failures[0]
            reason = f"rank {first_rank} failed: {type(first).__name__}: {first}"
        else:  # a rank answered "cancelled" unasked, or its executor task ended without answering
            first_rank = min(set(self._all_ranks).difference(ok_ranks))
            reason = f"rank {first_rank} cancelled"
        err = StepFailedError(step, first_rank, failures, "" if failures else "cancelled", plan.clear_list)
        await self.recorder.aborted(step, ok_ranks, reason, found, rank=first_rank, error=err)
        for hook in self.hooks:
            instead = hook.failed(sealed, err, found)
            if instead is not None:
                raise instead from err
        if failures:
            raise err from failures[0][1]
        raise err


def _timings(outcomes: Sequence[RankOutcome]) -> tuple[RankTiming, ...]:
    """The local ranks' timings, by rank (remote peers report none)."""
    if len(outcomes) == 1:
        timing = outcomes[0].timing
        return () if timing is None else (timing,)
    timings = [o.timing for o in outcomes if o.timing is not None]
    if len(timings) > 1:
        timings.sort(key=_by_rank)
    return tuple(timings)


def _by_rank(t: RankTiming) -> int:
    return t.rank


class OneStep:
    """``depth`` 1: one step at a time, seal to settle, under one lock (``wait_settled`` waits
    for the step holding it)."""

    def __init__(self, runner: StepRunner, access: LedgerAccess) -> None:
        self._runner = runner
        self._access = access
        self._lock = StepLock()

    async def run(self, step: int, inputs: Sequence[StepInputs], payload: bytes) -> StepResult:
        access = self._access
        lock = self._lock
        if lock.held:
            await lock.acquire()  # cancelled before it holds the lock: nothing sealed
        else:
            lock.held = True  # (the free path of acquire, inlined)
        try:
            if not access.is_open:  # closing began while this call waited for the lock
                access.check_open()
            t0 = time.perf_counter()
            runner = self._runner
            sealed = runner.seal_here(step, payload, t0) if access.direct else await runner.seal(step, payload, t0)
            return await runner.run_sealed(sealed, inputs)
        finally:
            lock.release()

    async def wait_settled(self) -> None:
        """Closing (no step is sealed any more): wait until the step in flight settled."""
        await self._lock.acquire()
        self._lock.release()


class StepLock:
    """The step lock of ``OneStep``: FIFO, handed from holder to the next waiter, and free of
    any checkpoint on its free path (``run_step`` has just passed its cancellation point;
    anyio's ``Lock`` costs about 3 us there). A waiter cancelled while it waits leaves the
    queue; one cancelled just as the lock was handed to it hands it on."""

    __slots__ = ("held", "_waiters")

    def __init__(self) -> None:
        self.held = False
        self._waiters: collections.deque[anyio.Event] = collections.deque()

    async def acquire(self) -> None:
        if not self.held:
            self.held = True
            return
        ev = anyio.Event()
        self._waiters.append(ev)
        try:
            await ev.wait()
        except BaseException:
            if ev.is_set():  # handed the lock just as the cancellation came: pass it on
                self.release()
            else:
                self._waiters.remove(ev)
            raise

    def release(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()  # the next holder (the lock stays held)
        else:
            self.held = False


class InFlight:
    """``depth`` > 1: up to ``depth`` steps sealed at once; the ranks run them one after the
    other, in step order (module docstring)."""

    def __init__(self, runner: StepRunner, access: LedgerAccess, depth: int) -> None:
        self._runner = runner
        self._recorder = runner.recorder
        self._access = access
        self._slots = fast_semaphore(depth)  # steps sealed and not yet settled
        self._seal_lock = fast_lock()  # seal and join the chain, in step order
        self._tail: anyio.Event | None = None  # set once the last sealed step settled

    async def run(self, step: int, inputs: Sequence[StepInputs], payload: bytes) -> StepResult:
        """Seal now, in order; run on the ranks once the step sealed before it settled (a
        rank runs one step at a time, in step order); a step an earlier one's abort reached
        runs nothing and raises (``_wait_turn``). The next step's wait ends when this one settled."""
        access = self._access
        async with self._slots:
            if not access.is_open:
                access.check_open()
            t0 = time.perf_counter()
            async with self._seal_lock:
                runner = self._runner
                sealed = runner.seal_here(step, payload, t0) if access.direct else await runner.seal(step, payload, t0)
                prev, mine = self._tail, anyio.Event()
                self._tail = mine
            try:
                await self._wait_turn(sealed, prev)
                return await self._runner.run_sealed(sealed, inputs)
            finally:
                mine.set()

    async def _wait_turn(self, sealed: SealedStep, prev: anyio.Event | None) -> None:
        """Yield once (a scheduler task may seal the next step before this one runs, also
        with inline ranks, which never yield while they run), then wait until the step sealed
        before this one (``prev``'s) settled. Raises, with nothing run:
        ``StepFailedError`` (``EngineClosedError`` while the engine closes after an error)
        when that step's abort, or an earlier one's, reached this one (recorded by that
        abort: one ``StepAborted`` for them all); on cancellation, this step's abort is
        recorded at once, then the wait goes on shielded (the ranks never run two steps
        at once) and the cancellation is re-raised."""
        step, recorder = sealed.step, self._recorder
        try:
            await anyio.lowlevel.checkpoint()
            if prev is not None:
                await prev.wait()
        except BaseException:
            await recorder.aborted(step, (), "cancelled before it ran", only_in_flight=True)
            if prev is not None:
                with anyio.CancelScope(shield=True):
                    await prev.wait()
            recorder.cascaded(step)
            raise
        cause = recorder.cascaded(step)
        if cause is None:
            return
        first, rank, reason = cause
        recorder.count_aborted()
        if self._runner.aborting:
            raise EngineClosedError(f"the engine closed before step {step} ran; it was aborted with step {first}")
        raise StepFailedError(step, rank, (), f"aborted with step {first} ({reason})", sealed.plan.clear_list)

    async def wait_settled(self) -> None:
        """Closing (no step is sealed any more): wait until every sealed step settled."""
        async with self._seal_lock:
            tail = self._tail
            if tail is not None:
                await tail.wait()


def fast_lock() -> anyio.Lock:
    """A lock that does not yield when it is free (anyio >= 4.5), or a plain one."""
    try:
        return anyio.Lock(fast_acquire=True)
    except TypeError:
        return anyio.Lock()


def fast_semaphore(n: int) -> anyio.Semaphore:
    """A semaphore that does not yield while it has room (anyio >= 4.5), or a plain one."""
    try:
        return anyio.Semaphore(n, fast_acquire=True)
    except TypeError:
        return anyio.Semaphore(n)
