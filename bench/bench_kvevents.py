"""KV events: the fold's effects to vLLM-format msgpack batches (target >= 1 M events/s), and
the replay of a full buffer (batches/s).

Encode. Workload (fixed seed): 2,000 steps (500 with --quick) of 32 KV events each,
half publishes (``BlocksStored`` of 1-4 new blocks of 16 tokens, 16-byte hashes, the
newest cached block as parent) and half evictions (``BlocksRemoved`` of the 1-4 oldest
cached blocks), as the fold returns them: every removal names a block published before,
as in a serving engine's stream.
Timed segment by segment (100 slices of the steps; the cases alternate within each
slice, and each slice's best over 15 repeats is summed: ``interleaved_segments``, the
figure that resists load from other processes), after a discarded warm-up:

    kvledger   per step: ``KVEventBatcher.observe(seq, event, effects)`` for each
               effect-carrying event, then a ``StepSealed`` closes the batch, and the
               sink encodes it (``encode_batch``): effects -> structs (map layout, hashes
               folded to u64: vLLM 0.33's defaults) -> batch -> bytes, the whole path
               of a published batch but the socket
    baseline   plain ``msgspec.msgpack.encode`` of the same batches already built as
               Python lists and dicts in the wire's shape ([ts, [{"type": "BlockStored",
               ...}, ...], 0], hashes already u64): the bytes alone, with no conversion
                                                            ratio = kvledger rate / baseline rate
    structs    ``encode_batch`` of the same batches already built as kvledger structs
               (the encoding share of the kvledger path)
    step path  what the serving thread pays with a publisher: observe and the seal's
               flush of a deferred batcher (effects kept, batch stamped); building the
               structs and encoding run in the publisher's thread

The kvledger bytes are checked equal to the baseline's, batch for batch (untimed).
events/s counts KV events (one BlockStored or BlockRemoved each).

Replay. A ``KVEventPublisher`` with a full buffer (``buffer_steps`` 10,000, vLLM's
default; 2,000 with --quick) of the workload's batches on loopback TCP; a DEALER asks
for everything from seq 0 the way vLLM's subscriber does and reads until the end
marker (every seq checked). Against a baseline timed alternately in the same run: a
plain ROUTER thread answering the same request with the same frames in one blocking
loop (vLLM 0.33's own way: a full replay at once, the live stream waiting). Best of
5 (3 with --quick); batches/s = batches replayed / seconds from the request to the
marker.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections import deque

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import msgspec  # noqa: E402
from _common import fmt_rate, interleaved, interleaved_segments, print_table  # noqa: E402

from kvledger.core.events.events import BlocksRemoved, BlocksStored, StepSealed  # noqa: E402
from kvledger.core.hashing import to_u64  # noqa: E402
from kvledger.kvevents import KVEventBatcher, encode_batch  # noqa: E402

TARGETS = {"events_per_s": (">=", 1_000_000)}

PAGE_TOKENS = 16
EVENTS_PER_STEP = 32
TS = 1767225600.25
SEGMENTS = 100  # timed slices of the workload; the cases alternate per slice (_common.interleaved_segments)
_OTHER = object()  # an event that is not a seal (the batcher looks only at StepSealed / CacheConfigured)
_SEAL = StepSealed(step=0)


def make_steps(n_steps: int, seed: int = 5) -> list[list[tuple]]:
    """Per step, the effects tuples of its effect-carrying events: publishes of new blocks whose
    parent is the newest block still cached (None when none is), and evictions of the oldest
    cached blocks, as a serving engine's stream has them (a removal names a block published
    before)."""
    rng = random.Random(seed)
    live: deque[bytes] = deque()

    def h() -> bytes:
        return rng.randbytes(16)

    steps = []
    for _ in range(n_steps):
        effs: list[tuple] = []
        for i in range(EVENTS_PER_STEP):
            k = rng.randint(1, 4)
            if i % 2 == 0:
                toks = tuple(rng.randrange(150_000) for _ in range(k * PAGE_TOKENS))
                new = tuple(h() for _ in range(k))
                effs.append((BlocksStored(hashes=new, parent_hash=live[-1] if live else None, token_ids=toks,
                                          page_tokens=PAGE_TOKENS),))
                live.extend(new)
            else:
                gone = tuple(live.popleft() for _ in range(min(k, len(live))))
                effs.append((BlocksRemoved(hashes=gone),))
        steps.append(effs)
    return steps


def as_lists(steps: list[list[tuple]]) -> list[list]:
    """The same batches as plain Python lists and dicts in the wire's shape (vLLM 0.33's map
    events, u64 hashes)."""
    out = []
    for effs in steps:
        events: list = []
        for (e,) in effs:
            if type(e) is BlocksStored:
                events.append({"type": "BlockStored", "block_hashes": [to_u64(h) for h in e.hashes],
                               "parent_block_hash": None if e.parent_hash is None else to_u64(e.parent_hash),
                               "token_ids": list(e.token_ids),
                               "block_size": e.page_tokens, "lora_id": None, "medium": "GPU", "lora_name": None})
            else:
                events.append({"type": "BlockRemoved", "block_hashes": [to_u64(h) for h in e.hashes],
                               "medium": "GPU"})
        out.append([TS, events, 0])
    return out


def _drive(b: KVEventBatcher, steps: list[list[tuple]], seq: int) -> int:
    """Feed ``steps`` to a batcher as the ledger would: each effect-carrying event, then a seal."""
    observe = b.observe
    for effs in steps:
        for e in effs:
            observe(seq, _OTHER, e)
            seq += 1
        observe(seq, _SEAL, ())
        seq += 1
    return seq


def _kvledger(steps: list[list[tuple]], encode: bool, deferred: bool = False) -> list:
    """The batches (bytes when ``encode``) of ``steps``, all at once (set-up and checks)."""
    out: list = []
    sink = (lambda b: out.append(encode_batch(b))) if encode else out.append
    _drive(KVEventBatcher(sink, clock=lambda: TS, deferred=deferred), steps, 0)
    return out


def _batcher_side(segments: list, encode: bool, deferred: bool, n_steps: int, hashes: str = "u64"):
    def build():
        out: list = []
        sink = (lambda b: out.append(encode_batch(b))) if encode else out.append
        b = KVEventBatcher(sink, clock=lambda: TS, deferred=deferred, hashes=hashes)
        pos = [0]

        def segment(i: int) -> None:
            pos[0] = _drive(b, segments[i], pos[0])

        def check() -> None:
            if len(out) != n_steps:
                raise AssertionError(f"{len(out)} batches for {n_steps} steps")

        return segment, check

    return build


def _encode_side(segments: list, n_steps: int, ours: bool):
    def build():
        enc = encode_batch if ours else msgspec.msgpack.Encoder().encode
        out: list = []

        def segment(i: int) -> None:
            out.extend([enc(x) for x in segments[i]])

        def check() -> None:
            if len(out) != n_steps:
                raise AssertionError(f"{len(out)} payloads for {n_steps} steps")

        return segment, check

    return build


def _chunks(items: list, n: int) -> list:
    k = len(items)
    return [items[i * k // n:(i + 1) * k // n] for i in range(n)]


def run(quick: bool) -> dict:
    n_steps = 500 if quick else 2000
    steps = make_steps(n_steps)
    lists = as_lists(steps)
    structs = _kvledger(steps, False)
    n_events = n_steps * EVENTS_PER_STEP
    base = [msgspec.msgpack.encode(x) for x in lists]
    if _kvledger(steps, True) != base:
        raise AssertionError("kvledger's bytes differ from the plain encoding of the same batches")
    segs = SEGMENTS // 4 if quick else SEGMENTS
    sides = {
        "kvledger": _batcher_side(_chunks(steps, segs), True, False, n_steps),
        "raw hashes": _batcher_side(_chunks(steps, segs), True, False, n_steps, "raw"),
        "baseline": _encode_side(_chunks(lists, segs), n_steps, False),
        "structs": _encode_side(_chunks(structs, segs), n_steps, True),
        "step path": _batcher_side(_chunks(steps, segs), False, True, n_steps),
    }
    res = interleaved_segments(sides, segs, repeats=5 if quick else 15)
    rate = {name: n_events / t.best for name, t in res.items()}
    rows = [[name, f"{t.best * 1e3:.1f}", fmt_rate(rate[name], " ev/s"), f"{rate[name] / rate['baseline']:.2f}x",
             f"{t.best / n_events * 1e9:.0f}", f"{t.runs.best * 1e3:.1f}", f"{t.runs.spread:.0%}"]
            for name, t in res.items()]
    print_table(f"KV event batches: {n_steps} steps x {EVENTS_PER_STEP} events, "
                f"{sum(map(len, base)) / n_steps:.0f} bytes per batch; {segs} segments alternated",
                ["case", "best ms", "rate", "vs baseline", "ns/event", "best run ms", "run spread"], rows)
    figures = {
        "events": n_events,
        "bytes_per_batch": sum(map(len, base)) / n_steps,
        "events_per_s": rate["kvledger"],
        "raw_hashes_events_per_s": rate["raw hashes"],
        "baseline_events_per_s": rate["baseline"],
        "ratio": rate["kvledger"] / rate["baseline"],
        "struct_encode_events_per_s": rate["structs"],
        "step_path_ns_per_event": 1e9 / rate["step path"],
        "kvledger_run_spread": res["kvledger"].runs.spread,
        "baseline": "plain msgspec.msgpack.encode of the same batches prebuilt as lists, dicts (bytes checked equal)",
    }
    figures.update(replay(quick))
    return figures


# ---------------------------------------------------------------------- the replay of a full buffer


def _baseline_router(zmq, ctx, payloads: list[bytes], ready: threading.Event, stop: threading.Event,
                     where: list[str]) -> None:
    """vLLM 0.33's way: on a request, every buffered batch then the marker, in one blocking loop."""
    rep = ctx.socket(zmq.ROUTER)
    rep.setsockopt(zmq.SNDHWM, 2 * (len(payloads) + 1))
    rep.bind("tcp://127.0.0.1:0")
    where.append(rep.getsockopt(zmq.LAST_ENDPOINT).decode())
    ready.set()
    end = (-1).to_bytes(8, "big", signed=True)
    try:
        while not stop.is_set():
            if not rep.poll(10):
                continue
            ident, _, start = rep.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in enumerate(payloads):
                if seq >= first:
                    rep.send_multipart((ident, b"", b"", seq.to_bytes(8, "big"), payload))
            rep.send_multipart((ident, b"", b"", end, b""))
    finally:
        rep.close(linger=0)


def _read_replay(zmq, dealer, n: int) -> float:
    """Ask for everything from seq 0, read to the end marker (every seq checked); seconds."""
    end = (-1).to_bytes(8, "big", signed=True)
    t0 = time.perf_counter()
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    seq = 0
    while True:
        frames = dealer.recv_multipart()
        if frames[2] == end:
            break
        if int.from_bytes(frames[2], "big") != seq:
            raise AssertionError(f"replay gave seq {int.from_bytes(frames[2], 'big')}, expected {seq}")
        seq += 1
    took = time.perf_counter() - t0
    if seq != n:
        raise AssertionError(f"replay gave {seq} batches of {n}")
    return took


def replay(quick: bool) -> dict:
    """A full buffer replayed through a DEALER: kvledger's publisher against vLLM's one-loop way."""
    try:
        import zmq
    except ImportError:
        return {"replay_skipped": "pyzmq is not installed"}
    from kvledger.kvevents import KVEventPublisher

    n = 2000 if quick else 10_000
    built: list = []  # n batches of the encode workload's shape (its steps, cycled)
    _drive(KVEventBatcher(built.append, clock=lambda: TS), make_steps(min(n, 500)), 0)
    built = (built * (n // len(built) + 1))[:n]
    payloads = [encode_batch(x) for x in built]  # the baseline's buffer: the same bytes
    ctx = zmq.Context()
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=n,
                           max_queue=n + 1).start()
    stop, ready, where = threading.Event(), threading.Event(), []
    base = threading.Thread(target=_baseline_router, args=(zmq, ctx, payloads, ready, stop, where), daemon=True)
    base.start()
    ready.wait(30)
    dealers = {}
    try:
        for batch in built:
            pub.publish(batch, timeout=60)
        pub.wait_sent(n - 1, 60)
        for name, endpoint in (("kvledger", pub.replay_endpoint), ("baseline", where[0])):
            d = dealers[name] = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 0)
            d.connect(endpoint)
        res = interleaved({name: (lambda d=d: _read_replay(zmq, d, n)) for name, d in dealers.items()},
                          repeats=3 if quick else 5)
    finally:
        stop.set()
        base.join(30)
        for d in dealers.values():
            d.close(linger=0)
        pub.stop()
        ctx.term()
    rate = {name: n / t.best for name, t in res.items()}
    print_table(f"Replay of a full buffer: {n} batches of {sum(map(len, payloads)) / n:.0f} bytes, loopback TCP, "
                "DEALER to the end marker",
                ["case", "best ms", "batches/s", "vs baseline", "spread"],
                [[name, f"{t.best * 1e3:.1f}", fmt_rate(rate[name], "/s"), f"{rate[name] / rate['baseline']:.2f}x",
                  f"{t.spread:.0%}"] for name, t in res.items()])
    return {"replay_batches": n, "replay_batches_per_s": rate["kvledger"],
            "replay_baseline_batches_per_s": rate["baseline"], "replay_ratio": rate["kvledger"] / rate["baseline"],
            "replay_baseline": "a plain ROUTER answering in one blocking loop (vLLM 0.33's way), same frames"}


if __name__ == "__main__":
    figs = run("--quick" in sys.argv)
    for k, (op, v) in TARGETS.items():
        print(k, op, v, "measured", f"{figs[k]:.0f}")
