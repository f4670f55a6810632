"""kvledger's KV events read by vLLM 0.33.0's own decoder (issue #19): the consumers' code, not a restatement.

Pins, with vLLM 0.33.0's ``vllm/distributed/kv_events.py`` taken from its source
distribution (``tests/support/upstream.py``) and loaded unchanged (only the vllm modules it
imports are stood in for, in ``sys.modules``, while it loads: its logger, its
network helpers; ``KVEventsConfig`` and ``ExternalBlockHash`` are vLLM's own):

* with no flags, ``msgspec.msgpack.Decoder(type=KVEventBatch)`` of vLLM's structs
  decodes every batch of a live engine's stream, of ``kvledger events --zmq`` and
  of a full replay read through a DEALER socket the way vLLM's subscriber reads it
  (``[b"", topic, seq, payload]`` per batch, ``[b"", b"", -1, b""]`` at the end);
  frames, seqs from 0 without gaps and every field's type are checked;
* 20 full replays of a full buffer lose nothing (every batch, every end marker);
* vLLM's ``--kv-events-config`` (its own ``KVEventsConfig``, as JSON) opens an engine's
  publisher; ``kvledger events --jsonl`` lines decode with vLLM's structs
  (``msgspec.json.Decoder(type=KVEventBatch)``);
* the tenant and a caller's cache salt travel in ``extra_keys``, one entry per block.

When the package registry cannot be reached the module is skipped, loudly (the
reason says these tests did not run, and a warning is raised).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time
import warnings

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from support import wait_for  # noqa: E402
from support.upstream import VLLM_VERSIONS, UpstreamUnavailable  # noqa: E402
from support.vllm_kv_events import load_kv_events  # noqa: E402

from kvledger import Geometry, Ledger, OutOfPagesError  # noqa: E402
from kvledger.engine import ExtraOptions  # noqa: E402
from kvledger.core.hashing import U64_MASK, block_hashes, to_u64  # noqa: E402
from kvledger.core.log import EventLog  # noqa: E402
from kvledger.engine import open_engine  # noqa: E402
from kvledger.kvevents import KVEventPublisher, encode_batch, export_log  # noqa: E402
from kvledger.kvevents.cli import main as events_main  # noqa: E402

G = Geometry(num_pages=48, page_tokens=4)
END = (-1).to_bytes(8, "big", signed=True)


# ---------------------------------------------------------------------- vLLM's own file, per version


@pytest.fixture(scope="module", params=VLLM_VERSIONS)
def vllm(request):
    """vLLM's ``vllm.distributed.kv_events`` (and its ``KVEventsConfig``), loaded from each supported
    version's sdist (``support.vllm_kv_events``)."""
    try:
        events = load_kv_events(request.param)
    except UpstreamUnavailable as exc:
        msg = (f"vLLM {request.param}'s kv_events.py could not be fetched ({exc}): the conformance tests against "
               "vLLM's own decoder did NOT run")
        warnings.warn(msg, stacklevel=1)
        pytest.skip(msg)
    return events


def check_fields(vllm, batch) -> None:
    """Every field of a batch vLLM decoded has the type vLLM's consumers rely on."""
    assert type(batch) is vllm.KVEventBatch and type(batch.ts) is float
    assert batch.data_parallel_rank is None or type(batch.data_parallel_rank) is int
    assert batch.events, "kvledger never sends an empty batch"
    for ev in batch.events:
        if type(ev) is vllm.BlockStored:
            assert ev.block_hashes and all(type(h) is int and 0 <= h <= U64_MASK for h in ev.block_hashes)
            assert ev.parent_block_hash is None or (type(ev.parent_block_hash) is int
                                                    and 0 <= ev.parent_block_hash <= U64_MASK)
            assert type(ev.block_size) is int and ev.block_size > 0
            assert all(type(t) is int for t in ev.token_ids)
            assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
            assert ev.medium == "GPU" and ev.lora_id is None and ev.lora_name is None
            if ev.extra_keys is not None:
                assert len(ev.extra_keys) == len(ev.block_hashes)
                assert all(k is None or (type(k) is tuple and all(type(x) is str for x in k)) for k in ev.extra_keys)
        elif type(ev) is vllm.BlockRemoved:
            assert ev.block_hashes and all(type(h) is int and 0 <= h <= U64_MASK for h in ev.block_hashes)
            assert ev.medium == "GPU"
        else:
            assert type(ev) is vllm.AllBlocksCleared


class VllmSubscriber:
    """A consumer written the way vLLM 0.33's own tests' subscriber is (SUB, and a DEALER for replay),
    decoding with vLLM's ``Decoder(type=KVEventBatch)``; it checks the frames it is handed."""

    def __init__(self, vllm, ctx, endpoint: str, replay_endpoint: str | None, topic: str = "", *, bind=False):
        self.vllm, self.topic = vllm, topic.encode()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)  # before the connection
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = ctx.socket(zmq.DEALER)
            self.replay.connect(replay_endpoint)
        self.batches: dict[int, object] = {}
        self.live = self.replayed = 0
        self.hashes: set[int] = set()

    def wait_connected(self, timeout: float = 30) -> None:
        """Wait for the SUB socket's handshake with the publisher, then a moment for the subscription
        to reach the publisher's I/O thread (a PUB drops what it sends before that: under CI's load
        a whole 31-batch run went by before a fresh subscription took)."""
        from zmq.utils.monitor import recv_monitor_message

        assert self.monitor.poll(int(timeout * 1000)), "the subscriber never connected"
        recv_monitor_message(self.monitor)
        time.sleep(0.2)

    def close(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)

    def _take(self, seq: int, payload: bytes) -> None:
        batch = self.vllm.decoder.decode(payload)  # vLLM's decoder: raises on anything it does not accept
        check_fields(self.vllm, batch)
        if seq in self.batches:
            assert msgspec.msgpack.encode(self.batches[seq]) == msgspec.msgpack.encode(batch), "replay differs"
            return
        assert seq == len(self.batches), f"seq {seq} arrived, {len(self.batches)} expected (gap or reorder)"
        self.batches[seq] = batch
        for ev in batch.events:
            if type(ev) is self.vllm.BlockStored:
                assert self.hashes.isdisjoint(ev.block_hashes), "stored twice"
                self.hashes.update(ev.block_hashes)
            elif type(ev) is self.vllm.BlockRemoved:
                assert self.hashes.issuperset(ev.block_hashes), "removed a block never stored"
                self.hashes.difference_update(ev.block_hashes)
            else:
                self.hashes.clear()

    def request_replay(self, start: int, timeout: float = 30.0) -> list[int]:
        """vLLM's way: [b"", seq] out; [b"", topic, seq, payload] back per batch, then the marker."""
        assert self.replay is not None
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        while True:
            assert self.replay.poll(int(timeout * 1000)), "no replay answer"
            frames = self.replay.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4, f"bad replay frames {[len(f) for f in frames]}"
            if frames == [b"", b"", END, b""]:
                return seqs
            _, topic, seq_frame, payload = frames
            assert topic == self.topic and len(seq_frame) == 8 and payload
            seq = int.from_bytes(seq_frame, "big")
            seqs.append(seq)
            self.replayed += seq >= len(self.batches)
            self._take(seq, payload)

    def pump(self, last: int, timeout: float = 60.0) -> None:
        """Receive until batch ``last`` is in; a gap, or silence, is filled by a replay."""
        deadline = time.monotonic() + timeout
        while len(self.batches) <= last:
            assert time.monotonic() < deadline, f"stuck at seq {len(self.batches)} of {last}"
            if self.sub.poll(100):
                frames = self.sub.recv_multipart()
                assert len(frames) == 3 and frames[0] == self.topic and len(frames[1]) == 8
                seq = int.from_bytes(frames[1], "big")
                if seq > len(self.batches) and self.replay is not None:
                    self.request_replay(len(self.batches))
                if seq >= len(self.batches):
                    self.live += 1
                    self._take(seq, frames[2])
            elif self.replay is not None:
                self.request_replay(len(self.batches))


# ---------------------------------------------------------------------- a workload with tenants


async def drive_engine(engine, seed: int = 4, steps: int = 50) -> int:
    """Requests of two tenants over shared prompts (equal prefixes in both tenants); returns blocks published."""
    rng = random.Random(seed)
    T = G.page_tokens
    docs = [[rng.randrange(50_000) for _ in range(T * rng.randint(2, 4))] for _ in range(3)]
    live: dict[int, tuple[list[int], list[bytes], int]] = {}
    published = 0
    req = 0
    for step in range(steps):
        for _ in range(rng.randint(1, 3)):
            req += 1
            tenant = rng.choice(("acme", "globex"))
            tokens = rng.choice(docs) + [rng.randrange(50_000) for _ in range(T * rng.randint(0, 1))]
            hashes = block_hashes(tokens, T, extra_keys=(tenant,))
            k = await engine.lookup(hashes, tenant=tenant)
            if k:
                await engine.share(req, hashes[:k], tenant=tenant)
            if len(hashes) > k:
                try:
                    await engine.reserve(req, len(hashes) - k, tenant=tenant)
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
                await engine.publish(r, new, tokens[k * T:len(hashes) * T], start=k,
                                     parent_hash=hashes[k - 1] if k else None)
                published += len(new)
            live[r] = (tokens, hashes, len(hashes))
            if rng.random() < 0.4:
                await engine.finish(r)
                del live[r]
    await engine.run_step(steps)  # the last publishes leave with the batch this step's outcome closes
    return published


# ---------------------------------------------------------------------- live engine, replay, config


@pytest.mark.asyncio
async def test_vllm_decodes_every_batch_of_a_live_engine_and_its_full_replay(vllm, ctx):
    # vLLM's own KVEventsConfig, as the JSON of --kv-events-config (ephemeral ports: tcp://...:0 binds)
    cfg = vllm.KVEventsConfigClass(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:0",
                                   replay_endpoint="tcp://127.0.0.1:0", topic="kv-events", buffer_steps=500)
    config_json = json.dumps(dataclasses.asdict(cfg))
    sub = None
    try:
        async with open_engine(G, extras=ExtraOptions(kv_events=config_json)) as engine:
            pub = engine.kv_events
            assert isinstance(pub, KVEventPublisher) and pub.topic == "kv-events"
            sub = VllmSubscriber(vllm, ctx, pub.endpoint, pub.replay_endpoint, "kv-events")
            sub.wait_connected()
            published = await drive_engine(engine)
            expected = {to_u64(h) for h in (engine.ledger.block_hash(p) for p in range(G.num_pages)) if h}
            stats = pub.statistics()
            last = stats.last_seq
            sub.pump(last)  # live, gaps filled by replay, while the engine is still up
            full = sub.request_replay(0)
        print(f"live engine: {last + 1} batches, {sub.live} decoded live and {sub.replayed} from replay by "
              f"vLLM's decoder; a full replay of {len(full)} then the end marker")
        assert stats.batches_dropped == stats.send_errors == 0
        assert full == list(range(last + 1))  # the whole run, then the end marker
        assert sub.live > last // 2 and sub.hashes == expected and published > 20
        extra = [e.extra_keys for b in sub.batches.values() for e in b.events if type(e) is vllm.BlockStored]
        assert {k for keys in extra for k in keys} == {("acme",), ("globex",)}  # the tenant of every block
    finally:
        if sub is not None:
            sub.close()


def test_twenty_full_replays_of_a_full_buffer_lose_nothing(vllm, ctx):
    steps = 10_000 if os.environ.get("KVLEDGER_HYPOTHESIS") == "heavy" else 2000  # heavy: vLLM's default
    led_batches = steps + steps // 4  # the buffer wraps: its oldest batch is seq steps // 4
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=steps,
                          topic="t", max_queue=led_batches + 1) as pub:
        sub = VllmSubscriber(vllm, ctx, pub.endpoint, pub.replay_endpoint, "t")
        payload = _batch(vllm, 3)
        for _ in range(led_batches):
            assert pub.publish_nowait(payload) is not None
        assert pub.wait_sent(led_batches - 1, 30)
        first = led_batches - steps
        lost = 0
        for trial in range(20):
            sub.replay.send_multipart([b"", (0).to_bytes(8, "big")])
            if trial % 2:  # a slow reader: the whole answer waits in its queue before it reads any
                assert wait_for(lambda: pub.statistics().replay_pending == 0, 30)
            got = []
            while True:
                assert sub.replay.poll(10_000), f"replay {trial} stalled after {len(got)} batches"
                frames = sub.replay.recv_multipart()
                if frames == [b"", b"", END, b""]:
                    break
                _, topic, seq, body = frames
                assert topic == b"t"
                vllm.decoder.decode(body)
                got.append(int.from_bytes(seq, "big"))
            lost += len(set(range(first, led_batches)) - set(got))
            assert got == list(range(first, led_batches)), f"replay {trial}"
        sub.close()
    stats = pub.statistics()  # after stop: the thread is gone, its counters final
    print(f"20 full replays of a full buffer ({steps} batches each, vLLM's decoder): {lost} lost, "
          f"{stats.replay_answers} end markers, {stats.replay_batches} batches resent")
    assert lost == 0 and stats.replay_answers == 20 and stats.replay_batches == 20 * steps
    assert stats.replay_refused == stats.replay_errors == 0


def plain(events) -> list:
    """Events as plain JSON values (vLLM's structs and kvledger's compare by content)."""
    return msgspec.json.decode(msgspec.json.encode(events))


def _batch(vllm, n: int):
    from kvledger.kvevents import BlockRemovedMap, KVEventBatchMap

    return KVEventBatchMap(1.0, tuple(BlockRemovedMap((i,), "GPU") for i in range(n)), 0)


# ---------------------------------------------------------------------- the CLI


def recorded_log(tmp_path, seed: int = 3, steps: int = 40):
    """A log of a ledger whose requests belong to two tenants."""
    path = tmp_path / "run.kvlog"
    log = EventLog.create(path, G)
    led = Ledger(G, sink=log.append)
    rng = random.Random(seed)
    T = G.page_tokens
    docs = [[rng.randrange(50_000) for _ in range(T * rng.randint(2, 4))] for _ in range(3)]
    live: dict[int, tuple[list[int], list[bytes]]] = {}
    for step in range(steps):
        r = step + 1
        tenant = rng.choice(("acme", "globex"))
        tokens = rng.choice(docs)
        hashes = block_hashes(tokens, T, extra_keys=(tenant,))
        if led.lookup(hashes, tenant=tenant) == len(hashes):
            led.share(r, hashes, tenant=tenant)
        else:
            try:
                led.reserve(r, len(hashes), tenant=tenant)
            except OutOfPagesError:
                continue
            led.commit(r, step, len(hashes))
            live[r] = (tokens, hashes)
        led.seal_step(step)
        led.complete_step(step, 0)
        for q, (tokens, hashes) in list(live.items()):
            if all(led.lookup([h]) == 0 for h in hashes):
                led.publish(q, hashes, tokens)
            del live[q]
        for q in list(led.state.requests):
            if rng.random() < 0.5:
                led.finish(q)
        if rng.random() < 0.2 and led.cached_count:
            led.evict(1)
    log.close()
    return path, led


def test_vllm_decodes_every_batch_of_kvledger_events_zmq(vllm, ctx, tmp_path):
    path, led = recorded_log(tmp_path)
    exported: list = []
    export_log(path, exported.append)
    endpoint, replay = f"ipc://{tmp_path}/kv.pub", f"ipc://{tmp_path}/kv.replay"  # ipc://: bound, by vLLM's rule
    sub = VllmSubscriber(vllm, ctx, endpoint, replay)
    codes: list = []
    th = threading.Thread(target=lambda: codes.append(events_main(
        [str(path), "--zmq", endpoint, "--replay", replay, "--wait", "0.3", "--linger", "2"])))
    th.start()
    try:
        sub.pump(len(exported) - 1)
        full = sub.request_replay(0)
    finally:
        th.join(30)
        sub.close()
    assert codes == [0] and full == list(range(len(exported)))
    assert [plain(b.events) for b in sub.batches.values()] == [plain(b.events) for b in exported]
    published = {to_u64(h) for h in (led.block_hash(p) for p in range(G.num_pages)) if h}
    assert sub.hashes == published and published


def test_jsonl_lines_decode_with_vllms_structs(vllm, tmp_path, capsys):
    path, _ = recorded_log(tmp_path)
    out = tmp_path / "events.jsonl"
    assert events_main([str(path), "-o", str(out)]) == 0
    dec = msgspec.json.Decoder(type=vllm.KVEventBatch)
    lines = out.read_bytes().splitlines()
    batches = [dec.decode(line) for line in lines]
    for b in batches:
        check_fields(vllm, b)
    exported: list = []
    export_log(path, exported.append)
    assert len(batches) == len(exported) > 5
    assert [plain(b.events) for b in batches] == [plain(b.events) for b in exported]
    assert events_main([str(path), "-o", str(out), "--objects"]) == 0  # the richer object, behind a flag
    first = json.loads(out.read_bytes().splitlines()[0])
    assert set(first) == {"seq", "ts", "data_parallel_rank", "events"} and first["seq"] == 0
    with pytest.raises(msgspec.ValidationError):
        dec.decode(out.read_bytes().splitlines()[0])


# ---------------------------------------------------------------------- a vLLM pool's KV cache groups


def test_a_hybrid_pools_blocks_carry_vllms_cache_spec_fields(vllm, tmp_path):
    """A vLLM pool's holds (one ledger request per vLLM request and KV cache group, its tenant
    naming the group, labelled with vLLM's request id) publish with ``group_idx``,
    ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window`` and ``session_id`` set, decoded
    by the version's own structs; no tenant in ``extra_keys``; a plain tenant keeps its key."""
    path = tmp_path / "hybrid.kvlog"
    log = EventLog.create(path, G)
    led = Ledger(G, sink=log.append)
    T = G.page_tokens
    groups = {1: "g0:full_attention:bfloat16", 2: "g1:mamba:float32", 3: "g2:sliding_window:bfloat16:w96",
              4: "acme"}
    hashed = {}
    for r, tenant in groups.items():
        tokens = list(range(r * 100, r * 100 + 2 * T))
        hashes = block_hashes(tokens, T, extra_keys=(tenant,))
        if r == 1:  # labelled before its first pages (as the pool does) or after: either way
            led.label(r, "chatcmpl-7")
        led.reserve(r, 2, tenant=tenant)
        if r in (2, 3):
            led.label(r, "chatcmpl-7")
        led.commit(r, 0, 2)
        hashed[r] = (tokens, hashes)
    led.seal_step(0)
    led.complete_step(0, 0)
    for r, (tokens, hashes) in hashed.items():
        led.publish(r, hashes, tokens)
    led.seal_step(1)
    log.close()
    exported: list = []
    export_log(path, exported.append)
    stored = [e for b in exported for e in vllm.decoder.decode(encode_batch(b)).events
              if type(e) is vllm.BlockStored]
    got = sorted((repr(e.group_idx), e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.session_id,
                  plain(e.extra_keys)) for e in stored)
    assert got == [("0", "full_attention", None, "chatcmpl-7", None), ("1", "mamba", None, "chatcmpl-7", None),
                   ("2", "sliding_window", 96, "chatcmpl-7", None), ("None", None, None, None, [["acme"], ["acme"]])]
