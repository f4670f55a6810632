"""Layout 9's handshake: a rank counts only after it proved the job's key (issue 32, finding 1).

Pure links (no I/O), then the leader's driver over real loopback sockets:

* a peer without the key, with another key, or replaying a recorded handshake (its HELLO and
  AUTH bytes, on a new link) never becomes a rank: REJECT BAD_AUTH, no PeerHello;
* a fake leader (no key) learns no proof: the peer answers its CHALLENGE with REJECT BAD_AUTH,
  never with AUTH; a leader's proof sent back as a peer's (reflection) is refused;
* a rank pinned to an address is refused from another one;
* the leader bounds unproven links: a deadline on the whole handshake (a client trickling one
  byte at a time is dropped at it, like an idle one), and a cap (the oldest unproven link is
  evicted for a new one, so a real rank still joins through a flood);
* the authenticated-wire fuzz (heavy profile: ``KVLEDGER_HYPOTHESIS=heavy`` multiplies it):
  attackers with bad MACs, replayed handshakes, garbage, trickling and idle clients, all at
  once, against a leader whose two real ranks run steps meanwhile.

Figures are printed (``-s``): attackers by kind, ranks they became (0), steps launched.
"""

from __future__ import annotations

import os
import random
import time

import anyio
import pytest

from support import HEAVY
from support.wirekeys import KEY, OTHER_KEY, challenge, leader_link, peer_link, prove

from kvledger import Geometry, HandshakeRefused, InvalidArgumentError, StepPlan, WireProtocolError
from kvledger.wire import (
    INSECURE_TEST_KEY,
    NEED_DATA,
    Joined,
    LeaderState,
    PeerHello,
    PeerState,
    connect_tcp,
    memory_pipe,
    open_leader,
    run_peer,
)
from kvledger.wire.auth import leader_proof, new_nonce, peer_proof
from kvledger.wire.codec import HEADER_SIZE, Auth, Challenge, Hello, Reject, RejectCode, encode, geometry_digest
from kvledger.wire.decoder import FrameDecoder, decode

G = Geometry(num_pages=64, page_tokens=16)


def _frames(data: bytes) -> list:
    dec = FrameDecoder()
    dec.feed(data)
    out = []
    while (f := dec.next_frame()) is not None:
        out.append(f)
    return out


def _handshake(leader, peer):
    """Run a whole handshake between two links; returns (peer's bytes, leader's event)."""
    sent = b""
    peer.start()
    hello = peer.data_to_send()
    sent += hello
    leader.receive_data(hello)
    assert leader.next_event() is NEED_DATA
    peer.receive_data(leader.data_to_send())
    assert peer.next_event() is NEED_DATA
    auth = peer.data_to_send()
    sent += auth
    leader.receive_data(auth)
    ev = leader.next_event()
    return sent, ev


# ---------------------------------------------------------------------------- the links


def test_the_handshake_proves_the_key_both_ways_and_then_the_peer_joins():
    leader, peer = leader_link(G, 3), peer_link(G, 2, 3)
    sent, ev = _handshake(leader, peer)
    assert type(ev) is PeerHello and ev.rank == 2 and leader.rank == 2
    kinds = [type(f).__name__ for f in _frames(sent)]
    assert kinds == ["Hello", "Auth"]
    leader.accept(7)
    peer.receive_data(leader.data_to_send())
    assert type(peer.next_event()) is Joined and peer.step == 7 and peer.state is PeerState.IDLE


@pytest.mark.parametrize("who", ["other key", "bad MAC", "wrong rank in AUTH"])
def test_a_peer_without_the_key_never_becomes_a_rank(who):
    leader = leader_link(G, 3)
    hello = Hello(step=0, rank=1, world_size=3, geometry_digest=geometry_digest(G), nonce=new_nonce())
    leader.receive_data(encode(hello))
    assert leader.next_event() is NEED_DATA and leader.state is LeaderState.CHALLENGED
    ch = decode(leader.data_to_send())
    proof = {"other key": peer_proof(OTHER_KEY, hello, ch.nonce), "bad MAC": os.urandom(32),
             "wrong rank in AUTH": peer_proof(KEY, hello, ch.nonce)}[who]
    leader.receive_data(encode(Auth(step=0, rank=2 if who == "wrong rank in AUTH" else 1, proof=proof)))
    with pytest.raises(WireProtocolError) as info:
        leader.next_event()
    assert info.value.code == RejectCode.BAD_AUTH and info.value.remote
    assert leader.state is LeaderState.ERROR and leader.rank is None
    (refusal,) = _frames(leader.data_to_send())
    assert type(refusal) is Reject and refusal.code == RejectCode.BAD_AUTH
    assert leader.statistics()["auth_failed"] == 1


def test_a_recorded_handshake_replayed_on_a_new_link_is_refused():
    """The bytes of a real rank's handshake (its HELLO and its AUTH), played again to the same
    leader on a new link, prove nothing: the new link's nonce is not the one they answered."""
    first, peer = leader_link(G, 2), peer_link(G, 1, 2)
    recorded, ev = _handshake(first, peer)
    assert type(ev) is PeerHello
    replayed = 0
    for _ in range(50):
        link = leader_link(G, 2)
        link.receive_data(recorded)  # HELLO then AUTH, exactly as recorded
        with pytest.raises(WireProtocolError) as info:
            while link.next_event() is not NEED_DATA:
                pass
        assert info.value.code == RejectCode.BAD_AUTH and link.rank is None
        replayed += 1
    print(f"replayed handshakes: {replayed}, ranks they became: 0")


def test_a_fake_leader_gets_no_proof_and_a_reflected_proof_is_refused():
    # a leader without the key: the peer refuses its CHALLENGE and never sends AUTH
    peer = peer_link(G, 1, 2)
    challenge(peer, key=OTHER_KEY)
    with pytest.raises(WireProtocolError) as info:
        peer.next_event()
    assert info.value.code == RejectCode.BAD_AUTH and peer.state is PeerState.ERROR
    assert [type(f) for f in _frames(peer.data_to_send())] == [Reject]
    # a replayed CHALLENGE (another connection's) fails the same way: it answers another nonce
    peer2 = peer_link(G, 1, 2)
    peer2.start()
    hello = decode(peer2.data_to_send())
    other = Hello(step=0, rank=1, world_size=2, geometry_digest=geometry_digest(G), nonce=new_nonce())
    n = new_nonce()
    peer2.receive_data(encode(Challenge(step=0, nonce=n, proof=leader_proof(KEY, other, n))))
    with pytest.raises(WireProtocolError):
        peer2.next_event()
    assert hello.nonce != other.nonce
    # reflection: the leader's own proof handed back as the peer's AUTH
    leader = leader_link(G, 2)
    leader.receive_data(encode(hello))
    leader.next_event()
    ch = decode(leader.data_to_send())
    leader.receive_data(encode(Auth(step=0, rank=1, proof=ch.proof)))
    with pytest.raises(WireProtocolError) as info:
        leader.next_event()
    assert info.value.code == RejectCode.BAD_AUTH


def test_a_leader_hello_without_its_challenge_nonce_or_before_it_is_refused():
    peer = peer_link(G, 1, 2)
    peer.start()
    peer.data_to_send()
    peer.receive_data(encode(Hello(step=0, rank=0, world_size=2, geometry_digest=geometry_digest(G))))
    with pytest.raises(WireProtocolError) as info:  # a HELLO that skips the CHALLENGE: no join
        peer.next_event()
    assert info.value.code == RejectCode.UNEXPECTED_FRAME
    peer = peer_link(G, 1, 2)
    challenge(peer)
    assert peer.next_event() is NEED_DATA
    peer.receive_data(encode(Hello(step=0, rank=0, world_size=2, geometry_digest=geometry_digest(G),
                                   nonce=new_nonce())))
    with pytest.raises(WireProtocolError) as info:
        peer.next_event()
    assert info.value.code == RejectCode.BAD_AUTH


def test_keys_and_nonces_are_checked():
    for bad in (b"short", "a str key", None, bytes(2000)):
        with pytest.raises(InvalidArgumentError):
            leader_link(G, 2, key=bad)
    with pytest.raises(InvalidArgumentError):
        peer_link(G, 1, 2).__class__(G, rank=1, world_size=2, key=KEY, nonce=b"\0" * 31)
    assert prove(leader_link(G, 2, key=INSECURE_TEST_KEY), key=INSECURE_TEST_KEY).rank == 1  # public: anyone


# ---------------------------------------------------------------------------- the leader's driver


async def _read_all(stream, seconds: float) -> tuple[bytes, bool]:
    """What the leader sent on ``stream`` until it closed it (True) or ``seconds`` passed (False)."""
    got = b""
    with anyio.move_on_after(seconds):
        try:
            while True:
                got += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return got, True
    return got, False


@pytest.mark.asyncio
async def test_pinned_ranks_join_only_from_their_address():
    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=3, pinned={1: "127.0.0.1", 2: "10.9.8.7"}, close_grace=0.1) as leader:
            host, port = await leader.listen_tcp("127.0.0.1", 0)
            s1 = await connect_tcp(host, port)
            tg.start_soon(lambda: run_peer(s1, G, rank=1, world_size=3, key=leader.key, on_launch=print))
            with anyio.fail_after(5):
                await leader.wait_joined([1])
            s2 = await connect_tcp(host, port)
            with pytest.raises(HandshakeRefused) as info, anyio.fail_after(10):  # (joined: it would serve on)
                await run_peer(s2, G, rank=2, world_size=3, key=leader.key, on_launch=print, hello_timeout=5)
            assert info.value.code == RejectCode.BAD_AUTH and "10.9.8.7" in info.value.detail
            assert leader.ranks == frozenset({1}) and leader.statistics()["pin_refused"] == 1
        tg.cancel_scope.cancel()
    with pytest.raises(InvalidArgumentError):
        async with open_leader(G, world_size=3, pinned={3: "127.0.0.1"}):
            pass
    with pytest.raises(InvalidArgumentError):
        async with open_leader(G, world_size=3, pinned={1: "leader.example"}):
            pass


@pytest.mark.asyncio
async def test_idle_and_trickling_clients_are_dropped_at_the_handshake_deadline():
    """The deadline is on the whole handshake, not on each read: a client that sends a byte
    every 50 ms (never a whole HELLO and AUTH) is dropped at it, as is one that sends nothing
    and one that sends a HELLO and never proves the key."""
    deadline = 0.4
    async with open_leader(G, world_size=2, handshake_timeout=deadline, close_grace=0.1) as leader:
        host, port = await leader.listen_tcp("127.0.0.1", 0)
        hello = encode(Hello(step=0, rank=1, world_size=2, geometry_digest=geometry_digest(G), nonce=new_nonce()))
        closed_after = {}

        async def client(kind):
            s = await connect_tcp(host, port)
            t0 = anyio.current_time()
            if kind == "hello only":
                await s.send(hello)
            if kind == "trickle":
                async with anyio.create_task_group() as tg:
                    async def trickle():
                        try:
                            for b in hello * 10:
                                await s.send(bytes([b]))
                                await anyio.sleep(0.05)
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                            pass
                    tg.start_soon(trickle)
                    _, closed = await _read_all(s, 5)
                    tg.cancel_scope.cancel()
            else:
                _, closed = await _read_all(s, 5)
            closed_after[kind] = (closed, anyio.current_time() - t0)
            await s.aclose()

        async with anyio.create_task_group() as tg:
            for kind in ("idle", "trickle", "hello only"):
                tg.start_soon(client, kind)
        stats = leader.statistics()
    print("handshake deadline", deadline, "s: closed after", {k: f"{t:.2f} s" for k, (_, t) in closed_after.items()})
    for kind, (closed, took) in closed_after.items():
        assert closed and deadline * 0.9 <= took < deadline + 2.0, (kind, took)
    assert stats["handshake_timeouts"] == 3 and stats["pending"] == 0 and leader.ranks == frozenset()


@pytest.mark.asyncio
async def test_the_cap_on_unproven_links_evicts_the_oldest_and_a_real_rank_still_joins():
    cap = 8
    async with open_leader(G, world_size=2, max_pending=cap, handshake_timeout=30, close_grace=0.1) as leader:
        host, port = await leader.listen_tcp("127.0.0.1", 0)
        idle = [await connect_tcp(host, port) for _ in range(5 * cap)]
        await anyio.sleep(0.2)
        stats = leader.statistics()
        assert stats["pending"] <= cap and stats["evicted"] >= 4 * cap - 1
        # the oldest were closed by the leader: they see the end of the stream
        _, closed = await _read_all(idle[0], 2)
        assert closed
        real = await connect_tcp(host, port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_peer(real, G, rank=1, world_size=2, key=leader.key, on_launch=lambda *a: None))
            with anyio.fail_after(5):
                await leader.wait_joined()
            d = await leader.run_step(StepPlan(step=0, clear_list=(1, 2)), timeout=2)
            assert d.launch and (await leader.wait_completed(0, timeout=2)).completed == (1,)
            tg.cancel_scope.cancel()
        for s in idle:
            await s.aclose()
    print(f"cap {cap}: {5 * cap} idle links, at most {stats['pending']} held, {stats['evicted']} evicted; "
          "the real rank joined and ran a step")


@pytest.mark.asyncio
async def test_a_peer_without_a_key_cannot_start_and_the_environment_carries_one(monkeypatch):
    from kvledger import ConfigurationError
    from kvledger.wire import KEY_ENV, key_to_text

    monkeypatch.delenv(KEY_ENV, raising=False)
    a, b = memory_pipe()
    with pytest.raises(ConfigurationError, match=KEY_ENV):
        await run_peer(b, G, rank=1, world_size=2, on_launch=print)
    monkeypatch.setenv(KEY_ENV, key_to_text(KEY))
    async with anyio.create_task_group() as tg, open_leader(G, world_size=2, close_grace=0.1) as leader:
        assert leader.key == KEY  # the leader read it too
        a, b = memory_pipe()
        leader.attach(a)
        tg.start_soon(lambda: run_peer(b, G, rank=1, world_size=2, on_launch=lambda *x: None))
        with anyio.fail_after(5):
            await leader.wait_joined()
        tg.cancel_scope.cancel()
    monkeypatch.setenv(KEY_ENV, "not hex")
    with pytest.raises(ConfigurationError):
        async with open_leader(G, world_size=2):
            pass


@pytest.mark.asyncio
async def test_an_in_process_rank_needs_no_key_handed_to_it():
    """A leader with no key given makes one per job; ``run_local_peer`` runs a rank in this process
    with it (two leaders' keys differ: a key is per job)."""
    ran = []
    async with anyio.create_task_group() as tg, open_leader(G, world_size=2, close_grace=0.1) as leader:
        tg.start_soon(lambda: leader.run_local_peer(1, lambda step, ids, payload: ran.append(step)))
        with anyio.fail_after(5):
            await leader.wait_joined()
        d = await leader.run_step(StepPlan(step=0, clear_list=(3,)), timeout=2)
        assert d.launch and (await leader.wait_completed(0, timeout=2)).ok
        async with open_leader(G, world_size=2) as other:
            assert other.key != leader.key and len(leader.key) == 32
        tg.cancel_scope.cancel()
    assert ran == [0]


# ---------------------------------------------------------------------------- the authenticated-wire fuzz

ATTACKERS = ["bad MAC", "other key", "replayed handshake", "garbage", "trickle", "idle", "reflected proof"]


async def _attacker(kind: str, host: str, port: int, recorded: bytes, rng: random.Random, seen: dict) -> None:
    """One attacking connection of ``kind``; records whether the leader ever welcomed it."""
    try:
        s = await connect_tcp(host, port)
    except OSError:
        seen["connect_failed"] = seen.get("connect_failed", 0) + 1
        return
    rank = rng.choice([1, 2])
    hello = Hello(step=0, rank=rank, world_size=3, geometry_digest=geometry_digest(G), nonce=new_nonce())
    try:
        if kind == "replayed handshake":
            await s.send(recorded)
        elif kind == "garbage":
            await s.send(os.urandom(rng.randrange(1, 300)))
        elif kind == "trickle":
            for b in encode(hello):
                await s.send(bytes([b]))
                await anyio.sleep(0.02)
        elif kind != "idle":
            await s.send(encode(hello))
            got = b""
            with anyio.move_on_after(2):
                while len(got) < HEADER_SIZE + 64:
                    got += await s.receive()
            ch = decode(got[: HEADER_SIZE + 64])
            proof = {"bad MAC": os.urandom(32), "other key": peer_proof(OTHER_KEY, hello, ch.nonce),
                     "reflected proof": ch.proof}[kind]
            await s.send(encode(Auth(step=0, rank=rank, proof=proof)))
        data, _ = await _read_all(s, 3)
        welcomed = any(type(f) is Hello for f in _frames_lenient(data))
        seen[kind] = seen.get(kind, 0) + 1
        seen["welcomed"] = seen.get("welcomed", 0) + welcomed
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError):
        seen[kind] = seen.get(kind, 0) + 1  # dropped mid-attack: never welcomed
    finally:
        await s.aclose()


def _frames_lenient(data: bytes) -> list:
    try:
        return _frames(data)
    except WireProtocolError:
        return []


@pytest.mark.asyncio
async def test_authenticated_wire_fuzz_attackers_never_become_ranks_and_the_real_ranks_keep_serving():
    """Attackers of every kind (bad MACs, another key, recorded handshakes replayed, garbage,
    trickling and idle clients, reflected proofs) connect in waves while two real ranks run
    steps: no attacker is ever welcomed, every step launches on the real ranks, and the
    leader never holds more unproven links than its cap."""
    waves = 6 * (20 if HEAVY else 1)
    per_wave = 24
    rng = random.Random(32)
    seen: dict = {}
    max_pending = 16
    launched = steps = 0
    peak = 0
    async with anyio.create_task_group() as tg:
        async with open_leader(G, world_size=3, max_pending=max_pending, handshake_timeout=0.5,
                               close_grace=0.1) as leader:
            host, port = await leader.listen_tcp("127.0.0.1", 0)
            # a real handshake, recorded for the replay attackers (its link then closes)
            rec_leader, rec_peer = leader_link(G, 3, key=leader.key), peer_link(G, 2, 3, key=leader.key)
            recorded, ev = _handshake(rec_leader, rec_peer)
            assert type(ev) is PeerHello
            for r in (1, 2):
                s = await connect_tcp(host, port)
                tg.start_soon(lambda s=s, r=r: run_peer(s, G, rank=r, world_size=3, key=leader.key,
                                                        on_launch=lambda *a: None))
            with anyio.fail_after(10):
                await leader.wait_joined()
            t0 = time.monotonic()
            for _ in range(waves):
                async with anyio.create_task_group() as attack:
                    for _ in range(per_wave):
                        attack.start_soon(_attacker, rng.choice(ATTACKERS), host, port, recorded, rng, seen)
                    for _ in range(3):  # the real ranks serve steps meanwhile
                        d = await leader.run_step(StepPlan(step=steps, clear_list=(steps % 64,)), timeout=5)
                        steps += 1
                        launched += d.launch
                        if d.launch:
                            assert (await leader.wait_completed(d.step, timeout=5)).ok
                        peak = max(peak, leader.statistics()["pending"])
            took = time.monotonic() - t0
            stats = leader.statistics()
        tg.cancel_scope.cancel()
    attacks = sum(seen.get(k, 0) for k in ATTACKERS)
    print(f"authenticated-wire fuzz: {attacks} attackers ({', '.join(f'{k} {seen.get(k, 0)}' for k in ATTACKERS)}), "
          f"welcomed {seen.get('welcomed', 0)}, auth failures counted {stats['auth_failed']}, handshake timeouts "
          f"{stats['handshake_timeouts']}, evicted {stats['evicted']}, peak pending {peak} (cap {max_pending}); "
          f"{launched}/{steps} steps launched on the real ranks in {took:.1f} s")
    assert seen.get("welcomed", 0) == 0 and attacks == waves * per_wave
    assert launched == steps and leader.ranks == frozenset()  # (closed now)
    assert peak <= max_pending and stats["auth_failed"] > 0
