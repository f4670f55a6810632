"""The engine publishes KV events as steps complete (issue #13 item 3), over a real ZMQ socket.

Pins: ``open_engine(..., kv_events=publisher)`` starts the publisher before the ledger,
observes every folded event, flushes once after each step's outcome is recorded and stops
it at close, after the last step settled; a real SUB socket on loopback (ephemeral port)
with a DEALER on the replay socket receives BlockStored / BlockRemoved batches whose
hashes (u64, vLLM's fold) rebuild the ledger's published set exactly, for an engine driven
through lookup / share / reserve (evicting) / commit / run_step / publish / finish / evict;
an endpoint string, a mapping of vLLM's KVEventsConfig fields and its JSON build the
publisher (disabled: none); a bad endpoint, config or kv_events value opens nothing.

The router reads while the engine (and so the replay socket) is still up, waiting on
what it needs with a generous deadline: on a loaded box the subscription may reach the
PUB socket after the first batches left, and only a replay brings those back.
"""

from __future__ import annotations

import random
import time

import pytest

zmq = pytest.importorskip("zmq")

from kvledger import ConfigurationError, Geometry, InvalidArgumentError, OutOfPagesError  # noqa: E402
from kvledger.engine import ExtraOptions  # noqa: E402
from kvledger.core.hashing import block_hashes, to_u64  # noqa: E402
from kvledger.engine import open_engine  # noqa: E402
from kvledger.kvevents import SEQ_END, KVEventPublisher, decode_batch, seq_bytes, seq_from_bytes  # noqa: E402

G = Geometry(num_pages=40, page_tokens=4)


class CountingPublisher(KVEventPublisher):
    """A real publisher that counts the engine's flushes."""

    flushes = 0

    def flush(self):
        self.flushes += 1
        return super().flush()


class Router:
    """What a KV-aware router does: SUB on the PUB endpoint, gaps filled from the replay socket,
    the cached hashes rebuilt from the events."""

    def __init__(self, ctx, endpoint, replay_endpoint):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.next = 0
        self.hashes: set = set()
        self.kinds: dict[str, int] = {}

    def close(self):
        self.sub.close(linger=0)
        self.replay.close(linger=0)

    def _apply(self, seq, payload):
        if seq < self.next:
            return
        assert seq == self.next, f"gap: {self.next} .. {seq}"
        self.next = seq + 1
        for ev in decode_batch(payload).events:
            name = type(ev).__struct_config__.tag
            self.kinds[name] = self.kinds.get(name, 0) + 1
            if name == "BlockStored":
                assert not self.hashes & set(ev.block_hashes)
                self.hashes.update(ev.block_hashes)
            elif name == "BlockRemoved":
                assert set(ev.block_hashes) <= self.hashes
                self.hashes.difference_update(ev.block_hashes)
            else:
                self.hashes.clear()

    def _replay(self, timeout=30.0):
        self.replay.send_multipart([b"", seq_bytes(self.next)])
        while True:
            assert self.replay.poll(int(timeout * 1000)), "no replay answer"
            _, _topic, seq, payload = self.replay.recv_multipart()
            if seq == SEQ_END:
                return
            self._apply(seq_from_bytes(seq), payload)

    def pump(self, last, timeout=60.0):
        """Receive until batch ``last`` is applied (live, or replayed where the live stream missed)."""
        deadline = time.monotonic() + timeout
        while self.next <= last:
            assert time.monotonic() < deadline, f"stuck at {self.next} of {last}"
            if self.sub.poll(100):
                _, seq, payload = self.sub.recv_multipart()
                seq = seq_from_bytes(seq)
                if seq > self.next:
                    self._replay()
                self._apply(seq, payload)
            else:
                self._replay()


async def drive(engine, seed=2, steps=60):
    """Requests over shared prompt prefixes through the engine; returns what it did."""
    rng = random.Random(seed)
    T = G.page_tokens
    docs = [[rng.randrange(50_000) for _ in range(T * rng.randint(2, 5))] for _ in range(4)]
    live: dict[int, tuple[list[int], list[bytes], int]] = {}
    n = {"shared": 0, "published": 0, "evicted": 0}
    req = 0
    for step in range(steps):
        for _ in range(rng.randint(1, 3)):
            req += 1
            tokens = rng.choice(docs) + [rng.randrange(50_000) for _ in range(T * rng.randint(0, 2))]
            hashes = block_hashes(tokens, T)
            k = await engine.lookup(hashes)
            if k:
                await engine.share(req, hashes[:k])
                n["shared"] += k
            if len(hashes) > k:
                try:
                    await engine.reserve(req, len(hashes) - k)
                except OutOfPagesError:
                    if k:
                        await engine.cancel(req)
                    continue
                await engine.commit(req, step, len(hashes) - k)
            live[req] = (tokens, hashes, k)
        await engine.run_step(step)
        for r, (tokens, hashes, k) in list(live.items()):
            new = hashes[k:]
            if new and all([await engine.lookup([h]) == 0 for h in new]):
                await engine.publish(r, new, tokens[k * T:len(hashes) * T], start=k)
                n["published"] += len(new)
            live[r] = (tokens, hashes, len(hashes))
            if rng.random() < 0.4:
                await engine.finish(r)
                del live[r]
        if engine.ledger.cached_count and rng.random() < 0.15:
            n["evicted"] += len(await engine.evict(1))
    return n


def published(ledger):
    """The ledger's published hashes as the wire carries them (u64)."""
    return {to_u64(h) for h in (ledger.block_hash(p) for p in range(ledger.geometry.num_pages)) if h is not None}


@pytest.mark.asyncio
@pytest.mark.parametrize("log", [False, True])
async def test_an_engine_publishes_batches_that_rebuild_its_cache(ctx, tmp_path, log):
    pub = CountingPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:*")
    router = None
    opts = {"log": tmp_path / "kv.kvlog"} if log else {}
    try:
        async with open_engine(G, ranks=1, extras=ExtraOptions(kv_events=pub), **opts) as engine:
            assert engine.kv_events is pub and pub.running  # started before the ledger: it saw seq 0
            router = Router(ctx, pub.endpoint, pub.replay_endpoint)
            n = await drive(engine)
            await engine.run_step(60)  # its outcome flushes what the last step's publishes left
            steps = engine.statistics()["steps_completed"]
            assert pub.flushes == steps == 61
            expected = published(engine.ledger)
            last = pub.statistics().last_seq
            assert pub.wait_sent(last, 60)
            router.pump(last)  # the replay socket still answers: every gap can be filled
        assert not pub.running  # stopped at close, after the last step settled
        stats = pub.statistics()
        assert stats.last_seq == last  # nothing was left for the close to send
        assert stats.batches_dropped == stats.send_errors == 0 and stats.batches_sent == stats.last_seq + 1 > 10
        assert router.hashes == expected and len(expected) > 10
        assert n["shared"] > 20 and n["evicted"] > 0
        assert router.kinds["BlockRemoved"] > n["evicted"]  # evictions inside reserve too
        assert router.kinds["AllBlocksCleared"] == 1
    finally:
        if router is not None:
            router.close()


@pytest.mark.asyncio
async def test_an_endpoint_builds_the_publisher_and_bad_values_open_nothing(tmp_path):
    async with open_engine(G, extras=ExtraOptions(kv_events="tcp://127.0.0.1:0")) as engine:
        pub = engine.kv_events
        assert isinstance(pub, KVEventPublisher) and pub.running and pub.endpoint.startswith("tcp://127.0.0.1:")
        await engine.reserve(1, 1)
        await engine.commit(1, 0, 1)
        await engine.run_step(0)
    assert not pub.running
    with pytest.raises(ConfigurationError):
        async with open_engine(G, extras=ExtraOptions(kv_events="nowhere")):
            pass
    with pytest.raises(InvalidArgumentError):
        async with open_engine(G, extras=ExtraOptions(kv_events=42)):
            pass
    # an endpoint in use: refused before the ledger opens (no log file is created)
    holder = KVEventPublisher("tcp://127.0.0.1:0").start()
    try:
        with pytest.raises(ConfigurationError):
            async with open_engine(G, log=tmp_path / "never.kvlog",
                                   extras=ExtraOptions(kv_events={"endpoint": holder.endpoint, "bind": True})):
                pass
        assert not (tmp_path / "never.kvlog").exists()
    finally:
        holder.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", ['{"endpoint": "tcp://*:0", "bufer_steps": 5}', '{"endpoint": ', '[1]',
                                 {"hwm": "many"}, {"publisher": "kafka"}, {"enable_kv_cache_events": 1}])
async def test_a_bad_kv_events_config_opens_nothing(bad, tmp_path):
    with pytest.raises(ConfigurationError):
        async with open_engine(G, log=tmp_path / "never.kvlog", extras=ExtraOptions(kv_events=bad)):
            pass
    assert not (tmp_path / "never.kvlog").exists()


@pytest.mark.asyncio
async def test_vllms_kv_events_config_builds_the_publisher():
    """vLLM's --kv-events-config JSON (its KVEventsConfig fields) and a mapping with kvledger's
    options; disabled, or publisher "null": no publisher at all."""
    cfg = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", '
           '"replay_endpoint": "tcp://127.0.0.1:0", "buffer_steps": 64, "hwm": 1000, "max_queue_size": 32, '
           '"topic": "kv@pod-0@m"}')
    async with open_engine(G, extras=ExtraOptions(kv_events=cfg)) as engine:
        pub = engine.kv_events
        assert pub.topic == "kv@pod-0@m" and pub.replay_endpoint.startswith("tcp://127.0.0.1:")
        assert (pub.layout, pub.hashes, pub.replay_format) == ("map", "u64", "vllm")
    events = {"endpoint": "tcp://127.0.0.1:0", "layout": "array", "replay_format": "legacy", "hashes": "raw"}
    async with open_engine(G, extras=ExtraOptions(kv_events=events)) as engine:
        assert (engine.kv_events.layout, engine.kv_events.hashes) == ("array", "raw")
    for off in ('{"enable_kv_cache_events": false}', {"publisher": "null", "endpoint": "tcp://*:5557"}):
        async with open_engine(G, extras=ExtraOptions(kv_events=off)) as engine:
            assert engine.kv_events is None
