"""``kvledger demo --prefix-cache``: tenants' system prompts shared through the ledger's prefix
cache. The shared pages are really read (corrupting them, or the prefix state's snapshot rows,
changes exactly the requests that hit), cached, evicted under a tight budget, and the logits
still equal a reference that shares nothing; with clears off the seed's failure is back.
The log never shows a stale page or another tenant's page shared. Budget: about 20 s.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

torch = pytest.importorskip("torch")

from support.demo import simulate_demo  # noqa: E402

from kvledger import replay  # noqa: E402
from kvledger.core.errors import InvalidArgumentError  # noqa: E402
from kvledger.core.events import PagesPublished, PagesShared  # noqa: E402
from kvledger.core.log import open_view  # noqa: E402
from kvledger.core.state.state import LedgerState  # noqa: E402
from kvledger.demo import DemoConfig  # noqa: E402
from kvledger.demo.cli import main  # noqa: E402
from kvledger.demo.prefix import PrefixCache  # noqa: E402
from kvledger.demo.results import compare_logits  # noqa: E402
from support.cli import kvledger  # noqa: E402

PREFIX = DemoConfig(requests=24, short_tokens=128, long_tokens=256, prefix_cache=True, page_budget=200,
                    bare_every=0)


@pytest.fixture(scope="module", name="reference")
def prefix_reference():
    ref = simulate_demo(PREFIX, reference=True)
    assert ref.passed == ref.requests == 24 and ref.page_reuses == 0
    assert ref.prefix_requests == ref.pages_shared == ref.pages_published == 0  # the reference shares nothing
    return ref


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("prefix") / "prefix.kvlog")
    return log, simulate_demo(PREFIX, log_path=log)


def _events(log):
    with open_view(log) as view:
        assert view.scan.error is None and view.scan.torn_at is None
        return [ev for _, ev, _ in view.iter_events()]


def test_prefix_cache_shares_caches_evicts_and_logits_equal_reference(logged, reference):
    log, run = logged
    assert run.passed == 24 and run.invalid_speculation == 0
    assert compare_logits(run, reference) == {"equal": True, "requests_equal": 24, "requests": 24,
                                              "max_abs_diff": 0.0}
    # the sharing was real: hits, pages shared, published, cached, and evicted under the budget
    assert 0 < run.prefix_hits < run.prefix_requests == 24
    assert run.pages_shared == run.prefix_hits * (64 // 16) and run.prefix_hit_tokens == run.pages_shared * 16
    assert run.pages_published > 0 and run.pages_evicted > 0 and run.pages_cached_end > 0
    # ... and so was the pressure: released snapshot pages came back as tails and were zeroed
    assert run.tails_released > 0 and run.pages_zeroed == run.pages_listed > 0
    events = _events(log)
    shared = [e for e in events if isinstance(e, PagesShared)]
    assert sum(len(e.page_ids) for e in shared) == run.pages_shared
    assert replay(events, check=True).digest() == run.digest


def test_no_request_shares_a_stale_page_or_another_tenants(logged):
    """Folding the log: at every PagesShared, each page was published by a request of the
    sharer's own tenant, still holds that hash, and is not marked."""
    log, _ = logged
    st = LedgerState()
    writer_tenant: dict[int, str] = {}
    checked = 0
    for ev in _events(log):
        if isinstance(ev, PagesPublished):
            writer_tenant.update(dict.fromkeys(ev.page_ids, st.requests[ev.request].tenant))
        elif isinstance(ev, PagesShared):
            rec = st.requests.get(ev.request)
            tenant = ev.tenant if rec is None else rec.tenant
            for p in ev.page_ids:
                assert writer_tenant[p] == tenant and p in st.page_hash and p not in st.marks
                checked += 1
        st.fold(ev)
    assert checked > 0


@pytest.mark.parametrize("target", ["shared pages", "snapshot rows"])
def test_hits_read_the_shared_pages_and_the_prefix_state(target, reference, monkeypatch):
    """Zero the shared prefix pages (what clearing a shared page would do), or the prefix
    state's snapshot rows, right after a hit shares them: exactly requests that hit change."""
    admit = PrefixCache.admit
    hits: set[int] = set()

    async def corrupting(self, engine, spec, gen, avail, snapshots, snap_pages):
        cost = await admit(self, engine, spec, gen, avail, snapshots, snap_pages)
        adm = self.admissions[spec.request]
        if adm.hit_blocks:
            hits.add(spec.request)
            table = await engine.call(lambda ledger: ledger.kv_pages(spec.request))
            pages = list(table[: adm.hit_blocks]) if target == "shared pages" else list(adm.restore)
            for ex in engine.executors:
                for plane in ex.context.planes:
                    plane.view(torch.uint8)[pages] = 0
        return cost

    monkeypatch.setattr(PrefixCache, "admit", corrupting)
    run = simulate_demo(PREFIX)
    assert hits
    changed = {rid for rid, want in reference.logits.items() if not torch.equal(run.logits.get(rid), want)}
    assert changed and changed <= hits


def test_clears_off_still_fails_the_seeds_way(reference):
    off = simulate_demo(dataclasses.replace(PREFIX, clear=False))
    assert off.invalid_speculation >= 1 and off.passed + off.invalid_speculation == 24
    assert off.tails_released > 0 and off.pages_listed > 0 and off.pages_zeroed == 0
    assert off.prefix_hits > 0  # sharing happened, and did not mask the failure
    oracle = compare_logits(off, reference)
    assert not oracle["equal"] and oracle["requests_equal"] == off.passed


@pytest.mark.parametrize("policy", ["cross_tenant", "all_reused"])
def test_isolating_policies_share_within_a_tenant_and_match(policy, reference):
    run = simulate_demo(dataclasses.replace(PREFIX, policy=policy))
    assert run.invalid_speculation == 0 and compare_logits(run, reference)["equal"]
    assert run.prefix_hits > 0


def test_two_ranks_share_read_and_run_bare():
    """Heads sharded over two in-process ranks: each rank reads its own shard of the shared
    pages and of the prefix state's rows; the bare runs meet in their own all-reduce."""
    cfg = dataclasses.replace(PREFIX, requests=12, page_budget=110, ranks=2, bare_every=2)
    ref = simulate_demo(cfg, reference=True)
    run = simulate_demo(cfg)
    assert compare_logits(run, ref)["equal"] and run.prefix_hits > 0 and run.pages_evicted > 0
    assert run.bare_steps > 0 and run.bare_mismatch == 0


def test_system_prompt_bounds_are_checked():
    for bad in (15, 128, 0, True):
        with pytest.raises(InvalidArgumentError, match="system_tokens"):
            dataclasses.replace(PREFIX, system_tokens=bad).validate()
    assert dataclasses.replace(PREFIX, system_tokens=100).prefix_tokens() == 96
    assert dataclasses.replace(PREFIX, prefix_cache=False).prefix_tokens() == 0


def test_cli_prefix_cache_table_json_replay_and_audit(tmp_path, capsys):
    log, js = tmp_path / "p.kvlog", tmp_path / "p.json"
    argv = ["--requests", "24", "--prompt-tokens", "128,256", "--prefix-cache", "--page-budget", "200",
            "--no-progress", "--log", str(log), "--json", str(js)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for row in ("prefix cache hit rate", "pages shared / published", "cached pages evicted", "pages cached at end",
                "yes (24/24"):
        assert row in out
    run = json.loads(js.read_text())["run"]
    assert run["prefix_hit_rate"] > 0 and run["pages_shared"] > 0 and run["pages_evicted"] > 0
    p = kvledger("replay", str(log))
    assert p.returncode == 0 and run["digest"] in p.stdout, p.stdout + p.stderr
    _audit_finds_only_what_the_cache_keeps(log)


def _audit_finds_only_what_the_cache_keeps(log) -> None:
    """``kvledger audit --check`` finds nothing: pages the prefix cache keeps after a request
    ended (cached, or shared by another request) are not leaks, and no read was unzeroed."""
    p = kvledger("audit", str(log), "--check", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["faults"] == [], p.stdout[-2000:]


def test_audit_check_passes_on_a_prefix_cache_log(logged):
    log, _ = logged
    p = kvledger("audit", log, "--check")
    assert p.returncode == 0, p.stdout[-2000:]
