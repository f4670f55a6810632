"""KV events against the wire rules two more consumers document: Dynamo's KV indexer and llm-d's.

The rules are restated here in our own words from their public documentation (no
code of theirs is copied or run):

Dynamo (its KV router's ZMQ wire types and its "KV events for custom engines" page):
  D1  a message is three frames: topic, an 8-byte big-endian sequence number, the payload;
  D2  the payload is a msgpack array ``[ts: float, events: array, data_parallel_rank: int | nil]``;
  D3  an event is a map tagged under ``"type"``, or an array with the tag first, the tag
      one of BlockStored / BlockRemoved / AllBlocksCleared;
  D4  block hashes and parent hashes are integers that fit a signed or unsigned 64-bit
      int: a bytes hash is not accepted (the whole batch is dropped);
  D5  token ids fit an unsigned 32-bit int, a block size is a positive int;
  D6  its replay reader takes legacy answers: ``[seq, payload]``, ended by ``[-1, b""]``.

llm-d (its KV-cache indexer's architecture and indexer pages):
  L1  the topic frame reads ``kv@<pod>@<model>``: the indexer takes pod and model from it;
  L2  events of one pod are applied in sequence order;
  L3  a BlockStored's tokens are chunked by block size into one chunk per block hash (the
      indexer computes its own keys from them, chained from the parent's key);
  L4  a parent hash, and every removed hash, names a block the pod stored before (the
      indexer maps engine hashes to its keys and resolves them through that map);
  L5  the extra data of a block (adapter, salt, ...) enters its key, so equal tokens with
      different extra data stay apart;
  L6  replays come back with the topic frame, like the live stream (vLLM 0.33's framing);
  L7  in its centralized mode the indexer binds and every engine connects to it.
"""

from __future__ import annotations

import hashlib
import random
import time

import msgspec
import pytest

zmq = pytest.importorskip("zmq")

from kvledger import Geometry, Ledger  # noqa: E402
from kvledger.core.hashing import block_hashes  # noqa: E402
from kvledger.kvevents import (  # noqa: E402
    SEQ_END,
    AllBlocksClearedMap,
    KVEventBatchMap,
    KVEventPublisher,
    seq_bytes,
)

G = Geometry(num_pages=48, page_tokens=4)
TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
I64_MIN, U64_MAX, U32_MAX = -(1 << 63), (1 << 64) - 1, (1 << 32) - 1


# ---------------------------------------------------------------------- the rules, as checks


def dynamo_problems(frames: list[bytes]) -> list[str]:
    """D1-D5 for one PUB message; an empty list when Dynamo's indexer takes it."""
    if len(frames) != 3:
        return [f"D1: {len(frames)} frames"]
    if len(frames[1]) != 8:
        return ["D1: seq frame not 8 bytes"]
    try:
        doc = msgspec.msgpack.decode(frames[2])
    except msgspec.DecodeError as exc:
        return [f"D2: {exc}"]
    if not (type(doc) is list and len(doc) == 3 and type(doc[0]) is float and type(doc[1]) is list
            and (doc[2] is None or type(doc[2]) is int)):
        return ["D2: not [ts, events, rank]"]
    out = []

    def hash_ok(h) -> bool:
        return type(h) is int and I64_MIN <= h <= U64_MAX

    for ev in doc[1]:
        if type(ev) is dict:
            tag, f = ev.get("type"), ev
        elif type(ev) is list and ev:
            tag = ev[0]
            names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                     "BlockRemoved": ("block_hashes",)}.get(tag, ())
            f = dict(zip(names, ev[1:], strict=False))
        else:
            out.append("D3: event neither map nor array")
            continue
        if tag not in TAGS:
            out.append(f"D3: tag {tag!r}")
            continue
        if tag == "AllBlocksCleared":
            continue
        if not all(hash_ok(h) for h in f.get("block_hashes", [None])):
            out.append("D4: a block hash is not a 64-bit int")
        if tag == "BlockStored":
            parent = f.get("parent_block_hash")
            if parent is not None and not hash_ok(parent):
                out.append("D4: the parent hash is not a 64-bit int")
            if not all(type(t) is int and 0 <= t <= U32_MAX for t in f.get("token_ids", [])):
                out.append("D5: a token id does not fit u32")
            if not (type(f.get("block_size")) is int and 0 < f["block_size"] <= U32_MAX):
                out.append("D5: block size")
    return out


class LlmdIndex:
    """L1-L5 applied as an indexer does: keys of its own computed from tokens and extra data, an
    engine-hash -> key map per pod; ``problems`` collects every rule a message broke."""

    def __init__(self) -> None:
        self.next_seq: dict[str, int] = {}
        self.engine_to_key: dict[tuple[str, int], bytes] = {}
        self.pods_of: dict[bytes, set[str]] = {}
        self.problems: list[str] = []
        self.models: set[str] = set()

    @staticmethod
    def key(parent: bytes | None, tokens: list, extra) -> bytes:
        """A chained key of our own (llm-d uses its own hash; any injective chain shows the rule)."""
        return hashlib.sha256(msgspec.msgpack.encode([parent, tokens, extra])).digest()[:16]

    def apply(self, frames: list[bytes]) -> None:
        parts = frames[0].decode().split("@")
        if len(parts) != 3 or parts[0] != "kv" or not parts[1] or not parts[2]:
            self.problems.append(f"L1: topic {frames[0]!r}")
            return
        pod, model = parts[1], parts[2]
        self.models.add(model)
        seq = int.from_bytes(frames[1], "big")
        if seq != self.next_seq.get(pod, 0):
            self.problems.append(f"L2: seq {seq} after {self.next_seq.get(pod, 0) - 1}")
        self.next_seq[pod] = seq + 1
        batch = msgspec.msgpack.decode(frames[2])
        for ev in batch[1]:
            tag = ev["type"]
            if tag == "BlockStored":
                hs, size, tokens = ev["block_hashes"], ev["block_size"], ev["token_ids"]
                if len(tokens) != size * len(hs):
                    self.problems.append("L3: tokens do not chunk into the blocks")
                    continue
                parent = ev["parent_block_hash"]
                pkey = None
                if parent is not None:
                    pkey = self.engine_to_key.get((pod, parent))
                    if pkey is None:
                        self.problems.append("L4: unknown parent")
                extras = ev.get("extra_keys") or [None] * len(hs)
                for i, h in enumerate(hs):
                    pkey = self.key(pkey, tokens[i * size:(i + 1) * size], extras[i])
                    self.engine_to_key[(pod, h)] = pkey
                    self.pods_of.setdefault(pkey, set()).add(pod)
            elif tag == "BlockRemoved":
                for h in ev["block_hashes"]:
                    key = self.engine_to_key.pop((pod, h), None)
                    if key is None:
                        self.problems.append("L4: removed an unknown block")
                    else:
                        self.pods_of[key].discard(pod)
            else:
                for k in [k for k in self.engine_to_key if k[0] == pod]:
                    self.pods_of[self.engine_to_key.pop(k)].discard(pod)


# ---------------------------------------------------------------------- a workload


def drive(led: Ledger, steps: int = 40, seed: int = 6) -> None:
    """Two tenants over the same prompts (equal token prefixes), publishing with parents."""
    rng = random.Random(seed)
    T = G.page_tokens
    docs = [[rng.randrange(50_000) for _ in range(T * 3)] for _ in range(3)]
    for step in range(steps):
        r = step + 1
        tenant = ("acme", "globex")[step % 2]
        tokens = rng.choice(docs)
        hashes = block_hashes(tokens, T, extra_keys=(tenant,))
        k = led.lookup(hashes, tenant=tenant)
        if k:
            led.share(r, hashes[:k], tenant=tenant)
        if k < len(hashes):
            led.reserve(r, len(hashes) - k, tenant=tenant)
            led.commit(r, step, len(hashes) - k)
        led.seal_step(step)
        led.complete_step(step, 0)
        if k < len(hashes):
            led.publish(r, hashes[k:], tokens[k * T:], start=k, parent_hash=hashes[k - 1] if k else None)
        led.finish(r)
        if rng.random() < 0.2 and led.cached_count:
            led.evict(1)
    led.seal_step(steps)


def collect(sub, last: int, timeout: float = 30.0) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while (not out or int.from_bytes(out[-1][1], "big") < last) and time.monotonic() < deadline:
        if sub.poll(100):
            out.append(sub.recv_multipart())
    return out


def _connected(pub: KVEventPublisher, sub) -> None:
    """Publish probe batches (AllBlocksCleared) until one reaches ``sub``; drain them."""
    deadline = time.monotonic() + 30
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the subscriber never got a batch"
        pub.publish_nowait(KVEventBatchMap(0.0, (AllBlocksClearedMap(),), 0))
    while sub.poll(100):
        sub.recv_multipart()


# ---------------------------------------------------------------------- Dynamo


def _stream(ctx, **kw) -> tuple[list[list[bytes]], KVEventPublisher]:
    """Every PUB message of a run (subscribed before the first one leaves)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", replay_endpoint="tcp://127.0.0.1:0", **kw).start()
    try:
        _connected(pub, sub)
        first = pub.statistics().last_seq + 1
        led = Ledger(G, observer=pub.observe)
        drive(led)
        last = pub.flush() or pub.statistics().last_seq
        assert pub.wait_sent(last, 30)
        msgs = [m for m in collect(sub, last) if int.from_bytes(m[1], "big") >= first]
    finally:
        sub.close(linger=0)
    return msgs, pub


def test_dynamo_rules_hold_for_the_default_stream(ctx):
    msgs, pub = _stream(ctx)
    try:
        problems = [p for m in msgs for p in dynamo_problems(m)]
        assert msgs and not problems
    finally:
        pub.stop()
    raw, pub = _stream(ctx, hashes="raw")  # the ledger's 16-byte hashes: what cc956ad sent by default
    pub.stop()
    assert any(p.startswith("D4") for m in raw for p in dynamo_problems(m))


def test_dynamo_reads_legacy_replay_answers(ctx):
    msgs, pub = _stream(ctx, replay_format="legacy")
    d = ctx.socket(zmq.DEALER)
    d.connect(pub.replay_endpoint)
    try:
        d.send_multipart([b"", seq_bytes(0)])
        answers = []
        while True:
            assert d.poll(10_000)
            frames = d.recv_multipart()[1:]
            if frames == [SEQ_END, b""]:  # D6: the legacy end marker
                break
            assert len(frames) == 2 and len(frames[0]) == 8  # D6: [seq, payload]
            answers.append(frames)
        assert answers and not [p for seq, payload in answers for p in dynamo_problems([b"", seq, payload])]
    finally:
        d.close(linger=0)
        pub.stop()


# ---------------------------------------------------------------------- llm-d


def test_llmd_rules_hold_in_centralized_mode_with_replay(ctx):
    index = LlmdIndex()
    sub = ctx.socket(zmq.SUB)  # L7: the indexer binds; the engine connects (vLLM's rule: no wildcard)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", replay_endpoint="tcp://127.0.0.1:0",
                           topic="kv@pod-0@llama-3-8b").start()
    d = ctx.socket(zmq.DEALER)
    d.connect(pub.replay_endpoint)
    try:
        assert not pub.binds
        _connected(pub, sub)  # the probes are part of the stream (seq 0 on): the replay brings them too
        led = Ledger(G, observer=pub.observe)
        drive(led)
        last = pub.flush() or pub.statistics().last_seq
        assert pub.wait_sent(last, 30)
        live = collect(sub, last)
        d.send_multipart([b"", seq_bytes(0)])  # L6: the whole run again, with the topic frame
        replayed = []
        while True:
            assert d.poll(10_000)
            frames = d.recv_multipart()[1:]
            if frames == [b"", SEQ_END, b""]:
                break
            assert frames[0] == b"kv@pod-0@llama-3-8b"
            replayed.append(frames)
        for frames in replayed:  # a late indexer rebuilds from the replay alone
            index.apply(frames)
        assert live and [m[1] for m in live] == [m[1] for m in replayed[-len(live):]]
    finally:
        d.close(linger=0)
        sub.close(linger=0)
        pub.stop()
    assert not index.problems and index.models == {"llama-3-8b"}
    assert len(replayed) == last + 1 and index.engine_to_key


def test_llmd_keeps_equal_prefixes_of_two_tenants_apart(ctx):
    """L5: the two tenants publish blocks of the same tokens; with the tenant in extra_keys they
    are two keys in the index (a router never sends one tenant to the other's cache); had the
    events no extra keys, they would be one."""
    msgs, pub = _stream(ctx, topic="kv@pod-0@m")
    pub.stop()
    index = LlmdIndex()
    index.next_seq["pod-0"] = int.from_bytes(msgs[0][1], "big")  # after the connection probes
    for m in msgs:
        index.apply(m)
    assert not index.problems
    stored = [ev for m in msgs for ev in msgspec.msgpack.decode(m[2])[1] if ev["type"] == "BlockStored"]
    by_tokens: dict[tuple, set] = {}
    for ev in stored:
        size = ev["block_size"]
        chunk = tuple(ev["token_ids"][:size])
        if ev["parent_block_hash"] is None:  # first blocks of a prompt: equal tokens across tenants
            by_tokens.setdefault(chunk, set()).add(tuple(ev["extra_keys"][0]))
    shared_first_blocks = [c for c, tenants in by_tokens.items() if len(tenants) == 2]
    assert shared_first_blocks  # the workload did put equal prefixes in both tenants
    for chunk in shared_first_blocks:
        keys = {LlmdIndex.key(None, list(chunk), [t]) for t in ("acme", "globex")}
        assert len(keys) == 2 and LlmdIndex.key(None, list(chunk), None) not in keys
