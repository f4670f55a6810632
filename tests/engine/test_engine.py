"""The embedded async engine: commands, run_step on in-process ranks, failures and
cancellation leave the ledger consistent (its digest equals a replay of its events)."""

from __future__ import annotations

import threading

import anyio
import pytest
from support.engine import assert_consistent, last_abort, released_then_committed
from support.planes import filled_planes, make_planes, page, page_is_zero

import kvledger
from kvledger.engine import LogOptions, StepOptions
from kvledger import (
    ConfigurationError,
    EngineClosedError,
    Geometry,
    InvalidArgumentError,
    OutOfPagesError,
    PageOutOfRangeError,
    StepFailedError,
    StepOrderError,
    replay,
)
from kvledger.core.events import StepAborted, StepCompleted, StepSealed
from kvledger.engine import RankSpec, StepInputs, StepResult, open_engine
from kvledger.executors.bytes_backend import BytesClearBackend

G = Geometry(num_pages=16, page_tokens=4)


@pytest.mark.asyncio
async def test_order_input_copies_then_clears_then_graph():
    planes = make_planes(G.num_pages)
    host_tokens = bytes([10, 11, 12, 13])
    dev_tokens = bytearray(4)
    seen = {}

    def graph(ctx, step, inputs):
        # runs third: the copied inputs are there, the listed pages are zero ...
        assert dev_tokens == host_tokens
        for plane in ctx.planes:
            for p in seen["listed"]:
                assert page_is_zero(plane, p), (step, p)
        # ... including the bytes an input copy wrote into a listed page: the copy ran first
        assert page_is_zero(ctx.planes[0], seen["listed"][0])
        seen["graph"] = (ctx.rank, step, inputs.data)

    async with kvledger.open_engine(G, ranks=[RankSpec(planes=planes, graph=graph)], record=True, check=True) as engine:
        seen["listed"] = await released_then_committed(engine, [planes])
        junk = b"\x33" * 32
        inputs = StepInputs(
            copies=[(host_tokens, dev_tokens), (junk, page(planes[0], seen["listed"][0]))], data="tokens"
        )
        result = await engine.run_step(0, inputs)
        assert seen["graph"] == (0, 0, "tokens")
        assert isinstance(result, StepResult)
        assert sorted(result.clear_list) == sorted(seen["listed"])
        assert [t.rank for t in result.ranks] == [0]
        t = result.ranks[0]
        assert min(t.copies_s, t.clear_s, t.graph_s) >= 0 and t.total_s >= t.graph_s
        # pages nobody listed keep their bytes
        for p in range(G.num_pages):
            if p not in seen["listed"]:
                assert not page_is_zero(planes[0], p)
        assert engine.ledger.events[-2:] == [
            StepSealed(step=0, clear_list=result.clear_list),
            StepCompleted(step=0, rank=0),
        ]
        assert engine.statistics() == {"steps_completed": 1, "steps_aborted": 0, "pages_cleared": 3}
        assert engine.executors[0].statistics()["pages_cleared"] == 3
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_two_ranks_in_process_each_clear_their_own_planes():
    planes = [make_planes(G.num_pages), make_planes(G.num_pages)]
    ran = []

    async def graph(ctx, step, inputs):  # async graphs are awaited
        await anyio.sleep(0)
        ran.append((ctx.rank, ctx.world_size, step))

    specs = [RankSpec(planes=p, graph=graph) for p in planes]
    async with open_engine(G, ranks=specs, record=True) as engine:
        assert engine.world_size == 2
        rows = await released_then_committed(engine, planes)
        result = await engine.run_step(0)
        assert sorted(ran) == [(0, 2, 0), (1, 2, 0)]
        assert [t.rank for t in result.ranks] == [0, 1]
        for rank_planes in planes:
            for plane in rank_planes:
                assert all(page_is_zero(plane, p) for p in rows)
        done = [e for e in engine.ledger.events if type(e) is StepCompleted]
        assert done == [StepCompleted(step=0, rank=0), StepCompleted(step=0, rank=1)]
        assert engine.ledger.state.completed == {0: 0, 1: 0}
        # a later step lists nothing again: the marks were taken exactly once
        await engine.reserve(2, 2)
        assert await engine.commit(2, 1, 2) == ()
        assert (await engine.run_step(1)).clear_list == ()
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_a_raising_rank_fails_the_step_and_nothing_is_completed_for_it():
    planes = [make_planes(G.num_pages), make_planes(G.num_pages)]
    async with open_engine(G, ranks=[RankSpec(planes=p) for p in planes], record=True) as engine:
        rows = await released_then_committed(engine, planes)
        # rank 1's input copy is malformed (lengths differ): it raises before its clears
        bad = StepInputs(copies=[(bytes(3), bytearray(4))])
        with pytest.raises(StepFailedError) as info:
            await engine.run_step(0, [None, bad])
        err = info.value
        assert err.step == 0 and err.rank == 1 and "rank 1" in str(err)
        assert isinstance(err.__cause__, ValueError)
        assert [r for r, _ in err.failures] == [1]
        events = engine.ledger.events
        assert StepCompleted(step=0, rank=1) not in events
        aborted = [e for e in events if type(e) is StepAborted]
        assert len(aborted) == 1 and aborted[0].step == 0 and "rank 1" in aborted[0].reason
        # rank 1 never cleared: its pages still hold the row bytes
        assert not any(page_is_zero(planes[1][0], p) for p in rows)
        assert_consistent(engine)
        # the aborted step's clear list is carried into the next step, and zeroed there
        result = await engine.run_step(1)
        assert sorted(result.clear_list) == sorted(rows)
        for rank_planes in planes:
            for plane in rank_planes:
                assert all(page_is_zero(plane, p) for p in rows)
        assert engine.statistics()["steps_aborted"] == 1
        assert engine.executors[1].statistics()["plans_failed"] == 1
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_a_raising_graph_and_a_raising_backend_name_their_rank():
    class RefusingBackend:
        """A ClearBackend over real planes whose device refuses the clear (a driver error)."""

        name = "refusing"

        def __init__(self, planes):
            self.inner = BytesClearBackend(planes)
            self.num_pages = self.inner.num_pages

        def clear(self, page_ids):
            raise PageOutOfRangeError(page_ids, 0)

    def boom(ctx, step, inputs):
        raise ValueError(f"graph exploded on rank {ctx.rank}")

    planes = [make_planes(G.num_pages), make_planes(G.num_pages), make_planes(G.num_pages)]
    specs = [
        RankSpec(planes=planes[0]),
        RankSpec(planes=planes[1], graph=boom),
        RankSpec(planes=planes[2], backend=RefusingBackend(planes[2])),
    ]
    async with open_engine(G, ranks=specs, record=True) as engine:
        await released_then_committed(engine, planes)
        with pytest.raises(StepFailedError) as info:
            await engine.run_step(0)
        failed = dict(info.value.failures)
        assert set(failed) <= {1, 2} and info.value.rank in (1, 2)
        completed = {e.rank for e in engine.ledger.events if type(e) is StepCompleted}
        assert not completed & {1, 2}  # never recorded for a failed rank
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_cancellation_mid_step_leaves_the_ledger_consistent():
    planes = [make_planes(G.num_pages), make_planes(G.num_pages)]
    hang = {"on": True}
    started = anyio.Event()

    async def graph(ctx, step, inputs):
        if ctx.rank == 1 and hang["on"]:
            started.set()
            await anyio.sleep_forever()

    specs = [RankSpec(planes=p, graph=graph) for p in planes]
    async with open_engine(G, ranks=specs, record=True, check=True) as engine:
        rows = await released_then_committed(engine, planes)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.run_step, 0)
                await started.wait()
                scope.cancel()  # the caller gives up while rank 1 is inside its graph
        assert scope.cancelled_caught
        events = engine.ledger.events
        assert StepCompleted(step=0, rank=0) in events
        assert StepCompleted(step=0, rank=1) not in events
        assert events.index(StepAborted(step=0, reason="cancelled")) < events.index(StepCompleted(step=0, rank=0))
        assert engine.executors[1].statistics()["plans_cancelled"] == 1
        assert_consistent(engine)
        # both executors are free again; the carried clear list runs in the next step
        hang["on"] = False
        result = await engine.run_step(1)
        assert sorted(result.clear_list) == sorted(rows)
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_fail_after_at_the_call_site_raises_timeout_and_records_the_abort():
    async def graph(ctx, step, inputs):
        if step == 0:
            await anyio.sleep_forever()

    async with open_engine(G, ranks=[RankSpec(graph=graph), RankSpec(graph=graph)], record=True) as engine:
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await engine.run_step(0)
        assert last_abort(engine.ledger.events) == StepAborted(step=0, reason="cancelled")
        assert not [e for e in engine.ledger.events if type(e) is StepCompleted]
        assert_consistent(engine)
        await engine.run_step(1)
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_a_deadline_before_the_seal_records_nothing_and_leaves_the_step_open():
    # run_step(1) waits for step 0 (one step at a time) and its deadline passes there:
    # step 1 is not sealed, nothing is recorded, and it runs later with its clear list.
    planes = make_planes(G.num_pages)
    release = anyio.Event()
    sealed_0 = anyio.Event()

    async def graph(ctx, step, inputs):
        if step == 0:
            sealed_0.set()
            await release.wait()

    async with open_engine(G, ranks=[RankSpec(planes=planes, graph=graph)], record=True) as engine:
        rows = await released_then_committed(engine, [planes], step=1)  # listed for step 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run_step, 0)
            await sealed_0.wait()
            before = len(engine.ledger.events)
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.05):
                    await engine.run_step(1)
            assert len(engine.ledger.events) == before  # nothing sealed, nothing aborted
            assert engine.open_step == 1
            release.set()
        assert not [e for e in engine.ledger.events if type(e) in (StepSealed, StepAborted) and e.step == 1]
        result = await engine.run_step(1)
        assert sorted(result.clear_list) == sorted(rows)
        assert all(page_is_zero(plane, p) for plane in planes for p in rows)
        assert engine.statistics()["steps_aborted"] == 0
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_a_deadline_already_over_records_nothing_in_the_log(tmp_path):
    # with a log, the seal is a worker-thread call: a deadline over before it starts
    # leaves the step open, in memory and on disk
    from kvledger.core.log import open_view

    path = tmp_path / "deadline.kvlog"
    async with open_engine(G, log=path, ranks=2) as engine:
        await engine.reserve(1, 2)
        await engine.commit(1, 0, 2)
        seq = engine.seq
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0):
                await engine.run_step(0)
        assert engine.seq == seq and engine.open_step == 0
        await engine.run_step(0)
        live = await engine.digest()
    with open_view(path) as view:
        events = [ev for _, ev, _ in view.iter_events()]
    assert [type(e) for e in events[seq:]] == [StepSealed, StepCompleted, StepCompleted]
    assert replay(events).digest() == live


@pytest.mark.asyncio
async def test_a_rank_cancellation_cannot_reach_does_not_hang_a_failed_step():
    # rank 0 waits in a worker thread for a collective that rank 1 (which fails) never
    # joins: the engine stops waiting after drain_timeout_s and records the abort.
    collective = threading.Event()

    async def graph(ctx, step, inputs):
        if step == 0 and ctx.rank == 0:
            await anyio.to_thread.run_sync(collective.wait)
        if step == 0 and ctx.rank == 1:
            raise RuntimeError("rank 1 lost its device")

    async with open_engine(G, ranks=[RankSpec(graph=graph), RankSpec(graph=graph)], record=True,
                           steps=StepOptions(drain_timeout_s=0.2)) as engine:
        with pytest.raises(StepFailedError) as info:
            with anyio.fail_after(10):
                await engine.run_step(0)
        assert info.value.rank == 1
        assert not [e for e in engine.ledger.events if type(e) is StepCompleted]
        assert last_abort(engine.ledger.events) is not None
        collective.set()  # rank 0 finishes its old plan; its late answer is dropped
        result = await engine.run_step(1)  # and the next plan runs on it
        assert [t.rank for t in result.ranks] == [0, 1]
        assert {(e.step, e.rank) for e in engine.ledger.events if type(e) is StepCompleted} == {(1, 0), (1, 1)}
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_bad_calls_change_nothing():
    async with open_engine(G, ranks=2, record=True) as engine:
        seq = engine.seq
        with pytest.raises(InvalidArgumentError):
            await engine.run_step(0, [StepInputs()])  # one entry for two ranks
        with pytest.raises(InvalidArgumentError):
            await engine.run_step(0, {5: StepInputs()})
        with pytest.raises(InvalidArgumentError):
            await engine.run_step(0, "tokens")
        with pytest.raises(InvalidArgumentError):
            StepInputs(copies=[(1, 2, 3)])
        with pytest.raises(StepOrderError):
            await engine.run_step(3)
        with pytest.raises(OutOfPagesError):
            await engine.reserve(1, G.num_pages + 1)
        assert engine.seq == seq
        # commands mirror the ledger
        pages = await engine.reserve(1, 4, tenant="a")
        assert await engine.return_reservation(1, pages[2:]) == pages[2:]
        await engine.commit(1, 0, 2)
        await engine.start_restore(await engine.reserve(2, 1), request=2)
        await engine.complete_restore(engine.ledger.reserved_pages(2), request=2)
        await engine.cancel(2)
        await engine.finish(1)
        await engine.run_step(0, {1: StepInputs(data=1)})
        assert await engine.call(lambda ledger, r: ledger.kv_pages(r), 1) == ()
        assert await engine.digest() == engine.ledger.digest()
        assert engine.open_step == 1 and engine.free_count == G.num_pages
        assert_consistent(engine)
    with pytest.raises(EngineClosedError):
        await engine.reserve(3, 1)
    with pytest.raises(EngineClosedError):
        await engine.run_step(1)


@pytest.mark.asyncio
async def test_open_refuses_bad_configuration():
    with pytest.raises(ConfigurationError, match="pages"):
        async with open_engine(G, ranks=[RankSpec(planes=filled_planes(G.num_pages + 1, [4]))]):
            pass
    with pytest.raises(InvalidArgumentError):
        async with open_engine(G, ranks=0):
            pass
    with pytest.raises(InvalidArgumentError):
        async with open_engine(G, ranks=["rank"]):
            pass
    with pytest.raises(ConfigurationError):
        async with open_engine(G, ranks=1, policy="sometimes"):
            pass
    with pytest.raises(ConfigurationError, match="unknown clear backend"):
        async with open_engine(G, ranks=[RankSpec(planes=make_planes(G.num_pages))], backend="opencl"):
            pass
    with pytest.raises(InvalidArgumentError):
        async with open_engine(None):
            pass


@pytest.mark.asyncio
async def test_an_error_in_the_body_comes_out_as_itself():
    with pytest.raises(KeyError):
        async with open_engine(G, ranks=2):
            raise KeyError("body")


@pytest.mark.asyncio
async def test_with_a_log_every_ledger_call_runs_in_a_worker_thread(tmp_path):
    pytest.importorskip("kvledger.durable")
    from kvledger.durable import open_ledger

    path = tmp_path / "engine.kvlog"
    planes = [make_planes(G.num_pages), make_planes(G.num_pages)]
    hang = {"on": True}

    async def graph(ctx, step, inputs):
        if ctx.rank == 0 and hang["on"]:
            await anyio.sleep_forever()

    loop_thread = threading.get_ident()
    specs = [RankSpec(planes=p, graph=graph) for p in planes]
    async with open_engine(G, log=path, ranks=specs,
                           log_options=LogOptions(fsync="per_step", background=False)) as engine:  # fsync inline
        assert await engine.call(lambda ledger: threading.get_ident()) != loop_thread
        rows = await released_then_committed(engine, planes)
        with anyio.move_on_after(0.05) as scope:
            await engine.run_step(0)
        assert scope.cancelled_caught
        hang["on"] = False
        await engine.reserve(2, 2)
        result = await engine.run_step(1)
        assert sorted(result.clear_list) == sorted(rows)
        live = await engine.digest()
    with open_ledger(path) as reopened:
        assert reopened.digest() == live
        assert reopened.state.completed == {0: 1, 1: 1}
    # reopening through the engine continues the same log
    async with open_engine(None, log=path, ranks=2) as engine:
        assert await engine.digest() == live
        assert engine.open_step == 2


@pytest.mark.asyncio
async def test_inline_ranks_run_in_the_callers_task_without_a_task_switch():
    # CPU ranks whose graph is a plain function run in run_step's own task: run_step is one
    # cancellation point at its entry (with yield_every_s=0 a ticker task runs once there),
    # none while the ranks run;
    # with more than one rank, an async graph, or an object whose __call__ is async, runs
    # in the rank's executor task
    seen: dict[str, set] = {"plain": set(), "async": set()}

    def plain(ctx, step, inputs):
        seen["plain"].add(anyio.get_current_task().id)

    class AsyncGraph:
        async def __call__(self, ctx, step, inputs):
            seen["async"].add(anyio.get_current_task().id)

    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0)

    me = anyio.get_current_task().id
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with open_engine(G, ranks=[RankSpec(planes=make_planes(G.num_pages), graph=plain)] * 2, record=True,
                               steps=StepOptions(yield_every_s=0)) as engine:
            await anyio.sleep(0)
            for step in range(3):
                before = ticks
                await engine.run_step(step)
                assert ticks == before + 1  # the entry's checkpoint only, no switch inside the step
            assert seen["plain"] == {me}
            assert_consistent(engine)
        async with open_engine(G, ranks=[RankSpec(graph=plain), RankSpec(graph=AsyncGraph())]) as engine:
            await engine.run_step(0)
            assert me not in seen["async"] and len(seen["async"]) == 1
        tg.cancel_scope.cancel()


@pytest.mark.asyncio
async def test_inline_a_failing_rank_stops_the_later_ranks_before_they_start():
    ran = []

    def graph(ctx, step, inputs):
        ran.append((step, ctx.rank))
        if step == 0 and ctx.rank == 1:
            raise ValueError("rank 1 failed")

    planes = [make_planes(G.num_pages) for _ in range(3)]
    async with open_engine(G, ranks=[RankSpec(planes=p, graph=graph) for p in planes], record=True) as engine:
        rows = await released_then_committed(engine, planes)
        with pytest.raises(StepFailedError) as info:
            await engine.run_step(0)
        assert info.value.rank == 1 and [r for r, _ in info.value.failures] == [1]
        assert ran == [(0, 0), (0, 1)]  # rank 2 never started
        assert engine.executors[2].statistics()["plans_completed"] == 0
        assert not any(page_is_zero(planes[2][0], p) for p in rows)  # rank 2 cleared nothing
        events = engine.ledger.events
        assert StepCompleted(step=0, rank=0) in events
        assert not {e.rank for e in events if type(e) is StepCompleted} & {1, 2}
        assert "rank 1" in last_abort(events).reason
        result = await engine.run_step(1)  # the carried clear list, zeroed on every rank
        assert sorted(result.clear_list) == sorted(rows) and [t.rank for t in result.ranks] == [0, 1, 2]
        assert all(page_is_zero(plane, p) for rank_planes in planes for plane in rank_planes for p in rows)
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_a_background_log_takes_the_commands_on_the_loop(tmp_path):
    # the log writes and fsyncs in its own thread: commands and run_step run on the loop
    # (no thread hop); flush waits for the disk in the engine's worker thread
    pytest.importorskip("kvledger.durable")
    from kvledger.durable import open_ledger

    path = tmp_path / "background.kvlog"
    loop_thread = threading.get_ident()
    planes = [make_planes(G.num_pages), make_planes(G.num_pages)]
    async with open_engine(G, log=path, ranks=[RankSpec(planes=p) for p in planes],
                           log_options=LogOptions(fsync="per_step", background=True)) as engine:
        assert engine.ledger.log.background
        assert await engine.call(lambda ledger: threading.get_ident()) == loop_thread
        rows = await released_then_committed(engine, planes)
        result = await engine.run_step(0)
        assert sorted(result.clear_list) == sorted(rows)
        flushed_in = []
        sync = engine.ledger.sync
        engine.ledger.sync = lambda: (flushed_in.append(threading.get_ident()), sync())  # type: ignore[method-assign]
        await engine.flush()
        assert flushed_in and flushed_in[0] != loop_thread
        assert engine.ledger.durable_seq == engine.seq - 1
        live = await engine.digest()
    with open_ledger(path) as reopened:
        assert reopened.digest() == live
        assert reopened.state.completed == {0: 0, 1: 0}


@pytest.mark.asyncio
async def test_a_log_that_may_block_sends_the_calls_to_the_worker_thread(tmp_path, monkeypatch):
    # assumed log attribute: may_block (True while an append could wait for the disk)
    pytest.importorskip("kvledger.durable")
    from kvledger.core.log import EventLog

    blocking = {"on": False}
    monkeypatch.setattr(EventLog, "may_block", property(lambda log: blocking["on"]), raising=False)
    loop_thread = threading.get_ident()
    async with open_engine(G, log=tmp_path / "lag.kvlog", ranks=1,
                           log_options=LogOptions(fsync="per_step", background=True)) as engine:
        where = lambda ledger: threading.get_ident()  # noqa: E731
        assert await engine.call(where) == loop_thread
        blocking["on"] = True
        assert await engine.call(where) != loop_thread
        await engine.reserve(1, 2)
        await engine.commit(1, 0, 2)
        await engine.run_step(0)
        blocking["on"] = False
        assert await engine.call(where) == loop_thread
        assert await engine.digest() == engine.ledger.digest()
