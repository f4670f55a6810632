"""The async drivers over real transports: anyio memory pipes and loopback TCP.

Every rank clears its own torch planes through the torch clear backend on LAUNCH
and reports COMPLETE; the leader collects them with ``wait_completed``. Faults (a
peer killed, paused or partitioned at a handshake phase, or after it ran a step
and before its COMPLETE left) are injected by a relay that reads the frames going
by. Deadlines here are real (anyio), so the figures printed are wall-clock: time
from PREPARE to the survivors' ABORT.
"""

from __future__ import annotations

import hashlib
import struct

import anyio
import pytest
torch = pytest.importorskip("torch")  # (the ranks clear real torch planes)

from kvledger import (
    DuplicatePageError,
    Geometry,
    HandshakeRefused,
    InvalidArgumentError,
    StepOrderError,
    StepPlan,
    WireProtocolError,
)
from kvledger.executors.backend import make_backend
from kvledger.wire import (
    FrameKind,
    Hello,
    RejectCode,
    Sanitize,
    connect_tcp,
    decode,
    encode,
    geometry_digest,
    memory_pipe,
    open_leader,
    run_peer,
)
from kvledger.wire.codec import HEADER_SIZE

G = Geometry(num_pages=128, page_tokens=16)
TIMEOUT = 0.3


class Rank:
    """One rank's planes, backend and record of what it cleared and dropped."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.planes = [torch.full((G.num_pages, 4 * (rank + 1)), 0x7F, dtype=torch.uint8) for _ in range(2)]
        self.backend = make_backend("torch", self.planes)
        self.ran: list[int] = []
        self.error = None
        self.dropped: list[tuple[int, float]] = []
        self.digest = hashlib.blake2b(digest_size=16)

    def on_launch(self, step, clear_pages, payload):
        self.backend.clear(clear_pages)
        self.ran.append(step)
        self.digest.update(struct.pack("<Q", step) + bytes(memoryview(clear_pages).cast("B")))

    def on_drop(self, step, code, rank):
        self.dropped.append((step, anyio.current_time()))

    def zeroed(self, ids) -> bool:
        return all(int(p[list(ids)].sum()) == 0 for p in self.planes) if ids else True


def frames_in(data: bytes):
    """Kinds and steps of the whole frames at the start of ``data`` (relay inspection)."""
    out, pos = [], 0
    while pos + HEADER_SIZE <= len(data):
        kind = data[pos + 5]
        body_len = int.from_bytes(data[pos + 8 : pos + 12], "little")
        step = int.from_bytes(data[pos + 12 : pos + 20], "little")
        out.append((kind, step))
        pos += HEADER_SIZE + body_len
    return out


class Relay:
    """Forwards bytes leader <-> peer; can hold (partition), or call ``on_frame`` hooks first."""

    def __init__(self, leader_end, peer_end, on_down=None, on_up=None) -> None:
        self.a, self.b = leader_end, peer_end
        self.on_down, self.on_up = on_down, on_up
        self.open = anyio.Event()
        self.open.set()
        self.after_send = None  # called once, after the next chunk went through

    def partition(self):
        self.open = anyio.Event()

    def heal(self):
        self.open.set()

    async def _pump(self, src, dst, hook):
        try:
            while True:
                data = await src.receive()
                if hook is not None:
                    data = await hook(data)
                    if data is None:
                        continue
                await self.open.wait()
                await dst.send(data)
                if self.after_send is not None:
                    fn, self.after_send = self.after_send, None
                    fn()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            with anyio.CancelScope(shield=True):
                await dst.aclose()
                await src.aclose()

    async def run(self):
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pump, self.a, self.b, self.on_down)
            tg.start_soon(self._pump, self.b, self.a, self.on_up)


def _wired(world, hooks, max_chunks=64):
    """Memory pipes leader <-> relay <-> peer for ranks in ``hooks``; direct pipes for the rest."""
    links = {}
    for r in range(1, world):
        lead_end, mid_a = memory_pipe(max_chunks)
        if r in hooks:
            mid_b, peer_end = memory_pipe(max_chunks)
            links[r] = (lead_end, peer_end, Relay(mid_a, mid_b, **hooks[r]))
        else:
            links[r] = (lead_end, mid_a, None)
    return links


async def _start(tg, leader, world, hooks=None, max_chunks=64):
    ranks = {r: Rank(r) for r in range(world)}
    scopes, relays = {}, {}
    for r, (lead_end, peer_end, relay) in _wired(world, hooks or {}, max_chunks).items():
        leader.attach(lead_end)
        if relay is not None:
            relays[r] = relay
            tg.start_soon(relay.run)
        scope = anyio.CancelScope()
        scopes[r] = scope

        async def peer(r=r, stream=peer_end, scope=scope):
            with scope:
                try:
                    await run_peer(stream, G, key=leader.key, rank=r, world_size=world, on_launch=ranks[r].on_launch,
                                   on_drop=ranks[r].on_drop, hello_timeout=2)
                except (WireProtocolError, TimeoutError) as exc:
                    ranks[r].error = exc

        tg.start_soon(peer)
    with anyio.fail_after(5):
        await leader.wait_joined()
    return ranks, scopes, relays


async def _steps(leader, ranks, n, first=0, ids_for=None, completions=None):
    """Run ``n`` steps; a launched one runs on rank 0 too, then its peers' COMPLETEs are
    collected (into ``completions``: step -> StepCompletion) within the deadline."""
    decisions = []
    for step in range(first, first + n):
        ids = ids_for(step) if ids_for else tuple(sorted({(step * 7 + i * 13) % G.num_pages for i in range(9)}))
        plan = StepPlan(step=step, clear_list=ids)
        t0 = anyio.current_time()
        d = await leader.run_step(plan, f"payload-{step}".encode(), timeout=TIMEOUT)
        if d.launch:
            ranks[0].on_launch(step, memoryview(struct.pack(f"<{len(ids)}I", *sorted(ids))).cast("I"), b"")
            c = await leader.wait_completed(step, timeout=TIMEOUT)
            if completions is not None:
                completions[step] = c
        decisions.append((d, t0, ids))
    return decisions


# ---------------------------------------------------------------------------- happy paths


@pytest.mark.asyncio
async def test_memory_transport_every_rank_clears_the_same_pages():
    completions = {}
    async with anyio.create_task_group() as tg, open_leader(G, world_size=4) as leader:
        ranks, _, _ = await _start(tg, leader, 4)
        decisions = await _steps(leader, ranks, 20, completions=completions)
        stats = leader.statistics()
        await anyio.sleep(0.05)
    assert all(d.launch for d, _, _ in decisions)
    # every peer's COMPLETE of every step came back, and only after that peer ran it
    assert all(c.ok and c.completed == (1, 2, 3) for c in completions.values()) and len(completions) == 20
    assert stats["complete.completed"] == 60 and stats["rank2.completed"] == 20
    digests = {r.digest.hexdigest() for r in ranks.values()}
    assert len(digests) == 1
    for _, _, ids in decisions:
        for r in ranks.values():
            assert r.zeroed(ids)
    assert all(r.ran == list(range(20)) and r.error is None for r in ranks.values())
    print("memory transport: 4 ranks x 20 steps, one clear digest", digests.pop()[:16])


@pytest.mark.asyncio
async def test_tcp_transport_every_rank_clears_the_same_pages():
    world = 4
    ranks = {r: Rank(r) for r in range(world)}
    completions = {}
    async with anyio.create_task_group() as tg, open_leader(G, world_size=world) as leader:
        host, port = await leader.listen_tcp()
        for r in range(1, world):
            stream = await connect_tcp(host, port)
            tg.start_soon(
                lambda s=stream, r=r: run_peer(s, G, key=leader.key, rank=r, world_size=world,
                                               on_launch=ranks[r].on_launch, hello_timeout=5)
            )
        with anyio.fail_after(5):
            await leader.wait_joined()
        decisions = await _steps(leader, ranks, 15, completions=completions)
        stats = leader.statistics()
    assert all(d.launch for d, _, _ in decisions)
    assert len({r.digest.hexdigest() for r in ranks.values()}) == 1
    assert stats["launched"] == 15 and stats["rank3.votes"] == 15
    assert all(c.ok for c in completions.values()) and stats["complete.completed"] == 45


# ---------------------------------------------------------------------------- refusals at HELLO


@pytest.mark.asyncio
async def test_tcp_peer_with_another_geometry_or_an_older_layout_is_refused_at_hello():
    world = 4
    outcomes = {}
    async with anyio.create_task_group() as tg, open_leader(G, world_size=world) as leader:
        host, port = await leader.listen_tcp()

        # a peer built for another geometry
        async def wrong_geometry():
            s = await connect_tcp(host, port)
            with pytest.raises(HandshakeRefused) as info:
                await run_peer(s, Geometry(num_pages=256, page_tokens=16), key=leader.key, rank=1, world_size=world,
                               on_launch=print)
            outcomes["geometry"] = info.value.code

        # a layout-6, 7 or 8 build: its HELLO has that layout byte
        async def old_layout(layout, rank):
            s = await connect_tcp(host, port)
            hello = Hello(step=0, rank=rank, world_size=world, geometry_digest=geometry_digest(G), layout=layout)
            await s.send(encode(hello))
            data = b""
            with anyio.fail_after(5):
                while len(data) < HEADER_SIZE or len(data) < HEADER_SIZE + int.from_bytes(data[8:12], "little"):
                    data += await s.receive()
            outcomes[f"layout{layout}"] = decode(data).code
            await s.aclose()

        tg.start_soon(wrong_geometry)
        tg.start_soon(old_layout, 6, 2)
        tg.start_soon(old_layout, 7, 3)
        tg.start_soon(old_layout, 8, 1)
        with anyio.move_on_after(1.0):
            await leader.wait_joined()
        assert leader.ranks == frozenset()
        # nothing joined: a step aborts at once, naming a missing rank
        d = await leader.run_step(StepPlan(step=0, clear_list=(1,)), timeout=TIMEOUT)
        assert not d.launch and d.code == RejectCode.PEER_LOST
    assert outcomes == {
        "geometry": RejectCode.GEOMETRY_MISMATCH,
        "layout6": RejectCode.BAD_LAYOUT,
        "layout7": RejectCode.BAD_LAYOUT,
        "layout8": RejectCode.BAD_LAYOUT,
    }


@pytest.mark.asyncio
async def test_a_second_link_for_a_taken_rank_is_refused():
    async with anyio.create_task_group() as tg, open_leader(G, world_size=2) as leader:
        ranks, _, _ = await _start(tg, leader, 2)
        a, b = memory_pipe()
        leader.attach(a)
        with pytest.raises(HandshakeRefused) as info:
            await run_peer(b, G, key=leader.key, rank=1, world_size=2, on_launch=print, hello_timeout=5)
        assert info.value.code == RejectCode.BAD_RANK
        d = (await _steps(leader, ranks, 1))[0][0]
        assert d.launch  # the first link is untouched


@pytest.mark.asyncio
async def test_bad_plan_raises_locally_and_sends_nothing():
    async with anyio.create_task_group() as tg, open_leader(G, world_size=3) as leader:
        ranks, _, _ = await _start(tg, leader, 3)
        before = leader.statistics()
        with pytest.raises(DuplicatePageError):
            await leader.run_step(StepPlan(step=0, clear_list=(3, 3)), timeout=TIMEOUT)
        with pytest.raises(StepOrderError):
            await leader.run_step(StepPlan(step=5, clear_list=(3,)), timeout=TIMEOUT)
        assert leader.statistics() == before
        d = (await _steps(leader, ranks, 1))[0][0]
        assert d.launch and d.step == 0


# ---------------------------------------------------------------------------- COMPLETE and sanitize over the drivers


async def _serve(tg, leader, world, on_launch, results, kwargs=None):
    """Peers 1..world-1 over memory pipes, each with ``on_launch[r]`` (and ``kwargs[r]`` for
    ``run_peer``); ``results[r]`` gets what its ``run_peer`` returned or raised."""
    kwargs = kwargs or {}
    for r in range(1, world):
        a, b = memory_pipe()
        leader.attach(a)

        async def peer(r=r, stream=b):
            try:
                results[r] = await run_peer(stream, G, key=leader.key, rank=r, world_size=world, on_launch=on_launch[r],
                                            hello_timeout=2, **kwargs.get(r, {}))
            except Exception as exc:
                results[r] = exc

        tg.start_soon(peer)
    with anyio.fail_after(5):
        await leader.wait_joined()


@pytest.mark.asyncio
async def test_a_peer_that_fails_reports_it_and_one_that_never_completes_is_named_at_the_deadline():
    ran = {r: [] for r in (1, 2, 3)}
    stuck = anyio.Event()

    def ok(r):
        return lambda step, ids, payload: ran[r].append(step)

    def failing(step, ids, payload):
        ran[2].append(step)
        if step == 1:
            raise RuntimeError("executor lost its stream")

    async def hanging(step, ids, payload):
        ran[3].append(step)
        if step == 1:
            await stuck.wait()  # never set: this rank never finishes step 1

    results = {}
    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=4, close_grace=0.1) as leader:
            await _serve(tg, leader, 4, {1: ok(1), 2: failing, 3: hanging}, results)
            completions = {}
            decisions = await _steps(leader, {0: Rank(0)}, 2, completions=completions)
            t0 = anyio.current_time()
            again = await leader.wait_completed(1, timeout=5.0)  # settled: returns at once, unchanged
            took = anyio.current_time() - t0
        tg.cancel_scope.cancel()
    assert [d.launch for d, _, _ in decisions] == [True, True]
    assert completions[0].ok and completions[0].completed == (1, 2, 3)
    c = completions[1]
    assert c.completed == (1,) and not c.ok and c.settled
    assert c.failed == ((2, "RuntimeError: executor lost its stream"),)
    (rank, why), = c.missing
    assert rank == 3 and "no COMPLETE within 0.3 s" in why
    assert again == c and took < 0.1
    assert isinstance(results[2], RuntimeError)  # the failure still propagates at the peer
    assert ran == {1: [0, 1], 2: [0, 1], 3: [0, 1]}
    print("step 1 completion:", c)


@pytest.mark.asyncio
async def test_a_peer_lost_before_its_complete_is_missing_at_once_not_at_the_deadline():
    scope = anyio.CancelScope()

    async def dies(step, ids, payload):
        if step == 0:
            scope.cancel()  # the rank dies mid-step: no COMPLETE, its link closes
            await anyio.sleep(1)

    async def peer2(stream):
        with scope:
            await run_peer(stream, G, key=leader.key, rank=2, world_size=3, on_launch=dies, hello_timeout=2)

    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=3, close_grace=0.1) as leader:
            a1, b1 = memory_pipe()
            a2, b2 = memory_pipe()
            leader.attach(a1)
            leader.attach(a2)
            tg.start_soon(lambda: run_peer(b1, G, key=leader.key, rank=1, world_size=3, on_launch=lambda *a: None,
                                           hello_timeout=2))
            tg.start_soon(peer2, b2)
            with anyio.fail_after(5):
                await leader.wait_joined()
            d = await leader.run_step(StepPlan(step=0, clear_list=(1, 2)), timeout=TIMEOUT)
            t0 = anyio.current_time()
            c = await leader.wait_completed(0, timeout=10.0)
            took = anyio.current_time() - t0
        tg.cancel_scope.cancel()
    assert d.launch and c.completed == (1,) and c.missing == ((2, "link lost"),)
    assert took < 2.0  # learnt from the closed link, long before the 10 s deadline


@pytest.mark.asyncio
async def test_sanitize_steps_reach_on_launch_and_a_rank_without_the_sanitizer_refuses_them():
    got = {}

    def sanitizing(step, ids, payload, *, sanitize=None):
        got[step] = (list(ids), None if sanitize is None else (list(sanitize.poison_pages),
                                                               list(sanitize.committed_pages)))

    results = {}
    lists = Sanitize(poison_pages=[40, 7], committed_pages=[3])
    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=2) as leader:
            await _serve(tg, leader, 2, {1: sanitizing}, results, {1: {"sanitize": True}})
            d0 = await leader.run_step(StepPlan(step=0, clear_list=(3, 1)), timeout=TIMEOUT, sanitize=lists)
            c0 = await leader.wait_completed(0, timeout=TIMEOUT)
            d1 = await leader.run_step(StepPlan(step=1, clear_list=(5,)), timeout=TIMEOUT)  # a plain step
            await leader.wait_completed(1, timeout=TIMEOUT)
        async with open_leader(G, world_size=2) as leader:  # a rank built without the sanitizer
            plain = {}
            await _serve(tg, leader, 2, {1: lambda step, ids, payload: plain.setdefault(step, ids)}, results)
            d2 = await leader.run_step(StepPlan(step=0, clear_list=(3,)), timeout=TIMEOUT, sanitize=lists)
            with pytest.raises(InvalidArgumentError):
                await leader.wait_completed(0, timeout=TIMEOUT)  # never launched
        tg.cancel_scope.cancel()
    assert d0.launch and c0.ok and d1.launch
    assert got == {0: ([1, 3], ([7, 40], [3])), 1: ([5], None)}
    assert not d2.launch and d2.code == RejectCode.UNSUPPORTED and d2.rank == 1 and plain == {}


# ---------------------------------------------------------------------------- R13 over the async drivers


def _phase_hook(phase, step, action):
    """A relay hook firing ``action()`` at ``phase`` of ``step``; returns (on_down, on_up)."""
    fired = {"done": False}

    async def on_down(data):
        kinds = frames_in(data)
        if not fired["done"]:
            if phase == "before_prepare" and (FrameKind.PREPARE, step) in kinds:
                fired["done"] = True
                return await action(data, before=True)
            decided = any(k in (FrameKind.LAUNCH, FrameKind.ABORT) and s == step for k, s in kinds)
            if phase == "after_decision" and decided:
                fired["done"] = True
                return await action(data, before=True)
        return data

    async def on_up(data):
        kinds = frames_in(data)
        if not fired["done"] and phase in ("after_prepare", "after_ready") and any(
            k in (FrameKind.READY, FrameKind.REJECT) and s == step for k, s in kinds
        ):
            fired["done"] = True
            # after_prepare: the answer never leaves; after_ready: it leaves, then the fault
            return await action(data, before=phase == "after_prepare")
        if not fired["done"] and phase == "after_run" and (FrameKind.COMPLETE, step) in kinds:
            fired["done"] = True
            return await action(data, before=True)  # it ran the step; its COMPLETE does not leave
        return data

    return on_down, on_up


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["kill", "pause", "partition"])
@pytest.mark.parametrize("phase", ["before_prepare", "after_prepare", "after_ready", "after_decision", "after_run"])
async def test_r13_async_fault_at_each_phase(fault, phase):
    world, fstep, f = 3, 1, 2
    completions = {}

    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=world, close_grace=0.1) as leader:
            holder = {}

            async def action(data, before):
                relay, scope = holder["relay"], holder["scope"]
                if fault == "kill":  # the peer dies: what it had not read or written is lost
                    if before:
                        scope.cancel()
                        return None
                    relay.after_send = scope.cancel  # ... or it wrote its READY, then died
                    return data
                if fault == "pause" and not before:
                    relay.after_send = relay.partition  # it wrote its READY, then stopped
                    return data
                relay.partition()  # nothing moves either way until healed; this chunk waits too
                return data

            on_down, on_up = _phase_hook(phase, fstep, action)
            ranks, scopes, relays = await _start(tg, leader, world, hooks={f: dict(on_down=on_down, on_up=on_up)})
            holder["relay"], holder["scope"] = relays[f], scopes[f]
            decisions = await _steps(leader, ranks, 4, completions=completions)
            # heal: a paused or partitioned peer catches up with its backlog
            relays[f].heal()
            await anyio.sleep(0.1)
            after_heal = {s: leader.completion(s) for s in completions}
        tg.cancel_scope.cancel()
    by_step = {d.step: (d, t0) for d, t0, _ in decisions}
    d1, t1 = by_step[fstep]
    survivor = ranks[1]
    # the faulted step aborts unless f's READY had reached the leader
    if phase in ("before_prepare", "after_prepare"):
        assert not d1.launch
    # survivors reach ABORT within the deadline (plus scheduling slack)
    worst = 0.0
    for s, (d, t0) in by_step.items():
        if not d.launch:
            t_drop = dict(survivor.dropped)[s]
            worst = max(worst, t_drop - t0)
            assert t_drop - t0 <= TIMEOUT + 1.0, (s, t_drop - t0)
    # nobody ran an aborted step, not even the healed peer; all ran the launched ones in order
    launched = [s for s, (d, _) in sorted(by_step.items()) if d.launch]
    assert ranks[0].ran == launched and survivor.ran == launched
    assert set(ranks[f].ran) <= set(launched)
    if fault != "kill":
        assert ranks[f].ran == launched
    # completions: the survivor completed every launched step; f only the ones whose COMPLETE got
    # through, never the faulted step of after_run (it ran it, its COMPLETE never arrived in time);
    # the healed peer's late COMPLETEs changed no answer
    assert set(completions) == set(launched) and after_heal == completions
    for s, c in completions.items():
        assert 1 in c.completed and set(c.completed) <= {r for r in (1, f) if s in ranks[r].ran}
    if phase == "after_run":
        assert d1.launch and fstep in ranks[f].ran and f in dict(completions[fstep].missing)
    print("R13 async", fault, phase, "decisions", [(d.step, d.launch, int(d.code)) for d, _, _ in decisions],
          f"slowest ABORT after PREPARE {worst:.3f} s (deadline {TIMEOUT:.1f} s)",
          "missing", {s: [r for r, _ in c.missing] for s, c in completions.items() if c.missing})


@pytest.mark.asyncio
async def test_a_peer_that_stops_reading_is_dropped_not_waited_for():
    """Backpressure: a peer whose outbox fills is given up (lost), the leader never blocks on it."""
    world = 3
    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=world, outbox_frames=2, close_grace=0.1) as leader:
            ranks, scopes, relays = await _start(tg, leader, world, hooks={2: {}}, max_chunks=2)
            relays[2].partition()
            t0 = anyio.current_time()
            decisions = await _steps(leader, ranks, 8)
            took = anyio.current_time() - t0
            leader_ranks = leader.ranks
            assert 2 not in leader_ranks
        tg.cancel_scope.cancel()  # the relay of the stalled link never heals
    codes = [int(d.code) for d, _, _ in decisions]
    assert all(not d.launch for d, _, _ in decisions)
    assert RejectCode.PEER_LOST in codes
    assert took < 8 * TIMEOUT + 1.0
    assert 1 in leader_ranks  # the healthy peer kept its link
    assert ranks[1].error is None and [s for s, _ in ranks[1].dropped] == list(range(8))
    print("stalled peer dropped after", codes.index(RejectCode.PEER_LOST), "timed-out steps; codes", codes)
