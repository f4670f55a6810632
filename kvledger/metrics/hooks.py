"""``LedgerMetrics``: the object a caller hands to the ledger, the engine and the log.

    metrics = LedgerMetrics(registry)              # registers every family on *that* registry
    Ledger(geometry, observer=metrics.observe)     # per folded event: plain int counts
    metrics.track_engine(engine)                   # state, log, executors, wire: read at scrape
    metrics.step_completed(result)                 # per step: StepResult
    metrics.step_failed(error)                     # per failed step: StepFailedError
    open_ledger(path, g, log_options=LogOptions(layer=metrics.timed_layer()))   # write and fsync seconds
    metrics.wire_decision(decision, seconds)       # per remote step: the wire leader's Decision
    metrics.sanitizer_violation(rank, kind, plane_kind)
    metrics.prefix_lookup(asked, found)            # per lookup (Engine.lookup calls it)

Per-event work is the observer's only (``counts.py``); per-step hooks feed
prometheus_client's own counters and histograms; everything else is read when the
registry is scraped (``families.py``). Every label is bounded: event types, holders,
reason and code vocabularies, ranks, plane kinds; never a page, request, snapshot or
step id.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from kvledger.core.errors import ConfigurationError, InvalidArgumentError, StepFailedError, WireProtocolError
from kvledger.executors.backend import page_bytes_of

from .counts import EventCounts

__all__ = ["HOOK_METRICS", "LedgerMetrics", "PLANE_KINDS", "STEP_FAILURES", "VIOLATION_KINDS", "prometheus"]

STEP_FAILURES = ("rank_error", "wire_abort", "cancelled")
VIOLATION_KINDS = ("not_zero", "poison", "nan_output", "other")
PLANE_KINDS = ("k", "v", "kv", "scale", "state", "other")

_SECONDS_FAST = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
_SECONDS_STEP = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# name -> (type, labels, help, buckets): the families fed by the hooks (counters without "_total").
HOOK_METRICS: dict[str, tuple[str, tuple[str, ...], str, tuple[float, ...]]] = {
    "kvledger_steps_completed": ("counter", (), "Steps every rank completed (step_completed).", ()),
    "kvledger_steps_failed": ("counter", ("reason",), "Steps that failed: rank_error, wire_abort, cancelled.", ()),
    "kvledger_pages_cleared": ("counter", (), "Clear-list pages of completed steps: zeroed on every rank.", ()),
    "kvledger_zeroed_bytes": ("counter", ("rank",), "Bytes a rank zeroed (pages x its bytes per page).", ()),
    "kvledger_bytes_zeroed": ("counter", ("rank",), "Deprecated: kvledger_zeroed_bytes_total, the same count "
                              "(this name is removed in the next release).", ()),
    "kvledger_step_seconds": ("histogram", (), "Engine wall time of a completed step, seal to last rank.",
                              _SECONDS_STEP),
    "kvledger_rank_clear_seconds": ("histogram", ("rank",), "A rank's clear phase, steps with pages to clear.",
                                    _SECONDS_FAST),
    "kvledger_log_write_seconds": ("histogram", (), "One write of sealed log records to the file.", _SECONDS_FAST),
    "kvledger_log_fsync_seconds": ("histogram", (), "One fsync of the log file.", _SECONDS_FAST),
    "kvledger_wire_round_trip_seconds": ("histogram", ("outcome",), "PREPARE out to the decision: launch, abort.",
                                         _SECONDS_FAST),
    "kvledger_wire_aborts": ("counter", ("code",), "Wire steps aborted, by REJECT / ABORT code name.", ()),
    "kvledger_sanitizer_violations": ("counter", ("rank", "kind", "plane_kind"),
                                      "Sanitizer violations: not_zero, poison, nan_output.", ()),
}


# registered by the first timed_layer(): until then the log's I/O is not timed, and a
# histogram with no observations beside kvledger_log_fsyncs_total would say otherwise
_ON_USE = ("kvledger_log_write_seconds", "kvledger_log_fsync_seconds")


def prometheus() -> Any:
    """The ``prometheus_client`` module; ``ConfigurationError`` naming the extra when it is missing."""
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise ConfigurationError(
            f"kvledger metrics need prometheus-client: pip install kvledger[metrics] ({exc})"
        ) from exc


def _rank(rank: Any) -> str:
    if type(rank) is not int or rank < 0:
        raise InvalidArgumentError(f"rank must be an int >= 0, got {rank!r}")
    return str(rank)


def _page_bytes_of(planes: Sequence[Any]) -> int:
    """Bytes one page takes across a rank's planes (``[num_pages, ...]`` tensors or byte buffers)."""
    return sum(map(page_bytes_of, planes))


class LedgerMetrics:
    """Counters, gauges and histograms of one ledger (and its engine and log) on ``registry``.

    ``registry`` must be a ``prometheus_client.CollectorRegistry`` the caller made: the
    global one is never used implicitly. Raises ``ConfigurationError`` when
    prometheus-client is not installed or the registry already holds kvledger metrics
    (nothing registered then), ``InvalidArgumentError`` for something else than a registry.
    """

    def __init__(self, registry: Any) -> None:
        prom = prometheus()
        if not isinstance(registry, prom.CollectorRegistry):
            raise InvalidArgumentError(f"registry must be a prometheus_client.CollectorRegistry, "
                                       f"got {type(registry).__name__}")
        from .families import ScrapeCollector

        self.registry = registry
        self.counts = EventCounts()
        self.observe = self.counts.observe  # the Ledger observer (a bound method: one call per event)
        self.ledger: Any = None
        self.log: Any = None
        self.engine: Any = None
        self._page_bytes: tuple[int, ...] = ()
        self._m = {name: self._make(prom, name) for name in HOOK_METRICS}
        self._collector = ScrapeCollector(self)
        self._register([m for name, m in self._m.items() if name not in _ON_USE] + [self._collector])
        for reason in STEP_FAILURES:
            self._m["kvledger_steps_failed"].labels(reason)  # known values start at 0
        self._ranks: dict[int, tuple[Any, Any, Any]] = {}
        self._log_timed = False

    @staticmethod
    def _make(prom: Any, name: str) -> Any:
        kind, labels, doc, buckets = HOOK_METRICS[name]
        if kind == "histogram":
            return prom.Histogram(name, doc, labels, buckets=buckets, registry=None)
        return prom.Counter(name, doc, labels, registry=None)

    def _register(self, collectors: list[Any]) -> None:
        """All or nothing: a clash unregisters what this call registered."""
        done: list[Any] = []
        try:
            for c in collectors:
                self.registry.register(c)
                done.append(c)
        except ValueError as exc:
            for c in done:
                self.registry.unregister(c)
            raise ConfigurationError(f"this registry already holds kvledger metrics: {exc}") from None

    @property
    def scrapes(self) -> int:
        """Times the registry was collected (every HTTP scrape collects it once)."""
        return self._collector.scrapes

    # ------------------------------------------------------------------ what is read at scrape time

    def track_ledger(self, ledger: Any) -> None:
        """Serve the ledger's state gauges (holders, marks, requests, seq) from now on."""
        if not hasattr(ledger, "state"):
            raise InvalidArgumentError(f"track_ledger needs a Ledger, got {type(ledger).__name__}")
        self.ledger = ledger

    def track_log(self, log: Any) -> None:
        """Serve an ``EventLog``'s statistics (events, durable seq and lag, records, bytes, fsyncs)."""
        if not callable(getattr(log, "statistics", None)):
            raise InvalidArgumentError(f"track_log needs an EventLog, got {type(log).__name__}")
        self.log = log

    def track_engine(self, engine: Any, *, page_bytes: Sequence[int] | None = None) -> None:
        """Serve an ``Engine``'s ledger, its log (a durable ledger's), its executors' plan
        counts and, while it has remote ranks, its wire leader's statistics.

        ``page_bytes``: bytes one page takes on each rank, for ``kvledger_zeroed_bytes``;
        default: from each rank's planes (a rank without planes zeroes none).
        """
        self.track_ledger(engine.ledger)
        log = getattr(engine.ledger, "log", None)
        if log is not None:
            self.track_log(log)
        if page_bytes is None:
            page_bytes = [_page_bytes_of(ex.context.planes) for ex in engine.executors]
        self.set_page_bytes(page_bytes)
        self.engine = engine

    def set_page_bytes(self, page_bytes: Sequence[int]) -> None:
        """Bytes one page takes on each rank (index = rank), summed over its planes."""
        sizes = tuple(page_bytes)
        if any(type(b) is not int or b < 0 for b in sizes):
            raise InvalidArgumentError(f"page_bytes must be ints >= 0, got {sizes!r}")
        self._page_bytes = sizes
        for rank in range(len(sizes)):
            self._rank_metrics(rank)

    def _rank_metrics(self, rank: int) -> tuple[Any, Any, Any]:
        got = self._ranks.get(rank)
        if got is None:
            r = str(rank)
            got = self._ranks[rank] = (self._m["kvledger_rank_clear_seconds"].labels(r),
                                       self._m["kvledger_zeroed_bytes"].labels(r),
                                       self._m["kvledger_bytes_zeroed"].labels(r))
        return got

    # ------------------------------------------------------------------ steps

    def step_completed(self, result: Any) -> None:
        """A ``StepResult``: one step completed, its clear list zeroed on every rank, and
        each rank's clear seconds (observed for steps that had pages to clear).
        ``InvalidArgumentError`` for something else (nothing counted)."""
        try:
            n = len(result.clear_list)
            wall = float(result.wall_s)
            timings = [(t.rank, float(t.clear_s)) for t in result.ranks]
            for rank, _ in timings:
                _rank(rank)
        except (AttributeError, TypeError, ValueError, InvalidArgumentError) as exc:
            raise InvalidArgumentError(f"step_completed needs a StepResult, got {type(result).__name__}: "
                                       f"{exc}") from None
        m = self._m
        m["kvledger_steps_completed"].inc()
        m["kvledger_step_seconds"].observe(wall)
        if not n:
            return
        m["kvledger_pages_cleared"].inc(n)
        sizes = self._page_bytes
        for rank, clear_s in timings:
            seconds, zeroed, deprecated = self._rank_metrics(rank)
            seconds.observe(clear_s)
            if rank < len(sizes) and sizes[rank]:
                zeroed.inc(n * sizes[rank])
                deprecated.inc(n * sizes[rank])

    def step_failed(self, error: StepFailedError) -> None:
        """A ``StepFailedError``: counted as ``wire_abort`` (a peer's REJECT / ABORT),
        ``cancelled`` (no rank raised) or ``rank_error``."""
        if not isinstance(error, StepFailedError):
            raise InvalidArgumentError(f"step_failed needs a StepFailedError, got {type(error).__name__}")
        causes = [exc for _, exc in error.failures]
        if any(isinstance(exc, WireProtocolError) and exc.remote for exc in causes):
            reason = "wire_abort"
        else:
            reason = "rank_error" if causes else "cancelled"
        self._m["kvledger_steps_failed"].labels(reason).inc()

    # ------------------------------------------------------------------ the prefix cache

    def prefix_lookup(self, asked: int, found: int) -> None:
        """A prefix-cache lookup asked for ``asked`` blocks and ``found`` leading ones were ready
        (``Ledger.lookup``'s answer): ``kvledger_prefix_cache_lookup_pages_total`` and
        ``..._lookup_hit_pages_total``, whose ratio is the hit rate. ``InvalidArgumentError``
        unless ``0 <= found <= asked`` are ints (nothing counted)."""
        if type(asked) is not int or type(found) is not int or not 0 <= found <= asked:
            raise InvalidArgumentError(f"prefix_lookup needs ints 0 <= found <= asked, got {found!r}, {asked!r}")
        self.counts.lookup(asked, found)

    # ------------------------------------------------------------------ the log, the wire, the sanitizer

    def timed_layer(self, inner: Any = None) -> Any:
        """A file layer for ``LogOptions(layer=...)`` that times every write and fsync
        of the log (``kvledger_log_write_seconds`` / ``kvledger_log_fsync_seconds``);
        ``inner`` is the layer it wraps (default: real files)."""
        from .layer import TimedFileLayer

        write_s, fsync_s = (self._m[name] for name in _ON_USE)
        if not self._log_timed:
            self._register([write_s, fsync_s])
            self._log_timed = True
        return TimedFileLayer(write_s, fsync_s, inner)

    def wire_decision(self, decision: Any, seconds: float) -> None:
        """The wire leader decided a step ``seconds`` after its PREPARE went out (a
        ``kvledger.wire`` ``Decision``): the round trip, and an abort's code by name."""
        try:
            launch, code, seconds = bool(decision.launch), int(decision.code), float(seconds)
        except (AttributeError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"wire_decision needs a Decision and seconds: {exc}") from None
        self._m["kvledger_wire_round_trip_seconds"].labels("launch" if launch else "abort").observe(seconds)
        if not launch:
            from kvledger.wire.codec import RejectCode

            try:
                name = RejectCode(code).name.lower()
            except ValueError:
                name = "other"
            self._m["kvledger_wire_aborts"].labels(name).inc()

    def sanitizer_violation(self, rank: int, kind: str, plane_kind: str = "other", count: int = 1) -> None:
        """The sanitizer found ``count`` violations of ``kind`` (``VIOLATION_KINDS``) on
        ``rank`` in a plane of ``plane_kind`` (``PLANE_KINDS``); an unknown word is ``other``."""
        r = _rank(rank)
        if type(count) is not int or count < 1:
            raise InvalidArgumentError(f"count must be an int >= 1, got {count!r}")
        kind = kind if kind in VIOLATION_KINDS else "other"
        plane_kind = plane_kind if plane_kind in PLANE_KINDS else "other"
        self._m["kvledger_sanitizer_violations"].labels(r, kind, plane_kind).inc(count)

