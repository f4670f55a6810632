"""What one step carries through the engine: ``SealedStep`` in, ``StepResult`` or ``StepSettled`` out.

    run_step ─► seal ─► SealedStep(plan, t0; poison, committed: the sanitizer's, set by its
                        ``sealed`` hook) ─► the ranks' strategy builds one StepJob per rank
                        from it (``jobs_for``) ─► RankOutcome per rank
             ─► recorded ─► StepSettled(step, result | error, violations) to every hook's
                            ``settled`` ─► StepResult to the caller (or the error raised)
"""

from __future__ import annotations

from collections.abc import Sequence
import anyio
import msgspec

from kvledger.core.errors import StepFailedError
from kvledger.core.events import StepPlan
from kvledger.executors.executor import RankTiming, StepInputs, StepJob, StepReplies
from kvledger.executors.sanitize import Violation

__all__ = ["SealedStep", "StepResult", "StepSettled", "jobs_for"]


class StepResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A step that completed on every rank: its clear list, per-rank timings (by rank; the
    local ranks') and the engine's wall time from the seal to the last completion recorded."""

    step: int
    clear_list: tuple[int, ...]
    ranks: tuple[RankTiming, ...]
    wall_s: float


class SealedStep:
    """A step the ledger sealed, on its way to the ranks: ``plan``; ``payload``, the bytes the
    remote peers get with its PREPARE; the sanitizer's ``poison`` and ``committed`` lists
    (None without the sanitizer: a job then uses none); ``t0``, the clock when ``run_step``
    began sealing it. ``abort_reason``: set by a strategy that gave up on the step before
    any rank ran it (the wire's handshake), for the record."""

    __slots__ = ("plan", "step", "payload", "poison", "committed", "t0", "abort_reason")

    def __init__(self, plan: StepPlan, t0: float, payload: bytes = b"") -> None:
        self.plan = plan
        self.step = plan.step
        self.payload = payload
        self.poison: Sequence[int] | None = None
        self.committed: Sequence[int] | None = None
        self.t0 = t0
        self.abort_reason: str | None = None


class StepSettled:
    """A step's outcome as recorded, for the ``settled`` hooks: ``result`` (completed on every
    rank) or ``error`` (a ``StepFailedError``; None when the step was cancelled or the engine
    closed), and the sanitizer's ``violations`` (``(rank, Violation)``) recorded with it."""

    __slots__ = ("step", "result", "error", "violations")

    def __init__(self, step: int, result: StepResult | None = None, error: StepFailedError | None = None,
                 violations: Sequence[tuple[int, Violation]] = ()) -> None:
        self.step = step
        self.result = result
        self.error = error
        self.violations = violations


def jobs_for(sealed: SealedStep, inputs: Sequence[StepInputs], reply: StepReplies,
             scopes: Sequence[anyio.CancelScope] | None = None) -> list[StepJob]:
    """The one place a step's jobs are built: one ``StepJob`` per rank of ``inputs``, answering
    to ``reply``, each under its own cancel scope (``scopes``) or under its caller's (None),
    marked checked (a sealed plan's clear list: the backend may skip its id check)."""
    plan, poison, committed = sealed.plan, sealed.poison, sealed.committed
    if scopes is None and len(inputs) == 1:
        return [StepJob(plan, inputs[0], None, reply, poison=poison, committed=committed, checked=True)]
    if scopes is None:
        return [StepJob(plan, x, None, reply, poison=poison, committed=committed, checked=True) for x in inputs]
    return [StepJob(plan, x, scope, reply, poison=poison, committed=committed, checked=True)
            for x, scope in zip(inputs, scopes, strict=True)]
