"""Remote completions (wire layout 8) turned into the engine's ranks: ``collect_remote``.

A leader (engine rank 0, the only local rank unless a test says otherwise) runs
each step with peers over memory pipes or loopback TCP; each peer answers its
LAUNCH with COMPLETE (``run_peer`` / ``serve_remote_rank``). ``collect_remote``
maps what came back to engine ranks, and the ledger records it as the engine
records its ranks: ``StepAborted`` first if any rank did not complete, then
``StepCompleted`` per rank that did. ``audit_log`` then sees every rank, remote
ones included.
"""

from __future__ import annotations

import contextlib

import anyio
import pytest
torch = pytest.importorskip("torch")  # (the ranks clear real torch planes)

from kvledger import Geometry, InvalidArgumentError, Ledger, WireProtocolError
from kvledger.core.events.events import StepAborted, StepCompleted
from kvledger.durable import open_ledger
from kvledger.engine.remote import RemoteOutcome, RemoteRanks, collect_remote, engine_rank, serve_remote_rank
from kvledger.tools.audit import audit_log
from kvledger.wire import RejectCode, memory_pipe, open_leader, run_peer

G = Geometry(num_pages=64, page_tokens=16)


def _record(ledger, step: int, local_ok: tuple[int, ...], remote: RemoteOutcome) -> None:
    """What the engine records for a step (StepRunner._record): abort first, then completions."""
    reason = remote.reason()
    if reason is not None:
        ledger.abort_step(step, reason)
    for rank in (*local_ok, *remote.completed):
        ledger.complete_step(step, rank)


def _use_pages(ledger, step: int, n: int) -> None:
    """A snapshot aliases ``n`` pages and is released (they are marked); request ``step``
    takes them back, so the step's clear list names them. The last step's request ends."""
    if step:
        ledger.finish(step - 1)
    ledger.alias_snapshot(step, n)
    ledger.release_snapshot(step)
    ledger.reserve(step, n)
    ledger.commit(step, step, n)


async def _group(tg, leader, launchers: dict, world: int, *, wait: bool = True) -> None:
    for r, on_launch in launchers.items():
        a, b = memory_pipe()
        leader.attach(a)

        async def peer(stream=b, r=r, on_launch=on_launch):
            # a failing rank re-raises its error after sending the failed COMPLETE
            with contextlib.suppress(RuntimeError):
                await run_peer(stream, G, rank=r, world_size=world, key=leader.key, on_launch=on_launch,
                               hello_timeout=2)

        tg.start_soon(peer)
    if wait:
        with anyio.fail_after(5):
            await leader.wait_joined()


@pytest.mark.asyncio
async def test_every_rank_recorded_from_its_own_complete_then_a_failed_and_a_silent_peer_abort_the_step():
    ledger = Ledger(G, record=True)
    stuck = anyio.Event()

    def fails_at_1(step, ids, payload):
        if step == 1:
            raise RuntimeError("graph capture failed")

    async def silent_at_1(step, ids, payload):
        if step == 1:
            await stuck.wait()  # never set: rank 3 never finishes step 1

    remote = RemoteRanks(world_size=4, listen=None, complete_timeout=0.3)
    outcomes = []
    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=4, close_grace=0.1) as leader:
            await _group(tg, leader, {1: lambda *a: None, 2: fails_at_1, 3: silent_at_1}, 4)
            for step in (0, 1):
                _use_pages(ledger, step, 3)
                plan = ledger.seal_step(step)
                d = await leader.run_step(plan, timeout=1.0)
                assert d.launch
                out = await collect_remote(leader, remote, step, local_ranks=1)
                _record(ledger, step, (0,), out)
                outcomes.append((plan, out))
            carried = ledger.seal_step(2).clear_list
        tg.cancel_scope.cancel()
    (plan0, ok), (plan1, bad) = outcomes
    assert ok.ok and ok.completed == (1, 2, 3) and ok.reason() is None
    assert bad.completed == (1,) and not bad.ok
    (r2, e2), (r3, e3) = bad.failures
    assert (r2, e2.code, e2.remote) == (2, RejectCode.PEER_FAILED, True)
    assert "RuntimeError: graph capture failed" in e2.detail and isinstance(e2, WireProtocolError)
    assert (r3, e3.code) == (3, RejectCode.TIMEOUT) and "no COMPLETE within 0.3 s" in e3.detail
    assert bad.reason().startswith("rank 2 did not complete the step over the wire: code 21")
    completed = sorted((e.step, e.rank) for e in ledger.events if type(e) is StepCompleted)
    assert completed == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    (aborted,) = [e for e in ledger.events if type(e) is StepAborted]
    assert aborted.step == 1 and "rank 2" in aborted.reason
    # the aborted step's pages are cleared again next step
    assert plan1.clear_list and set(plan1.clear_list) <= set(carried)
    print("step 1:", bad.reason(), "| carried into step 2:", len(carried), "pages")


@pytest.mark.asyncio
async def test_a_lost_peer_is_named_at_once_and_wire_ranks_follow_the_local_ranks():
    scope = anyio.CancelScope()

    async def dies(step, ids, payload):
        scope.cancel()  # the rank dies mid-step: no COMPLETE, its link closes
        await anyio.sleep(1)

    async def peer2(stream):
        with scope:
            await run_peer(stream, G, rank=2, world_size=3, key=leader.key, on_launch=dies, hello_timeout=2)

    ledger = Ledger(G)
    remote = RemoteRanks(world_size=3, listen=None, complete_timeout=10.0)
    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=3, close_grace=0.1) as leader:
            await _group(tg, leader, {1: lambda *a: None}, 3, wait=False)
            a2, b2 = memory_pipe()
            leader.attach(a2)
            tg.start_soon(peer2, b2)
            with anyio.fail_after(5):
                await leader.wait_joined()
            plan = ledger.seal_step(0)
            assert (await leader.run_step(plan, timeout=1.0)).launch
            t0 = anyio.current_time()
            out = await collect_remote(leader, remote, 0, local_ranks=2)  # engine ranks 0, 1 are local
            took = anyio.current_time() - t0
            with pytest.raises(InvalidArgumentError, match="not launched"):
                await collect_remote(leader, remote, 5, local_ranks=2)
        tg.cancel_scope.cancel()
    assert out.completed == (2,)  # wire rank 1 -> engine rank 2
    ((rank, err),) = out.failures
    assert rank == 3 and err.code == RejectCode.PEER_LOST and err.detail == "link lost"
    assert took < 2.0  # from the closed link, not the 10 s deadline


def test_rank_numbering_and_options_are_checked():
    assert [engine_rank(w, 1) for w in (1, 2, 3)] == [1, 2, 3]
    assert [engine_rank(w, 4) for w in (1, 2)] == [4, 5]
    for bad in ((0, 1), (1, 0), (True, 1), (1, 2.0)):
        with pytest.raises(InvalidArgumentError):
            engine_rank(*bad)
    for bad in (0, -1.0, "1"):
        with pytest.raises(InvalidArgumentError, match="complete_timeout"):
            RemoteRanks(world_size=2, complete_timeout=bad)
    assert RemoteOutcome(step=3).ok and RemoteOutcome(step=3).reason() is None


@pytest.mark.asyncio
async def test_served_ranks_clear_their_planes_and_the_audit_sees_each_rank_over_tcp(tmp_path):
    """Real processes are in examples/tp_ranks.py; here two ``serve_remote_rank`` tasks over
    loopback TCP clear their own planes, and a log that leaves a remote rank's completion out
    (what layout 7 did) is what the audit reports."""
    planes = {r: [torch.full((G.num_pages, 8), 0x7F, dtype=torch.uint8)] for r in (1, 2)}
    path = tmp_path / "remote.kvl"
    remote = RemoteRanks(world_size=3, complete_timeout=2.0)
    led = open_ledger(path, G)
    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=3, close_grace=0.2) as leader:
            host, port = await leader.listen_tcp("127.0.0.1", 0)
            for r in (1, 2):
                tg.start_soon(lambda r=r: serve_remote_rank(host, port, G, rank=r, world_size=3, planes=planes[r],
                                                                  key=leader.key))
            with anyio.fail_after(10):
                await leader.wait_joined()
            cleared = []
            for step in range(3):
                _use_pages(led, step, 4)
                plan = led.seal_step(step)
                assert (await leader.run_step(plan, timeout=2.0)).launch
                out = await collect_remote(leader, remote, step, local_ranks=1)
                assert out.ok and out.completed == (1, 2)
                # step 2: ranks 0 and 2 recorded, rank 1's COMPLETE left out of the log
                _record(led, step, (0,), out if step < 2 else RemoteOutcome(step=2, completed=(2,)))
                cleared += plan.clear_list
        tg.cancel_scope.cancel()
    led.close()
    assert cleared and all(int(planes[r][0][cleared].sum()) == 0 for r in (1, 2))
    assert all(int(planes[r][0].sum()) > 0 for r in (1, 2))  # pages never listed keep their bytes
    rep = audit_log(path, check=True)
    (fault,) = rep.faults
    assert fault.kind == "step_never_completed" and "rank 1 never completed steps [2]" in fault.detail
    print("audit:", fault.kind, "-", fault.detail)
