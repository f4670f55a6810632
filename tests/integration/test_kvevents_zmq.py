"""KV events over real ZMQ sockets on loopback (kvledger.kvevents.publisher / export / cli).

Pins: a ledger driven through publish / share / finish / evict (and evictions
inside reserve) with a KVEventPublisher as its observer; a consumer with a real
SUB socket (tcp://127.0.0.1, ephemeral port) and a DEALER on the replay socket
decodes every batch, fills gaps by replay, and rebuilds the set of stored minus
removed hashes, which must equal the ledger's published hashes at the end; the
replay socket answers from any seq with the live payloads and the end marker;
the offline export of the log recorded in the same run is byte-identical to what
was sent; the CLI (JSON lines, ZMQ over ipc://, a corrupt log, no pyzmq); drops
counted when the queue is full; bad endpoints, an endpoint in use and a missing
pyzmq raise kvledger errors; ``import kvledger.kvevents`` does not import zmq.
Both layouts, both hash forms and both replay formats (vLLM 0.33's by default,
``legacy`` for older consumers); vLLM's bind/connect rule and DP-rank offset.

(A REQ socket receives only the first frame of a replay answer under libzmq, so
the consumer here uses a DEALER with an empty delimiter: the same bytes on the wire.)
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import threading
import time
from collections import Counter

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from kvledger import (  # noqa: E402
    ConfigurationError,
    CorruptLogError,
    Geometry,
    InvalidArgumentError,
    Ledger,
    OutOfPagesError,
)
from kvledger.core.hashing import block_hashes, to_u64  # noqa: E402
from kvledger.core.log import EventLog  # noqa: E402
from kvledger.kvevents import (  # noqa: E402
    SEQ_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStoredMap,
    BlockRemovedMap,
    AllBlocksClearedMap,
    KVEventBatch,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    export_log,
    seq_bytes,
    seq_from_bytes,
)
from kvledger.kvevents.cli import main as events_main  # noqa: E402

G = Geometry(num_pages=40, page_tokens=4)


class Consumer:
    """What a router does: SUB on the PUB endpoint, DEALER on the replay endpoint, gaps filled by
    replay, and the set of cached hashes rebuilt from the events."""

    def __init__(self, ctx, endpoint: str, replay_endpoint: str | None, topic: str = "", layout: str = "map",
                 replay_format: str = "vllm"):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = ctx.socket(zmq.DEALER)
            self.replay.connect(replay_endpoint)
        self.topic = topic.encode()
        self.layout = layout
        self.legacy = replay_format == "legacy"
        self.next = 0
        self.payloads: dict[int, bytes] = {}
        self.hashes: set = set()
        self.kinds: Counter = Counter()
        self.replayed = 0

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)

    def request_replay(self, start: int) -> list[tuple[int, bytes]]:
        assert self.replay is not None
        self.replay.send_multipart([b"", seq_bytes(start)])
        out: list[tuple[int, bytes]] = []
        while True:
            assert self.replay.poll(30_000), "no replay answer"
            frames = self.replay.recv_multipart()
            assert frames[0] == b""
            if self.legacy:  # [seq, payload], [SEQ_END, b""]
                _, seq, payload = frames
            else:  # vLLM 0.33: [topic, seq, payload], [b"", SEQ_END, b""]
                _, topic, seq, payload = frames
                assert topic == (b"" if seq == SEQ_END else self.topic)
            if seq == SEQ_END:
                assert payload == b""
                return out
            out.append((seq_from_bytes(seq), payload))

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next:
            return  # already applied (live and replay overlap)
        self.payloads[seq] = payload
        self.next = seq + 1
        for ev in decode_batch(payload, self.layout).events:
            name = type(ev).__struct_config__.tag
            self.kinds[name] += 1
            if name == "BlockStored":
                assert not self.hashes & set(ev.block_hashes), "stored twice"
                self.hashes.update(ev.block_hashes)
            elif name == "BlockRemoved":
                assert set(ev.block_hashes) <= self.hashes, "removed a hash never stored"
                self.hashes.difference_update(ev.block_hashes)
            else:
                self.hashes.clear()

    def _fill(self, upto: int | None) -> None:
        for seq, payload in self.request_replay(self.next):
            if upto is None or seq <= upto:
                self.replayed += 1
                self._apply(seq, payload)

    def pump(self, last_seq: int, timeout: float = 60.0) -> None:
        """Receive until batch ``last_seq`` is applied; a gap (or silence) is filled by replay."""
        deadline = time.monotonic() + timeout
        while self.next <= last_seq:
            assert time.monotonic() < deadline, f"stuck at seq {self.next} of {last_seq}"
            if self.sub.poll(200):
                topic, seq_frame, payload = self.sub.recv_multipart()
                assert topic == self.topic
                seq = seq_from_bytes(seq_frame)
                if seq > self.next and self.replay is not None:
                    self._fill(seq - 1)
                self._apply(seq, payload)
            elif self.replay is not None:
                self._fill(None)


def drive(led: Ledger, seed: int = 1, steps: int = 80) -> Counter:
    """Requests over a few shared prompt prefixes: lookup / share / reserve (evicting) / commit,
    seal, complete, publish the new full pages, finish some, evict now and then."""
    rng = random.Random(seed)
    T = led.geometry.page_tokens
    docs = [[rng.randrange(50_000) for _ in range(T * rng.randint(2, 5))] for _ in range(4)]
    live: dict[int, tuple[list[int], list[bytes], int]] = {}
    n: Counter = Counter()
    req = 0
    for step in range(steps):
        for _ in range(rng.randint(1, 3)):
            req += 1
            tokens = rng.choice(docs) + [rng.randrange(50_000) for _ in range(T * rng.randint(0, 2))]
            hashes = block_hashes(tokens, T)
            k = led.lookup(hashes)
            if k:
                led.share(req, hashes[:k])
                n["shared"] += k
            if len(hashes) > k:
                try:
                    led.reserve(req, len(hashes) - k)
                except OutOfPagesError:
                    n["refused"] += 1
                    if k:
                        led.cancel(req)
                    continue
                led.commit(req, step, len(hashes) - k)
            live[req] = (tokens, hashes, k)
        led.seal_step(step)
        led.complete_step(step, 0)
        for r, (tokens, hashes, k) in list(live.items()):
            new = hashes[k:]
            if new and all(led.lookup([h]) == 0 for h in new):
                led.publish(r, new, tokens[k * T:len(hashes) * T], start=k)
                n["published"] += len(new)
            live[r] = (tokens, hashes, len(hashes))
            if rng.random() < 0.4:
                led.finish(r)
                del live[r]
        if led.cached_count and rng.random() < 0.15:
            n["evicted"] += len(led.evict(1))
    return n


def published_hashes(led: Ledger, form: str = "u64") -> set:
    """The ledger's published hashes as the wire carries them (u64 by default)."""
    got = {h for h in (led.block_hash(p) for p in range(led.geometry.num_pages)) if h is not None}
    return {to_u64(h) for h in got} if form == "u64" else got


def ticks():
    c = itertools.count()
    return lambda: float(next(c))


def test_live_stream_rebuilds_the_ledgers_cache_and_the_export_matches(ctx, tmp_path):
    path = tmp_path / "run.kvlog"
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:*", topic="kv-events",
                           clock=ticks()).start()
    con = Consumer(ctx, pub.endpoint, pub.replay_endpoint, "kv-events")
    try:
        log = EventLog.create(path, G)
        led = Ledger(G, sink=log.append, observer=pub.observe)
        n = drive(led)
        last = pub.flush()
        log.close()
        assert last is not None and pub.wait_sent(last, timeout=10)
        con.pump(last)
        assert con.hashes == published_hashes(led)
        # the run exercised what it claims to: shares, evictions inside reserve and explicit ones
        assert n["shared"] > 20 and n["evicted"] > 0 and n["published"] > 50
        assert con.kinds["BlockRemoved"] > n["evicted"] and con.kinds["AllBlocksCleared"] == 1
        stats = pub.statistics()
        assert stats.batches_sent == last + 1 and stats.batches_dropped == stats.send_errors == 0
        assert stats.events_sent == sum(con.kinds.values())

        # replay from a seq in the middle: exactly the live payloads from there on, then the end marker
        mid = last // 2
        got = con.request_replay(mid)
        assert [s for s, _ in got] == list(range(mid, last + 1))
        assert all(con.payloads[s] == p for s, p in got)
        assert con.request_replay(last + 1) == []

        # the offline export of the recorded log: the same batches, byte for byte (same clock)
        exported: list = []
        summary = export_log(path, exported.append, clock=ticks())
        assert [encode_batch(b) for b in exported] == [con.payloads[s] for s in range(last + 1)]
        assert summary.batches == last + 1 and summary.events == led.seq and summary.torn_at is None
    finally:
        con.close()
        pub.stop()
    assert pub.publish_nowait(KVEventBatch(0.0, (), 0)) is None  # after stop: dropped, counted


def test_array_layout_raw_hashes_and_legacy_replay_on_the_wire(ctx, tmp_path):
    """The options older consumers need: positional events, the ledger's own bytes hashes,
    [seq, payload] replay answers ending with [SEQ_END, b""]."""
    pub = KVEventPublisher(f"ipc://{tmp_path}/a", replay_endpoint=f"ipc://{tmp_path}/b", layout="array",
                           hashes="raw", replay_format="legacy", clock=ticks()).start()
    con = Consumer(ctx, pub.endpoint, pub.replay_endpoint, layout="array", replay_format="legacy")
    try:
        led = Ledger(G, observer=pub.observe)
        drive(led, steps=30)
        last = pub.flush()
        assert last is not None and pub.wait_sent(last, timeout=10)
        con.pump(last)
        assert con.hashes == published_hashes(led, "raw") and all(type(h) is bytes for h in con.hashes)
        assert [s for s, _ in con.request_replay(1)] == list(range(1, last + 1))
        raw = msgspec.msgpack.decode(con.payloads[1])
        assert type(raw[1][0]) is list and raw[1][0][0] in ("BlockStored", "BlockRemoved")  # positional, tag first
    finally:
        con.close()
        pub.stop()


def test_map_layout_and_data_parallel_rank_on_the_wire(ctx):
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", layout="map",
                          data_parallel_rank=3, medium="CPU") as pub:
        con = Consumer(ctx, pub.endpoint, pub.replay_endpoint, layout="map")
        led = Ledger(Geometry(num_pages=4, page_tokens=2), observer=pub.observe)
        led.reserve(1, 1)
        led.commit(1, 0, 1)
        led.seal_step(0)
        led.complete_step(0, 0)
        led.publish(1, [99], [5, 6])
        led.finish(1)
        led.evict()
        last = pub.flush()
        assert last == 1 and pub.wait_sent(last, 10)
        con.pump(last)
        con.close()
    batches = [decode_batch(con.payloads[s], "map") for s in (0, 1)]
    assert [b.data_parallel_rank for b in batches] == [3, 3]
    assert batches[0].events == (AllBlocksClearedMap(),)
    assert batches[1].events == (BlockStoredMap((99,), None, (5, 6), 2, None, "CPU", None),
                                 BlockRemovedMap((99,), "CPU"))  # an int hash < 2**64 folds to itself
    assert msgspec.msgpack.decode(con.payloads[1])[1][0]["type"] == "BlockStored"


def test_full_queue_drops_and_leaves_a_visible_gap(ctx):
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", max_queue=2)
    batch = KVEventBatch(1.0, (AllBlocksCleared(), BlockRemoved((1,), "GPU")), 0)
    t0 = time.perf_counter()
    assert [pub.publish_nowait(batch) for _ in range(3)] == [0, 1, None]  # not started: the queue holds two
    assert time.perf_counter() - t0 < 0.5
    s = pub.statistics()
    assert (s.batches_queued, s.batches_dropped, s.events_dropped, s.queue_depth, s.last_seq) == (2, 1, 2, 2, 2)
    with pub:
        con = Consumer(ctx, pub.endpoint, pub.replay_endpoint)
        assert pub.publish_nowait(batch) == 3 and pub.wait_sent(3, 10)
        assert [seq for seq, _ in con.request_replay(0)] == [0, 1, 3]
        con.close()
    assert pub.statistics().batches_sent == 3


def test_replay_socket_answers_bad_requests_with_the_end_marker(ctx):
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish_nowait(KVEventBatch(1.0, (AllBlocksCleared(),), 0))
        assert pub.wait_sent(0, 10)
        d = ctx.socket(zmq.DEALER)
        d.connect(pub.replay_endpoint)
        d.send_multipart([b"", b"abc"])  # a seq frame that is not 8 bytes
        assert d.poll(30_000) and d.recv_multipart() == [b"", b"", SEQ_END, b""]
        d.send_multipart([b"no-delimiter"])  # no envelope: nothing to answer
        d.send_multipart([b"", seq_bytes(0)])
        assert d.poll(30_000) and d.recv_multipart()[2] == seq_bytes(0)
        assert d.poll(30_000) and d.recv_multipart() == [b"", b"", SEQ_END, b""]
        d.close(linger=0)
        s = pub.statistics()
        assert (s.replay_requests, s.replay_errors, s.replay_batches) == (3, 2, 1)


def test_connecting_publisher_reaches_a_bound_subscriber(ctx):
    """vLLM's rule: an endpoint without a wildcard is connected to (llm-d's centralized mode)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with KVEventPublisher(f"tcp://127.0.0.1:{port}") as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}" and not pub.binds
        got = None
        for _ in range(50):  # until the subscription has reached the PUB side
            pub.publish_nowait(KVEventBatch(2.0, (AllBlocksCleared(),), 0))
            if sub.poll(100):
                got = sub.recv_multipart()
                break
    sub.close(linger=0)
    assert got is not None and decode_batch(got[2], "array").events == (AllBlocksCleared(),)


@pytest.mark.parametrize("endpoint", ["", "http://127.0.0.1:5557", "tcp://127.0.0.1", "tcp://", "ipc://", 5557, b"x"])
def test_bad_endpoints_raise_configuration_error(endpoint):
    with pytest.raises(ConfigurationError):
        KVEventPublisher(endpoint)  # (None is the default endpoint: tests/integration/test_kvevents_exposure.py)
    with pytest.raises(ConfigurationError):
        KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=endpoint)  # type: ignore[arg-type]


def test_an_endpoint_in_use_raises_and_leaves_nothing_open():
    with KVEventPublisher("tcp://127.0.0.1:0") as first:
        second = KVEventPublisher(first.endpoint, bind=True)
        with pytest.raises(ConfigurationError, match="cannot bind"):
            second.start()
        assert not second.running
        third = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=first.endpoint)
        with pytest.raises(ConfigurationError):
            third.start()
        third2 = KVEventPublisher(third.endpoint, bind=True)  # the PUB port third bound was released again
        third2.start().stop()
        assert first.running


def test_missing_pyzmq_is_a_configuration_error_naming_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(ConfigurationError, match=r"pip install kvledger\[events\]"):
        KVEventPublisher("tcp://127.0.0.1:0")
    path = tmp_path / "x.kvlog"
    log = EventLog.create(path, G)
    Ledger(G, sink=log.append)
    log.close()
    assert events_main([str(path), "--zmq", "tcp://127.0.0.1:0"]) == 2
    assert "kvledger[events]" in capsys.readouterr().err


def test_import_kvledger_and_kvevents_leave_zmq_out():
    code = ("import sys, kvledger, kvledger.kvevents, kvledger.kvevents.cli;"
            "print('zmq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- the CLI


def recorded_log(tmp_path, seed: int = 2):
    path = tmp_path / "cli.kvlog"
    log = EventLog.create(path, G)
    led = Ledger(G, sink=log.append)
    drive(led, seed=seed, steps=40)
    log.close()
    return path, led


class _JsonBatch(msgspec.Struct):
    seq: int
    ts: float
    data_parallel_rank: int | None
    events: tuple[BlockStoredMap | BlockRemovedMap | AllBlocksClearedMap, ...]


def test_cli_jsonl_equals_the_export(tmp_path, capsys):
    path, led = recorded_log(tmp_path)
    out = tmp_path / "events.jsonl"
    assert events_main(["--jsonl", str(path), "-o", str(out), "--dp-rank", "1", "--objects"]) == 0
    assert "batches" in capsys.readouterr().err
    lines = [msgspec.json.decode(line, type=_JsonBatch) for line in out.read_bytes().splitlines()]
    exported: list = []
    export_log(path, exported.append, layout="map", data_parallel_rank=1)
    assert [x.seq for x in lines] == list(range(len(exported)))
    assert [x.events for x in lines] == [b.events for b in exported]
    assert {x.data_parallel_rank for x in lines} == {1}
    assert '"type":"BlockStored"' in out.read_text()
    assert events_main([str(path), "--until", "0"]) == 0  # to stdout: just the AllBlocksCleared batch
    assert capsys.readouterr().out.count("AllBlocksCleared") == 1


def test_cli_zmq_over_ipc_rebuilds_the_cache(tmp_path, ctx):
    path, led = recorded_log(tmp_path, seed=3)
    exported: list = []
    export_log(path, exported.append)
    endpoint, replay = f"ipc://{tmp_path}/kv.pub", f"ipc://{tmp_path}/kv.replay"
    con = Consumer(ctx, endpoint, replay, "t")
    codes: list = []
    th = threading.Thread(target=lambda: codes.append(events_main(
        [str(path), "--zmq", endpoint, "--replay", replay, "--topic", "t", "--wait", "0.3", "--linger", "3"])))
    th.start()
    try:
        con.pump(len(exported) - 1)
    finally:
        th.join(30)
        con.close()
    assert codes == [0]
    assert [decode_batch(con.payloads[s]).events for s in range(len(exported))] == [b.events for b in exported]
    assert con.hashes == published_hashes(led)


def test_cli_connects_by_vllms_rule_and_binds_when_told(tmp_path, ctx, capsys):
    """``kvledger events --zmq tcp://host:port`` connects (a subscriber or proxy that binds, as
    llm-d's centralized indexer does); ``--bind`` overrides; the endpoint is printed as dialled."""
    path, led = recorded_log(tmp_path, seed=4)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    codes: list = []
    th = threading.Thread(target=lambda: codes.append(events_main(
        [str(path), "--zmq", f"tcp://127.0.0.1:{port}", "--wait", "1.0"])))
    th.start()
    exported: list = []
    export_log(path, exported.append)
    got: list = []  # until the last batch came (batches still in flight when the CLI returns count too)
    deadline = time.monotonic() + 60
    while th.is_alive() or not got or int.from_bytes(got[-1][1], "big") < len(exported) - 1:
        if sub.poll(100):
            got.append(sub.recv_multipart())
        assert time.monotonic() < deadline, f"{len(got)} of {len(exported)} batches came"
    th.join()
    sub.close(linger=0)
    seqs = [int.from_bytes(m[1], "big") for m in got]  # all of them, unless the subscription was late
    assert codes == [0] and seqs and seqs == list(range(seqs[0], len(exported)))
    assert f"PUB connected to tcp://127.0.0.1:{port}" in capsys.readouterr().err
    with KVEventPublisher("tcp://127.0.0.1:0", bind=True) as holder:  # --bind on a taken port: refused, exit 2
        assert events_main([str(path), "--zmq", holder.endpoint, "--bind", "--wait", "0"]) == 2
    assert events_main([str(path), "--bind"]) == 2  # --bind without --zmq


def test_cli_refuses_a_corrupt_log_and_bad_usage(tmp_path, capsys):
    path, _ = recorded_log(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError):
        export_log(path, lambda b: None)
    assert events_main([str(path)]) == 3
    assert "corrupt log" in capsys.readouterr().err
    assert events_main([str(tmp_path / "missing.kvlog")]) == 2
    assert events_main([str(path), "--replay", "tcp://127.0.0.1:0"]) == 2
    assert events_main([str(path), "--zmq", "nonsense"]) == 2
    assert events_main([str(path), "--zmq", "tcp://127.0.0.1:0", "-o", str(tmp_path / "x.jsonl")]) == 2
    with pytest.raises(SystemExit):
        events_main([str(path), "--jsonl", "--zmq", "tcp://127.0.0.1:0"])


def test_export_of_a_log_up_to_a_seq(tmp_path):
    path, led = recorded_log(tmp_path)
    first: list = []
    s = export_log(path, first.append, until=0)
    assert (s.events, s.last_seq, s.batches) == (1, 0, 1) and first[0].events == (AllBlocksClearedMap(),)
    whole: list = []
    export_log(path, whole.append)
    stored = [e for b in whole for e in b.events if type(e) is BlockStoredMap]
    assert stored and all(e.block_size == G.page_tokens and e.medium == "GPU" for e in stored)


def test_a_batch_that_cannot_be_encoded_is_counted_and_the_thread_goes_on(ctx):
    with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        assert pub.publish_nowait(KVEventBatch(1.0, (BlockRemoved((1 << 70,), None),), 0)) == 0
        assert pub.publish(KVEventBatch(2.0, (BlockRemoved((1,), None),), 0), timeout=5) == 1
        assert pub.wait_sent(1, 10)
        con = Consumer(ctx, pub.endpoint, pub.replay_endpoint)
        assert [seq for seq, _ in con.request_replay(0)] == [1]
        con.close()
        s = pub.statistics()
        assert (s.send_errors, s.batches_sent) == (1, 1)
        with pytest.raises(InvalidArgumentError):
            pub.publish_nowait([1.0, [], 0])
        with pytest.raises(InvalidArgumentError):
            pub.publish({"ts": 1.0})


def test_stop_before_start_drops_what_was_queued():
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    led = Ledger(G, observer=pub.observe)
    led.seal_step(0)  # the AllBlocksCleared batch is queued, waiting for start
    assert pub.statistics().batches_queued == 1
    assert pub.publish(KVEventBatch(1.0, (), 0), timeout=0.1) is None  # blocking publish needs a running one
    pub.stop()
    s = pub.statistics()
    assert (s.batches_dropped, s.events_dropped, s.queue_depth, s.batches_sent) == (2, 1, 0, 0)
    pub.stop()  # idempotent
