"""Steps in flight together in the engine (``open_engine(..., depth=2)``), on real inline CPU ranks.

The interleavings below are the scheduler's: every engine call gives the loop its turn
(``yield_every_s=0``), so which task runs when does not depend on the clock.

Step k+1 is sealed while step k has not run yet; the ranks run them in step order. If
step k fails, one ``StepAborted(k)`` aborts k and k+1, recorded before k's completions;
k+1 runs nothing and raises ``StepFailedError`` naming step k; every page of both clear
lists is listed again for the next step and zeroed there. A page freed in step k and
committed in step k+1 is cleared after step k's graph (the rank runs k, then k+1's clear).

The tasks are started before either yields (asyncio runs ready tasks in order): each
yields at run_step's entry; step 0's task seals and yields once more, step 1's task seals
while step 0 has not run.
"""

from __future__ import annotations

import anyio
import pytest
from support.engine import assert_consistent, released_then_committed, step_events
from support.planes import filled_planes, page_is_zero, write_rows

from kvledger import ConfigurationError, Geometry, InvalidArgumentError, StepFailedError
from kvledger.engine import LogOptions, StepOptions
from kvledger.engine import RankSpec, RemoteOptions, open_engine

G = Geometry(num_pages=16, page_tokens=4)


def recording_graph(ran, fail_at=None):
    def graph(ctx, step, inputs):
        ran.append((step, ctx.rank))
        if (step, ctx.rank) == fail_at:
            raise RuntimeError(f"rank {ctx.rank} broke at step {step}")

    return graph


@pytest.mark.asyncio
async def test_two_steps_in_flight_run_in_step_order_and_both_complete():
    ran: list = []
    planes = [filled_planes(G.num_pages, [32, 32], 0x11), filled_planes(G.num_pages, [32, 32], 0x11)]
    specs = [RankSpec(planes=p, graph=recording_graph(ran)) for p in planes]
    results = {}
    async with open_engine(G, ranks=specs, record=True, check=True,
                           steps=StepOptions(depth=2, yield_every_s=0)) as engine:
        rows0 = await released_then_committed(engine, planes, snapshot=7, request=1, n=2, step=0)
        rows1 = await released_then_committed(engine, planes, snapshot=8, request=2, n=3, step=1)

        async def run(k):
            results[k] = await engine.run_step(k)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            tg.start_soon(run, 1)
        assert step_events(engine) == [("sealed", 0), ("sealed", 1), ("completed", 0, 0), ("completed", 0, 1),
                                       ("completed", 1, 0), ("completed", 1, 1)]
        assert ran == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert sorted(results[0].clear_list) == sorted(rows0)
        assert sorted(results[1].clear_list) == sorted(rows1)
        assert all(page_is_zero(plane, p) for rp in planes for plane in rp for p in rows0 + rows1)
        assert engine.ledger.state.in_flight == []
        assert_consistent(engine)


@pytest.mark.asyncio
@pytest.mark.parametrize("log", ["memory", "fsync_inline"])
async def test_a_failed_step_aborts_the_later_sealed_step_which_runs_nothing(log, tmp_path):
    """In memory, and with a log that fsyncs inline (every ledger call in the worker thread)."""
    ran: list = []
    planes = [filled_planes(G.num_pages, [32, 32], 0x11), filled_planes(G.num_pages, [32, 32], 0x11)]
    specs = [RankSpec(planes=p, graph=recording_graph(ran, fail_at=(0, 1))) for p in planes]
    errors: dict = {}
    opts = {"record": True} if log == "memory" else \
        {"log": tmp_path / "l.kvlog", "log_options": LogOptions(background=False)}
    async with open_engine(G, ranks=specs, check=True, steps=StepOptions(depth=2, yield_every_s=0), **opts) as engine:
        rows0 = await released_then_committed(engine, planes, snapshot=7, request=1, n=2, step=0)
        rows1 = await released_then_committed(engine, planes, snapshot=8, request=2, n=3, step=1)

        async def run(k):
            with pytest.raises(StepFailedError) as info:
                await engine.run_step(k)
            errors[k] = info.value

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            tg.start_soon(run, 1)
        # one abort reaches both, recorded before the completion of the rank that ran step 0
        assert step_events(engine) == [("sealed", 0), ("sealed", 1), ("aborted", 0), ("completed", 0, 0)]
        assert ran == [(0, 0), (0, 1)]  # step 1's graph never ran
        assert errors[0].step == 0 and errors[0].rank == 1
        later = errors[1]
        assert later.step == 1 and later.rank == 1 and later.failures == ()
        assert "aborted with step 0" in str(later) and "rank 1 failed" in str(later)
        assert sorted(later.clear_list) == sorted(rows1)
        assert {0, 1} <= engine.ledger.state.aborted_steps and engine.ledger.state.in_flight == []
        assert engine.statistics()["steps_aborted"] == 2
        assert_consistent(engine)
        # both clear lists carry into the next step, the oldest plan's pages first, and are zeroed there
        result = await engine.run_step(2)
        assert list(result.clear_list) == [*errors[0].clear_list, *later.clear_list]
        assert sorted(result.clear_list) == sorted(rows0 + rows1)
        assert all(page_is_zero(plane, p) for rp in planes for plane in rp for p in rows0 + rows1)
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_a_page_freed_in_step_k_and_committed_in_step_k1_is_cleared_after_step_ks_graph():
    seen: dict = {}
    planes = [filled_planes(G.num_pages, [32, 32], 0x11)]
    gate = anyio.Event()

    async def graph(ctx, step, inputs):
        if step == 0:
            await gate.wait()  # step 0's graph still runs while step 1 is committed and sealed
        seen[step] = [bool(page_is_zero(plane, p)) for plane in ctx.planes for p in seen["rows"]]

    async with open_engine(G, ranks=[RankSpec(planes=p, graph=graph) for p in planes], record=True, check=True,
                           steps=StepOptions(depth=2, yield_every_s=0)) as engine:
        rows = seen["rows"] = await engine.alias_snapshot(7, 3)
        write_rows(planes[0], rows)
        await engine.reserve(1, 1)
        await engine.commit(1, 0, 1)

        async def step1():
            seen["result"] = await engine.run_step(1)

        async def scheduler(tg):
            # step 0 is sealed and its graph has not read the pages: free the snapshot's pages and
            # commit them for step 1, seal it, then let step 0's graph go on
            while engine.open_step != 1:
                await anyio.sleep(0)
            await engine.release_snapshot(7)
            await engine.reserve(2, 3)
            listed = await engine.commit(2, 1, 3)
            assert sorted(listed) == sorted(rows)
            tg.start_soon(step1)
            while engine.open_step != 2:
                await anyio.sleep(0)
            gate.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run_step, 0)
            tg.start_soon(scheduler, tg)
        assert seen[0] == [False] * 6  # step 0's graph read the snapshot's bytes: not cleared under it
        assert seen[1] == [True] * 6  # step 1's clear ran before its graph
        assert sorted(seen["result"].clear_list) == sorted(rows)
        assert step_events(engine) == [("sealed", 0), ("sealed", 1), ("completed", 0, 0), ("completed", 1, 0)]
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_a_sealed_step_cancelled_before_it_ran_is_aborted_and_the_earlier_one_completes():
    ran: list = []
    planes = [filled_planes(G.num_pages, [32, 32], 0x11), filled_planes(G.num_pages, [32, 32], 0x11)]
    specs = [RankSpec(planes=p, graph=recording_graph(ran)) for p in planes]
    async with open_engine(G, ranks=specs, record=True, check=True,
                           steps=StepOptions(depth=2, yield_every_s=0)) as engine:
        await released_then_committed(engine, planes, snapshot=7, request=1, n=2, step=0)
        rows1 = await released_then_committed(engine, planes, snapshot=8, request=2, n=3, step=1)
        scope = anyio.CancelScope()

        async def second():
            with scope:
                await engine.run_step(1)

        async def cancel():
            while engine.open_step != 2:  # both sealed
                await anyio.sleep(0)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run_step, 0)
            tg.start_soon(second)
            tg.start_soon(cancel)  # runs after both seals
        assert scope.cancelled_caught
        # the cancellation reaches step 1's task when it resumes, after step 0 ran
        assert step_events(engine) == [("sealed", 0), ("sealed", 1), ("completed", 0, 0), ("completed", 0, 1),
                                       ("aborted", 1)]
        assert ran == [(0, 0), (0, 1)]
        result = await engine.run_step(2)
        assert sorted(result.clear_list) == sorted(rows1)
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_depth_bounds_the_steps_sealed_at_once():
    planes = [filled_planes(G.num_pages, [32, 32], 0x11)]
    async with open_engine(G, ranks=[RankSpec(planes=p) for p in planes], record=True,
                           steps=StepOptions(depth=2, yield_every_s=0)) as engine:
        sealed_while_first_waits: list = []

        async def run(k):
            await engine.run_step(k)
            sealed_while_first_waits.append((k, engine.open_step))

        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(run, k)
        # step 2 waited for a slot: it was sealed only after step 0 settled
        assert step_events(engine)[:3] == [("sealed", 0), ("sealed", 1), ("completed", 0, 0)]
        assert [k for k, _ in sealed_while_first_waits] == [0, 1, 2]
        assert_consistent(engine)


@pytest.mark.asyncio
@pytest.mark.parametrize("depth", [0, 17, "2", 1.0, True])
async def test_bad_depth_opens_nothing(depth):
    with pytest.raises(InvalidArgumentError, match="depth"):
        async with open_engine(G, ranks=1, steps=StepOptions(depth=depth)):
            pass


@pytest.mark.asyncio
async def test_depth_with_remote_ranks_is_refused():
    with pytest.raises(ConfigurationError, match="depth"):
        async with open_engine(G, ranks=1, remote=RemoteOptions(world_size=2, listen=None), steps=StepOptions(depth=2)):
            pass
