"""Prometheus metrics (``kvledger.metrics``): every family against what it claims to count.

Driven ledgers check the observer's counters against an independent tally of the
events' effects and the holder gauges against ``holder_codes()`` (the O(num_pages)
truth); real engines (local and with a peer over loopback TCP), a real durable log and
the wire's decision rule check the hooks. Everything goes through
the text exposition a scraper sees (``test_metrics_http.py`` serves it over HTTP and
runs the demo). Budget: about 8 s (torch's import most).
"""

from __future__ import annotations

import collections
import random
import subprocess
import sys

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvledger import ConfigurationError, Geometry, InvalidArgumentError, KVLedgerError, Ledger  # noqa: E402
from kvledger.core.events import EVENT_TYPES, BlocksRemoved, BlocksStored, ClearPages, PagesMarked  # noqa: E402
from kvledger.core.events import PagesShared, StepAborted, StepPlan  # noqa: E402
from kvledger.core.state import LedgerState  # noqa: E402
from kvledger.core.state.table import HOLDER_NAMES  # noqa: E402
from kvledger.metrics import ABORT_REASONS, LedgerMetrics, abort_reason  # noqa: E402
from kvledger.metrics.counts import event_tag  # noqa: E402

G = Geometry(num_pages=32, page_tokens=2)


def parse(text: str) -> dict:
    """``{(sample name, ((label, value), ...)): value}`` from a text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(registry) -> dict:
    return parse(prometheus_client.generate_latest(registry).decode())


def v(got: dict, name: str, **labels) -> float:
    return got[(name, tuple(sorted(labels.items())))]


def fresh() -> tuple:
    reg = prometheus_client.CollectorRegistry()
    return reg, LedgerMetrics(reg)


# ---------------------------------------------------------------------- import, registry, refusals


def test_importing_kvledger_and_its_metrics_leaves_prometheus_client_out():
    code = "import sys, kvledger, kvledger.metrics; sys.exit('prometheus_client' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_without_prometheus_client_metrics_name_the_extra():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from kvledger.metrics import LedgerMetrics\n"
            "from kvledger import ConfigurationError\n"
            "try:\n    LedgerMetrics(object())\nexcept ConfigurationError as e:\n    print(e)\n"
            "from kvledger.demo.cli import main\n"
            "sys.exit(main(['--metrics-port', '0', '--no-progress', '--requests', '2']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "pip install kvledger[metrics]" in p.stdout
    assert "pip install kvledger[metrics]" in " ".join(p.stderr.split())  # the demo: exit 2, same advice


def test_registry_is_the_callers_all_or_nothing_and_never_the_global_one():
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    reg, _ = fresh()
    assert set(prometheus_client.REGISTRY._names_to_collectors) == before
    assert "kvledger_steps_completed_total" in reg._names_to_collectors
    names = dict(reg._names_to_collectors)
    with pytest.raises(ConfigurationError, match="already holds kvledger metrics"):
        LedgerMetrics(reg)
    assert reg._names_to_collectors == names  # the refused one left nothing behind
    with pytest.raises(InvalidArgumentError, match="CollectorRegistry"):
        LedgerMetrics(None)


# ---------------------------------------------------------------------- the observer


def drive(led: Ledger) -> None:
    """Every event type and effect: released aliases listed, a publish, shares, cache, evict, abort."""
    led.alias_snapshot(1, 4)
    led.release_snapshot(1)  # 4 pages marked
    led.reserve(10, 3)
    assert len(led.commit(10, 0, 3)) == 3  # LIFO: the released pages, listed
    led.reserve(11, 2)
    led.commit(11, 0, 2)
    led.reserve(12, 2)
    led.return_reservation(12)
    led.seal_step(0)
    led.complete_step(0, 0)
    led.publish(10, [101, 102], list(range(4)))
    led.share(20, [101, 102])  # two prefix-cache hits
    led.finish(10)
    led.finish(20)  # the hashed pages go to the cache
    led.evict(1)
    led.reserve(13, 2)
    led.start_restore(led.reserved_pages(13), request=13)
    led.complete_restore(led.reserved_pages(13), request=13)
    led.commit(13, 1, 2)
    led.alias_snapshot(2, 2)
    led.release_snapshot(2)
    led.reserve(14, 2)
    led.commit(14, 1, 2)
    led.seal_step(1)
    led.abort_step(1, "rank 0 failed: RuntimeError: boom")
    led.cancel(11)
    led.seal_step(2)  # carries step 1's pages
    led.complete_step(2, 0)


def tally(events) -> dict:
    """The reference: fold the events into a fresh state and count effects by hand."""
    st, t = LedgerState(), collections.Counter[str]()
    for ev in events:
        t[f"event:{event_tag(type(ev))}"] += 1
        if type(ev) is PagesShared:
            t["shared"] += len(ev.page_ids)
        if type(ev) is StepAborted:
            t[f"abort:{abort_reason(ev.reason)}"] += 1
        for eff in st.fold(ev):
            if type(eff) is ClearPages:
                t["listed"] += len(eff.page_ids)
            elif type(eff) is StepPlan:
                t["sealed"] += 1
                t["planned"] += len(eff.clear_list)
                t[f"plan:{len(eff.clear_list)}"] += 1
            elif type(eff) is PagesMarked:
                t["marked"] += len(eff.page_ids)
            elif type(eff) is BlocksStored:
                t["stored"] += len(eff.hashes)
            elif type(eff) is BlocksRemoved:
                t["removed"] += len(eff.hashes)
    return t


def test_observer_counters_equal_a_tally_of_the_effects():
    reg, m = fresh()
    led = Ledger(G, observer=m.observe, record=True, check=True)
    drive(led)
    got, t = scrape(reg), tally(led.events)
    for cls in EVENT_TYPES:
        assert v(got, "kvledger_events_total", type=event_tag(cls)) == t[f"event:{event_tag(cls)}"]
    assert sum(t[f"event:{event_tag(c)}"] for c in EVENT_TYPES) == led.seq
    for reason in ABORT_REASONS:
        assert v(got, "kvledger_steps_aborted_total", reason=reason) == t[f"abort:{reason}"]
    for name, key in (("kvledger_pages_listed_total", "listed"), ("kvledger_steps_sealed_total", "sealed"),
                      ("kvledger_pages_planned_total", "planned"), ("kvledger_pages_marked_total", "marked"),
                      ("kvledger_blocks_stored_total", "stored"), ("kvledger_blocks_removed_total", "removed"),
                      ("kvledger_prefix_cache_hit_pages_total", "shared")):
        assert v(got, name) == t[key], name
    # what the scenario pins by hand: 4 released pages marked and 3 of them listed at step 0,
    # two blocks stored and shared, one evicted, one abort in the engine's wording
    assert t["listed"] >= 3 and t["marked"] >= 4 and (t["stored"], t["shared"], t["removed"]) == (2, 2, 1)
    assert t["abort:rank_failed"] == 1 and t["sealed"] == 3
    plans = sum(n for key, n in t.items() if key.startswith("plan:"))
    assert v(got, "kvledger_clear_list_pages_count") == plans == 3
    assert v(got, "kvledger_clear_list_pages_sum") == t["planned"]
    assert v(got, "kvledger_clear_list_pages_bucket", le="0.0") == t["plan:0"]


def test_observer_families_are_absent_until_it_sees_an_event():
    reg, m = fresh()
    assert not any(name.startswith("kvledger_events") for name, _ in scrape(reg))
    Ledger(G, observer=m.observe)
    assert v(scrape(reg), "kvledger_events_total", type="cache_configured") == 1


@pytest.mark.parametrize("reason, label", [
    ("", "unspecified"), ("cancelled", "cancelled"), ("cancelled before dispatch", "cancelled"),
    ("rank 3 failed: RuntimeError: page 17 of request 99", "rank_failed"), ("rank 12 cancelled", "rank_cancelled"),
    ("rank 2 aborted the step over the wire: code 19: no READY", "wire_abort"),
    ("remote handshake: TimeoutError()", "wire_handshake"), ("timeout", "timeout"),
    ("request 4711 page 3", "other"), ("rank x failed", "other"),
])
def test_abort_reasons_map_to_a_fixed_vocabulary(reason, label):
    assert abort_reason(reason) == label


# ---------------------------------------------------------------------- the state gauges


def random_ops(led: Ledger, rng: random.Random, n: int):
    """Random commands (refusals are fine: nothing changes); yields after each one."""
    step, rid, sid, h = 0, 0, 0, 1000
    for _ in range(n):
        st = led.state
        op = rng.randrange(10)
        try:
            if op == 0:
                rid += 1
                led.reserve(rid, rng.randint(1, 3), tenant=rng.choice("ab"))
            elif op == 1 and st.requests:
                r = rng.choice(sorted(st.requests))
                led.commit(r, step, len(st.requests[r].reserved) or 1)
            elif op == 2 and st.requests:
                rng.choice((led.finish, led.cancel))(rng.choice(sorted(st.requests)))
            elif op == 3:
                sid += 1
                led.alias_snapshot(sid, rng.randint(1, 3))
            elif op == 4 and st.snapshots:
                led.release_snapshot(rng.choice(sorted(st.snapshots)))
            elif op == 5:
                led.seal_step(step)
                led.complete_step(step, 0)
                step += 1
            elif op == 6 and st.requests:
                r = rng.choice(sorted(st.requests))
                k = len(st.requests[r].kv) - sum(p in st.page_hash for p in st.requests[r].kv)
                h += 10
                led.publish(r, [h + i for i in range(k)], [0] * (k * G.page_tokens))
            elif op == 7 and st.hash_page:
                rid += 1
                led.share(rid, rng.sample(sorted(st.hash_page), 1), tenant="a")
            elif op == 8 and st.cached:
                led.evict(1)
            elif op == 9 and st.requests:
                r = rng.choice(sorted(st.requests))
                pages = st.requests[r].reserved[:1]
                if pages:
                    led.start_restore(pages, request=r)
                    if rng.random() < 0.5:
                        led.complete_restore(pages, request=r)
        except KVLedgerError:
            pass
        yield


@pytest.mark.parametrize("policy", ["released_aliases", "cross_tenant"])
def test_holder_gauges_equal_a_full_scan_of_the_page_table(policy):
    reg, m = fresh()
    led = Ledger(G, policy=policy, check=True)
    m.track_ledger(led)
    seen = collections.Counter[str]()
    for i, _ in enumerate(random_ops(led, random.Random(policy), 600)):
        if i % 7:
            continue
        st, got = led.state, scrape(reg)
        truth = collections.Counter(st.holder_codes())
        for code, holder in enumerate(HOLDER_NAMES):
            assert v(got, "kvledger_pages", holder=holder) == truth[code], (i, holder)
            seen[holder] += truth[code] > 0
        shared = sum(1 for p in range(G.num_pages) if len(st.holders_of(p)) > 1)
        assert v(got, "kvledger_shared_pages") == shared
        assert v(got, "kvledger_marked_pages") == sum(map(led.is_marked, range(G.num_pages)))
        assert v(got, "kvledger_restoring_pages") == sum(map(led.is_restoring, range(G.num_pages)))
        assert v(got, "kvledger_hashed_pages") == sum(led.block_hash(p) is not None for p in range(G.num_pages))
        assert (v(got, "kvledger_ledger_seq"), v(got, "kvledger_open_step")) == (led.seq, led.open_step)
        assert v(got, "kvledger_requests") == len(st.requests)
        idle = truth[HOLDER_NAMES.index("free")] + truth[HOLDER_NAMES.index("cached")]
        assert v(got, "kvledger_kv_cache_pages") == G.num_pages
        assert v(got, "kvledger_kv_cache_usage_ratio") == pytest.approx(1 - idle / G.num_pages)
    assert all(seen[h] for h in HOLDER_NAMES), seen  # the walk reached every holder


@pytest.mark.asyncio
async def test_an_engine_counts_prefix_lookups_beside_the_hits():
    """open_engine(metrics=) feeds the lookup counters from engine.lookup; the hit rate is
    lookup hits / lookups; a bad count is refused and counts nothing."""
    from kvledger.engine import open_engine

    reg, m = fresh()
    async with open_engine(G, metrics=m) as engine:
        await engine.reserve(1, 2)
        await engine.commit(1, 0, 2)
        await engine.run_step(0)
        await engine.publish(1, [11, 12], [1, 2, 3, 4])
        assert await engine.lookup([11, 12, 13]) == 2
        assert await engine.lookup(iter([11, 99])) == 1  # any iterable
        assert await engine.lookup([7]) == 0
        await engine.share(2, [11])
    got = scrape(reg)
    assert v(got, "kvledger_prefix_cache_lookup_pages_total") == 6
    assert v(got, "kvledger_prefix_cache_lookup_hit_pages_total") == 3
    assert v(got, "kvledger_prefix_cache_hit_pages_total") == 1  # what share took
    for bad in ((2, 3), (-1, 0), (1.0, 0)):
        with pytest.raises(InvalidArgumentError):
            m.prefix_lookup(*bad)
    assert v(scrape(reg), "kvledger_prefix_cache_lookup_pages_total") == 6


# ---------------------------------------------------------------------- steps, through a real engine


@pytest.mark.asyncio
async def test_step_hooks_count_what_the_engine_and_its_backends_did():
    torch = pytest.importorskip("torch")
    from kvledger import StepFailedError
    from kvledger.engine import RankSpec, open_engine

    planes = [[torch.full((G.num_pages, 8), 7, dtype=torch.uint8),
               torch.ones((G.num_pages, 2, 3), dtype=torch.bfloat16)] for _ in range(2)]  # 8 + 12 bytes a page
    fail_at = {3}

    def graph(ctx, step, inputs):
        if step in fail_at and ctx.rank == 1:
            raise RuntimeError(f"rank {ctx.rank} broke at step {step}")

    reg, m = fresh()
    async with open_engine(G, ranks=[RankSpec(planes=p, graph=graph) for p in planes]) as engine:
        m.track_engine(engine)
        cleared, with_clears = 0, 0
        for step in range(5):
            await engine.alias_snapshot(step, 2)
            await engine.release_snapshot(step)
            await engine.reserve(step, 2)
            await engine.commit(step, step, 2)
            try:
                result = await engine.run_step(step)
            except StepFailedError as exc:
                m.step_failed(exc)
                continue
            m.step_completed(result)
            cleared += len(result.clear_list)
            with_clears += bool(result.clear_list)
        stats = [ex.backend.statistics() for ex in engine.executors]
    got = scrape(reg)
    assert v(got, "kvledger_steps_completed_total") == engine.statistics()["steps_completed"] == 4
    assert v(got, "kvledger_steps_failed_total", reason="rank_error") == 1
    assert v(got, "kvledger_steps_failed_total", reason="wire_abort") == 0
    assert v(got, "kvledger_pages_cleared_total") == cleared == engine.statistics()["pages_cleared"] > 0
    for rank in (0, 1):
        r = str(rank)
        # the backends also zeroed the failed step's 2 pages (the clear runs before the graph that
        # raised); the metric counts completed steps, which zeroed them again in the next step
        assert v(got, "kvledger_zeroed_bytes_total", rank=r) == cleared * 20 == stats[rank]["bytes"] - 2 * 20
        assert v(got, "kvledger_bytes_zeroed_total", rank=r) == cleared * 20  # the deprecated name, one release
        assert v(got, "kvledger_rank_clear_seconds_count", rank=r) == with_clears
        assert v(got, "kvledger_rank_plans_total", rank=r, status="completed") == 4 + (rank == 0)
    assert v(got, "kvledger_rank_plans_total", rank="1", status="failed") == 1
    assert v(got, "kvledger_step_seconds_count") == 4
    assert v(got, "kvledger_ledger_seq") == engine.seq


def test_step_hooks_refuse_what_is_not_a_step_outcome_and_count_nothing():
    reg, m = fresh()
    before = scrape(reg)
    for bad in (object(), None, 3):
        with pytest.raises(InvalidArgumentError):
            m.step_completed(bad)
        with pytest.raises(InvalidArgumentError):
            m.step_failed(bad)
    with pytest.raises(InvalidArgumentError):
        m.set_page_bytes([4, -1])
    after = scrape(reg)
    assert {k: x for k, x in after.items() if not k[0].endswith("_created")} == \
        {k: x for k, x in before.items() if not k[0].endswith("_created")}


# ---------------------------------------------------------------------- the log


@pytest.mark.parametrize("background", [False, True])
def test_log_statistics_lag_and_timed_writes_and_fsyncs(tmp_path, background):
    from kvledger import open_ledger

    reg, m = fresh()
    assert not any(k[0].startswith("kvledger_log_fsync") for k in scrape(reg))  # not timed: absent
    with open_ledger(tmp_path / "x.kvlog", G, layer=m.timed_layer(), background=background) as led:
        m.track_ledger(led)
        m.track_log(led.log)
        for step in range(6):
            led.reserve(step, 2)
            led.commit(step, step, 2)
            led.seal_step(step)
            led.complete_step(step, 0)
        led.reserve(99, 1)  # not sealed: in the open batch, not durable
        got, stats = scrape(reg), led.log.statistics()
        assert v(got, "kvledger_log_events") == stats.events == led.seq
        assert v(got, "kvledger_log_durable_lag_events") == led.seq - 1 - stats.durable_seq >= 1
        led.sync()
        got, stats = scrape(reg), led.log.statistics()
        assert v(got, "kvledger_log_durable_lag_events") == 0 and v(got, "kvledger_log_durable_seq") == led.seq - 1
        assert v(got, "kvledger_log_fsyncs_total") == stats.syncs == v(got, "kvledger_log_fsync_seconds_count")
        assert v(got, "kvledger_log_written_bytes_total") == stats.bytes_written > 0
        assert v(got, "kvledger_log_records_total") == stats.records
        assert v(got, "kvledger_log_size_bytes") == stats.size
        assert v(got, "kvledger_log_write_seconds_count") >= 1
        assert v(got, "kvledger_log_fsync_seconds_sum") > 0


def test_a_timed_fsync_that_fails_is_timed_and_reaches_the_log_unchanged(tmp_path):
    from kvledger import LogIOError, open_ledger
    from support.simdisk import FaultInjector

    reg, m = fresh()
    faults = FaultInjector(fail_sync=3)
    led = open_ledger(tmp_path / "x.kvlog", G, layer=m.timed_layer(faults), fsync="per_step")  # inline: the seal raises
    with pytest.raises(LogIOError, match="fsync"):
        for step in range(4):
            led.reserve(step, 1)
            led.commit(step, step, 1)
            led.seal_step(step)
    assert v(scrape(reg), "kvledger_log_fsync_seconds_count") == faults.syncs == 3
    led.log.abandon()


# ---------------------------------------------------------------------- the wire and the sanitizer


def test_wire_decisions_round_trips_and_abort_codes_from_the_leaders_rule():
    from kvledger.core.events import StepPlan as Plan
    from kvledger.wire.codec import Ready, Reject, RejectCode
    from kvledger.wire.decision import Leader

    reg, m = fresh()
    rule = Leader(G, world_size=3)
    rule.join(1)
    rule.join(2)
    rule.begin(Plan(step=0, clear_list=(1, 2)))
    rule.vote(Ready(step=0, rank=1, prepare_checksum=rule.checksum))
    m.wire_decision(rule.vote(Ready(step=0, rank=2, prepare_checksum=rule.checksum)), 0.002)
    rule.finish()
    rule.begin(Plan(step=1, clear_list=(5,)))  # a peer that holds fewer pages refuses it
    m.wire_decision(rule.vote(Reject(step=1, rank=2, code=RejectCode.PAGE_OUT_OF_RANGE, detail="page 5")), 0.003)
    rule.finish()
    rule.begin(Plan(step=2))
    m.wire_decision(rule.expire(), 0.5)
    got = scrape(reg)
    assert v(got, "kvledger_wire_round_trip_seconds_count", outcome="launch") == 1
    assert v(got, "kvledger_wire_round_trip_seconds_count", outcome="abort") == 2
    assert v(got, "kvledger_wire_aborts_total", code="page_out_of_range") == 1
    assert v(got, "kvledger_wire_aborts_total", code="timeout") == 1
    with pytest.raises(InvalidArgumentError):
        m.wire_decision(object(), 1.0)


@pytest.mark.asyncio
async def test_engine_with_a_remote_peer_serves_the_leaders_link_counters():
    torch = pytest.importorskip("torch")
    import anyio

    from kvledger import StepFailedError
    from kvledger.engine import RankSpec, RemoteRanks, open_engine
    from kvledger.wire.rank import run_peer
    from kvledger.wire.transport import connect_tcp

    reg, m = fresh()
    planes = [torch.zeros((G.num_pages, 4), dtype=torch.uint8)]
    async with open_engine(G, ranks=[RankSpec(planes=planes)], remote=RemoteRanks(world_size=2, timeout=2.0)) as engine:
        m.track_engine(engine)
        with pytest.raises(StepFailedError) as info:  # no peer yet: PEER_LOST, over the wire
            await engine.run_step(0)
        m.step_failed(info.value)
        async with anyio.create_task_group() as tg:
            assert engine.remote_address is not None
            stream = await connect_tcp(*engine.remote_address)
            tg.start_soon(lambda: run_peer(stream, G, rank=1, world_size=2, key=engine.leader.key,
                                           on_launch=lambda *a: None))
            await engine.wait_remote(5)
            for step in (1, 2):
                m.step_completed(await engine.run_step(step))
            got = scrape(reg)
            tg.cancel_scope.cancel()
    assert v(got, "kvledger_steps_failed_total", reason="wire_abort") == 1
    assert v(got, "kvledger_wire_decisions_total", decision="launched") == 2
    assert v(got, "kvledger_wire_decisions_total", decision="aborted") == 1
    assert v(got, "kvledger_wire_peers", state="joined") == 1
    assert v(got, "kvledger_wire_frames_total", rank="1", direction="in") >= 3  # HELLO, READY, READY
    assert v(got, "kvledger_wire_frames_total", rank="1", direction="out") >= 4  # PREPARE, LAUNCH twice
    assert v(got, "kvledger_wire_received_bytes_total", rank="1") > 0


def test_sanitizer_violations_keep_their_labels_bounded():
    reg, m = fresh()
    m.sanitizer_violation(1, "poison", "k", count=3)
    m.sanitizer_violation(0, "not_zero")
    m.sanitizer_violation(0, "page 17 of request 4", "plane 9")  # free text never becomes a label
    got = scrape(reg)
    assert v(got, "kvledger_sanitizer_violations_total", rank="1", kind="poison", plane_kind="k") == 3
    assert v(got, "kvledger_sanitizer_violations_total", rank="0", kind="not_zero", plane_kind="other") == 1
    assert v(got, "kvledger_sanitizer_violations_total", rank="0", kind="other", plane_kind="other") == 1
    for rank, count in ((-1, 1), ("0", 1), (0, 0)):
        with pytest.raises(InvalidArgumentError):
            m.sanitizer_violation(rank, "poison", count=count)
