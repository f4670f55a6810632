"""Metric families built at scrape time: the observer's counts, the ledger's state, the
log's, the executors' and the wire leader's statistics.

    registry.collect() ─► ScrapeCollector.collect()
                            observer_families(counts)    once the observer has seen an event
                            state_families(state)        once a ledger is tracked
                            log_families(stats)          once a log is tracked
                            executor_families(stats)     once an engine is tracked
                            leader_families(stats)       while the engine has remote ranks

Nothing is computed between scrapes: a family reads what its source already keeps
(ints, sparse dict sizes, ``statistics()``). The holder gauges cost O(requests +
shared pages) per scrape, never O(num_pages). A scrape runs in the HTTP server's
thread while the ledger folds in another: sources are read without stopping the
ledger, so a gauge may be off by the pages of the one event in flight (never
negative); with no command running they are exact.

``SCRAPE_METRICS`` names every family this module can build (``describe()`` reports
them all, so a registry refuses a second ``LedgerMetrics`` up front).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvledger.core.state.table import HOLDER_NAMES

from .counts import EventCounts, event_tag

__all__ = ["SCRAPE_METRICS", "ScrapeCollector", "holder_counts"]

# name -> (type, labels, help). Counters are named without "_total" (the exposition adds it).
SCRAPE_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    # the ledger observer
    "kvledger_events": ("counter", ("type",), "Events folded into the ledger, by event type."),
    "kvledger_pages_listed": ("counter", (), "Marked pages commits listed for a clear (ClearPages effects)."),
    "kvledger_steps_sealed": ("counter", (), "Steps sealed into a plan (StepPlan effects)."),
    "kvledger_pages_planned": ("counter", (), "Clear-list entries of sealed plans (an aborted step's pages again)."),
    "kvledger_clear_list_pages": ("histogram", (), "Pages in each sealed step's clear list."),
    "kvledger_steps_aborted": ("counter", ("reason",), "StepAborted events, by reason (a fixed vocabulary)."),
    "kvledger_pages_marked": ("counter", (), "Pages that became stale (PagesMarked effects)."),
    "kvledger_blocks_stored": ("counter", (), "Block hashes published (BlocksStored effects)."),
    "kvledger_blocks_removed": ("counter", (), "Block hashes evicted (BlocksRemoved effects)."),
    "kvledger_prefix_cache_hit_pages": ("counter", (), "Pages requests took from the prefix cache (PagesShared)."),
    "kvledger_prefix_cache_lookup_pages": ("counter", (), "Blocks prefix-cache lookups asked for (prefix_lookup)."),
    "kvledger_prefix_cache_lookup_hit_pages": ("counter", (), "Leading blocks those lookups found cached or held."),
    # the ledger's state
    "kvledger_pages": ("gauge", ("holder",), "Pages by holder: free, reserved, kv, alias, cached."),
    "kvledger_kv_cache_pages": ("gauge", (), "Pages in the KV cache (num_pages)."),
    "kvledger_kv_cache_usage_ratio": ("gauge", (), "Fraction of pages in use: 1 - (free + cached) / num_pages."),
    "kvledger_marked_pages": ("gauge", (), "Pages holding stale bytes no request may read before a clear."),
    "kvledger_restoring_pages": ("gauge", (), "Pages an inbound restore is writing."),
    "kvledger_shared_pages": ("gauge", (), "KV pages held by two or more requests."),
    "kvledger_hashed_pages": ("gauge", (), "Pages published under a block hash (held or cached)."),
    "kvledger_pending_clear_pages": ("gauge", (), "Pages listed for a clear in a step not sealed yet."),
    "kvledger_requests": ("gauge", (), "Requests the ledger knows."),
    "kvledger_snapshots": ("gauge", (), "Live snapshots."),
    "kvledger_open_step": ("gauge", (), "The step commits go into."),
    "kvledger_ledger_seq": ("gauge", (), "Events folded into the ledger (the next event's seq)."),
    # the event log
    "kvledger_log_events": ("gauge", (), "Events in the log (the next seq)."),
    "kvledger_log_durable_seq": ("gauge", (), "Highest seq on stable storage (-1: none)."),
    "kvledger_log_durable_lag_events": ("gauge", (), "Events appended but not yet durable."),
    "kvledger_log_records": ("counter", (), "Records this log handle wrote."),
    "kvledger_log_written_bytes": ("counter", (), "Bytes this log handle wrote."),
    "kvledger_log_fsyncs": ("counter", (), "fsyncs this log handle completed."),
    "kvledger_log_checkpoints": ("counter", (), "Checkpoints this log handle appended."),
    "kvledger_log_size_bytes": ("gauge", (), "Log file size (buffered bytes excluded)."),
    # the executors
    "kvledger_rank_plans": ("counter", ("rank", "status"), "Step plans a rank ran: completed, failed, cancelled."),
    # the wire leader
    "kvledger_wire_decisions": ("counter", ("decision",), "Steps the wire leader decided: launched, aborted."),
    "kvledger_wire_peers": ("gauge", ("state",), "Peers that joined, and of those, lost."),
    "kvledger_wire_frames": ("counter", ("rank", "direction"), "Frames on a peer's link: in, out."),
    "kvledger_wire_received_bytes": ("counter", ("rank",), "Bytes received on a peer's link."),
    "kvledger_wire_ignored_frames": ("counter", ("rank", "why"), "Frames absorbed: duplicate, stale."),
}

_FAMILY = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


def _family(name: str) -> Any:
    kind, labels, doc = SCRAPE_METRICS[name]
    return _FAMILY[kind](name, doc, labels=labels)


def _one(name: str, value: float) -> Any:
    fam = _family(name)
    fam.add_metric((), value)
    return fam


def _stable(read: Callable[[], Any]) -> Any:
    """``read()``, retried when a fold in another thread resized a dict it iterated."""
    for _ in range(4):
        try:
            return read()
        except RuntimeError:
            continue
    return read()


# ---------------------------------------------------------------------- the observer


def observer_families(counts: EventCounts) -> Iterator[Any]:
    fam = _family("kvledger_events")
    for t, n in list(counts.events.items()):
        fam.add_metric((event_tag(t),), n)
    yield fam
    fam = _family("kvledger_steps_aborted")
    for reason, n in list(counts.aborts.items()):
        fam.add_metric((reason,), n)
    yield fam
    h = counts.clear_lists
    fam = _family("kvledger_clear_list_pages")
    fam.add_metric((), h.cumulative(), h.total)
    yield fam
    for name, value in (
        ("kvledger_pages_listed", counts.pages_listed),
        ("kvledger_steps_sealed", counts.steps_sealed),
        ("kvledger_pages_planned", counts.pages_planned),
        ("kvledger_pages_marked", counts.pages_marked),
        ("kvledger_blocks_stored", counts.blocks_stored),
        ("kvledger_blocks_removed", counts.blocks_removed),
        ("kvledger_prefix_cache_hit_pages", counts.pages_shared),
        ("kvledger_prefix_cache_lookup_pages", counts.lookup_pages),
        ("kvledger_prefix_cache_lookup_hit_pages", counts.lookup_hit_pages),
    ):
        yield _one(name, value)


# ---------------------------------------------------------------------- the state


def holder_counts(state: Any) -> dict[str, int]:
    """Pages per holder (``free``, ``reserved``, ``kv``, ``alias``, ``cached``) from the
    state's counters and its requests, O(requests + shared pages): a shared page sits
    in every sharer's block table but is one page; alias is what the others leave."""
    records = list(state.requests.values())
    sharers = list(state.sharers.values())
    reserved = sum([len(r.reserved) for r in records])
    kv = sum([len(r.kv) for r in records]) - sum([len(s) - 1 for s in sharers])
    free, cached = state.free_count, len(state.cached)
    alias = max(0, state.num_pages - free - reserved - kv - cached)
    return dict(zip(HOLDER_NAMES, (free, reserved, kv, alias, cached), strict=True))


def state_families(state: Any) -> Iterator[Any]:
    holders = _stable(lambda: holder_counts(state))
    fam = _family("kvledger_pages")
    for holder, n in holders.items():
        fam.add_metric((holder,), n)
    yield fam
    total = state.num_pages
    idle = holders["free"] + holders["cached"]  # what vLLM counts free: cached blocks can be taken
    for name, value in (
        ("kvledger_kv_cache_pages", total),
        ("kvledger_kv_cache_usage_ratio", min(1.0, max(0.0, 1.0 - idle / total)) if total else 0.0),
    ):
        yield _one(name, value)
    for name, value in (
        ("kvledger_marked_pages", len(state.marks)),
        ("kvledger_restoring_pages", len(state.restore_targets)),
        ("kvledger_shared_pages", len(state.sharers)),
        ("kvledger_hashed_pages", len(state.page_hash)),
        ("kvledger_pending_clear_pages", len(state.pending)),
        ("kvledger_requests", len(state.requests)),
        ("kvledger_snapshots", len(state.snapshots)),
        ("kvledger_open_step", state.open_step),
        ("kvledger_ledger_seq", state.seq),
    ):
        yield _one(name, value)


# ---------------------------------------------------------------------- the log


def log_families(stats: Any) -> Iterator[Any]:
    """From ``EventLog.statistics()``; a field an older or newer log lacks is left out."""
    events, durable = getattr(stats, "events", None), getattr(stats, "durable_seq", None)
    if events is not None:
        yield _one("kvledger_log_events", events)
    if durable is not None:
        yield _one("kvledger_log_durable_seq", durable)
    if events is not None and durable is not None:
        yield _one("kvledger_log_durable_lag_events", max(0, events - 1 - durable))
    for name, field in (
        ("kvledger_log_records", "records"),
        ("kvledger_log_written_bytes", "bytes_written"),
        ("kvledger_log_fsyncs", "syncs"),
        ("kvledger_log_checkpoints", "checkpoints"),
        ("kvledger_log_size_bytes", "size"),
    ):
        value = getattr(stats, field, None)
        if value is not None:
            yield _one(name, value)


# ---------------------------------------------------------------------- executors and the wire


def executor_families(per_rank: Iterable[tuple[int, dict]]) -> Iterator[Any]:
    """From each ``RankExecutor.statistics()``: ``(rank, stats)`` pairs."""
    fam = _family("kvledger_rank_plans")
    for rank, stats in per_rank:
        for status in ("completed", "failed", "cancelled"):
            fam.add_metric((str(rank), status), stats.get(f"plans_{status}", 0))
    yield fam


def leader_families(stats: dict, world_size: int) -> Iterator[Any]:
    """From ``WireLeader.statistics()``: the decision rule's counters and ``rank{r}.{key}``
    per live link (wire ranks, 1 .. world_size - 1)."""
    fam = _family("kvledger_wire_decisions")
    for decision in ("launched", "aborted"):
        fam.add_metric((decision,), stats.get(decision, 0))
    yield fam
    fam = _family("kvledger_wire_peers")
    for state in ("joined", "lost"):
        fam.add_metric((state,), stats.get(state, 0))
    yield fam
    links: dict[int, dict[str, int]] = {}
    for key, value in stats.items():
        head, _, field = key.partition(".")
        if field and head.startswith("rank") and head[4:].isdigit() and int(head[4:]) < world_size:
            links.setdefault(int(head[4:]), {})[field] = value
    frames, received, ignored = (_family(n) for n in (
        "kvledger_wire_frames", "kvledger_wire_received_bytes", "kvledger_wire_ignored_frames"))
    for rank, link in sorted(links.items()):
        r = str(rank)
        frames.add_metric((r, "in"), link.get("frames_in", 0))
        frames.add_metric((r, "out"), link.get("frames_out", 0))
        received.add_metric((r,), link.get("bytes_in", 0))
        ignored.add_metric((r, "duplicate"), link.get("duplicates", 0))
        ignored.add_metric((r, "stale"), link.get("stale", 0))
    yield from (frames, received, ignored)


# ---------------------------------------------------------------------- the collector


class ScrapeCollector:
    """The registry's view of the scrape-time families; ``sources`` is the ``LedgerMetrics``
    that knows what is tracked. ``scrapes`` counts ``collect()`` calls."""

    def __init__(self, sources: Any) -> None:
        self._sources = sources
        self.scrapes = 0

    def describe(self) -> list[Any]:
        return [_family(name) for name in SCRAPE_METRICS]

    def collect(self) -> Iterator[Any]:
        self.scrapes += 1
        src = self._sources
        if src.counts.observed:
            yield from observer_families(src.counts)
        ledger = src.ledger
        if ledger is not None:
            yield from state_families(ledger.state)
        log = src.log
        if log is not None:
            yield from log_families(log.statistics())
        engine = src.engine
        if engine is not None:
            yield from executor_families((ex.rank, ex.statistics()) for ex in engine.executors)
            leader = getattr(engine, "leader", None)
            if leader is not None:
                yield from leader_families(_stable(leader.statistics), leader.world_size)
