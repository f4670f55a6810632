"""The engine drives remote ranks through the wire over real loopback TCP.

One local rank (the engine, wire leader) and two peers (anyio tasks in this
process, each with its own torch planes and torch clear backend, connected over
127.0.0.1 sockets). A released snapshot's pages are reused as a request's tail
and committed: every rank zeroes exactly those pages. A peer that goes silent or
is refused at HELLO aborts the step: StepFailedError names it, nothing is
cleared anywhere, StepAborted is recorded, and the next step carries the list.
Budget: about 3 s.
"""

from __future__ import annotations

import anyio
import pytest
from anyio.abc import ByteStream

torch = pytest.importorskip("torch")

from kvledger import Geometry, HandshakeRefused, StepFailedError, check_invariants, replay  # noqa: E402
from kvledger.core.events import StepAborted, StepCompleted, StepSealed  # noqa: E402
from kvledger.engine import RankSpec, RemoteRanks, open_engine, serve_remote_rank  # noqa: E402
from kvledger.executors.backend import make_backend  # noqa: E402
from kvledger.wire.codec import RejectCode  # noqa: E402
from kvledger.wire.rank import run_peer  # noqa: E402
from kvledger.wire.transport import connect_tcp  # noqa: E402

def _last_abort(events):
    """The last StepAborted, provided nothing but completions of the ranks that ran follows it
    (a failed step is aborted first, then the ranks that did run their part are recorded)."""
    i = max((i for i, e in enumerate(events) if type(e) is StepAborted), default=None)
    if i is None:
        return None
    assert all(type(e) is StepCompleted for e in events[i + 1:]), events[i + 1:]
    return events[i]


G = Geometry(num_pages=32, page_tokens=4)
ROW = 0x7F  # what a released snapshot row leaves behind
WORLD = 3  # the engine (wire rank 0) and two peers
TIMEOUT = 0.3


def make_planes():
    k = torch.full((G.num_pages, 4, 8), 0x11, dtype=torch.uint8).view(torch.float8_e4m3fn)
    v = torch.full((G.num_pages, 4, 8), 1.5, dtype=torch.bfloat16)
    return [k, v]


def write_rows(planes, pages, byte=ROW):
    for plane in planes:
        plane.view(torch.uint8)[list(pages)] = byte


def zero(planes, pages) -> bool:
    return all(int(p[list(pages)].reshape(-1).view(torch.uint8).count_nonzero()) == 0 for p in planes)


def untouched(planes, pages) -> bool:
    """Every byte of ``pages`` still holds the snapshot row byte."""
    return all(bool((p.view(torch.uint8)[list(pages)] == ROW).all()) for p in planes)


async def until(predicate, seconds=5.0):
    """Wait for ``predicate()`` (a peer acts on LAUNCH after the engine returned)."""
    with anyio.fail_after(seconds):
        while not predicate():
            await anyio.sleep(0.005)


class Pausable(ByteStream):
    """A real TCP stream whose reader can be paused: a peer that goes silent (it reads
    nothing, so it answers nothing) and later catches up with its backlog."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.go = anyio.Event()
        self.go.set()

    def pause(self) -> None:
        if self.go.is_set():
            self.go = anyio.Event()

    def resume(self) -> None:
        self.go.set()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await self.go.wait()
        data = await self.inner.receive(max_bytes)
        await self.go.wait()  # paused while a receive was already waiting: hold what came
        return data

    async def send(self, item: bytes) -> None:
        await self.inner.send(item)

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


class Peer:
    """One remote rank: its planes, its clear backend, the steps it launched and dropped."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.planes = make_planes()
        self.backend = make_backend("torch", self.planes)
        self.launched: list[int] = []
        self.dropped: list[int] = []
        self.stream = None

    def on_launch(self, step, clear_pages, payload):
        self.backend.clear(clear_pages)
        self.launched.append(step)

    def on_drop(self, step, code, rank):
        self.dropped.append(step)

    async def run(self, host, port, geometry=G, key=None):
        self.stream = Pausable(await connect_tcp(host, port))
        return await run_peer(
            self.stream, geometry, rank=self.rank, world_size=WORLD, key=key, on_launch=self.on_launch,
            on_drop=self.on_drop, hello_timeout=5,
        )


async def snapshot_tail(engine, all_planes, *, snapshot, request, step, n=3):
    """A snapshot writes rows into n pages and is released; a request takes them as its
    tail and commits them into ``step``: they join its clear list."""
    rows = await engine.alias_snapshot(snapshot, n)
    for planes in all_planes:
        write_rows(planes, rows)
    await engine.release_snapshot(snapshot)
    pages = await engine.reserve(request, n)
    assert sorted(pages) == sorted(rows)  # the released rows are handed out again
    listed = await engine.commit(request, step, n)
    assert sorted(listed) == sorted(rows)
    return rows


def assert_consistent(engine):
    check_invariants(engine.ledger.state)
    assert replay(engine.ledger.events, check=True).digest() == engine.ledger.digest()


@pytest.mark.asyncio
async def test_remote_peers_over_tcp_clear_the_same_pages():
    local = make_planes()
    peers = {r: Peer(r) for r in (1, 2)}
    remote = RemoteRanks(world_size=WORLD, listen=("127.0.0.1", 0), timeout=2.0)
    async with (
        anyio.create_task_group() as tg,
        open_engine(G, ranks=[RankSpec(planes=local)], remote=remote, record=True, check=True) as engine,
    ):
        host, port = engine.remote_address
        for peer in peers.values():
            tg.start_soon(peer.run, host, port, G, engine.leader.key)
        await engine.wait_remote(5)
        assert engine.remote_ranks == frozenset({1, 2})
        everyone = [local] + [p.planes for p in peers.values()]
        listed: set = set()
        for step in range(4):
            rows = await snapshot_tail(engine, everyone, snapshot=10 + step, request=step, step=step)
            result = await engine.run_step(step, payload=f"step-{step}".encode())
            assert sorted(result.clear_list) == sorted(rows)
            await until(lambda step=step: all(step in p.launched for p in peers.values()))
            for planes in everyone:
                assert zero(planes, rows), step
            # pages never listed keep their bytes on every rank
            listed.update(rows)
            never = [p for p in range(G.num_pages) if p not in listed]
            for planes in everyone:
                assert not any(int(planes[0][p].view(torch.uint8).count_nonzero()) == 0 for p in never)
        # every rank's completion is recorded: rank 0's own, the peers' from their COMPLETEs
        assert engine.ledger.events[-4:] == [
            StepSealed(step=3, clear_list=result.clear_list),
            StepCompleted(step=3, rank=0),
            StepCompleted(step=3, rank=1),
            StepCompleted(step=3, rank=2),
        ]
        assert engine.statistics()["steps_completed"] == 4
        assert engine.leader.statistics()["launched"] == 4
        assert_consistent(engine)
    # leaving the engine closed the links: the peers returned
    assert all(p.launched == [0, 1, 2, 3] and p.dropped == [] for p in peers.values())


@pytest.mark.asyncio
async def test_two_dispatched_local_ranks_and_two_peers_complete_every_step():
    # two local ranks with an async graph are dispatched to their executor tasks; the peers are
    # engine ranks 2 and 3: the local ranks' answers end the local wait, the peers' COMPLETEs
    # come after (kills a wait that counts the peers among the local answers: it never ends)
    locals_ = [make_planes(), make_planes()]
    peers = {r: Peer(r) for r in (1, 2)}
    ran: list = []

    async def graph(ctx, step, inputs):
        ran.append((step, ctx.rank))

    remote = RemoteRanks(world_size=WORLD, listen=("127.0.0.1", 0), timeout=2.0)
    async with (
        anyio.create_task_group() as tg,
        open_engine(G, ranks=[RankSpec(planes=p, graph=graph) for p in locals_], remote=remote,
                    record=True, check=True) as engine,
    ):
        host, port = engine.remote_address
        for peer in peers.values():
            tg.start_soon(peer.run, host, port, G, engine.leader.key)
        await engine.wait_remote(5)
        assert engine.remote_ranks == frozenset({2, 3})
        everyone = locals_ + [p.planes for p in peers.values()]
        for step in range(3):
            rows = await snapshot_tail(engine, everyone, snapshot=10 + step, request=step, step=step)
            with anyio.fail_after(10):
                result = await engine.run_step(step)
            assert sorted(result.clear_list) == sorted(rows) and [t.rank for t in result.ranks] == [0, 1]
            await until(lambda step=step: all(step in p.launched for p in peers.values()))
            for planes in everyone:
                assert zero(planes, rows), step
        assert engine.ledger.events[-4:] == [StepCompleted(step=2, rank=r) for r in range(4)]
        assert sorted(ran) == [(s, r) for s in range(3) for r in range(2)]
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_silent_peer_aborts_the_step_nothing_cleared_next_step_carries_it():
    local = make_planes()
    peers = {r: Peer(r) for r in (1, 2)}
    remote = RemoteRanks(world_size=WORLD, timeout=TIMEOUT)
    async with (
        anyio.create_task_group() as tg,
        open_engine(G, ranks=[RankSpec(planes=local)], remote=remote, record=True) as engine,
    ):
        host, port = engine.remote_address
        for peer in peers.values():
            tg.start_soon(peer.run, host, port, G, engine.leader.key)
        await engine.wait_remote(5)
        everyone = [local] + [p.planes for p in peers.values()]
        rows0 = await snapshot_tail(engine, everyone, snapshot=1, request=1, step=0)
        await engine.run_step(0)
        rows1 = await snapshot_tail(engine, everyone, snapshot=2, request=2, step=1)
        peers[2].stream.pause()  # rank 2 stops reading: no READY comes back
        t0 = anyio.current_time()
        with pytest.raises(StepFailedError) as info:
            await engine.run_step(1)
        took = anyio.current_time() - t0
        err = info.value
        assert err.step == 1 and err.rank == 2 and sorted(err.clear_list) == sorted(rows1)
        assert err.failures[0][1].code == RejectCode.TIMEOUT
        assert took < TIMEOUT + 1.0
        await until(lambda: peers[1].dropped == [1])
        await anyio.sleep(0.05)
        for planes in everyone:  # nobody cleared the aborted step
            assert untouched(planes, rows1)
        assert _last_abort(engine.ledger.events) is not None
        assert not any(type(e) is StepCompleted and e.step == 1 for e in engine.ledger.events)
        assert peers[1].dropped == [1] and peers[1].launched == [0]
        # rank 2 wakes up, catches up (PREPARE 1 then ABORT 1: nothing cleared) ...
        peers[2].stream.resume()
        await until(lambda: peers[2].dropped == [1])
        assert peers[2].launched == [0] and peers[2].dropped == [1]
        for planes in everyone:
            assert untouched(planes, rows1)
        # ... and the next step carries the aborted clear list to every rank
        result = await engine.run_step(2)
        assert sorted(result.clear_list) == sorted(rows1)
        await until(lambda: all(2 in p.launched for p in peers.values()))
        for planes in everyone:
            assert zero(planes, rows1) and zero(planes, rows0)
        assert all(p.launched == [0, 2] for p in peers.values())
        assert engine.statistics()["steps_aborted"] == 1
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_peer_refused_at_hello_aborts_until_the_right_peer_joins():
    local = make_planes()
    good, wrong = Peer(1), Peer(2)
    remote = RemoteRanks(world_size=WORLD, timeout=TIMEOUT)
    refused = {}
    async with (
        anyio.create_task_group() as tg,
        open_engine(G, ranks=[RankSpec(planes=local)], remote=remote, record=True) as engine,
    ):
        host, port = engine.remote_address

        async def wrong_geometry():
            with pytest.raises(HandshakeRefused) as info:
                await wrong.run(host, port, geometry=Geometry(num_pages=64, page_tokens=4), key=engine.leader.key)
            refused["code"] = info.value.code

        tg.start_soon(good.run, host, port, G, engine.leader.key)
        tg.start_soon(wrong_geometry)
        with pytest.raises(TimeoutError):
            await engine.wait_remote(1.0)
        assert engine.remote_ranks == frozenset({1}) and refused["code"] == RejectCode.GEOMETRY_MISMATCH
        everyone = [local, good.planes, wrong.planes]
        rows = await snapshot_tail(engine, everyone, snapshot=3, request=3, step=0)
        with pytest.raises(StepFailedError) as info:
            await engine.run_step(0)
        assert info.value.rank == 2 and info.value.failures[0][1].code == RejectCode.PEER_LOST
        await until(lambda: good.dropped == [0])
        for planes in everyone:
            assert untouched(planes, rows)
        assert good.launched == [] and good.dropped == [0]
        assert _last_abort(engine.ledger.events) is not None
        # rank 2 comes back with the engine's geometry, through the library's peer helper
        late = make_planes()
        write_rows(late, rows)
        late_steps = []
        tg.start_soon(lambda: serve_remote_rank(host, port, G, rank=2, world_size=WORLD, planes=late,
                                                key=engine.leader.key,
                                                on_step=lambda step, ids, payload: late_steps.append(step)))
        await engine.wait_remote(5)
        result = await engine.run_step(1)
        assert sorted(result.clear_list) == sorted(rows)
        await until(lambda: good.launched == [1] and late_steps == [1])
        for planes in (local, good.planes, late):
            assert zero(planes, rows)
        assert untouched(wrong.planes, rows)  # the refused peer never cleared anything
        assert_consistent(engine)


@pytest.mark.asyncio
async def test_with_a_log_a_cancelled_handshake_is_recorded_and_a_reopened_engine_carries_it(tmp_path):
    pytest.importorskip("kvledger.durable")
    from kvledger.durable import open_ledger

    path = tmp_path / "remote.kvlog"
    local = make_planes()
    peers = {r: Peer(r) for r in (1, 2)}
    async with (
        anyio.create_task_group() as tg,
        open_engine(G, log=path, ranks=[RankSpec(planes=local)],
                    remote=RemoteRanks(world_size=WORLD, timeout=5.0)) as engine,
    ):
        host, port = engine.remote_address
        for peer in peers.values():
            tg.start_soon(peer.run, host, port, G, engine.leader.key)
        await engine.wait_remote(5)
        everyone = [local] + [p.planes for p in peers.values()]
        rows = await snapshot_tail(engine, everyone, snapshot=4, request=4, step=0)
        peers[2].stream.pause()  # silent: the vote deadline (5 s) is far away
        with anyio.move_on_after(0.1) as scope:
            await engine.run_step(0)
        assert scope.cancelled_caught
        await until(lambda: peers[1].dropped == [0])  # the ABORT still went out
        for planes in everyone:
            assert untouched(planes, rows)
        live = await engine.digest()
        peers[2].stream.resume()
    with open_ledger(path) as reopened:
        assert reopened.digest() == live and reopened.open_step == 1
        assert not reopened.state.completed.get(0)
    # a reopened engine's leader starts at the log's open step; the peers rejoin
    again = {r: Peer(r) for r in (1, 2)}
    for r, p in again.items():
        p.planes = peers[r].planes
        p.backend = make_backend("torch", p.planes)
    async with (
        anyio.create_task_group() as tg,
        open_engine(None, log=path, ranks=[RankSpec(planes=local)],
                    remote=RemoteRanks(world_size=WORLD, timeout=2.0)) as engine,
    ):
        host, port = engine.remote_address
        for peer in again.values():
            tg.start_soon(peer.run, host, port, G, engine.leader.key)
        await engine.wait_remote(5)
        result = await engine.run_step(1)
        assert sorted(result.clear_list) == sorted(rows)
        await until(lambda: all(p.launched == [1] for p in again.values()))
        for planes in everyone:
            assert zero(planes, rows)


@pytest.mark.asyncio
async def test_steps_cancelled_at_any_point_keep_the_wire_in_step_with_the_ledger(tmp_path):
    """Cancel run_step after a sweep of short delays (before the seal, between the seal in the
    worker thread and the wire, during the handshake, after it): afterwards the wire leader's
    next step is the ledger's open step, and a normal step launches everywhere."""
    local = make_planes()
    peers = {r: Peer(r) for r in (1, 2)}
    async with (
        anyio.create_task_group() as tg,
        open_engine(G, log=tmp_path / "sweep.kvlog", ranks=[RankSpec(planes=local)],
                    remote=RemoteRanks(world_size=WORLD, timeout=2.0)) as engine,
    ):
        host, port = engine.remote_address
        for peer in peers.values():
            tg.start_soon(peer.run, host, port, G, engine.leader.key)
        await engine.wait_remote(5)
        cancelled_sealed = 0
        for i in range(12):
            step = engine.open_step
            with anyio.move_on_after(i * 0.00025) as scope:
                await engine.run_step(step)
            if scope.cancelled_caught and engine.open_step == step + 1:
                cancelled_sealed += 1
            assert engine.leader.next_step == engine.open_step, i
        everyone = [local] + [p.planes for p in peers.values()]
        step = engine.open_step
        rows = await snapshot_tail(engine, everyone, snapshot=5, request=5, step=step)
        result = await engine.run_step(step)
        assert sorted(result.clear_list) == sorted(rows)
        await until(lambda: all(step in p.launched for p in peers.values()))
        for planes in everyone:
            assert zero(planes, rows)
        # every peer launched or dropped every step, the same ones
        for p in peers.values():
            assert sorted(p.launched + p.dropped) == list(range(step + 1))
        assert peers[1].launched == peers[2].launched
        print("cancelled after the seal:", cancelled_sealed, "of 12; launched", peers[1].launched)


class FailingPeer(Peer):
    """A peer whose step breaks after its LAUNCH: it reports COMPLETE failed, then ends."""

    def __init__(self, rank: int, fail_at: int) -> None:
        super().__init__(rank)
        self.fail_at = fail_at

    def on_launch(self, step, clear_pages, payload):
        if step == self.fail_at:
            raise RuntimeError(f"peer {self.rank} broke in step {step}")
        super().on_launch(step, clear_pages, payload)

    async def run(self, host, port, geometry=G, key=None):
        with pytest.raises(RuntimeError, match="broke in step"):  # run_peer re-raises after COMPLETE
            await super().run(host, port, geometry, key)


@pytest.mark.asyncio
async def test_a_peer_that_fails_after_its_launch_fails_the_step_and_the_others_completions_follow_the_abort():
    local = make_planes()
    peers = {1: Peer(1), 2: FailingPeer(2, fail_at=1)}
    remote = RemoteRanks(world_size=WORLD, timeout=TIMEOUT)
    async with (
        anyio.create_task_group() as tg,
        open_engine(G, ranks=[RankSpec(planes=local)], remote=remote, record=True) as engine,
    ):
        host, port = engine.remote_address
        for peer in peers.values():
            tg.start_soon(peer.run, host, port, G, engine.leader.key)
        await engine.wait_remote(5)
        everyone = [local] + [p.planes for p in peers.values()]
        await snapshot_tail(engine, everyone, snapshot=1, request=1, step=0)
        await engine.run_step(0)
        assert [e.rank for e in engine.ledger.events if type(e) is StepCompleted and e.step == 0] == [0, 1, 2]
        rows1 = await snapshot_tail(engine, everyone, snapshot=2, request=2, step=1)
        with pytest.raises(StepFailedError) as info:
            await engine.run_step(1)
        err = info.value
        assert (err.step, err.rank) == (1, 2) and sorted(err.clear_list) == sorted(rows1)
        assert err.failures[0][1].code == RejectCode.PEER_FAILED and "broke in step 1" in str(err.failures[0][1])
        # the abort first, then the ranks that ran their part: rank 0 and peer 1, never rank 2
        abort = _last_abort(engine.ledger.events)
        assert abort is not None and abort.step == 1
        tail = engine.ledger.events[engine.ledger.events.index(abort) + 1:]
        assert tail == [StepCompleted(step=1, rank=0), StepCompleted(step=1, rank=1)]
        assert_consistent(engine)
        tg.cancel_scope.cancel()
