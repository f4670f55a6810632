"""RankExecutor on its own: one answer per job, failures and cancellations stay inside
the job, the executor keeps serving; on CUDA the model stream carries all three phases."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from support.gpu import requires_cuda
from support.planes import filled_planes, page

from kvledger import ConfigurationError, PageOutOfRangeError, StepPlan
from kvledger.executors.bytes_backend import BytesClearBackend
from kvledger.executors.executor import (
    RankExecutor,
    StepInputs,
    StepJob,
    StepReplies,
)

NUM_PAGES = 8


def ones():
    """One plane of 16-byte pages, every byte 1."""
    return filled_planes(NUM_PAGES, [16], 1)


def sums(plane) -> list[int]:
    return [sum(page(plane, p)) for p in range(NUM_PAGES)]


def executor(graph=None, planes=None, rank=0, world_size=1):
    planes = planes if planes is not None else ones()
    backend = BytesClearBackend(planes) if planes else None
    return RankExecutor(rank, num_pages=NUM_PAGES, backend=backend, graph=graph, planes=planes,
                        world_size=world_size), planes


def job(step, clear_list=(), inputs=None, scope=None):
    replies = StepReplies(1)
    return StepJob(StepPlan(step=step, clear_list=tuple(clear_list)), inputs or StepInputs(),
                   scope or anyio.CancelScope(), replies), replies


@pytest.mark.asyncio
async def test_jobs_run_in_order_and_each_gets_one_answer():
    calls = []
    ex, planes = executor(graph=lambda ctx, step, inputs: calls.append((step, inputs.data)))
    send, recv = anyio.create_memory_object_stream[StepJob](2)
    jobs = [job(s, [s], StepInputs(data=s * 10)) for s in range(4)]
    async with anyio.create_task_group() as tg:
        await tg.start(ex.serve, recv)
        async with send:
            for j, _ in jobs:
                await send.send(j)
    # serve returned once the stream closed; every job answered exactly once, in order
    assert calls == [(0, 0), (1, 10), (2, 20), (3, 30)]
    for s, (_, replies) in enumerate(jobs):
        (outcome,) = replies.outcomes
        assert (outcome.rank, outcome.step, outcome.status) == (0, s, "ok")
    assert sums(planes[0]) == [0, 0, 0, 0] + [16] * 4
    assert ex.statistics() == {"plans_completed": 4, "plans_failed": 0, "plans_cancelled": 0, "pages_cleared": 4,
                               "sanitizer_violations": 0}


@pytest.mark.asyncio
async def test_a_job_cancelled_before_it_starts_runs_nothing():
    calls = []
    ex, planes = executor(graph=lambda ctx, step, inputs: calls.append(step))
    scope = anyio.CancelScope()
    scope.cancel()
    j, replies = job(0, [1, 2], scope=scope)
    outcome = await ex.run_job(j)
    assert outcome.status == "cancelled" and replies.outcomes == [outcome]
    assert calls == [] and sum(sums(planes[0])) == NUM_PAGES * 16  # not even the clear ran


@pytest.mark.asyncio
async def test_failures_are_answers_and_the_executor_keeps_serving():
    def graph(ctx, step, inputs):
        if step == 1:
            raise RuntimeError("kernel fault")

    ex, planes = executor(graph=graph)
    outcomes = [await ex.run_job(job(s)[0]) for s in range(3)]
    assert [o.status for o in outcomes] == ["ok", "failed", "ok"]
    assert isinstance(outcomes[1].error, RuntimeError) and outcomes[1].timing is None
    # a bad clear list is a failure of that job only, before anything was zeroed
    bad = await ex.run_job(job(3, [2, NUM_PAGES])[0])
    assert bad.status == "failed" and isinstance(bad.error, PageOutOfRangeError)
    assert sum(sums(planes[0])) == NUM_PAGES * 16
    # a rank without planes still validates its clear lists
    bare, _ = executor(planes=[])
    assert (await bare.run_job(job(0, [NUM_PAGES + 3])[0])).status == "failed"
    assert (await bare.run_job(job(0, [1, 2])[0])).status == "ok"
    assert ex.statistics()["plans_failed"] == 2


@pytest.mark.asyncio
async def test_cancelling_a_job_mid_graph_and_cancelling_the_executor_task():
    entered = anyio.Event()

    async def graph(ctx, step, inputs):
        entered.set()
        await anyio.sleep_forever()

    ex, _ = executor(graph=graph)
    j, replies = job(0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ex.run_job, j)
        await entered.wait()
        j.scope.cancel()  # this rank's part of the step only
    assert [o.status for o in replies.outcomes] == ["cancelled"]

    # cancelling the executor's own task: the job in hand is answered, the cancel re-raised
    entered = anyio.Event()
    send, recv = anyio.create_memory_object_stream[StepJob](1)
    j2, replies2 = job(1)
    with anyio.move_on_after(5) as outer:
        async with anyio.create_task_group() as tg:
            await tg.start(ex.serve, recv)
            await send.send(j2)
            await entered.wait()
            tg.cancel_scope.cancel()
    send.close()
    assert not outer.cancelled_caught
    assert [o.status for o in replies2.outcomes] == ["cancelled"]
    assert ex.statistics()["plans_cancelled"] == 2


def test_rank_must_fit_the_world():
    with pytest.raises(ConfigurationError):
        RankExecutor(2, num_pages=4, world_size=2)
    not_callable: Any = "not callable"
    with pytest.raises(ConfigurationError):
        RankExecutor(0, num_pages=4, graph=not_callable)


@requires_cuda
@pytest.mark.asyncio
async def test_cuda_rank_runs_copies_clears_graph_on_its_stream():
    import torch

    from kvledger.executors.torch_backend import TorchClearBackend

    stream = torch.cuda.Stream()
    planes = [torch.full((NUM_PAGES, 1 << 20), 7, dtype=torch.uint8, device="cuda")]
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dev = torch.zeros(1 << 20, device="cuda")
    seen = {}

    def graph(ctx, step, inputs):
        assert torch.cuda.current_stream() == ctx.stream
        # enqueued after the copy and the clear on the same stream: sees both
        seen["copy"] = dev.clone()  # every element (a float sum hid a short copy and differed by an ulp)
        seen["page"] = planes[0][3].sum()
        torch.cuda._sleep(10_000_000)  # keep the stream busy: completion must be awaited

    ex = RankExecutor(0, num_pages=NUM_PAGES, backend=TorchClearBackend(planes, stream=stream),
                      graph=graph, planes=planes, device=planes[0].device, stream=stream)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        outcome = await ex.run_job(job(0, [3, 4], StepInputs(copies=[(host, dev)]))[0])
        tg.cancel_scope.cancel()
    assert outcome.status == "ok", outcome.error
    assert outcome.timing is not None
    assert ticks > 1  # the loop kept running while the GPU worked
    assert torch.equal(seen["copy"].cpu(), host) and int(seen["page"]) == 0
    assert outcome.timing.graph_s > 0 and outcome.timing.total_s >= outcome.timing.graph_s


class CheckedBackend(BytesClearBackend):
    """The bytes backend with a no-recheck clear, counting which of the two each job used."""

    def __init__(self, planes):
        super().__init__(planes)
        self.calls: list[str] = []

    def clear(self, page_ids):
        self.calls.append("clear")
        super().clear(page_ids)

    def clear_checked(self, page_ids):
        self.calls.append("clear_checked")
        super().clear(page_ids)


@pytest.mark.asyncio
async def test_only_a_checked_job_with_a_tuple_list_skips_the_backends_recheck():
    planes = ones()
    backend = CheckedBackend(planes)
    ex = RankExecutor(0, num_pages=NUM_PAGES, backend=backend, planes=planes, world_size=1)
    for checked, clear_list in ((True, (1, 2)), (False, (3,)), (True, [4])):
        j = StepJob(StepPlan(step=0, clear_list=clear_list), StepInputs(), anyio.CancelScope(), StepReplies(1),
                    checked=checked)
        assert (await ex.run_job(j)).status == "ok"
    # a list (not a sealed plan's tuple) is checked whatever the job says
    assert backend.calls == ["clear_checked", "clear", "clear"]
    assert sums(planes[0]) == [16, 0, 0, 0, 0, 16, 16, 16]
    plain = RankExecutor(0, num_pages=NUM_PAGES, backend=BytesClearBackend(planes), planes=planes, world_size=1)
    j = StepJob(StepPlan(step=0, clear_list=(5,)), StepInputs(), anyio.CancelScope(), StepReplies(1), checked=True)
    assert (await plain.run_job(j)).status == "ok" and sums(planes[0])[5] == 0


@pytest.mark.asyncio
async def test_the_engine_marks_its_jobs_checked():
    from kvledger import Geometry
    from kvledger.engine import RankSpec, open_engine

    planes = ones()
    backend = CheckedBackend(planes)
    async with open_engine(Geometry(num_pages=NUM_PAGES, page_tokens=4),
                           ranks=[RankSpec(planes=planes, backend=backend)]) as engine:
        rows = await engine.alias_snapshot(1, 2)
        await engine.release_snapshot(1)
        await engine.reserve(1, 2)
        await engine.commit(1, 0, 2)
        result = await engine.run_step(0)
    assert sorted(result.clear_list) == sorted(rows) and backend.calls == ["clear_checked"]
