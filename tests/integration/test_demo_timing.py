"""The demo's per-step timing figures (issue #15): the clear phase's host and device time,
and the engine's overhead against the same graph run bare. The bare runs leave no trace:
same schedule, same events, same digest, same logits as a run without them. Budget: about 6 s.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from support.demo import simulate_demo  # noqa: E402

from kvledger.demo import DemoConfig  # noqa: E402
from kvledger.demo.results import RunResult  # noqa: E402
from kvledger.demo.table import render_table  # noqa: E402

SMALL = DemoConfig(requests=12, short_tokens=128, long_tokens=256)


@pytest.fixture(scope="module")
def runs():
    return (simulate_demo(dataclasses.replace(SMALL, bare_every=0)),
            simulate_demo(dataclasses.replace(SMALL, bare_every=1)))


def test_bare_runs_leave_no_trace(runs):
    plain, bare = runs
    assert (bare.steps, bare.events, bare.digest, bare.pages_listed) == (plain.steps, plain.events, plain.digest,
                                                                          plain.pages_listed)
    assert bare.logits.keys() == plain.logits.keys()
    assert all(torch.equal(bare.logits[r], plain.logits[r]) for r in plain.logits)
    assert plain.bare_steps == 0 and bare.bare_steps == bare.steps and bare.bare_mismatch == 0


def test_bare_every_samples_every_nth_step():
    run = simulate_demo(dataclasses.replace(SMALL, requests=6, bare_every=3))
    assert run.bare_steps == -(-run.steps // 3) > 0 and run.bare_mismatch == 0


def test_overheads_and_clear_times_are_per_step_figures(runs):
    _, run = runs
    f = run.figures()
    # the graph runs inside the step and inside the bare call: both overheads are positive
    assert 0 < f["overhead_mean_s"] <= run.overhead_max_s and run.overhead_sum_s < run.step_s
    assert 0 < f["bare_engine_overhead_mean_s"] <= run.bare_engine_overhead_max_s
    assert 0 < f["bare_overhead_mean_s"] <= run.bare_overhead_max_s
    assert run.bare_graph_s > 0
    # clears: the slowest rank per step, over the steps that had a clear list; on the CPU the
    # clear phase's own time is its host time
    assert run.steps_with_clears > 0
    assert 0 < f["clear_host_mean_s"] <= run.clear_host_max_s
    assert run.clear_dev_sum_s == run.clear_host_sum_s and run.clear_dev_max_s == run.clear_host_max_s
    assert run.clear_dev_sum_s <= run.clear_s


def test_add_step_takes_the_slowest_rank():
    from kvledger.engine import RankTiming, StepResult

    res = RunResult(label="x")
    ranks = (RankTiming(rank=0, copies_s=0, clear_s=3e-6, graph_s=5e-3, total_s=6e-3, clear_host_s=9e-6),
             RankTiming(rank=1, copies_s=0, clear_s=4e-6, graph_s=4e-3, total_s=6e-3, clear_host_s=7e-6))
    res.add_step(StepResult(step=0, clear_list=(1, 2), ranks=ranks, wall_s=6e-3))
    res.add_step(StepResult(step=1, clear_list=(), ranks=ranks, wall_s=7e-3))
    f = res.figures()
    assert (res.steps, res.steps_with_clears, res.pages_listed) == (2, 1, 2)
    assert (res.clear_host_sum_s, res.clear_dev_sum_s) == (9e-6, 4e-6)
    assert f["overhead_mean_s"] == pytest.approx(((6e-3 - 5e-3) + (7e-3 - 5e-3)) / 2)
    assert res.overhead_max_s == pytest.approx(2e-3)


def test_table_shows_the_rows_for_both_runs(runs):
    from rich.console import Console

    from kvledger.demo.results import DemoReport

    _, run = runs
    console = Console(width=120, record=True)
    console.print(render_table(DemoReport(config=SMALL, run=run, reference=run, oracle=None, wall_s=1.0)))
    text = console.export_text()
    for row in ("clear, host", "clear, device (=host)", "engine overhead", "bare loop overhead"):
        assert row in text
    assert "prefix cache hit rate" not in text  # only with --prefix-cache
