"""``Extras``: what ``open_engine`` wires in besides the ledger and the ranks, and in which order.

    open_engine(..., extras=ExtraOptions(metrics=, kv_events=, sanitize=, observers=))
      Extras(options)    build a KVEventPublisher for an endpoint; a SanitizerTracker in
                         sanitize mode
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

import dataclasses
from typing import TYPE_CHECKING

import anyio

from kvledger.durable import chain_observers
from kvledger.options import LogOptions

from .options import ExtraOptions, KVEvents
from .plugins import EventPublisher, KVFlushHook, MetricsHooks, MetricsStepHook, StepHook
from .sanitizer import SanitizerTracker

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

__all__ = ["Extras"]


class Extras:
    """The optional parts of one engine (module docstring), from its ``ExtraOptions`` (which
    checked them). Raises ``InvalidArgumentError`` for an observer that is not callable;
    ``ConfigurationError`` for a bad endpoint or a missing pyzmq. Nothing is opened by the
    constructor."""

    def __init__(self, options: ExtraOptions) -> None:
        metrics = options.metrics
        self.metrics: MetricsHooks | None = metrics
        self.publisher = _publisher(options.kv_events)
        self.tracker = SanitizerTracker() if options.sanitize else None
        self.observer = chain_observers(
            metrics.observe if metrics is not None else None,
            self.publisher.observe if self.publisher is not None else None,
            self.tracker.observe if self.tracker is not None else None,
            *options.observers,
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

    def log_options(self, given: LogOptions) -> LogOptions:
        """The durable ledger's options: ``given``, with the metrics' timed file layer unless
        ``given`` names a layer."""
        if self.metrics is not None and given.layer is None:
            return dataclasses.replace(given, layer=self.metrics.timed_layer(None))
        return given

    def attach(self, engine: Engine) -> None:
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


def _publisher(kv_events: KVEvents | None) -> EventPublisher | None:
    """A publisher for ``kv_events`` (``ExtraOptions`` checked its type): None, an endpoint,
    vLLM's ``--kv-events-config`` JSON or a mapping of its fields (a ``KVEventPublisher`` is
    built: ``kvledger.kvevents.make_publisher``), or a publisher itself."""
    if kv_events is None or isinstance(kv_events, EventPublisher):
        return kv_events
    from kvledger.kvevents import make_publisher

    made: EventPublisher = make_publisher(kv_events)
    return made
