"""audit_log: lifecycles of pages, requests and snapshots; lifecycle faults; the SVG timeline."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from support import QUIET
from kvledger.core.state import TRANSITIONS
from kvledger.options import LogOptions
from kvledger import CLEAR_POLICIES, Geometry, LedgerState
from kvledger.tools.audit import COLORS, AuditReport, audit_log, render, render_svg
from kvledger.core.events.events import (
    CacheConfigured,
    PagesCommitted,
    PagesReserved,
    RequestFinished,
    RestoreCompleted,
    RestoreStarted,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepSealed,
)
from kvledger.core.log import EventLog
from support.simdisk import SimulatedDisk
from kvledger.durable import open_ledger

from support.workload import GEOMETRY, drive

G = Geometry(num_pages=8, page_tokens=4)


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """The seed's story on 8 pages: a snapshot's rows alias pages, it is released, a request commits them."""
    p = tmp_path_factory.mktemp("audit") / "story.kvlog"
    with open_ledger(p, G, logger=QUIET) as led:
        rows = led.alias_snapshot(1, 2)  # seq 1
        led.release_snapshot(1)  # seq 2: pages free and marked
        got = led.reserve(5, 2)  # seq 3: LIFO hands the marked pages out again
        assert set(got) == set(rows)
        led.commit(5, 0, 2)  # seq 4: both listed for step 0
        led.seal_step(0)  # seq 5: step 0's plan zeroes them
        led.finish(5)  # seq 6
    return p, rows


def test_page_timeline(story):
    p, rows = story
    rep = audit_log(p, page=rows[0])
    got = [(r.seq, r.event, r.holder_before, r.holder_after, r.marked_before, r.marked_after) for r in rep.rows]
    assert got == [
        (1, "snapshot_aliased", "free", "alias({1})", False, False),
        (2, "snapshot_released", "alias({1})", "free", False, True),
        (3, "pages_reserved", "free", "reserved(5)", True, True),
        (4, "pages_committed", "reserved(5)", "kv(5)", True, False),
        (5, "step_sealed", "kv(5)", "kv(5)", False, False),
        (6, "request_finished", "kv(5)", "free", False, False),
    ]
    notes = [r.note for r in rep.rows]
    assert "marked" in notes[1] and "listed for step 0's clear list" in notes[3]
    assert notes[4] == "zeroed by step 0's plan, before any request read it"
    text = render(rep)
    assert "zeroed by step 0's plan" in text and "reserved(5) -> kv(5)" in text
    assert audit_log(p, page=7).rows == []


def test_request_and_snapshot_timelines(story):
    p, rows = story
    req = audit_log(p, request=5)
    assert [(r.seq, r.event) for r in req.rows] == [(3, "pages_reserved"), (4, "pages_committed"),
                                                    (5, "step_sealed"), (6, "request_finished")]
    assert "listed for step 0's clear list" in req.rows[1].note and sorted(req.rows[2].page_ids) == sorted(rows)
    snap = audit_log(p, snapshot=1)
    assert [(r.seq, r.event) for r in snap.rows] == [(1, "snapshot_aliased"), (2, "snapshot_released"),
                                                     (3, "pages_reserved"), (4, "pages_committed"),
                                                     (5, "step_sealed")]
    assert "freed and marked" in snap.rows[1].note and "zeroed by step 0's plan" in snap.rows[4].note


def test_the_request_view_names_the_pages_its_end_marked():
    """The request timeline quotes the fold's PagesMarked effect: under all_reused a finished request's pages
    are marked; under released_aliases nothing is. Kills: a view that drops the effect or reads it elsewhere."""
    def rows(policy: str) -> list:
        events = [CacheConfigured(geometry=G, policy=policy), PagesReserved(request=5, page_ids=(0, 1, 2), tenant="a"),
                  PagesCommitted(request=5, step=0, page_ids=(0, 1)), StepSealed(step=0),
                  RequestFinished(request=5)]
        return audit_log("f", layer=_log(events), request=5).rows

    finished = rows("all_reused")[-1]
    assert finished.event == "request_finished"
    assert finished.note.endswith("; 2 marked by the clear policy (its bytes stay behind): [0, 1]"), finished.note
    assert "marked" not in rows("released_aliases")[-1].note


@pytest.mark.parametrize("policy", CLEAR_POLICIES)
def test_check_finds_no_fault_in_random_workloads(tmp_path, policy):
    logs = 0
    for seed in range(6):
        p = tmp_path / f"w{seed}.kvlog"
        with open_ledger(p, GEOMETRY, policy=policy, logger=QUIET, log_options=LogOptions(checkpoint_every=53)) as led:
            drive(led, f"audit-{seed}", 50, ranks=2)
            for (into, target) in sorted(set(led.state.restore_targets.values())):  # drain restores
                pages = sorted(q for q, t in led.state.restore_targets.items() if t == (into, target))
                led.complete_restore(pages, **{into: target})
            for rank in range(2):
                led.complete_step(led.open_step - 1, rank)
        for since in (None, 200):
            rep = audit_log(p, check=True, since=since)
            assert rep.ok, [f.detail for f in rep.faults]
            assert rep.closed_cleanly and rep.events > 300
        logs += 1
    print(f"audit --check ({policy}): {logs} random logs, no faults")


def _log(events, *, close: bool = True, geometry: Geometry = G):
    disk = SimulatedDisk()
    log = EventLog.create("f", geometry, policy=events[0].policy, layer=disk)
    for i, ev in enumerate(events):
        log.append(i, ev)
    if close:
        log.close()
    else:
        log.sync()
        log.abandon()
    return disk


def _faults(events, **kw) -> tuple[dict, AuditReport]:
    disk = _log(events, close=kw.pop("close", True))
    rep = audit_log("f", layer=disk, check=True, **kw)
    found = {(f.kind, f.seq): f for f in rep.faults}
    assert len(found) == len(rep.faults) or all(f.seq is None for f in rep.faults if f.kind.startswith("step"))
    return found, rep


BASE = [
    CacheConfigured(geometry=G),
    SnapshotAliased(snapshot=1, page_ids=(0, 1)),
    SnapshotReleased(snapshot=1),
    PagesReserved(request=5, page_ids=(0, 1), tenant="a"),
    PagesCommitted(request=5, step=0, page_ids=(0, 1)),
]


def test_a_plan_that_misses_a_marked_page_is_an_unzeroed_read():
    faults, rep = _faults(BASE + [StepSealed(step=0, clear_list=(1,))])
    assert set(faults) == {("plan_mismatch", 5), ("unzeroed_read", 5)}
    f = faults[("unzeroed_read", 5)]
    assert f.page_ids == [0] and f.request == 5 and "snapshot 1's row bytes" in f.detail
    assert not rep.ok and "FAULTS: 2" in render(rep)


def test_a_plan_that_zeroes_an_extra_page_is_needless_or_redundant():
    faults, _ = _faults(BASE + [StepSealed(step=0, clear_list=(0, 1, 6))])
    assert set(faults) == {("plan_mismatch", 5), ("needless_clear", 5)}
    assert faults[("needless_clear", 5)].page_ids == [6]
    ar = [CacheConfigured(geometry=G, policy="all_reused"), StepSealed(step=0, clear_list=(3,))]
    faults, _ = _faults(ar)
    assert set(faults) == {("plan_mismatch", 1), ("redundant_clear", 1)}


def test_rejected_events_are_classified_and_skipped():
    events = BASE + [StepSealed(step=0, clear_list=(0, 1)), RequestFinished(request=5), RequestFinished(request=5),
                     RequestFinished(request=77), SnapshotReleased(snapshot=1), SnapshotReleased(snapshot=9),
                     PagesReserved(request=6, page_ids=(9,))]
    faults, rep = _faults(events)
    assert set(faults) == {("double_finish", 7), ("unknown_request", 8), ("double_release", 9),
                           ("unknown_snapshot", 10), ("rejected_event", 11)}
    assert rep.events == len(events)


def test_aborted_steps_undo_their_clears():
    ok = BASE + [StepSealed(step=0, clear_list=(0, 1)), StepAborted(step=0, reason="timeout"),
                 StepSealed(step=1, clear_list=(0, 1))]
    faults, _ = _faults(ok)
    assert faults == {}
    bad = ok[:-1] + [StepSealed(step=1, clear_list=())]
    faults, _ = _faults(bad)
    assert set(faults) == {("plan_mismatch", 7), ("unzeroed_read", 7)}


def test_restores_and_steps_left_open():
    events = [CacheConfigured(geometry=G), PagesReserved(request=5, page_ids=(0,)),
              RestoreStarted(into="request", target=5, page_ids=(0,)),
              StepSealed(step=0), StepCompleted(step=0, rank=0), StepCompleted(step=0, rank=1),
              StepSealed(step=1), StepCompleted(step=1, rank=0),
              StepSealed(step=2), StepCompleted(step=2, rank=0), StepCompleted(step=2, rank=1),
              StepSealed(step=3), StepCompleted(step=3, rank=0)]
    faults, rep = _faults(events)
    kinds = sorted(f.kind for f in rep.faults)
    assert kinds == ["restore_never_completed", "step_never_completed", "step_never_completed"]
    details = " / ".join(f.detail for f in rep.faults)
    assert "rank 1 completed step 2 but never steps [1]" in details and "never completed steps [3]" in details
    # the same log, not closed (a live or crashed log): in flight, not faults -- except the skipped step
    faults, rep = _faults(events, close=False)
    assert sorted(f.kind for f in rep.faults) == ["step_never_completed"]
    assert {f.kind for f in rep.open} >= {"restore_in_flight", "steps_in_flight", "request_open"}
    done = events + [RestoreCompleted(into="request", target=5, page_ids=(0,)), StepCompleted(step=1, rank=1),
                     StepCompleted(step=3, rank=1)]
    faults, rep = _faults(done)
    assert faults == {}


def _leaky_finish(st, e):
    rec = st.requests[e.request]
    kept = rec.kv[-1:]
    rec.kv = rec.kv[:-1]
    out = TRANSITIONS[RequestFinished].apply(st, e)
    for p in kept:
        st.holder[p] = -2  # the page still looks held (as an alias) after the request is gone
    return out


class _LeakyState(LedgerState):
    """A broken fold: a finished request keeps its last KV page."""

    transitions = {**TRANSITIONS, RequestFinished: TRANSITIONS[RequestFinished]._replace(apply=_leaky_finish)}


def test_leaks_are_caught_against_a_broken_fold():
    events = BASE + [StepSealed(step=0, clear_list=(0, 1)), RequestFinished(request=5)]
    disk = _log(events)
    assert audit_log("f", layer=disk, check=True).ok
    rep = audit_log("f", layer=disk, check=True, state_factory=_LeakyState)
    assert [(f.kind, f.seq, f.page_ids) for f in rep.faults] == [("leak", 6, [1])]


def test_svg_timeline(story, tmp_path):
    p, rows = story
    rep = audit_log(p, check=True, svg_pages=list(range(8)))
    svg = render_svg(rep)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    texts = [t.text for t in root.iter() if t.tag.endswith("text")]
    assert sum(1 for t in texts if t and t.startswith("page ")) == 8
    fills = {r.get("fill") for r in root.iter() if r.tag.endswith("rect")}
    assert {COLORS["free"], COLORS["reserved"], COLORS["kv"], COLORS["alias"], COLORS["marked"]} <= fills
    zeroed = [e for e in root.iter() if e.tag.endswith("path") and e.get("fill") == COLORS["zeroed"]]
    assert len(zeroed) == 1 + 2  # the legend's and one per zeroed page
    assert any(t and str(p) in t for t in texts)
    # a fault is drawn where it happened
    disk = _log(BASE + [StepSealed(step=0, clear_list=(1,))])
    bad = audit_log("f", layer=disk, check=True, svg_pages=[0, 1])
    root = ET.fromstring(render_svg(bad))
    crosses = [g for g in root.iter() if g.tag.endswith("g") and g.get("stroke") == COLORS["fault"]]
    assert len(crosses) == 3  # the legend's, and page 0's two faults (plan mismatch, unzeroed read)
    (tmp_path / "story.svg").write_text(svg)
