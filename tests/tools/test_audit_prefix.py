"""``kvledger audit`` and the new holders (issue #13) and the sanitizer's record (issue #14): ``--check``
over logs that share, cache and evict pages (no false leak, no false fault), the new faults
(a cached page that is marked, a shared page in a clear list, a recorded sanitizer violation), the
SVG's colours and legend for shared and cached pages, and the report's JSON pinned. Each test
names the mutant it kills.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from kvledger import CLEAR_POLICIES, Geometry, LedgerState
from kvledger.core.events.events import (
    CacheConfigured,
    PagesCommitted,
    PagesPublished,
    PagesReserved,
    PagesShared,
    RequestFinished,
    SanitizerViolation,
    StepCompleted,
    StepSealed,
)
from kvledger.core.log import EventLog, open_view
from support.simdisk import SimulatedDisk
from kvledger.core.state import MARK_ALL, TRANSITIONS
from kvledger.durable import open_ledger
from kvledger.tools.audit import COLORS, FAULT_KINDS, audit_log, render, render_svg

from test_audit_workload import QUIET, build
from test_cli import kvledger

G = Geometry(num_pages=8, page_tokens=4)
REPORT_KEYS = [
    "path", "num_pages", "page_tokens", "policy", "start_seq", "end_seq", "events", "closed_cleanly", "torn_at",
    "torn_bytes", "subject", "mode", "window", "checkpoint_seq", "first_file", "rows", "faults", "open",
    "fault_counts", "step_table", "ranks", "aborted", "error", "seconds", "ok",
]


@pytest.mark.parametrize("policy", CLEAR_POLICIES)
def test_check_finds_only_the_recorded_violations_in_shared_and_cached_workloads(tmp_path, policy):
    """Kills: the leak check counting a page a finished request left to its other sharers (or to the cache)
    as leaked; a cached page's contents seeded as another request's bytes at a checkpoint."""
    info = build(tmp_path / "log", policy=policy, seed=f"check-{policy}", steps=140)
    with open_view(info["path"]) as v:
        violations = sum(1 for _, ev, _ in v.iter_events() if type(ev) is SanitizerViolation)
    mid = info["files"][len(info["files"]) // 2]
    windows: list[tuple[str, dict[str, Any]]] = [(info["path"], {}), (mid, {}), (info["path"], {"since": 600})]
    for path, kw in windows:
        rep = audit_log(path, check=True, **kw)
        assert rep.error is None and rep.closed_cleanly
        assert rep.fault_counts == {"sanitizer_violation": rep.fault_counts.get("sanitizer_violation", 0)}, \
            [f.detail for f in rep.faults if f.kind != "sanitizer_violation"][:5]
    assert audit_log(info["path"], check=True).fault_counts["sanitizer_violation"] == violations >= 1


def _log(events) -> SimulatedDisk:
    disk = SimulatedDisk()
    log = EventLog.create("f", G, policy=events[0].policy, layer=disk)
    for i, ev in enumerate(events):
        log.append(i, ev)
    log.close()
    return disk


SHARED = [
    CacheConfigured(geometry=G),
    PagesReserved(request=1, page_ids=(0, 1), tenant="a"),
    PagesCommitted(request=1, step=0, page_ids=(0, 1)),
    StepSealed(step=0),
    StepCompleted(step=0, rank=0),
    PagesPublished(request=1, page_ids=(0,), hashes=(5,), token_ids=(1, 2, 3, 4)),
    PagesShared(request=2, page_ids=(0,), tenant="a"),
]


def test_a_plan_that_zeroes_a_shared_page_is_a_fault():
    """Kills: a --check that never looks at the recorded plan's shared or published pages."""
    rep = audit_log("f", layer=_log(SHARED + [StepSealed(step=1, clear_list=(0,))]), check=True)
    found = {f.kind: f for f in rep.faults}
    assert {"plan_mismatch", "shared_page_listed"} <= set(found)
    assert found["shared_page_listed"].page_ids == [0] and found["shared_page_listed"].seq == 7
    ok = audit_log("f", layer=_log(SHARED + [StepSealed(step=1), StepCompleted(step=1, rank=0)]), check=True)
    assert ok.ok, [f.detail for f in ok.faults]


def _marking_finish(st, e):
    out = TRANSITIONS[RequestFinished].apply(st, e)
    for p in st.cached:
        st.marks[p] = MARK_ALL  # a broken fold: pages going to the cache keep a mark
    return out


class _MarkingState(LedgerState):
    transitions = {**TRANSITIONS, RequestFinished: TRANSITIONS[RequestFinished]._replace(apply=_marking_finish)}


def test_a_cached_page_that_is_marked_is_a_fault_against_a_broken_fold():
    """Kills: a --check that does not look for marks on cached pages."""
    events = SHARED + [RequestFinished(request=1), RequestFinished(request=2)]
    disk = _log(events)
    assert audit_log("f", layer=disk, check=True).ok
    rep = audit_log("f", layer=disk, check=True, state_factory=_MarkingState)
    assert [(f.kind, f.seq, f.page_ids) for f in rep.faults] == [("marked_cached_page", 8, [0])]


def test_a_recorded_sanitizer_violation_is_a_fault_and_shown(tmp_path):
    """Kills: a violation that --check does not report (exit 0), or one the page view leaves out."""
    p = tmp_path / "v.kvlog"
    with open_ledger(p, G, logger=QUIET) as led:
        rows = led.alias_snapshot(1, 2)
        led.release_snapshot(1)
        led.reserve(5, 2, tenant="a")
        led.commit(5, 0, 2)
        led.seal_step(0)
        led.record_violation(0, 1, 2, rows[0], "poison")  # seq 6
        led.abort_step(0, "sanitizer")
        led.seal_step(1)
    rep = audit_log(p, check=True)
    (f,) = rep.faults
    assert (f.kind, f.seq, f.step, f.page_ids) == ("sanitizer_violation", 6, 0, [rows[0]])
    assert "rank 1 plane 2" in f.detail and "still holding poison" in f.detail
    assert f"page {rows[0]} is kv(5), not marked, step 0's plan listed it, last zeroed by the plan at seq 5 " \
           "(policy released_aliases)" in f.detail, f.detail
    assert f"--page {rows[0]} shows its lifecycle" in f.detail
    assert "sanitizer_violation" in FAULT_KINDS
    out = kvledger("audit", p, "--check")
    assert out.returncode == 1 and "sanitizer_violation" in out.stdout
    page = audit_log(p, page=rows[0])
    assert [r.event for r in page.rows].count("sanitizer_violation") == 1


def test_the_svg_colours_shared_and_cached_pages_with_legend_entries(tmp_path):
    """Kills: shared pages drawn as plain kv, cached pages without a colour, or a legend without them."""
    p = tmp_path / "s.kvlog"
    with open_ledger(p, G, logger=QUIET) as led:
        led.reserve(1, 2, tenant="a")
        led.commit(1, 0, 2)
        led.seal_step(0)
        led.complete_step(0, 0)
        led.publish(1, [7, 8], list(range(8)))
        led.share(2, [7], tenant="a")
        led.finish(1)
        led.finish(2)
        led.seal_step(1)
        led.record_violation(1, 0, 0, 0, "not_zero")
    rep = audit_log(p, check=True, svg_pages=[0, 1, 2])
    holders = {(s.page, s.holder) for s in rep.segments}
    assert {(0, "shared"), (0, "cached"), (1, "cached"), (0, "kv")} <= holders
    root = ET.fromstring(render_svg(rep))
    fills = [r.get("fill") for r in root.iter() if r.tag.endswith("rect")]
    assert fills.count(COLORS["shared"]) == 2 and fills.count(COLORS["cached"]) >= 3  # lanes + legend
    texts = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    assert "kv(R): shared by the requests R" in texts and "cached(h): no holder" in texts
    assert "sanitizer violation recorded" in texts
    diamonds = [e for e in root.iter() if e.tag.endswith("path") and e.get("fill") == COLORS["violation"]]
    assert len(diamonds) == 2  # the legend's and page 0's
    assert len(set(COLORS.values())) == len(COLORS)  # every holder and marker its own colour
    out = kvledger("audit", p, "--page", 0, "--svg", tmp_path / "p.svg")
    assert out.returncode == 0 and ET.parse(tmp_path / "p.svg").getroot().tag.endswith("svg")


def test_the_report_json_is_pinned(tmp_path):
    """Kills: a report field added, dropped or reordered without updating the pinned list; a file missing
    from an error."""
    info = build(tmp_path / "log", seed="json", steps=60)
    for args in (["--check"], ["--page", 3], ["--steps"], ["--request", 2]):
        out = kvledger("audit", info["path"], *args, "--json")
        rep = json.loads(out.stdout)
        assert list(rep) == REPORT_KEYS, args
    victim = info["files"][2]
    data = bytearray(Path(victim).read_bytes())
    data[300] ^= 0x08
    Path(victim).write_bytes(bytes(data))
    out = kvledger("audit", info["path"], "--check", "--json")
    rep = json.loads(out.stdout)
    assert out.returncode == 3 and rep["error"]["kind"] == "corrupt" and rep["error"]["file"] == victim
    assert "FAILED (corrupt, " + victim in render(audit_log(info["path"], check=True))
