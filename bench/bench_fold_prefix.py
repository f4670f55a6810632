"""Fold benchmark, prefix-caching trace: the ledger against a plain refcount + dict + LRU pool.

A seeded serving trace with shared system prompts, under KV pressure:

    8 tenants, each with a system prompt of 4-32 blocks (its prefix hashes);
    every step admits 1-4 requests: each looks up its tenant's prefix, shares the
      cached blocks it finds, reserves and commits the rest of its prompt (the
      uncached prefix blocks plus 1-16 blocks of its own) for the step;
    the step is sealed and completed, then every admitted request publishes the
      blocks it wrote (so later requests can share them), except a leading run that
      a request admitted in the same step already published;
    done requests finish (the oldest first, or a random one) while more than 48
      are live; their hashed blocks go to the cache, the last block first in line
      for eviction, and reservations evict the least recently used cached blocks
      when free pages run out.

Both sides run the identical trace through the identical driver:

* the subject, ``kvledger.Ledger``: ``lookup``, ``share``, ``reserve`` (evicting
  inside the command), ``commit``, ``seal_step``, ``complete_step``, ``publish``
  (with its tokens, as the KV event needs them), ``finish``; every one an event,
  validated and folded;
* the baseline, ``RefcountPool``: a free list, a refcount per block, a dict hash
  -> block and an OrderedDict LRU of cached blocks, the structure vLLM's BlockPool
  keeps with caching on (written here from that description; no events, no checks).

A verification pass (untimed) requires both sides to see the same cache hits and
evictions at every admission, and checks the ledger's invariants at the end.
Timing as in bench_fold: the trace is cut into segments, sides alternate per
segment, each segment's best time over repeats is summed. ratio = baseline time /
ledger time (target >= 0.5).
"""

from __future__ import annotations

import os
import random
import sys
from collections import OrderedDict

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _common import fmt_count, fmt_rate, interleaved_segments, print_table  # noqa: E402

from kvledger import Geometry, Ledger, check_invariants  # noqa: E402

NUM_PAGES = 4_096
PAGE_TOKENS = 16
SEED = 20261201
STEPS = 1_500
SEGMENTS = 50
TENANTS = 8
PREFIX_BLOCKS = (4, 32)
OWN_BLOCKS = (1, 16)
ADMIT = (1, 4)
MAX_LIVE = 48
VARIANTS = ("oldest", "random")
ADMIT_OP, STEP_OP, FINISH_OP = 0, 1, 2

TARGETS = {"ratio": (">=", 0.5)}


def make_trace(variant: str, steps: int = STEPS, seed: int = SEED) -> list:
    """The operations: ("admit", r, tenant, hashes, n_prefix), ("step", s, [r...]), ("finish", r)."""
    rng = random.Random(f"{variant}:{seed}")
    prefixes = [[(t << 40) | i for i in range(rng.randint(*PREFIX_BLOCKS))] for t in range(TENANTS)]
    ops: list = []
    live: list[int] = []
    next_r, next_hash = 0, 1 << 56
    for step in range(steps):
        admitted = []
        for _ in range(rng.randint(*ADMIT)):
            t = rng.randrange(TENANTS)
            own = list(range(next_hash, next_hash + rng.randint(*OWN_BLOCKS)))
            next_hash += len(own)
            ops.append((ADMIT_OP, (next_r, f"t{t}", tuple(prefixes[t] + own), len(prefixes[t]))))
            admitted.append(next_r)
            live.append(next_r)
            next_r += 1
        ops.append((STEP_OP, (step, tuple(admitted))))
        while len(live) > MAX_LIVE:
            r = live.pop(0) if variant == "oldest" else live.pop(rng.randrange(len(live)))
            ops.append((FINISH_OP, (r,)))
    return ops


class LedgerSide:
    """The subject: every operation through ``kvledger.Ledger`` commands."""

    def __init__(self) -> None:
        self.L = Ledger(Geometry(num_pages=NUM_PAGES, page_tokens=PAGE_TOKENS))
        self.todo: dict[int, tuple] = {}  # admitted this step: r -> (hashes to publish)
        self.hits: list[int] = []
        self.tokens = {k: (0,) * (k * PAGE_TOKENS) for k in range(1, 64)}

    def admit(self, r: int, tenant: str, hashes: tuple, n_prefix: int) -> None:
        L = self.L
        n = L.lookup(hashes[:n_prefix])
        if n:
            L.share(r, hashes[:n], tenant=tenant)
        need = len(hashes) - n
        L.reserve(r, need, tenant=tenant)
        L.commit(r, L.state.open_step, need)
        self.todo[r] = (n, hashes[n:])
        self.hits.append(n)

    def step(self, step: int, admitted: tuple) -> None:
        L = self.L
        L.seal_step(step)
        L.complete_step(step, 0)
        for r in admitted:
            n, hashes = self.todo.pop(r)
            k = L.lookup(hashes)  # a request admitted with the same prefix in the same step published it
            if k < len(hashes):
                L.publish(r, hashes[k:], self.tokens[len(hashes) - k], start=n + k)

    def finish(self, r: int) -> None:
        self.L.finish(r)


class RefcountPool:
    """The baseline: free list, refcounts, hash -> block, LRU of cached blocks."""

    def __init__(self) -> None:
        self.free = list(range(NUM_PAGES - 1, -1, -1))
        self.ref = [0] * NUM_PAGES
        self.block_of: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.tables: dict[int, list[int]] = {}
        self.todo: dict[int, tuple] = {}
        self.hits: list[int] = []

    def admit(self, r: int, tenant: str, hashes: tuple, n_prefix: int) -> None:
        block_of, ref, lru = self.block_of, self.ref, self.lru
        table = self.tables[r] = []
        n = 0
        for h in hashes[:n_prefix]:
            b = block_of.get(h)
            if b is None:
                break
            if ref[b] == 0:
                del lru[b]
            ref[b] += 1
            table.append(b)
            n += 1
        need = len(hashes) - n
        free = self.free
        short = need - len(free)
        for _ in range(short):  # evict the least recently used cached blocks
            b, _ = lru.popitem(last=False)
            del block_of[self.hash_of.pop(b)]
            free.append(b)
        for _ in range(need):
            b = free.pop()
            ref[b] = 1
            table.append(b)
        self.todo[r] = (n, hashes[n:])
        self.hits.append(n)

    def step(self, step: int, admitted: tuple) -> None:
        block_of, hash_of = self.block_of, self.hash_of
        for r in admitted:
            n, hashes = self.todo.pop(r)
            table = self.tables[r]
            for b, h in zip(table[n:], hashes, strict=True):
                if h not in block_of:  # (a block another request of this step published stays unhashed)
                    block_of[h] = b
                    hash_of[b] = h

    def finish(self, r: int) -> None:
        ref, lru, hash_of, free = self.ref, self.lru, self.hash_of, self.free
        for b in reversed(self.tables.pop(r)):
            ref[b] -= 1
            if ref[b] == 0:
                if b in hash_of:
                    lru[b] = None
                else:
                    free.append(b)


def _side(cls, ops: list, n_segments: int):
    def build():
        side = cls()
        calls = (side.admit, side.step, side.finish)
        cut = [len(ops) * i // n_segments for i in range(n_segments + 1)]

        def segment(i: int) -> None:
            for code, args in ops[cut[i] : cut[i + 1]]:
                calls[code](*args)

        def check() -> None:
            build.last = side  # type: ignore[attr-defined]

        return segment, check

    return build


def verify(ops: list) -> dict:
    """Both sides see the same hits; the ledger's invariants hold. Returns the trace's figures."""
    a, b = LedgerSide(), RefcountPool()
    for code, args in ops:
        (a.admit, a.step, a.finish)[code](*args)
        (b.admit, b.step, b.finish)[code](*args)
    if a.hits != b.hits:
        i = next(i for i, (x, y) in enumerate(zip(a.hits, b.hits, strict=True)) if x != y)
        raise AssertionError(f"admission {i}: the ledger shared {a.hits[i]} blocks, the baseline {b.hits[i]}")
    check_invariants(a.L.state)
    admits = sum(1 for code, _ in ops if code == ADMIT_OP)
    blocks = sum(len(args[2]) for code, args in ops if code == ADMIT_OP)
    return {"admits": admits, "blocks": blocks, "hits": sum(a.hits), "commands": a.L.seq,
            "cached_at_end": a.L.cached_count}


def run(quick: bool) -> dict:
    repeats = 3 if quick else 5
    steps = STEPS // 2 if quick else STEPS
    figures: dict = {}
    rows = []
    worst = None
    for variant in VARIANTS:
        ops = make_trace(variant, steps)
        facts = verify(ops)
        t = interleaved_segments({"ledger": _side(LedgerSide, ops, SEGMENTS),
                                  "baseline": _side(RefcountPool, ops, SEGMENTS)}, SEGMENTS, repeats)
        ratio = t["baseline"].best / t["ledger"].best
        worst = ratio if worst is None else min(worst, ratio)
        hit_rate = facts["hits"] / facts["blocks"]
        figures[f"{variant}_ratio"] = round(ratio, 3)
        figures[f"{variant}_hit_rate"] = round(hit_rate, 3)
        figures[f"{variant}_ledger_admits_per_s"] = round(facts["admits"] / t["ledger"].best)
        rows.append((variant, fmt_count(facts["admits"]), fmt_count(facts["commands"]), f"{hit_rate:.1%}",
                     fmt_rate(facts["admits"] / t["ledger"].best), fmt_rate(facts["admits"] / t["baseline"].best),
                     f"{ratio:.3f}"))
    figures["ratio"] = round(worst, 3)
    print_table(f"fold, prefix caching: Ledger vs refcount + dict + LRU pool, {NUM_PAGES:,} pages, "
                f"{repeats} repeats x {SEGMENTS} segments",
                ("finish order", "requests", "ledger events", "block hit rate", "ledger req/s", "baseline req/s",
                 "ratio"), rows)
    print("ratio = baseline time / ledger time (sum of per-segment best times); target >= 0.5")
    return figures


if __name__ == "__main__":
    run("--quick" in sys.argv[1:])
