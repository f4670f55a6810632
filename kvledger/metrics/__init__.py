"""Prometheus metrics for a ledger, its engine and its log (the ``kvledger[metrics]`` extra).

    registry = prometheus_client.CollectorRegistry()     # yours: never the global one implicitly
    metrics = LedgerMetrics(registry)
    ledger = Ledger(geometry, observer=metrics.observe)  # counts every folded event
    metrics.track_ledger(ledger)                         # holder gauges, read at scrape time
    with MetricsServer(registry, port=9400):             # or your own exposition of the registry
        ...

Where each family comes from (docs/METRICS.md has the table, one row per metric):

    per event   metrics.observe(seq, event, effects)   the Ledger observer: plain int counts
                                                       (events by type, pages listed, steps
                                                       sealed, clear-list sizes, aborts by
                                                       reason, pages marked, blocks stored /
                                                       removed, prefix-cache hit pages)
    per lookup  prefix_lookup(asked, found)            prefix-cache lookup and lookup-hit pages
    per step    step_completed(StepResult)             steps, pages cleared, bytes zeroed per
                step_failed(StepFailedError)           rank, step and per-rank clear seconds,
                wire_decision(Decision, seconds)       failures by reason, wire round trips,
                sanitizer_violation(rank, kind, ...)   aborts by REJECT code, violations
    per I/O     timed_layer()                          the log's write and fsync seconds
    at scrape   track_ledger / track_log / track_engine   holders, KV cache pages and usage
                                                       ratio, marks, shares, seq; the
                                                       log's durable lag, records, bytes,
                                                       fsyncs; plans per rank; wire links

Labels are bounded: event type, holder, reason and code vocabularies, rank, plane
kind, outcome. Never a page, request, snapshot or step id, and never a reason's text.

Cost: nothing unless used (``import kvledger`` imports neither this package nor
prometheus_client; ``import kvledger.metrics`` imports prometheus_client only when
a ``LedgerMetrics`` or ``MetricsServer`` is made, and raises ``ConfigurationError``
naming ``pip install kvledger[metrics]`` if it is missing). When used, the
observer adds a few int increments per event (about 150-200 ns on the 2-core dev
box, some 9 % of a ledger command; docs/METRICS.md has the measurement); the
families are built only when the registry is scraped.

The rooms:

    counts.py    EventCounts (the observer), the abort-reason vocabulary; no prometheus_client
    families.py  what a scrape builds: observer counts, state, log, executors, wire leader
    hooks.py     LedgerMetrics: registration, the per-step hooks, tracking
    layer.py     TimedFileLayer: the log's writes and fsyncs, timed
    server.py    MetricsServer: the registry over HTTP on loopback, a thread per connection,
                 idle connections dropped, close() at once
"""

from .counts import ABORT_REASONS, EventCounts, abort_reason
from .hooks import HOOK_METRICS, PLANE_KINDS, STEP_FAILURES, VIOLATION_KINDS, LedgerMetrics, prometheus
from .server import MetricsServer

__all__ = [
    "ABORT_REASONS",
    "HOOK_METRICS",
    "PLANE_KINDS",
    "STEP_FAILURES",
    "VIOLATION_KINDS",
    "EventCounts",
    "LedgerMetrics",
    "MetricsServer",
    "abort_reason",
    "prometheus",
]

