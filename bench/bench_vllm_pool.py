"""kvledger's ``Ledger`` beside vLLM 0.33.0's and 0.34.0's own ``BlockPool`` and a plain pool, in one run.

vLLM's ``vllm/v1/core/block_pool.py`` and ``kv_cache_utils.py`` are read at run
time out of each version's source distribution (``tests/support/upstream.py``: a cache folder,
``$KVLEDGER_UPSTREAM_CACHE`` or ``~/.cache/kvledger/upstream``, filled from the
package registry once; never committed). Both versions are timed in the same run,
as two sides (``vllm`` and ``vllm034``); ``--vllm 0.33.0`` times one. The modules they import (the config,
the logger, the KV-event structs, the request, ...) are replaced by empty stubs
here: none of them runs on the paths timed (KV events and metrics are off, as
vLLM's defaults). Without the cached files and without a registry, the module
reports itself skipped.

Part 1, the serving trace (``serving_trace.py``: 8 requests growing in chunks
of 1-16 blocks, 200,000 allocations, freed lifo or random, caching off and on,
at 10,000 and 1,048,576 blocks), driven through three sides:

    vllm     BlockPool(num_blocks + 1) (its block 0 is the null block), with the
             bookkeeping vLLM's KV cache manager does around it: a block list per
             request, the lookup loop of ``find_longest_cache_hit`` (one
             ``get_cached_block`` per hash), ``touch`` of the hit,
             ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks`` of the
             request's blocks tail first
    plain    a list free stack, refcounts, hash -> block, an LRU of cached blocks,
             a block list per request: no checks, no events
    kvledger ``Ledger``: ``lookup`` + ``share``, ``allocate`` (reserve + commit:
             two events), ``publish``, ``finish``, and per step ``seal_step`` +
             ``complete_step`` (what an engine records); every command validated,
             every event folded
    kvledger_sink  the same with every event recorded: a sink that appends each
             event to a list (the least a durable log costs the command: with
             its encoding on the writer thread, the log's sink is an append)

An untimed pass first replays the trace through every side op by op and checks
that each lookup hits what the trace's model says, that the ledger evicted
exactly the blocks the model evicted, the ledger's invariants, and that every
side ends with every block free or cached. Timing: ``_common.interleaved_segments``
(segments of 2,000 ops, sides alternated per segment, the collector off, best
per segment over repeats after a discarded warm-up). Figures: block-ops/s
(blocks allocated, freed, shared, published and probed) and
``kvledger / vLLM`` = vLLM time / kvledger time (higher is better for kvledger;
target >= 1.2), for kvledger alone and with the recording sink.

Part 2, per operation (each a batch of calls timed together, per call; cases
alternated, best of repeats):

    allocate(1)            get_new_blocks(1)               allocate(r, step, 1)
    free 1 block           free_blocks([b])                finish(r) of a 1-page request
    lookup hit             get_cached_block(h, [0])        lookup((h,))
    touch a cached block   touch([b]) (ref 0, in the queue) share(r, (h,))
    lookup + touch         get_cached_block + touch        lookup((h,)) + share(r, (h,))
    publish 1 block        cache_full_blocks(req, 1 block) publish(r, (h,), tokens) (1-block requests)
    allocate(1), evicting  get_new_blocks(1) of a cached   allocate(r, step, 1) when only
                           block                           cached pages are left
    bulk 64 / 256          get_new_blocks(n) + free_blocks allocate(r, step, n) + finish(r)
    <row>, events to a     as <row>                        as <row>, on a ledger whose recording
      sink (allocate(1), free, touch, publish, evicting, bulk 64)   sink gets every event

Targets: ledger / vLLM time per op <= 1.5 for allocate(1), free, lookup hit and
touch.

    python bench/bench_vllm_pool.py [--quick] [--json PATH] [--only trace|ops]
                                    [--blocks 10000,1048576]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
if _REPO not in sys.path:  # last: tests.support.upstream only (an installed or mapped kvledger comes first)
    sys.path.append(_REPO)

from _common import fmt_rate, interleaved, interleaved_segments, print_table  # noqa: E402
from serving_trace import (  # noqa: E402
    ADMIT,
    ALLOC,
    FREE,
    ORDERS,
    PUBLISH,
    SEAL,
    Trace,
    block_ops,
    make_trace,
    token_ids,
)

from kvledger import Geometry, Ledger, check_invariants  # noqa: E402
from kvledger.core.events.events import PagesEvicted  # noqa: E402

PAGE_TOKENS = 16
BLOCKS = (10_000, 1 << 20)
SEGMENT_OPS = 2_000
ALLOCATIONS, QUICK_ALLOCATIONS = 200_000, 40_000
PER_OP_CALLS = 2_000
SINK_ROW = ", events to a sink"
OP_ROWS = ("allocate(1)", "free 1 block", "lookup hit", "touch cached", "lookup + touch", "publish 1 block",
           "allocate(1) evicting", "bulk 64", "bulk 256",
           *(row + SINK_ROW for row in ("allocate(1)", "free 1 block", "lookup hit", "touch cached",
                                        "publish 1 block", "allocate(1) evicting", "bulk 64")))
# Issue 30's targets: with a recording sink, >= 1.2 x vLLM 0.33 and >= 1.0 x vLLM 0.34 on the trace,
# caching off and on; per op (allocate(1), free, lookup, touch, publish) <= 1.5 x vLLM 0.33.
TARGETS = {
    **{f"op_{key}_sink_ratio": ("<=", 1.5) for key in ("allocate1", "free1", "lookup", "touch", "publish1")},
    **{f"trace_{b}_{c}_sink_ratio": (">=", 1.2) for b in ("10k", "1m") for c in ("off", "on")},
    **{f"trace_{b}_{c}_sink_ratio_034": (">=", 1.0) for b in ("10k", "1m") for c in ("off", "on")},
}


class CheckError(AssertionError):
    """A side disagreed with the trace or with itself: the figures would be meaningless."""


# --------------------------------------------------------------------------- vLLM's own code

_STUBBED = (
    "vllm", "vllm.envs", "vllm.config", "vllm.logger", "vllm.multimodal", "vllm.multimodal.utils",
    "vllm.utils", "vllm.utils.hashing", "vllm.utils.math_utils", "vllm.utils.gc_utils", "vllm.distributed",
    "vllm.distributed.kv_events", "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_metrics",
    "vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_spec_registry", "vllm.v1.request", "vllm.v1.utils",
    "vllm.v1.token_buffer",
)
_STUB_VALUES = {
    "vllm.envs": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": False},
    "vllm.logger": {"init_logger": logging.getLogger},
    "vllm.distributed.kv_events": {"MEDIUM_GPU": "GPU"},
    "vllm.utils.math_utils": {"cdiv": lambda a, b: -(-a // b)},
    "vllm.utils.gc_utils": {"gc_untrack": lambda obj: obj},  # (0.34: a dict the collector skips; same dict here)
}
VLLM_VERSIONS = ("0.33.0", "0.34.0")


def _stub(name: str) -> types.ModuleType:
    """An empty module: any other name it is asked for is a fresh placeholder class."""
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so submodules import
    mod.__dict__.update(_STUB_VALUES.get(name, {}))

    def __getattr__(attr: str):  # noqa: N807 (PEP 562)
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = type(attr, (), {"__init__": lambda self, *a, **k: None})
        setattr(mod, attr, value)
        return value

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


def _core_file(name: str, version: str):
    """``vllm/v1/core/<name>.py`` of vLLM ``version``, out of its source distribution."""
    from tests.support.upstream import source_file

    return source_file(f"vllm/v1/core/{name}.py", version)


def load_block_pool(version: str = "0.33.0") -> types.ModuleType:
    """vLLM ``version``'s ``vllm.v1.core.block_pool`` module, loaded from the cached source
    files with stubs for what it imports. Raises ``UpstreamUnavailable`` when the files are
    not cached and the registry cannot be reached. Leaves ``sys.modules`` as it found it."""
    files = {name: _core_file(name, version) for name in ("kv_cache_utils", "block_pool")}
    saved = {name: sys.modules.get(name) for name in (*_STUBBED, "vllm.v1.core.kv_cache_utils",
                                                      "vllm.v1.core.block_pool")}
    try:
        for name in _STUBBED:
            sys.modules[name] = _stub(name)
        for name, path in files.items():
            full = f"vllm.v1.core.{name}"
            spec = importlib.util.spec_from_file_location(full, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module
            spec.loader.exec_module(module)
        return sys.modules["vllm.v1.core.block_pool"]
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


class _Request:
    """What ``BlockPool.cache_full_blocks`` reads of a request with KV events off."""

    __slots__ = ("block_hashes", "request_id")

    def __init__(self, request_id: int, block_hashes: list) -> None:
        self.request_id = request_id
        self.block_hashes = block_hashes


def _nothing(*args: Any) -> None:
    return None


# --------------------------------------------------------------------------- the three sides


class Side(NamedTuple):
    """``prepare(trace)`` -> ops in this side's form (untimed, once); ``build(trace)`` ->
    ``(calls, handle)`` on a fresh pool, ``calls[code](*args)`` per op (an ADMIT returns the
    blocks it hit); ``state(handle)`` -> (free + cached blocks, live requests)."""

    prepare: Callable[[Trace], list]
    build: Callable[[Trace], tuple]
    state: Callable[[Any], tuple]


def _vllm_prepare(trace: Trace) -> list:
    """The vLLM side's ops: a request object (block hashes as vLLM's ``Request`` keeps them)
    per request, built before the clock."""
    hashes: dict[int, list] = {}
    reqs: dict[int, _Request] = {}
    out = []
    for code, args in trace.ops:
        if code == ADMIT:
            r, probe, hit = args
            hashes[r] = list(probe[:hit])
            reqs[r] = _Request(r, hashes[r])
            out.append((code, (r, probe)))
        elif code == PUBLISH:
            r, start, hs, _ = args
            if len(hashes[r]) != start:
                raise CheckError(f"request {r} publishes from block {start} with {len(hashes[r])} hashed")
            hashes[r].extend(hs)
            out.append((code, (r, reqs[r], start, start + len(hs))))
        else:
            out.append((code, args))
    return out


def _vllm_build(pool_module) -> Callable[[Trace], tuple]:
    BlockPool = pool_module.BlockPool

    def build(trace: Trace) -> tuple:
        pool = BlockPool(trace.num_blocks + 1, enable_caching=trace.caching, hash_block_size=trace.page_tokens)
        tables: dict[int, list] = {}
        get_cached_block, touch = pool.get_cached_block, pool.touch
        get_new_blocks, free_blocks, cache_full_blocks = pool.get_new_blocks, pool.free_blocks, pool.cache_full_blocks
        groups = [0]
        block_size = trace.page_tokens

        def admit(r, probe):
            hit = []
            for h in probe:  # find_longest_cache_hit, one group
                blocks = get_cached_block(h, groups)
                if blocks is None:
                    break
                hit.append(blocks[0])
            touch(hit)
            tables[r] = hit
            return len(hit)

        def alloc(r, step, n):
            blocks = get_new_blocks(n)
            table = tables.get(r)
            if table is None:
                tables[r] = blocks
            else:
                table += blocks

        def publish(r, req, start, end):
            cache_full_blocks(req, tables[r], start, end, block_size, 0)

        def free(r):
            free_blocks(reversed(tables.pop(r)))

        calls = [None] * 5
        calls[ADMIT], calls[ALLOC], calls[PUBLISH], calls[FREE], calls[SEAL] = admit, alloc, publish, free, _nothing
        return tuple(calls), (pool, tables)

    return build


def _vllm_state(handle) -> tuple:
    pool, tables = handle
    return pool.get_num_free_blocks(), len(tables)


class PlainPool:
    """The yardstick: a list free stack, refcounts, hash -> block, an LRU of cached blocks,
    a block list per request. No checks, no events, no steps."""

    __slots__ = ("block_of", "free", "hash_of", "lru", "ref", "tables")

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref = [0] * num_blocks
        self.block_of: dict = {}
        self.hash_of: dict = {}
        self.lru: OrderedDict = OrderedDict()
        self.tables: dict[int, list[int]] = {}

    def admit(self, r: int, probe: tuple) -> int:
        block_of, ref, lru = self.block_of, self.ref, self.lru
        table = self.tables[r] = []
        for h in probe:
            b = block_of.get(h)
            if b is None:
                break
            if ref[b] == 0:
                del lru[b]
            ref[b] += 1
            table.append(b)
        return len(table)

    def alloc(self, r: int, step: int, n: int) -> list[int]:
        free = self.free
        short = n - len(free)
        if short > 0:
            lru, block_of, hash_of = self.lru, self.block_of, self.hash_of
            for _ in range(short):  # evict the least recently used cached blocks
                b, _ = lru.popitem(last=False)
                del block_of[hash_of.pop(b)]
                free.append(b)
        pages = free[: -n - 1 : -1]
        del free[-n:]
        ref = self.ref
        for b in pages:
            ref[b] = 1
        table = self.tables.get(r)
        if table is None:
            self.tables[r] = pages
        else:
            table += pages
        return pages

    def publish(self, r: int, start: int, hashes: tuple, tokens: tuple) -> None:
        block_of, hash_of = self.block_of, self.hash_of
        for b, h in zip(self.tables[r][start : start + len(hashes)], hashes, strict=True):
            block_of[h] = b
            hash_of[b] = h

    def finish(self, r: int) -> None:
        ref, lru, hash_of, free = self.ref, self.lru, self.hash_of, self.free
        for b in reversed(self.tables.pop(r)):
            k = ref[b] - 1
            ref[b] = k
            if k == 0:
                if b in hash_of:
                    lru[b] = None
                else:
                    free.append(b)


def _plain_build(trace: Trace) -> tuple:
    pool = PlainPool(trace.num_blocks)
    calls = [None] * 5
    calls[ADMIT], calls[ALLOC], calls[PUBLISH], calls[FREE], calls[SEAL] = (
        pool.admit, pool.alloc, pool.publish, pool.finish, _nothing)
    return tuple(calls), pool


def _plain_prepare(trace: Trace) -> list:
    return [(code, args[:2]) if code == ADMIT else (code, args) for code, args in trace.ops]


def _plain_state(pool: PlainPool) -> tuple:
    return len(pool.free) + len(pool.lru), len(pool.tables)


def _ledger_build(trace: Trace, **kwargs) -> tuple:
    L = Ledger(Geometry(num_pages=trace.num_blocks, page_tokens=trace.page_tokens), **kwargs)
    lookup, share, publish_, seal_step, complete_step = L.lookup, L.share, L.publish, L.seal_step, L.complete_step

    def admit(r, probe):
        k = lookup(probe)
        if k:
            share(r, probe if k == len(probe) else probe[:k])
        return k

    def publish(r, start, hashes, tokens):
        publish_(r, hashes, tokens, start=start)

    def seal(step):
        seal_step(step)
        complete_step(step, 0)

    calls = [None] * 5
    calls[ADMIT], calls[ALLOC], calls[PUBLISH], calls[FREE], calls[SEAL] = admit, L.allocate, publish, L.finish, seal
    return tuple(calls), L


def _ledger_state(L: Ledger) -> tuple:
    return L.free_count + L.cached_count, len(L.state.requests)


SINK_KINDS = {
    "journal": "an EventList journal: every event kept in a list the ledger appends to itself",
    "callable": "a callable sink: sink(seq, event) appends the event to a list",
}
SINK = ["journal"]  # which recording sink the "+ sink" side and rows use (``--sink``)


def _event_list():
    """``kvledger.core.journal.EventList``, or None for a kvledger without journals (an older tree,
    timed for a before/after figure: its ``Ledger`` takes callable sinks only)."""
    from kvledger.core import ledger

    if getattr(ledger, "Journal", None) is None:
        return None
    from kvledger.core.journal import EventList

    return EventList


def sink_kind() -> str:
    return SINK[0] if SINK[0] == "callable" or _event_list() is not None else "callable"


def recording_sink() -> tuple[Any, list]:
    """A sink that records every event, and the list it records them in: an ``EventList`` journal
    (the ledger appends each event to its list itself, the durable log's face), or with
    ``--sink callable`` (or a kvledger without journals) a callable that appends each event
    (``sink(seq, event)``: a call per event)."""
    if sink_kind() == "journal":
        journal = _event_list()()  # type: ignore[misc]
        return journal, journal.events
    events: list = []
    append = events.append

    def sink(seq: int, event: object) -> None:
        append(event)

    return sink, events


def _sunk_build(trace: Trace, **kwargs) -> tuple:
    """The kvledger side with every event recorded: a ``recording_sink`` attached."""
    sink, events = recording_sink()
    calls, L = _ledger_build(trace, sink=sink, **kwargs)
    return calls, (L, events)


def _sunk_state(handle) -> tuple:
    return _ledger_state(handle[0])


VLLM_SIDES = {"0.33.0": "vllm", "0.34.0": "vllm034"}  # version -> side name
SIDE_NAMES = ("vllm", "vllm034", "plain", "kvledger", "kvledger_sink")


def make_sides(pools: dict) -> dict[str, Side]:
    """The sides, one per vLLM version in ``pools`` (version -> its ``block_pool`` module)."""
    sides = {VLLM_SIDES[v]: Side(_vllm_prepare, _vllm_build(m), _vllm_state) for v, m in pools.items()}
    sides.update({
        "plain": Side(_plain_prepare, _plain_build, _plain_state),
        "kvledger": Side(_plain_prepare, _ledger_build, _ledger_state),
        "kvledger_sink": Side(_plain_prepare, _sunk_build, _sunk_state),
    })
    return sides


# --------------------------------------------------------------------------- the trace, checked and timed


def verify(trace: Trace, sides: dict[str, Side], prepared: dict[str, list]) -> dict:
    """Untimed: every side op by op. Raises ``CheckError`` if a lookup hits other than the
    trace's model says, if the ledger evicts other blocks than the model, breaks an invariant
    or folds another number of events, or if a side does not end with every block back."""
    evicted = [0]

    def observe(seq, event, effects):
        if type(event) is PagesEvicted:
            evicted[0] += len(event.page_ids)

    built = {name: side.build(trace) for name, side in sides.items() if name != "kvledger"}
    built["kvledger"] = _ledger_build(trace, observer=observe)
    L = built["kvledger"][1]
    half = len(trace.ops) // 2
    for i, (code, args) in enumerate(trace.ops):
        for name, (calls, _) in built.items():
            got = calls[code](*prepared[name][i][1])
            if code == ADMIT and got != args[2]:
                raise CheckError(f"op {i} admit of request {args[0]}: {name} hit {got} blocks, "
                                 f"the trace says {args[2]}")
        if i == half:
            check_invariants(L.state)
    check_invariants(L.state)
    if evicted[0] != trace.evicted:
        raise CheckError(f"the ledger evicted {evicted[0]} blocks, the trace's model {trace.evicted}")
    sunk, events = built["kvledger_sink"][1]
    if len(events) != sunk.seq or sunk.digest() != L.digest():
        raise CheckError(f"the ledger with a sink recorded {len(events)} of {sunk.seq} events, or its state "
                         "differs from the ledger without one")
    end = (trace.num_blocks, 0)
    for name, (_, handle) in built.items():
        if sides[name].state(handle) != end:
            raise CheckError(f"{name} ended with {sides[name].state(handle)} (free + cached, requests), not {end}")
    return {"events": L.seq - 1}


def _split(ops: list, n: int) -> list:
    k = len(ops)
    return [ops[i * k // n : (i + 1) * k // n] for i in range(n)]


def _timed_side(side: Side, trace: Trace, ops: list, n_segments: int):
    segments = _split(ops, n_segments)

    def build():
        calls, handle = side.build(trace)

        def segment(i: int) -> None:
            for code, args in segments[i]:
                calls[code](*args)

        def check() -> None:
            if side.state(handle) != (trace.num_blocks, 0):
                raise CheckError("a timed run did not end with every block back")

        return segment, check

    return build


def _suffix(side: str) -> str:
    """Figure-name suffix of a vLLM side: "" for 0.33 (the pin), "_034" for 0.34."""
    return "" if side == "vllm" else "_" + side[len("vllm"):]


def run_trace(pools: dict, blocks: int, caching: bool, order: str, allocations: int, repeats: int) -> dict:
    """Generate, verify and time one trace on every side. Returns its figures (unprefixed)."""
    trace = make_trace(blocks, caching=caching, order=order, allocations=allocations)
    sides = make_sides(pools)
    prepared = {name: side.prepare(trace) for name, side in sides.items()}
    checked = verify(trace, sides, prepared)
    n_segments = max(1, len(trace.ops) // SEGMENT_OPS)
    builders = {name: _timed_side(side, trace, prepared[name], n_segments) for name, side in sides.items()}
    t = interleaved_segments(builders, n_segments, repeats)
    ops = block_ops(trace)
    out: dict = {"ops": len(trace.ops), "block_ops": ops, "allocs": trace.allocs, "events": checked["events"],
                 "hit_rate": trace.hits / trace.probed if trace.probed else 0.0}
    for name in sides:
        out[f"{name}_s"] = t[name].best
        out[f"{name}_block_ops_per_s"] = ops / t[name].best
        out[f"{name}_spread"] = t[name].runs.spread
    led, sunk = t["kvledger"], t["kvledger_sink"]
    for side in (VLLM_SIDES[v] for v in pools):
        vl, x = t[side], _suffix(side)
        out["ratio" + x] = vl.best / led.best
        paired = [v / k for v, k in zip(vl.runs.samples, led.runs.samples, strict=True)]
        out["ratio_run_median" + x] = statistics.median(paired)
        out["sink_ratio" + x] = vl.best / sunk.best
        paired = [v / k for v, k in zip(vl.runs.samples, sunk.runs.samples, strict=True)]
        out["sink_ratio_run_median" + x] = statistics.median(paired)
        out["plain_ratio" + x] = vl.best / t["plain"].best
    return out


# --------------------------------------------------------------------------- per operation


def _per_call(body: Callable[[], None], calls: int) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        body()
        return (time.perf_counter() - t0) / calls
    finally:
        gc.enable()


def _hash(i: int) -> bytes:
    return (3 << 248 | i).to_bytes(32, "big")


def _op_cases(pool_module, row: str, k: int) -> dict[str, Callable[[], float]]:
    """The vLLM and kvledger cases of one per-op row: each builds its fixture (untimed), then
    times ``k`` calls and returns seconds per call."""
    BlockPool = pool_module.BlockPool
    num = 4 * k + 1024
    geometry = Geometry(num_pages=num, page_tokens=PAGE_TOKENS)
    tok = token_ids(1)
    group = [0]
    sunk = row.endswith(SINK_ROW)  # the same row with every event recorded (vLLM's side unchanged)
    if sunk:
        row = row[: -len(SINK_ROW)]

    def ledger() -> Ledger:
        return Ledger(geometry, sink=recording_sink()[0]) if sunk else Ledger(geometry)

    def vpool(caching: bool = False):
        return BlockPool(num + 1, enable_caching=caching, hash_block_size=PAGE_TOKENS)

    def cached_vllm(n: int):
        """A caching pool with ``n`` cached free blocks (hashes _hash(i)) and nothing else free."""
        pool = vpool(True)
        blocks = pool.get_new_blocks(num)
        req = _Request(0, [_hash(i) for i in range(n)])
        pool.cache_full_blocks(req, blocks, 0, n, PAGE_TOKENS, 0)
        pool.free_blocks(blocks[n:])  # uncached: free, ahead of the cached ones
        pool.free_blocks(reversed(blocks[:n]))
        return pool, blocks[:n]

    def cached_ledger(n: int, *, fill: bool = False):
        """A ledger with ``n`` cached pages (hashes _hash(i)); ``fill``: no free page left."""
        L = ledger()
        L.allocate(1, 0, num)
        L.seal_step(0)
        L.complete_step(0, 0)
        hashes = tuple(_hash(i) for i in range(n))
        L.publish(1, hashes, token_ids(n), start=0)
        L.finish(1)  # n cached, the rest free
        if fill:
            L.allocate(2, 1, num - n)
        return L, hashes

    if row == "allocate(1)":
        def v():
            pool = vpool()
            get = pool.get_new_blocks
            return _per_call(lambda: [get(1) for _ in range(k)], k)

        def led():
            L = ledger()
            alloc = L.allocate
            return _per_call(lambda: [alloc(7, 0, 1) for _ in range(k)], k)
    elif row == "free 1 block":
        def v():
            pool = vpool()
            blocks = [pool.get_new_blocks(1) for _ in range(k)]
            free = pool.free_blocks
            return _per_call(lambda: [free(b) for b in blocks], k)

        def led():
            L = ledger()
            for r in range(k):
                L.allocate(r, 0, 1)
            finish = L.finish
            return _per_call(lambda: [finish(r) for r in range(k)], k)
    elif row == "lookup hit":
        def v():
            pool, _ = cached_vllm(k)
            get = pool.get_cached_block
            keys = [_hash(i) for i in range(k)]
            return _per_call(lambda: [get(h, group) for h in keys], k)

        def led():
            L, hashes = cached_ledger(k)
            lookup = L.lookup
            keys = [(h,) for h in hashes]
            return _per_call(lambda: [lookup(h) for h in keys], k)
    elif row == "touch cached":
        def v():
            pool, blocks = cached_vllm(k)
            touch = pool.touch
            one = [[b] for b in blocks]
            return _per_call(lambda: [touch(b) for b in one], k)

        def led():
            L, hashes = cached_ledger(k)
            L.allocate(9, 1, 1)  # the sharing request exists
            share = L.share
            keys = [(h,) for h in hashes]
            return _per_call(lambda: [share(9, h) for h in keys], k)
    elif row == "lookup + touch":
        def v():
            pool, _ = cached_vllm(k)
            get, touch = pool.get_cached_block, pool.touch
            keys = [_hash(i) for i in range(k)]

            def body():
                for h in keys:
                    touch(get(h, group))

            return _per_call(body, k)

        def led():
            L, hashes = cached_ledger(k)
            L.allocate(9, 1, 1)  # the sharing request exists
            lookup, share = L.lookup, L.share
            keys = [(h,) for h in hashes]

            def body():
                for h in keys:
                    if lookup(h):
                        share(9, h)

            return _per_call(body, k)
    elif row == "publish 1 block":
        def v():
            pool = vpool(True)
            tables = [pool.get_new_blocks(1) for _ in range(k)]
            reqs = [_Request(i, [_hash(i)]) for i in range(k)]
            cache = pool.cache_full_blocks
            return _per_call(lambda: [cache(reqs[i], tables[i], 0, 1, PAGE_TOKENS, 0) for i in range(k)], k)

        def led():
            L = ledger()
            for r in range(k):
                L.allocate(r, 0, 1)
            L.seal_step(0)
            L.complete_step(0, 0)
            publish = L.publish
            keys = [(_hash(i),) for i in range(k)]
            return _per_call(lambda: [publish(i, keys[i], tok, start=0) for i in range(k)], k)
    elif row == "allocate(1) evicting":
        def v():
            pool, _ = cached_vllm(k)
            pool.get_new_blocks(num - k)  # only the cached blocks are left
            get = pool.get_new_blocks
            return _per_call(lambda: [get(1) for _ in range(k)], k)

        def led():
            L, _ = cached_ledger(k, fill=True)
            alloc = L.allocate
            return _per_call(lambda: [alloc(7, 2, 1) for _ in range(k)], k)
    elif row in ("bulk 64", "bulk 256"):
        n = int(row.split()[1])
        reps = max(1, k // n)

        def v():
            pool = vpool()
            get, free = pool.get_new_blocks, pool.free_blocks

            def body():
                for _ in range(reps):
                    free(get(n))

            return _per_call(body, reps)

        def led():
            L = ledger()
            alloc, finish = L.allocate, L.finish

            def body():
                for r in range(reps):
                    alloc(r, 0, n)
                    finish(r)

            return _per_call(body, reps)
    else:
        raise ValueError(f"unknown per-op row {row!r}")
    return {"vllm": v, "kvledger": led}


OP_KEYS = {"allocate(1)": "allocate1", "free 1 block": "free1", "lookup hit": "lookup", "touch cached": "touch",
           "lookup + touch": "hit", "publish 1 block": "publish1", "allocate(1) evicting": "evict1",
           "bulk 64": "bulk64", "bulk 256": "bulk256"}
OP_KEYS.update({row + SINK_ROW: key + "_sink" for row, key in list(OP_KEYS.items())})


def _op_row(pools: dict, row: str, k: int) -> dict[str, Callable[[], float]]:
    """One per-op row's cases: each vLLM version's and kvledger's."""
    cases: dict[str, Callable[[], float]] = {}
    for version, module in pools.items():
        c = _op_cases(module, row, k)
        cases[VLLM_SIDES[version]] = c["vllm"]
        cases.setdefault("kvledger", c["kvledger"])
    return cases


def run_ops(pools: dict, repeats: int, calls: int = PER_OP_CALLS) -> tuple[dict, list]:
    figures: dict = {}
    rows = []
    vsides = [VLLM_SIDES[v] for v in pools]
    for row in OP_ROWS:
        t = interleaved(_op_row(pools, row, calls), repeats)
        led = t["kvledger"].best
        key = OP_KEYS[row]
        figures[f"op_{key}_kvledger_us"] = led * 1e6
        cells = []
        for side in vsides:
            v, x = t[side].best, _suffix(side)
            figures[f"op_{key}_vllm{x}_us"] = v * 1e6
            figures[f"op_{key}_ratio{x}"] = led / v
            cells.append(f"{v * 1e6:.3f}")
        cells.append(f"{led * 1e6:.3f}")
        cells += [f"{led / t[side].best:.2f}" for side in vsides]
        rows.append((row, *cells))
    return figures, rows


# --------------------------------------------------------------------------- run


def _label(blocks: int) -> str:
    return "1m" if blocks >= 1 << 20 else f"{blocks // 1000}k"


def run(quick: bool, *, only: str | None = None, blocks: tuple[int, ...] = BLOCKS,
        caching: tuple[bool, ...] = (False, True), versions: tuple[str, ...] = VLLM_VERSIONS) -> dict:
    """The serving trace and the per-op table; prints both. Skipped without vLLM's files."""
    from tests.support.upstream import UpstreamUnavailable

    try:
        pools = {v: load_block_pool(v) for v in versions}
    except UpstreamUnavailable as exc:
        return {"skipped": f"vLLM's files are not cached and the registry is unreachable: {exc}"}
    repeats = 3 if quick else 5
    allocations = QUICK_ALLOCATIONS if quick else ALLOCATIONS
    vsides = [VLLM_SIDES[v] for v in versions]
    names = {side: f"vLLM {v[:4]}" for v, side in zip(versions, vsides, strict=True)}
    figures: dict = {"repeats": repeats, "allocations": allocations, "segment_ops": SEGMENT_OPS,
                     "vllm": ", ".join(f"{v} BlockPool" for v in versions) + " (files from the sdist)",
                     "gc": "disabled while timed", "sink": SINK_KINDS[sink_kind()]}
    if only in (None, "trace"):
        rows = []
        for n in blocks:
            for cache_on in caching:
                worst: dict = {}
                for order in ORDERS:
                    f = run_trace(pools, n, cache_on, order, allocations, repeats)
                    key = f"trace_{_label(n)}_{'on' if cache_on else 'off'}_{order}"
                    figures.update({f"{key}_{k}": v for k, v in f.items()})
                    for side in vsides:
                        for what in ("ratio", "sink_ratio"):
                            name = what + _suffix(side)
                            worst[name] = min(worst.get(name, f[name]), f[name])
                    rows.append((f"{n:,}", "on" if cache_on else "off", order, f"{f['ops']:,}",
                                 *(fmt_rate(f[f"{side}_block_ops_per_s"]) for side in vsides),
                                 fmt_rate(f["plain_block_ops_per_s"]), fmt_rate(f["kvledger_block_ops_per_s"]),
                                 fmt_rate(f["kvledger_sink_block_ops_per_s"]),
                                 *(f"{f['ratio' + _suffix(side)]:.2f}" for side in vsides),
                                 *(f"{f['sink_ratio' + _suffix(side)]:.2f}" for side in vsides),
                                 f"{f['hit_rate']:.0%}"))
                for name, value in worst.items():
                    figures[f"trace_{_label(n)}_{'on' if cache_on else 'off'}_{name}"] = value
        print_table(f"serving trace: {allocations:,} allocations, 8 growing requests, chunks of 1-16 blocks "
                    f"({repeats} repeats, segments of {SEGMENT_OPS} ops), block-ops/s and ratios",
                    ("blocks", "caching", "order", "ops", *names.values(), "plain", "kvledger", "kvledger + sink",
                     *(f"kvledger / {names[s]}" for s in vsides), *(f"+ sink / {names[s]}" for s in vsides),
                     "hit rate"), rows)
        print(f"kvledger / vLLM = vLLM time / kvledger time (> 1: kvledger is faster); + sink: every event "
              f"recorded ({SINK_KINDS[sink_kind()]}); block-ops = blocks allocated, freed, shared, published, probed")
    if only in (None, "ops"):
        op_figures, rows = run_ops(pools, repeats)
        figures.update(op_figures)
        print_table(f"per operation, us per call (batches of {PER_OP_CALLS}, best of {repeats})",
                    ("operation", *names.values(), "kvledger", *(f"kvledger / {names[s]}" for s in vsides)), rows)
        print("kvledger / vLLM = kvledger time / vLLM time (< 1: kvledger is faster; target <= 1.5 x vLLM 0.33 "
              "with a sink for allocate(1), free, lookup, touch, publish)")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/bench_vllm_pool.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40,000 allocations, 3 repeats")
    parser.add_argument("--only", choices=("trace", "ops"), help="only the serving trace or only the per-op table")
    parser.add_argument("--blocks", help="comma-separated pool sizes (default 10000,1048576)")
    parser.add_argument("--caching", choices=("off", "on"), help="only the trace with caching off or on")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    parser.add_argument("--sink", choices=tuple(SINK_KINDS), default="journal",
                        help="the recording sink of the '+ sink' side and rows (default journal)")
    parser.add_argument("--vllm", help=f"comma-separated vLLM versions (default {','.join(VLLM_VERSIONS)})")
    args = parser.parse_args(argv)
    versions = tuple(args.vllm.split(",")) if args.vllm else VLLM_VERSIONS
    SINK[0] = args.sink
    blocks = tuple(int(b) for b in args.blocks.split(",")) if args.blocks else BLOCKS
    caching = (False, True) if args.caching is None else (args.caching == "on",)
    figures = run(args.quick, only=args.only, blocks=blocks, caching=caching, versions=versions)
    if "skipped" in figures:
        print(f"SKIPPED: {figures['skipped']}")
    elif TARGETS:
        for key, (op, value) in TARGETS.items():
            if key in figures:
                met = figures[key] >= value if op == ">=" else figures[key] <= value
                print(f"target {key} {op} {value}: {figures[key]:.3f} {'PASS' if met else 'MISS'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
