"""The executor's CUDA step path, its bookkeeping run on the CPU with a stand-in rank (no GPU here).

``RankExecutor._execute_cuda`` takes a path of its own for the usual step (no timings, no
sanitizer). What this file checks is its Python: the order of the calls (switch, copies, the
clear (checked or not), the graph, the completion event, the wait), the outcome and its
timing, and a failure inside the switch answered as a failed rank. The GPU tests run the same
path on a card (``test_gpu_backends.py``'s stream-order tests, the engine's GPU tests).
"""

from __future__ import annotations

import pytest

from kvledger import StepPlan
from kvledger.executors import executor as ex_mod


class _Switch:
    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("switch in")

    def __exit__(self, *exc):
        self.log.append("switch out")


class _Done:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(("done", stream))

    def query(self):
        return True

    def synchronize(self):
        pass


class _Rank:
    """Stands for ``cuda_rank.CudaRank`` (what the executor reads of it)."""

    def __init__(self, log):
        self.stream = "model stream"
        self.marks = None
        self.switch = _Switch(log)
        self.done = _Done(log)
        self.log = log

    def copy_all(self, copies):
        self.log.append(("copies", len(copies)))


class _Backend:
    name = "stand-in"
    can_sanitize = False
    num_pages = 16

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def clear(self, ids):
        if self.fail:
            raise RuntimeError("the clear broke")
        self.log.append(("clear", tuple(ids)))

    def clear_checked(self, ids):
        self.log.append(("clear_checked", ids))

    def poison(self, ids):
        raise AssertionError("not in this mode")

    def start_verify(self, a, b):
        raise AssertionError("not in this mode")


def _executor(log, fail=False):
    graph_calls = []

    def graph(ctx, step, inputs):
        log.append(("graph", step))
        graph_calls.append(step)

    ex = ex_mod.RankExecutor(0, num_pages=16, backend=_Backend(log, fail), graph=graph, timings=False)
    ex._cuda = _Rank(log)  # (the stand-in rank: a CUDA rank's bookkeeping, run where no GPU is)
    return ex


@pytest.mark.anyio
@pytest.mark.parametrize("checked", [False, True])
async def test_the_usual_cuda_step_runs_copies_clear_graph_then_waits(checked):
    log: list = []
    ex = _executor(log)
    replies = ex_mod.StepReplies(1)
    job = ex_mod.StepJob(StepPlan(step=3, clear_list=(4, 9)), ex_mod.StepInputs(copies=[(1, 2)]), None, replies,
                         checked=checked)
    outcome = await ex.run_job(job)
    assert outcome.status == "ok" and replies.outcomes == [outcome]
    clear = ("clear_checked", (4, 9)) if checked else ("clear", (4, 9))
    assert log == ["switch in", ("copies", 1), clear, ("graph", 3), "switch out", ("done", "model stream")]
    t = outcome.timing
    assert t.copies_s == t.clear_s == t.graph_s == 0.0 and t.total_s >= t.clear_host_s > 0.0
    assert ex.statistics()["pages_cleared"] == 2


@pytest.mark.anyio
async def test_an_empty_clear_list_clears_nothing_and_a_failed_clear_is_a_failed_rank():
    log: list = []
    ex = _executor(log)
    outcome = await ex.run_job(ex_mod.StepJob(StepPlan(step=0, clear_list=()), ex_mod.NO_INPUTS, None,
                                              ex_mod.StepReplies(1)))
    assert outcome.status == "ok" and outcome.timing.clear_host_s == 0.0
    assert log == ["switch in", ("graph", 0), "switch out", ("done", "model stream")]
    log.clear()
    ex = _executor(log, fail=True)
    outcome = await ex.run_job(ex_mod.StepJob(StepPlan(step=1, clear_list=(2,)), ex_mod.NO_INPUTS, None,
                                              ex_mod.StepReplies(1)))
    assert outcome.status == "failed" and "the clear broke" in str(outcome.error)
    assert log == ["switch in", "switch out"]  # nothing after the failure: no graph, no event
