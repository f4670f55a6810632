"""``Extras``: what ``open_engine`` wires in besides the ledger and the ranks, and in which order.

    open_engine(..., metrics=, kv_events=, sanitize=, observers=)
      Extras(...)        check the arguments; build a KVEventPublisher for an endpoint; a
                         SanitizerTracker in sanitize mode
      .start()           the publisher starts (binds its sockets) before the ledger opens
      .observer          one Ledger observer for all of them (kvledger.durable.chain_observers:
                         none at all when nothing observes, the one itself when one does):
                         metrics.observe, publisher.observe, tracker.observe, then the caller's
      .log_options()     a durable ledger's layer: metrics.timed_layer() unless the caller gave one
      .hooks             the step hooks (plugins.py), in this order: MetricsStepHook (its
                         settled: step_completed / step_failed / sanitizer_violation),
                         KVFlushHook (its settled: publisher.flush, on the ledger's path),
                         the tracker (sealed: take; failed: SanitizerError)
      .decided           what hears every wire handshake's decision: metrics.wire_decision
      .attach(engine)    tracker.attach(ledger); metrics.track_engine(engine)
      .stop()            after the ledger closed (the last step settled): the publisher sends
                         what it holds and closes its sockets (in a worker thread)

Nothing here is imported or called for an engine opened without them: no prometheus_client,
no pyzmq, no per-event call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import anyio

from kvledger.core.errors import InvalidArgumentError
from kvledger.durable import chain_observers

from .plugins import EventPublisher, KVFlushHook, MetricsHooks, MetricsStepHook, StepHook
from .sanitizer import SanitizerTracker

__all__ = ["Extras"]


class Extras:
    """The optional parts of one engine (module docstring). Raises ``InvalidArgumentError`` for
    a ``metrics`` that is not a ``LedgerMetrics``, a ``kv_events`` that is neither an endpoint
    nor a publisher, an observer that is not callable; ``ConfigurationError`` for a bad
    endpoint or a missing pyzmq. Nothing is opened by the constructor."""

    def __init__(self, *, sanitize: bool = False, metrics: Any = None, kv_events: Any = None,
                 observers: Iterable[Any] = ()) -> None:
        if metrics is not None and not isinstance(metrics, MetricsHooks):
            raise InvalidArgumentError(f"metrics must be a kvledger.metrics.LedgerMetrics, got {metrics!r}")
        if type(sanitize) is not bool:
            raise InvalidArgumentError(f"sanitize must be True or False, got {sanitize!r}")
        if isinstance(observers, (str, bytes)) or not isinstance(observers, Iterable):
            raise InvalidArgumentError(f"observers must be a sequence of callables, got {observers!r}")
        self.metrics: MetricsHooks | None = metrics
        self.publisher = _publisher(kv_events)
        self.tracker = SanitizerTracker() if sanitize else None
        self.observer = chain_observers(
            metrics.observe if metrics is not None else None,
            self.publisher.observe if self.publisher is not None else None,
            self.tracker.observe if self.tracker is not None else None,
            *observers,
        )
        hooks: list[StepHook] = []
        if metrics is not None:
            hooks.append(MetricsStepHook(metrics))
        if self.publisher is not None:
            hooks.append(KVFlushHook(self.publisher))
        if self.tracker is not None:
            hooks.append(self.tracker)
        self.hooks: tuple[StepHook, ...] = tuple(hooks)
        self.decided = (metrics.wire_decision,) if metrics is not None else ()

    def start(self) -> None:
        """Start the publisher unless it is running already (``ConfigurationError``: its endpoint
        cannot be bound; nothing left open)."""
        pub = self.publisher
        if pub is not None and not pub.running:
            pub.start()

    def log_options(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """The durable ledger's extra options: ``given``, plus the metrics' timed file layer
        unless ``given`` names a layer."""
        if given is not None and not isinstance(given, Mapping):
            raise InvalidArgumentError(f"log_options must be a mapping of open_ledger options, got {given!r}")
        out = dict(given or {})
        if self.metrics is not None and out.get("layer") is None:
            out["layer"] = self.metrics.timed_layer(None)
        return out

    def attach(self, engine: Any) -> None:
        """The engine exists: the tracker reads its ledger, the metrics serve its figures."""
        if self.tracker is not None:
            self.tracker.attach(engine.ledger)
        if self.metrics is not None:
            self.metrics.track_engine(engine)

    async def stop(self) -> None:
        """Stop the publisher (it sends its last batch and what is queued), in a worker thread,
        shielded. Idempotent; raises nothing the publisher's stop does not."""
        if self.publisher is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.publisher.stop)


def _publisher(kv_events: Any) -> EventPublisher | None:
    """A publisher for ``kv_events``: None, an endpoint, vLLM's ``--kv-events-config`` JSON or a
    mapping of its fields (a ``KVEventPublisher`` is built: ``kvledger.kvevents.make_publisher``),
    or a publisher (an ``EventPublisher``: running, start, observe, flush, stop)."""
    if kv_events is None:
        return None
    if isinstance(kv_events, (str, Mapping)):
        from kvledger.kvevents import make_publisher

        made: EventPublisher = make_publisher(kv_events)
        return made
    if isinstance(kv_events, EventPublisher):
        return kv_events
    raise InvalidArgumentError(f"kv_events must be a ZMQ endpoint, vLLM's --kv-events-config JSON or a "
                               f"kvledger.kvevents.KVEventPublisher, got {kv_events!r}")
