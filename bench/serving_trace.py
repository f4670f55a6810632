"""The serving trace: what a scheduler asks of its block allocator, generated as data.

One seeded trace, built before any clock runs, that every allocator under test
replays through its own adapter (``bench_vllm_pool.py`` drives kvledger's
``Ledger``, vLLM 0.33.0's own ``BlockPool`` and a plain list + dict pool with
it). The trace names no page ids: each side's allocator picks its pages, and
the trace says only what a scheduler decided.

Ops (``Trace.ops`` is a list of ``(code, args)``):

    ADMIT    (r, hashes, hit)   caching only: look up the block hashes of the
                                prompt's full blocks (all but its last block,
                                as vLLM's scheduler does), then share / touch
                                the ``hit`` leading blocks found (``hit`` is
                                what the trace's own model of the cache says
                                the lookup finds: a side that finds another
                                number is wrong)
    ALLOC    (r, step, n)       ``n`` new blocks for request ``r`` in ``step``
                                (vLLM's ``get_new_blocks(n)``; kvledger's
                                ``allocate(r, step, n)``); the first ALLOC of a
                                request without an ADMIT creates it
    PUBLISH  (r, start, hashes, token_ids)
                                caching only, after the step that wrote them
                                ended: blocks ``start .. start + len(hashes)``
                                of ``r``'s block table are full and may be
                                shared (vLLM's ``cache_full_blocks``;
                                kvledger's ``publish``)
    FREE     (r,)               the request finished: its blocks go back
                                (vLLM's ``free_blocks`` of its blocks, tail
                                first; kvledger's ``finish``)
    SEAL     (step,)            the step's forward pass ran (kvledger seals
                                and completes it; vLLM has no steps)

Shape (per step, until ``allocations`` allocations were made, then drain):

    admit requests while fewer than 8 are growing and at least 128 blocks are
      free or cached (evictable)
    every growing request allocates its next chunk: 1-16 blocks, capped at
      what it still needs (a request that finds too few blocks waits)
    finish done requests while fewer than 256 blocks are free or cached
      (lifo: the most recently done first; random: a random done one); at the
      end, all of them
    seal the step; then (caching) every live request publishes its blocks
      written so far, except its last (partial) block

Requests: caching off, 1-64 blocks each (vLLM's and the ledger's fixed cost per
call is what this measures). Caching on, a prompt of a shared prefix (one of
32 "system prompts" of 4-32 blocks, chosen with Zipf-like weights, for 80 % of
requests) plus 1-16 blocks of its own, then 0-32 generated blocks. Block
hashes are 32-byte values (vLLM's default sha256 hashes are 32 bytes): a
prefix block's hash is shared by every request of that prefix, every other
block's is the request's own. The trace never publishes a hash that is already
cached or held (vLLM tolerates duplicates, kvledger refuses them): a request
stops publishing at the first such block.

The model behind ``hit``: free blocks are taken before cached ones, cached
blocks are evicted least recently used first, and a finished request's hashed
blocks join the cache tail first (its last block is evicted first). That is
both vLLM's free-queue order (uncached blocks prepended, cached ones appended)
and kvledger's allocator (the free stack, then its LRU cache).

    python bench/serving_trace.py [--blocks N] [--caching] [--order lifo|random]
                                  [--allocations N]     # print the trace's counts
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import OrderedDict
from typing import NamedTuple

__all__ = [
    "ADMIT",
    "ALLOC",
    "FREE",
    "ORDERS",
    "PUBLISH",
    "SEAL",
    "SEED",
    "Trace",
    "block_ops",
    "make_trace",
    "token_ids",
]

SEED = 20261222
PAGE_TOKENS = 16
ORDERS = ("lifo", "random")
ADMIT, ALLOC, PUBLISH, FREE, SEAL = range(5)
OP_NAMES = ("admit", "alloc", "publish", "free", "seal")

MAX_GROWING = 8
CHUNK = (1, 16)
ADMIT_FREE = 128
LOW_WATER = 256
REQUEST_BLOCKS = (1, 64)  # caching off
PREFIXES = 32  # caching on: shared prompt prefixes ("system prompts")
PREFIX_BLOCKS = (4, 32)
SHARED_SHARE = 0.8  # requests that start with a shared prefix
OWN_PROMPT = (1, 16)
GENERATED = (0, 32)
HASH_BYTES = 32

_token_cache: dict[tuple[int, int], tuple[int, ...]] = {}


def token_ids(blocks: int, page_tokens: int = PAGE_TOKENS) -> tuple[int, ...]:
    """The token ids a PUBLISH of ``blocks`` blocks carries (one tuple per size, shared)."""
    key = (blocks, page_tokens)
    t = _token_cache.get(key)
    if t is None:
        t = _token_cache[key] = tuple(range(blocks * page_tokens))
    return t


class Trace(NamedTuple):
    """A generated trace and its counts (every count is what the ops hold)."""

    ops: list  # [(code, args)]
    num_blocks: int
    page_tokens: int
    caching: bool
    order: str
    requests: int
    allocs: int  # ALLOC ops
    allocated: int  # blocks allocated
    frees: int  # FREE ops
    freed: int  # blocks the FREE ops let go of (allocated + shared)
    admits: int  # ADMIT ops
    probed: int  # hashes the lookups named
    hits: int  # blocks shared (lookup hits)
    publishes: int  # PUBLISH ops
    published: int  # blocks published
    evicted: int  # cached blocks the allocations evicted (the model's count)
    steps: int


def block_ops(trace: Trace) -> int:
    """Block operations in a trace: blocks allocated, freed, shared, published and probed."""
    return trace.allocated + trace.freed + trace.hits + trace.published + trace.probed


class _Request:
    __slots__ = ("blocks", "hashes", "need", "pub", "stopped", "total")

    def __init__(self, hashes: list, total: int) -> None:
        self.hashes = hashes  # the hash every block will have, if it is published
        self.total = total  # blocks when done
        self.blocks = 0  # blocks held (shared + allocated)
        self.pub = 0  # blocks [0, pub) are hashed (shared or published)
        self.stopped = False  # met a hash already present: publishes no more
        self.need = total


def _hash(kind: int, a: int, i: int) -> bytes:
    """A 32-byte block hash: kind 1 = block i of shared prefix a, kind 2 = block i of request a."""
    return (kind << 248 | a << 32 | i).to_bytes(HASH_BYTES, "big")


def make_trace(
    num_blocks: int,
    *,
    caching: bool,
    order: str = "lifo",
    allocations: int = 200_000,
    seed: int = SEED,
    page_tokens: int = PAGE_TOKENS,
) -> Trace:
    """Generate the serving trace over ``num_blocks`` blocks (see the module docstring).

    Raises ``ValueError`` for an unknown order or a pool too small for the shape.
    Deterministic for given arguments.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    smallest = LOW_WATER + MAX_GROWING * (PREFIX_BLOCKS[1] + OWN_PROMPT[1] + GENERATED[1])
    if num_blocks < smallest:
        raise ValueError(f"num_blocks must be >= {smallest}, got {num_blocks}")
    if allocations < 1:
        raise ValueError(f"allocations must be >= 1, got {allocations}")
    rng = random.Random(f"{num_blocks}:{caching}:{order}:{allocations}:{seed}")
    randint = rng.randint
    prefixes = [[_hash(1, f, i) for i in range(randint(*PREFIX_BLOCKS))] for f in range(PREFIXES)]
    weights = [1.0 / (f + 1) for f in range(PREFIXES)]

    ops: list = []
    emit = ops.append
    free = num_blocks  # free blocks that hold no hash
    cached: OrderedDict[bytes, None] = OrderedDict()  # hashed blocks no request holds, LRU first
    refs: dict[bytes, int] = {}  # hashed blocks requests hold -> how many requests
    live: dict[int, _Request] = {}  # admission order
    growing: list[int] = []
    done: list[int] = []
    wrote: set[int] = set()  # requests that allocated this step: the ones with blocks to publish
    c = dict.fromkeys(("requests", "allocs", "allocated", "frees", "freed", "admits", "probed", "hits",
                       "publishes", "published", "evicted"), 0)
    step = 0

    while c["allocs"] < allocations or growing or done:
        admitting = c["allocs"] < allocations
        while admitting and len(growing) < MAX_GROWING and free + len(cached) >= ADMIT_FREE:
            r = c["requests"]
            c["requests"] += 1
            if not caching:
                total = randint(*REQUEST_BLOCKS)
                live[r] = _Request([], total)
            else:
                prompt = (prefixes[rng.choices(range(PREFIXES), weights)[0]]
                          if rng.random() < SHARED_SHARE else [])
                own = randint(*OWN_PROMPT)
                total = len(prompt) + own + randint(*GENERATED)
                hashes = prompt + [_hash(2, r, i) for i in range(len(prompt), total)]
                req = live[r] = _Request(hashes, total)
                probe = tuple(hashes[: len(prompt) + own - 1])  # the prompt's full blocks but its last
                hit = 0
                for h in probe:
                    if h not in refs and h not in cached:
                        break
                    hit += 1
                for h in probe[:hit]:
                    if h in cached:
                        del cached[h]
                        refs[h] = 1
                    else:
                        refs[h] += 1
                req.blocks = req.pub = hit
                req.need = total - hit
                c["admits"] += 1
                c["probed"] += len(probe)
                c["hits"] += hit
                emit((ADMIT, (r, probe, hit)))
            if live[r].need:
                growing.append(r)
            else:
                done.append(r)  # (a prompt wholly cached: nothing to allocate)
        still = []
        for r in growing:
            req = live[r]
            n = min(randint(*CHUNK), req.need)
            if n > free + len(cached):
                still.append(r)  # waits for blocks
                continue
            if n > free:
                short = n - free
                for _ in range(short):
                    cached.popitem(last=False)
                c["evicted"] += short
                free = 0
            else:
                free -= n
            req.blocks += n
            req.need -= n
            c["allocs"] += 1
            c["allocated"] += n
            emit((ALLOC, (r, step, n)))
            wrote.add(r)
            (still if req.need else done).append(r)
        growing = still
        draining = c["allocs"] >= allocations
        while done and (free + len(cached) < LOW_WATER or draining):
            if order == "lifo":
                r = done.pop()
            else:
                i = randint(0, len(done) - 1)
                r = done[i]
                done[i] = done[-1]
                done.pop()
            req = live.pop(r)
            to_cache = []
            for i in range(req.blocks):
                if i < req.pub:
                    h = req.hashes[i]
                    k = refs[h] - 1
                    if k:
                        refs[h] = k
                    else:
                        del refs[h]
                        to_cache.append(h)
                else:
                    free += 1
            for h in reversed(to_cache):  # the request's last block is the first to be evicted
                cached[h] = None
            c["frees"] += 1
            c["freed"] += req.blocks
            emit((FREE, (r,)))
        emit((SEAL, (step,)))
        if caching:
            for r in sorted(wrote):  # admission order
                req = live.get(r)
                if req is None:
                    continue  # finished this step
                end = min(req.blocks, req.total - 1)
                if req.stopped or req.pub >= end:
                    continue
                start = req.pub
                i = start
                while i < end and req.hashes[i] not in refs and req.hashes[i] not in cached:
                    refs[req.hashes[i]] = 1
                    i += 1
                if i < end:
                    req.stopped = True
                if i > start:
                    req.pub = i
                    c["publishes"] += 1
                    c["published"] += i - start
                    emit((PUBLISH, (r, start, tuple(req.hashes[start:i]), token_ids(i - start, page_tokens))))
        wrote.clear()
        step += 1
    if live or free + len(cached) != num_blocks:
        raise AssertionError("the trace did not drain the pool")  # a bug in this generator
    return Trace(ops, num_blocks, page_tokens, caching, order, steps=step, **c)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/serving_trace.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=10_000)
    parser.add_argument("--caching", action="store_true")
    parser.add_argument("--order", choices=ORDERS, default="lifo")
    parser.add_argument("--allocations", type=int, default=200_000)
    args = parser.parse_args(argv)
    t = make_trace(args.blocks, caching=args.caching, order=args.order, allocations=args.allocations)
    counts = {k: v for k, v in t._asdict().items() if k != "ops"}
    ops = [0] * len(OP_NAMES)
    for code, _ in t.ops:
        ops[code] += 1
    counts.update({f"{name}_ops": n for name, n in zip(OP_NAMES, ops, strict=True)})
    counts["block_ops"] = block_ops(t)
    for k, v in counts.items():
        print(f"{k:>14}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
