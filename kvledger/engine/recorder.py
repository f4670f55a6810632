"""``StepRecorder``: the one path that records a sealed step's outcome, and the hooks after it.

    completed(sealed, ranks, timings)  ─► on the ledger's path: StepCompleted per rank, the
                                          StepResult (wall time at the last completion), every
                                          hook's settled(StepSettled(result)); completed_here:
                                          the same without a coroutine, where the access
                                          records in place
    aborted(step, ok_ranks, reason,    ─► on the ledger's path: SanitizerViolation per violation
            found, error)                 found, StepAborted(step, reason) (the later steps in
                                          flight it reaches are noted: cascaded()), StepCompleted
                                          per rank that did run its part, every hook's
                                          settled(StepSettled(error, violations))

Both go through the engine's one path to the ledger (``LedgerAccess.record``): shielded
from cancellation, in place when the ledger cannot block, in the worker thread when it
can. A failure there breaks the engine (every later call raises ``EngineClosedError``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvledger.core.errors import StepFailedError
from kvledger.executors.executor import RankTiming

from .access import LedgerAccess
from .plugins import StepHook
from .records import SealedStep, StepResult, StepSettled

__all__ = ["StepRecorder"]


class StepRecorder:
    """Records step outcomes through ``access`` and tells ``hooks`` (module docstring).
    Counts ``steps_completed``, ``steps_aborted`` and ``pages_cleared``."""

    def __init__(self, access: LedgerAccess, hooks: Sequence[StepHook], logger: Any) -> None:
        self._access = access
        self._ledger = access.ledger
        self.hooks = tuple(hooks)
        self._log = logger
        self._cascaded: dict[int, tuple[int, int, str]] = {}  # step -> (aborting step, its rank, reason)
        self.steps_completed = self.steps_aborted = self.pages_cleared = 0

    async def completed(self, sealed: SealedStep, ranks: tuple[int, ...], timings: tuple[RankTiming, ...]
                        ) -> StepResult:
        """Every rank completed ``sealed``: record it; the ``StepResult``."""
        try:
            result: StepResult = await self._access.record(self._record_completed, sealed, ranks, timings)
        except BaseException as exc:
            self._log.error("step_outcome_not_recorded", step=sealed.step, error=repr(exc))
            raise
        self.steps_completed += 1
        self.pages_cleared += len(sealed.plan.clear_list)
        return result

    def completed_here(self, sealed: SealedStep, ranks: tuple[int, ...], timings: tuple[RankTiming, ...]
                       ) -> StepResult:
        """``completed`` where the access records right here (``LedgerAccess.records_here``): no await."""
        try:
            result = self._record_completed(sealed, ranks, timings)
        except BaseException as exc:
            self._access.broken(exc)
            self._log.error("step_outcome_not_recorded", step=sealed.step, error=repr(exc))
            raise
        self.steps_completed += 1
        self.pages_cleared += len(sealed.plan.clear_list)
        return result

    async def aborted(self, step: int, ok_ranks: tuple[int, ...], reason: str, found: Sequence[tuple[int, Any]] = (),
                      *, rank: int = -1, only_in_flight: bool = False, error: StepFailedError | None = None) -> None:
        """Record ``step`` as aborted (``reason``), after the violations ``found`` and before the
        completions of ``ok_ranks``. ``rank``: the rank that failed it (-1: none), for the later
        steps the abort reaches. ``only_in_flight``: nothing when an earlier abort reached
        ``step`` already. ``error``: the ``StepFailedError`` the caller will get, for the hooks."""
        try:
            await self._access.record(self._record_aborted, step, ok_ranks, reason, found, rank, only_in_flight,
                                      error)
        except BaseException as exc:
            self._log.error("step_outcome_not_recorded", step=step, error=repr(exc))
            raise
        self.steps_aborted += 1
        self._log.warning("step_aborted", step=step, reason=reason, completed_ranks=list(ok_ranks))

    def cascaded(self, step: int) -> tuple[int, int, str] | None:
        """``(aborting step, its rank, reason)`` when an earlier step's abort reached ``step`` (once)."""
        return self._cascaded.pop(step, None)

    def count_aborted(self) -> None:
        """A step an earlier abort reached, recorded by that abort, counted here."""
        self.steps_aborted += 1

    # ------------------------------------------------------------------ on the ledger's path

    def _record_completed(self, sealed: SealedStep, ranks: tuple[int, ...], timings: tuple[RankTiming, ...]
                          ) -> StepResult:
        ledger, step = self._ledger, sealed.step
        for r in ranks:
            ledger.complete_step(step, r)
        result = StepResult(step=step, clear_list=sealed.plan.clear_list, ranks=timings,
                            wall_s=time.perf_counter() - sealed.t0)
        if self.hooks:
            settled = StepSettled(step, result=result)
            for hook in self.hooks:
                hook.settled(settled)
        return result

    def _record_aborted(self, step: int, ok_ranks: tuple[int, ...], reason: str, found: Sequence[tuple[int, Any]],
                        rank: int, only_in_flight: bool, error: StepFailedError | None) -> None:
        """What the sanitizer found first, then the abort (once every reporting rank has completed
        a step, it can no longer be aborted), then the ranks that did run their part."""
        ledger = self._ledger
        for r, v in found:
            ledger.record_violation(step, r, v.plane, v.page, v.kind)
        self._abort(step, reason, rank, only_in_flight)
        for r in ok_ranks:
            ledger.complete_step(step, r)
        if self.hooks:
            settled = StepSettled(step, error=error, violations=found)
            for hook in self.hooks:
                hook.settled(settled)

    def _abort(self, step: int, reason: str, rank: int, only_in_flight: bool) -> None:
        """``StepAborted(step)``; the later steps in flight it reaches learn it (``cascaded``).
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
