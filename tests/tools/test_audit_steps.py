"""``kvledger audit --steps`` (issue #16): which ranks completed each step, which steps were aborted, and
which were aborted in a cascade (an abort of step k takes every later step in flight with it); and
``--check`` over such a log: no step owed by a rank, the content model's clears and reads undone
for every step of the cascade. Logs written by the real ledger. Each test names the mutant it kills.
"""

from __future__ import annotations

import json

import pytest

from kvledger import Geometry
from kvledger.options import LogOptions
from kvledger.durable import open_ledger
from kvledger.tools.audit import audit_log, render

from test_audit_workload import QUIET
from test_cli import kvledger

G = Geometry(num_pages=16, page_tokens=4)
STEP_KEYS = ["step", "sealed_seq", "cleared", "ranks", "missing", "aborted_seq", "aborted_by", "reason", "violations",
             "status"]


def _marked(led, snapshot: int, n: int) -> tuple:
    pages = led.alias_snapshot(snapshot, n)
    led.release_snapshot(snapshot)
    return pages


@pytest.fixture(scope="module")
def cascade(tmp_path_factory):
    """seal 0 (completed on both ranks); seal 1, seal 2 (marked pages in both plans); rank 0 completes 1;
    the sanitizer records a violation in step 1; abort 1 (2 goes with it); seal 3 (the carried pages),
    completed on both ranks. A checkpoint is taken between seal 2 and the abort."""
    p = tmp_path_factory.mktemp("steps") / "log"
    with open_ledger(p, G, logger=QUIET, log_options=LogOptions(segment_bytes=4096)) as led:
        led.reserve(1, 1, tenant="a")
        led.commit(1, 0, 1)
        led.seal_step(0)
        for rank in (0, 1):
            led.complete_step(0, rank)
        a = _marked(led, 10, 2)
        led.reserve(2, 2, tenant="a")
        led.commit(2, 1, 2)
        p1 = led.seal_step(1)
        b = _marked(led, 11, 2)
        led.reserve(3, 2, tenant="b")
        led.commit(3, 2, 2)
        p2 = led.seal_step(2)
        led.complete_step(1, 0)
        led.checkpoint()
        checkpoint_seq = led.seq
        led.record_violation(1, 1, 0, p1.clear_list[0], "not_zero")
        abort_seq = led.seq
        led.abort_step(1, "rank 1 failed step 1")
        p3 = led.seal_step(3)
        for rank in (0, 1):
            led.complete_step(3, rank)
    assert sorted(p1.clear_list) == sorted(a) and sorted(p2.clear_list) == sorted(b)
    assert p3.clear_list == p1.clear_list + p2.clear_list  # carried, the oldest plan's pages first
    return {"path": p, "abort_seq": abort_seq, "checkpoint_seq": checkpoint_seq, "p1": p1, "p2": p2}


def test_steps_show_per_rank_completion_and_the_cascade(cascade):
    """Kills: an abort recorded for the named step only (step 2 shown in flight, owed by both ranks)."""
    rep = audit_log(cascade["path"], steps=True)
    assert rep.ok and rep.subject == "steps"
    got = {r.step: (r.ranks, r.missing, r.status, r.aborted_by, r.cleared) for r in rep.step_table}
    assert got == {
        0: ([0, 1], [], "completed", None, 0),
        1: ([0], [], "aborted", 1, 2),
        2: ([], [], "aborted_in_cascade", 1, 2),
        3: ([0, 1], [], "completed", None, 4),
    }
    assert rep.step_table[1].aborted_seq == rep.step_table[2].aborted_seq == cascade["abort_seq"]
    assert rep.step_table[1].violations == 1 and rep.step_table[1].reason == "rank 1 failed step 1"
    assert rep.ranks == {"0": 3, "1": 2} and rep.aborted == {"named": 1, "in_cascade": 1}
    text = render(rep)
    assert "aborted_in_cascade at seq" in text and "(step 1 aborted)" in text
    assert "steps: completions per rank: rank 0 3, rank 1 2; 1 abort(s), 1 more step(s) aborted in a cascade" in text


def test_check_owes_no_aborted_step_and_undoes_every_plan_of_the_cascade(cascade):
    """Kills: the content model undoing only the named step's clears and reads (step 2's pages then look
    zeroed twice, or read unzeroed), or counting a step of the cascade as one the ranks still owe."""
    rep = audit_log(cascade["path"], check=True)
    assert set(rep.fault_counts) == {"sanitizer_violation"}, [f.detail for f in rep.faults]
    assert rep.aborted == {"named": 1, "in_cascade": 1} and rep.step_table == []
    # from the checkpoint taken while steps 1 and 2 were in flight: the model is seeded with both plans
    rep = audit_log(cascade["path"], check=True, since=cascade["checkpoint_seq"])
    assert rep.checkpoint_seq == cascade["checkpoint_seq"]
    assert set(rep.fault_counts) == {"sanitizer_violation"}, [f.detail for f in rep.faults]
    steps = audit_log(cascade["path"], steps=True, since=cascade["checkpoint_seq"])
    seeded = {r.step: (r.sealed_seq, r.status) for r in steps.step_table}
    assert seeded == {1: (None, "aborted"), 2: (None, "aborted_in_cascade"), 3: (seeded[3][0], "completed")}


def test_the_aborted_plans_are_drawn_hollow_on_every_page_of_the_cascade(cascade):
    """Kills: the SVG hollowing only the named step's markers (step 2's zeroing drawn as done)."""
    pages = sorted(cascade["p1"].clear_list + cascade["p2"].clear_list)
    rep = audit_log(cascade["path"], check=True, svg_pages=pages)
    kinds: dict[int, list[str]] = {}
    for kind, p, _ in rep.markers:
        kinds.setdefault(p, []).append(kind)
    for p in pages:  # zeroed in step 1's or 2's plan (aborted: hollow), then in step 3's
        assert [k for k in kinds[p] if k.startswith("zeroed")] == ["zeroed_aborted", "zeroed"], (p, kinds[p])
    assert ["violation", cascade["p1"].clear_list[0], cascade["abort_seq"] - 1] in rep.markers


def test_steps_from_the_command_line(cascade):
    """Kills: --steps missing from the CLI, or its JSON rows losing a field."""
    out = kvledger("audit", cascade["path"], "--steps", "--json")
    assert out.returncode == 0
    rep = json.loads(out.stdout)
    assert [list(r) for r in rep["step_table"]] == [STEP_KEYS] * 4
    assert [r["status"] for r in rep["step_table"]] == ["completed", "aborted", "aborted_in_cascade", "completed"]
    out = kvledger("audit", cascade["path"], "--steps")
    assert out.returncode == 0 and "completed by" in out.stdout and "aborted_in_cascade" in out.stdout
    out = kvledger("audit", cascade["path"], "--check")
    assert out.returncode == 1 and "1 more step(s) aborted in a cascade" in out.stdout
