"""The engine's typed seams: what it calls on metrics, a KV event publisher, and step hooks.

    MetricsHooks     what the engine calls on ``ExtraOptions(metrics=...)``
                     (kvledger.metrics.LedgerMetrics is one): observe, track_engine,
                     step_completed, step_failed, wire_decision, sanitizer_violation,
                     timed_layer, prefix_lookup
    EventPublisher   what it calls on ``ExtraOptions(kv_events=)`` (kvledger.kvevents.KVEventPublisher
                     is one): running, start, observe, flush, stop
    StepHook         one list of hooks the step runner calls, in order, for every step:

        sealed(sealed)            after the seal, before any rank runs (run_step's task);
                                  may set sealed.poison / sealed.committed (the sanitizer)
        settled(outcome)          once the step's outcome is recorded, on the ledger's
                                  path (exclusive of every ledger call: in the engine's
                                  worker thread for a log that fsyncs inline); a
                                  StepSettled: the result, or the error and the
                                  violations. Must not raise (it would break the engine)
        failed(sealed, error, found)   a failed step, recorded, before run_step raises:
                                  another exception to raise instead (chained to error),
                                  or None

    implemented by: MetricsStepHook (metrics: settled), KVFlushHook (the publisher's
    flush: settled), kvledger.engine.sanitizer.SanitizerTracker (sealed, failed).

Checked with ``isinstance`` against these protocols when the engine opens (an object
missing a member is refused with ``InvalidArgumentError``); nothing is looked up by
name at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvledger.core.errors import StepFailedError

from .records import SealedStep, StepResult, StepSettled

__all__ = ["EventPublisher", "KVFlushHook", "MetricsHooks", "MetricsStepHook", "StepHook"]


@runtime_checkable
class MetricsHooks(Protocol):
    """What the engine calls on its metrics (``kvledger.metrics.LedgerMetrics``)."""

    def observe(self, seq: int, event: Any, effects: tuple) -> None: ...

    def track_engine(self, engine: Any, *, page_bytes: Sequence[int] | None = None) -> None: ...

    def step_completed(self, result: StepResult) -> None: ...

    def step_failed(self, error: StepFailedError) -> None: ...

    def wire_decision(self, decision: Any, seconds: float) -> None: ...

    def sanitizer_violation(self, rank: int, kind: str, plane_kind: str = "other", count: int = 1) -> None: ...

    def timed_layer(self, inner: Any = None) -> Any: ...

    def prefix_lookup(self, asked: int, found: int) -> None: ...


@runtime_checkable
class EventPublisher(Protocol):
    """What the engine calls on a KV event publisher (``kvledger.kvevents.KVEventPublisher``)."""

    @property
    def running(self) -> bool: ...

    def start(self) -> Any: ...

    def observe(self, seq: int, event: Any, effects: tuple) -> None: ...

    def flush(self) -> Any: ...

    def stop(self) -> None: ...


class StepHook:
    """A step hook (module docstring); every method does nothing here: override what you need."""

    def sealed(self, sealed: SealedStep) -> None:
        return None

    def settled(self, outcome: StepSettled) -> None:
        return None

    def failed(self, sealed: SealedStep, error: StepFailedError, found: Sequence[tuple[int, Any]]
               ) -> BaseException | None:
        return None


class MetricsStepHook(StepHook):
    """The metrics' side of every step: ``step_completed`` / ``step_failed``, and the sanitizer's
    violations counted by rank and kind."""

    def __init__(self, metrics: MetricsHooks) -> None:
        self.metrics = metrics

    def settled(self, outcome: StepSettled) -> None:
        metrics = self.metrics
        if outcome.result is not None:
            metrics.step_completed(outcome.result)
            return
        if outcome.error is not None:
            metrics.step_failed(outcome.error)
        kinds: dict[tuple[int, str], int] = {}
        for rank, v in outcome.violations:
            kinds[rank, v.kind] = kinds.get((rank, v.kind), 0) + 1
        for (rank, kind), count in kinds.items():
            metrics.sanitizer_violation(rank, kind, "other", count)


class KVFlushHook(StepHook):
    """The KV events folded so far leave as one batch once a step's outcome is recorded."""

    def __init__(self, publisher: EventPublisher) -> None:
        self.publisher = publisher

    def settled(self, outcome: StepSettled) -> None:
        self.publisher.flush()
