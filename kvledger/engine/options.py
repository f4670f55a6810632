"""``open_engine``'s option groups besides the log's (``kvledger.options.LogOptions``).

    StepOptions    how steps run: depth (steps in flight together), queue_size, drain_timeout_s,
                   timings (CUDA events per phase), yield_every_s (the loop's turn)
    ExtraOptions   what the engine wires in: sanitize, metrics, kv_events, observers

Frozen; each checks its fields when made and raises ``InvalidArgumentError`` naming the
field (nothing opened). ``opening.py`` describes every option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from kvledger.core.errors import InvalidArgumentError
from kvledger.core.state import MAX_IN_FLIGHT

from .access import YIELD_EVERY_S
from .plugins import EventPublisher, MetricsHooks

__all__ = ["ExtraOptions", "KVEvents", "Observer", "StepOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How the engine runs steps (``open_engine(..., steps=StepOptions(...))``).

    ``depth``: steps in flight together, 1 to ``MAX_IN_FLIGHT`` (local ranks only);
    ``queue_size``: bounds each dispatched rank's plan stream; ``drain_timeout_s``: how long
    a failed or cancelled step waits for its other ranks; ``timings``: CUDA ranks time every
    phase with CUDA events (on anyway with metrics or the sanitizer); ``yield_every_s``: the
    loop gets a turn at least this often, 0 to 1 s (0: at every call).
    """

    depth: int = 1
    queue_size: int = 1
    drain_timeout_s: float = 10.0
    timings: bool = False
    yield_every_s: float = YIELD_EVERY_S

    def __post_init__(self) -> None:
        if type(self.depth) is not int or not 1 <= self.depth <= MAX_IN_FLIGHT:
            raise InvalidArgumentError(f"depth must be an int from 1 to {MAX_IN_FLIGHT}, got {self.depth!r}")
        if type(self.queue_size) is not int or self.queue_size < 1:
            raise InvalidArgumentError(f"queue_size must be an int >= 1, got {self.queue_size!r}")
        if type(self.drain_timeout_s) not in (int, float) or not self.drain_timeout_s >= 0:
            raise InvalidArgumentError(f"drain_timeout_s must be a number of seconds >= 0, got "
                                       f"{self.drain_timeout_s!r}")
        if type(self.timings) is not bool:
            raise InvalidArgumentError(f"timings must be True or False, got {self.timings!r}")
        if type(self.yield_every_s) not in (int, float) or not 0 <= self.yield_every_s <= 1:
            raise InvalidArgumentError(f"yield_every_s must be a number of seconds from 0 to 1, got "
                                       f"{self.yield_every_s!r}")


KVEvents = EventPublisher | str | Mapping[str, object]
Observer = Callable[[int, object, tuple[object, ...]], None]
"""A ``Ledger`` observer: ``(seq, event, effects)`` after each event is folded (``EventObserver``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtraOptions:
    """What the engine wires in besides its ledger and ranks (``open_engine(..., extras=...)``).

    ``sanitize``: the debug mode (SPEC "The sanitizer"); ``metrics``: a
    ``kvledger.metrics.LedgerMetrics`` (any ``MetricsHooks``); ``kv_events``: a
    ``kvledger.kvevents.KVEventPublisher``, or a ZMQ endpoint, vLLM's ``--kv-events-config``
    JSON or a mapping of its fields to build one on; ``observers``: more ``Ledger``
    observers ``(seq, event, effects)``, called after the engine's own, in order.
    """

    sanitize: bool = False
    metrics: MetricsHooks | None = None
    kv_events: KVEvents | None = None
    observers: tuple[Observer, ...] = ()

    def __post_init__(self) -> None:
        if type(self.sanitize) is not bool:
            raise InvalidArgumentError(f"sanitize must be True or False, got {self.sanitize!r}")
        if self.metrics is not None and not isinstance(self.metrics, MetricsHooks):
            raise InvalidArgumentError(f"metrics must be a kvledger.metrics.LedgerMetrics, got {self.metrics!r}")
        kv = self.kv_events
        if kv is not None and not isinstance(kv, (str, Mapping, EventPublisher)):
            raise InvalidArgumentError(f"kv_events must be a ZMQ endpoint, vLLM's --kv-events-config JSON or a "
                                       f"kvledger.kvevents.KVEventPublisher, got {kv!r}")
        observers: object = self.observers
        if isinstance(observers, (str, bytes)) or not isinstance(observers, Iterable):
            raise InvalidArgumentError(f"observers must be a sequence of callables, got {observers!r}")
        object.__setattr__(self, "observers", tuple(observers))  # (each checked where they are chained)
