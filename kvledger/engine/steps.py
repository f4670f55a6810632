"""``StepRunner``: one step across the ranks, and what is recorded when it does not complete.

    run(step) ─► seal (a ledger call) ─► [remote: PREPARE/READY/LAUNCH with the peers,
                                          remote_steps.py]
              ─► the ranks' parts:
                   inline ranks (CPU planes, a plain-function graph): each rank's job in this
                   task, in rank order (no stream hop, no task switch); after a failure the
                   later ranks' jobs are cancelled before they start
                   otherwise: one StepJob per rank over its bounded stream, wait for the outcomes
                   a rank failed: cancel the others, wait for them (drain_timeout_s at most)
                   the caller cancelled: the same, shielded, then the cancellation re-raised
                   the engine closes after an error: the same, then EngineClosedError
              ─► [remote: every peer's COMPLETE, or its failure, loss or silence]
              ─► record (shielded): [SanitizerViolation per violation a rank's check found,]
                 StepAborted if any rank did not complete, StepCompleted per rank that finished,
                 [the KV event publisher's flush]
              ─► StepResult, or StepFailedError naming the first failed rank (SanitizerError,
                 chained to it, when the sanitizer found violations)

Sanitize mode (``sanitizer``, a ``SanitizerTracker``): after the seal, every local
rank's job carries the plan's poison and committed lists (``sanitizer.py``).
``metrics`` (a ``LedgerMetrics``) hears of every completed or failed step, every
wire decision and every violation; ``kv_flush`` (a publisher's ``flush``) runs
after each step's outcome is recorded, on the ledger's path. Each is None when
unused, and then costs one attribute test per step.

Steps in flight (``depth`` > 1): ``run`` seals under the seal lock and joins a
chain of events (each step's set once it settled), yields once so that a
scheduler task may seal the next step, then waits for the previous step's event
before its ranks run. An abort recorded for step k (``_abort``, on the ledger's
path) names every later step in flight in ``_cascaded``; each of those, when its
turn comes, runs nothing and raises ``StepFailedError`` naming step k.

Nothing is recorded before the seal: a caller cancelled while the seal waits
for the worker thread leaves the step open. After the seal every exit records
the step's outcome (see ``kvledger.engine``), through the engine's one path to
the ledger (``access.py``); a failure to record it breaks the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import anyio
import anyio.lowlevel
import msgspec

from kvledger.core.errors import EngineClosedError, StepFailedError
from kvledger.core.events import StepPlan
from kvledger.executors.executor import RankExecutor, RankOutcome, RankTiming, StepInputs, StepJob, StepReplies

from .access import LedgerAccess
from .remote_steps import RemoteSteps
from .sanitizer import SanitizerTracker

__all__ = ["StepResult", "StepRunner"]


class StepResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A step that completed on every rank: its clear list, per-rank timings (by rank)
    and the engine's wall time from seal to the last completion recorded."""

    step: int
    clear_list: tuple[int, ...]
    ranks: tuple[RankTiming, ...]
    wall_s: float


class StepRunner(RemoteSteps):
    """Runs the engine's steps: one at a time (``depth`` 1: the engine holds its slot lock
    around ``run``), or up to ``depth`` sealed at once, run on the ranks one after the other.

    ``inline``: every local rank runs synchronously (planes on the CPU, a graph that
    is a plain function or none): its job runs in ``run``'s own task, rank after
    rank, instead of going through the rank's stream to its executor task.
    """

    def __init__(self, access: LedgerAccess, executors: Sequence[RankExecutor], senders: Sequence[Any], *,
                 inline: bool, drain_timeout_s: float, logger: Any, metrics: Any = None,
                 kv_flush: Callable[[], Any] | None = None, sanitizer: SanitizerTracker | None = None,
                 depth: int = 1) -> None:
        self._access = access
        self._ledger = access.ledger
        self._executors = tuple(executors)
        self._senders = list(senders)
        self.world_size = len(self._senders)
        self._all_ranks = tuple(range(self.world_size))
        self._inline = inline
        self._drain_timeout_s = drain_timeout_s
        self._log = logger
        self._scope: anyio.CancelScope | None = None  # the running step's, while it may wait
        self._aborting = False  # the engine is closing after an error: abort what is in flight
        self._replies: StepReplies | None = None  # the dispatched step's, while it waits for answers
        self._gone: set[int] = set()  # ranks whose executor task ended
        self._sink: StepReplies | None = None  # where inline jobs answer (run_job also returns the outcome)
        self._new_scope: Any = anyio.CancelScope
        self.leader: Any = None  # the wire leader, while remote ranks are attached
        self.remote: Any = None  # their RemoteRanks
        self.steps_completed = self.steps_aborted = self.pages_cleared = 0
        self.metrics = metrics
        self.kv_flush = kv_flush
        self.sanitizer = sanitizer
        self.depth = depth
        self._seal_lock = _fast_lock() if depth > 1 else None  # seal, take the lists, join the chain
        self._tail: anyio.Event | None = None  # set once the last sealed step settled (depth > 1)
        self._cascaded: dict[int, tuple[int, int, str]] = {}  # step -> (aborting step, its rank, reason)

    def close(self) -> None:
        """No more plans: the executors stop after their current one."""
        for s in self._senders:
            s.close()

    def abort_in_flight(self) -> None:
        """The engine closes after an error: cancel the step in flight (it is recorded as
        aborted, its caller gets ``EngineClosedError``), and any step sealed from now on."""
        self._aborting = True
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, step: int, per_rank: list[StepInputs], payload: bytes = b"") -> StepResult:
        """Seal ``step``, run it on every rank, record the outcome: a ``StepResult``, or
        ``StepFailedError`` / ``EngineClosedError`` once the abort is recorded."""
        if self._seal_lock is not None:
            return await self._run_in_flight(step, per_rank, payload)
        t0 = time.perf_counter()
        plan = await self._seal(step)
        lists = self.sanitizer.take(step) if self.sanitizer is not None else _NO_LISTS
        return await self._run_plan(plan, lists, per_rank, payload, t0)

    async def _run_in_flight(self, step: int, per_rank: list[StepInputs], payload: bytes) -> StepResult:
        """``run`` with steps in flight together (``depth`` > 1): seal now, in order; run on
        the ranks once the step sealed before it settled (a rank runs one step at a time,
        in step order); a step an earlier one's abort reached runs nothing and raises
        (``_wait_turn``). The next step's wait ends when this one settled."""
        t0 = time.perf_counter()
        assert self._seal_lock is not None
        async with self._seal_lock:
            plan = await self._seal(step)
            lists = self.sanitizer.take(step) if self.sanitizer is not None else _NO_LISTS
            prev, mine = self._tail, anyio.Event()
            self._tail = mine
        try:
            await self._wait_turn(plan, prev)
            return await self._run_plan(plan, lists, per_rank, payload, t0)
        finally:
            mine.set()

    async def _wait_turn(self, plan: StepPlan, prev: anyio.Event | None) -> None:
        """Yield once (a scheduler task may seal the next step before this one runs, also
        with inline ranks, which never yield while they run), then wait until the step sealed
        before ``plan`` (``prev``'s) settled. Raises, with nothing run:
        ``StepFailedError`` (``EngineClosedError`` while the engine closes after an error)
        when that step's abort, or an earlier one's, reached this one (recorded by that
        abort: one ``StepAborted`` for them all); on cancellation, this step's abort is
        recorded at once, then the wait goes on shielded (the ranks never run two steps
        at once) and the cancellation is re-raised."""
        step = plan.step
        try:
            await anyio.lowlevel.checkpoint()
            if prev is not None:
                await prev.wait()
        except BaseException:
            await self.settle(step, (), "cancelled before it ran", rank=-1, only_in_flight=True)
            if prev is not None:
                with anyio.CancelScope(shield=True):
                    await prev.wait()
            self._cascaded.pop(step, None)
            raise
        cause = self._cascaded.pop(step, None)
        if cause is None:
            return
        first, rank, reason = cause
        self.steps_aborted += 1
        if self._aborting:
            raise EngineClosedError(f"the engine closed before step {step} ran; it was aborted with step {first}")
        raise StepFailedError(step, rank, (), f"aborted with step {first} ({reason})", plan.clear_list)

    async def _run_plan(self, plan: StepPlan, lists: tuple, per_rank: list[StepInputs], payload: bytes,
                        t0: float) -> StepResult:
        """A sealed plan on every rank, and its outcome recorded (``run``)."""
        step = plan.step
        if self._aborting:  # sealed while the engine began closing after an error
            await self.settle(step, (), "engine closed")
            raise EngineClosedError(f"the engine closed before step {step} ran; it was recorded as aborted")
        if self._inline and self.leader is None:
            outcomes = await self._run_inline(plan, per_rank, lists)
        else:
            outcomes = await self._run_waiting(plan, per_rank, payload, lists)
        remote = await self._collect_remote(step) if self.leader is not None else None
        if len(outcomes) == self.world_size and (remote is None or remote.ok):
            for o in outcomes:
                if o.status != "ok":
                    break
            else:
                result = await self._complete(plan, outcomes, t0, remote.completed if remote else ())
                if self.metrics is not None:
                    self.metrics.step_completed(result)
                return result
        ok_ranks = tuple(sorted(o.rank for o in outcomes if o.status == "ok"))
        if remote is None:
            await self._fail(plan, outcomes, ok_ranks, lists[1])
        await self._fail(plan, outcomes, ok_ranks + remote.completed, lists[1], remote.failures)

    async def wait_settled(self) -> None:
        """Closing: wait until every sealed step settled (with ``depth`` > 1; the engine's
        slot lock does it for one step at a time). No step is sealed meanwhile."""
        if self._seal_lock is None:
            return
        async with self._seal_lock:
            tail = self._tail
            if tail is not None:
                await tail.wait()

    async def _complete(self, plan: StepPlan, outcomes: list[RankOutcome], t0: float,
                        remote_ranks: tuple[int, ...] = ()) -> StepResult:
        """Every rank completed (local ones, and the peers' COMPLETEs): record it, and the
        ``StepResult`` (timings of the local ranks)."""
        await self.settle(plan.step, self._all_ranks + remote_ranks, None)
        self.pages_cleared += len(plan.clear_list)
        timings: list[Any] = [o.timing for o in outcomes]
        if not self._inline:
            timings.sort(key=_by_rank)
        return StepResult(step=plan.step, clear_list=plan.clear_list, ranks=tuple(timings),
                          wall_s=time.perf_counter() - t0)

    async def _seal(self, step: int) -> StepPlan:
        access = self._access
        if access.direct:
            return self._ledger.seal_step(step)
        box: list = []
        try:
            return await access.call(self._seal_into, step, box)
        except BaseException:
            if box:  # sealed in the worker thread, but our caller was cancelled meanwhile
                if self.leader is not None:
                    with anyio.CancelScope(shield=True):
                        await self._wire_catch_up(box[0])
                await self.settle(step, (), "cancelled before dispatch")
            raise  # not sealed (StepOrderError, closed, or cancelled before the seal): nothing recorded

    def _seal_into(self, step: int, box: list) -> StepPlan:
        plan = self._ledger.seal_step(step)
        box.append(plan)
        return plan

    async def _run_waiting(self, plan: StepPlan, per_rank: list[StepInputs], payload: bytes,
                           lists: tuple) -> list[RankOutcome]:
        """The handshake with the peers and the ranks' parts, in a scope the engine's close
        may cancel (the step is then recorded as aborted and this raises ``EngineClosedError``)."""
        with anyio.CancelScope() as scope:
            self._scope = scope
            try:
                if self.leader is not None:
                    await self._remote_handshake(plan, payload)
                if self._inline:
                    return await self._run_inline(plan, per_rank, lists)
                return await self._dispatch(plan, per_rank, lists)
            finally:
                self._scope = None
        await anyio.lowlevel.checkpoint_if_cancelled()  # our caller's own cancellation comes first
        raise EngineClosedError(f"the engine closed while step {plan.step} ran; it was recorded as aborted")

    async def _run_inline(self, plan: StepPlan, per_rank: list[StepInputs], lists: tuple) -> list[RankOutcome]:
        """Every rank's job here, in rank order, through its executor's ``run_job`` (the same
        copies -> clears -> graph, counters and outcomes). After a rank failed, the later
        ranks' jobs are cancelled before they start (they answer "cancelled", run nothing).
        ``lists``: the sanitizer's (poison, committed), or (None, None)."""
        sink, new_scope = self._sink, self._new_scope
        if sink is None:
            sink = self._sink = StepReplies(0)
            sink.close()  # the outcomes come back from run_job
            # anyio.CancelScope() looks the backend up on every call; its class, once, is the same scope
            new_scope = self._new_scope = type(anyio.CancelScope())
        outcomes: list[RankOutcome] = []
        stop = False
        poison, committed = lists
        try:
            for rank, ex in enumerate(self._executors):
                scope = new_scope()
                if stop:
                    scope.cancel()
                outcome = await ex.run_job(StepJob(plan, per_rank[rank], scope, sink, poison=poison, checked=True,
                                                   committed=committed))
                outcomes.append(outcome)
                if outcome.status != "ok":
                    stop = True
        except BaseException as exc:  # only a graph that awaited can be interrupted
            with anyio.CancelScope(shield=True):
                ok = tuple(o.rank for o in outcomes if o.status == "ok")
                await self.settle(plan.step, ok, self._reason(exc))
            raise
        return outcomes

    def _reason(self, exc: BaseException) -> str:
        if not isinstance(exc, anyio.get_cancelled_exc_class()):
            return repr(exc)
        return "engine closed" if self._aborting else "cancelled"

    async def _dispatch(self, plan: StepPlan, per_rank: list[StepInputs], lists: tuple) -> list[RankOutcome]:
        """Hand every rank its job and collect the outcomes; on cancellation, settle and re-raise."""
        n = self.world_size
        scopes = [anyio.CancelScope() for _ in range(n)]
        replies = self._replies = StepReplies(n)
        sent = 0
        poison, committed = lists
        try:
            for rank in range(n):
                job = StepJob(plan, per_rank[rank], scopes[rank], replies, poison=poison, committed=committed,
                              checked=True)
                sender = self._senders[rank]
                try:
                    sender.send_nowait(job)
                except anyio.WouldBlock:
                    await sender.send(job)  # the rank is still busy: backpressure
                sent += 1
            await replies.event.wait()  # every rank answered, one did not complete, or one is gone
            if len(replies.outcomes) < n:
                await self._stop_the_others(scopes, replies)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._drain(scopes, replies, sent)
                ok = tuple(sorted(o.rank for o in replies.outcomes if o.status == "ok"))
                await self.settle(plan.step, ok, self._reason(exc))
            raise
        finally:
            self._replies = None
        replies.close()
        return replies.outcomes

    async def _stop_the_others(self, scopes: list[anyio.CancelScope], replies: StepReplies) -> None:
        """A rank failed: stop the others and wait for their answers, but not for ever (a rank
        stuck where cancellation cannot reach, e.g. a worker thread waiting on a collective
        the failed rank never joins)."""
        for scope in scopes:
            scope.cancel()
        await self._wait_answers(replies, self.world_size)

    async def _drain(self, scopes: list[anyio.CancelScope], replies: StepReplies, sent: int) -> None:
        """The caller gave up (call shielded): stop every rank, wait for the ones that got a job."""
        for scope in scopes:
            scope.cancel()
        replies.expected = sent
        await self._wait_answers(replies, sent)
        replies.close()

    async def _wait_answers(self, replies: StepReplies, sent: int) -> None:
        """Wait until ranks ``0 .. sent - 1`` answered, or their executor task ended without
        answering (cancelled with the job still in its stream: no answer will come), for
        ``drain_timeout_s`` at most."""
        with anyio.move_on_after(self._drain_timeout_s):
            while len(replies.outcomes) < sent:
                answered = {o.rank for o in replies.outcomes}
                if all(r in answered or r in self._gone for r in range(sent)):
                    return
                replies.rearm()
                await replies.event.wait()

    def rank_gone(self, rank: int) -> None:
        """Rank ``rank``'s executor task ended: it answers nothing more (wakes a waiting step)."""
        self._gone.add(rank)
        if self._replies is not None:
            self._replies.event.set()

    async def _fail(self, plan: StepPlan, outcomes: list[RankOutcome], ok_ranks: tuple[int, ...],
                    committed: Any = (), remote_failures: Sequence = ()) -> NoReturn:
        """Record a step some rank did not complete, and raise ``StepFailedError`` naming it
        (``SanitizerError`` chained to it when a rank's sanitizer check found violations,
        each recorded first). ``remote_failures``: peers that failed, were lost or stayed
        silent after the LAUNCH (``(rank, WireProtocolError)``), after the local failures."""
        step = plan.step
        failures = [(o.rank, o.error) for o in outcomes if o.status == "failed" and o.error is not None]
        failures += remote_failures
        found = [(o.rank, v) for o in outcomes for v in o.violations]
        if failures:
            first_rank, first = failures[0]
            reason = f"rank {first_rank} failed: {type(first).__name__}: {first}"
        else:  # a rank answered "cancelled" unasked, or its executor task ended without answering
            first_rank = min(set(range(self.world_size)).difference(ok_ranks))
            reason = f"rank {first_rank} cancelled"
        await self.settle(step, ok_ranks, reason, found, rank=first_rank)
        err = StepFailedError(step, first_rank, failures, "" if failures else "cancelled", plan.clear_list)
        if self.metrics is not None:
            self._count_failure(err, found)
        if found and self.sanitizer is not None:
            raise self.sanitizer.error(plan, committed or (), found) from err
        if failures:
            raise err from failures[0][1]
        raise err

    def _count_failure(self, err: StepFailedError, found: list) -> None:
        metrics = self.metrics
        metrics.step_failed(err)
        kinds: dict[tuple[int, str], int] = {}
        for rank, v in found:
            kinds[rank, v.kind] = kinds.get((rank, v.kind), 0) + 1
        for (rank, kind), count in kinds.items():
            metrics.sanitizer_violation(rank, kind, "other", count)

    # ------------------------------------------------------------------ recording

    def _record(self, step: int, ok_ranks: tuple[int, ...], reason: str | None, found: Sequence = (),
                rank: int = -1, only_in_flight: bool = False) -> None:
        """What the sanitizer found first, then a failed step is aborted (``_abort``), then the
        ranks that did run their part are recorded (once every reporting rank has completed a
        step, it can no longer be aborted); then the KV events folded so far leave as a batch."""
        ledger = self._ledger
        for r, v in found:
            ledger.record_violation(step, r, v.plane, v.page, v.kind)
        if reason is not None:
            self._abort(step, reason, rank, only_in_flight)
        for r in ok_ranks:
            ledger.complete_step(step, r)
        if self.kv_flush is not None:
            self.kv_flush()

    def _abort(self, step: int, reason: str, rank: int, only_in_flight: bool) -> None:
        """``StepAborted(step)``; the later steps in flight it reaches learn it (``_cascaded``).
        ``only_in_flight``: nothing when an earlier abort reached ``step`` already (checked
        here, on the ledger's path, where no other record can come in between)."""
        ledger = self._ledger
        in_flight = ledger.state.in_flight
        if only_in_flight and not any(plan.step == step for plan in in_flight):
            return
        later = [plan.step for plan in in_flight if plan.step > step] if len(in_flight) > 1 else ()
        ledger.abort_step(step, reason)
        for s in later:
            self._cascaded[s] = (step, rank, reason)

    async def settle(self, step: int, ok_ranks: tuple[int, ...], reason: str | None, found: Sequence = (), *,
                      rank: int = -1, only_in_flight: bool = False) -> None:
        """Record a sealed step's outcome through the engine's one path to the ledger, shielded
        from cancellation (in place when the ledger cannot block): every outcome, local or
        remote, goes through here. A failure here breaks the engine."""
        try:
            await self._access.record(self._record, step, ok_ranks, reason, found, rank, only_in_flight)
        except BaseException as exc:
            self._log.error("step_outcome_not_recorded", step=step, error=repr(exc))
            raise
        if reason is None:
            self.steps_completed += 1
        else:
            self.steps_aborted += 1
            self._log.warning("step_aborted", step=step, reason=reason, completed_ranks=list(ok_ranks))


_NO_LISTS: tuple = (None, None)  # a job's poison and committed lists without the sanitizer: the defaults


def _fast_lock() -> anyio.Lock:
    """A lock that does not yield when it is free (anyio >= 4.5), or a plain one."""
    try:
        return anyio.Lock(fast_acquire=True)
    except TypeError:
        return anyio.Lock()


def _by_rank(t: RankTiming) -> int:
    return t.rank
