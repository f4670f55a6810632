"""A ledger under KV pressure: snapshot rows alias pages, are released, and the
pages come back as requests' tail pages. Prints each step's clear list.

    python examples/kv_pressure.py [--steps 12] [--pages 32] [--policy released_aliases]
"""

from __future__ import annotations

import argparse
import random

from kvledger import CLEAR_POLICIES, Geometry, Ledger, OutOfPagesError


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--policy", choices=CLEAR_POLICIES, default="released_aliases")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    ledger = Ledger(Geometry(num_pages=args.pages, page_tokens=16), policy=args.policy, check=True)
    live: dict[int, int] = {}  # request -> tokens
    snapshots: list[int] = []
    next_request = next_snapshot = 0
    refused = cleared = 0
    print(f"{args.pages} pages of 16 tokens, policy {args.policy}\n")
    print(f"{'step':>4} {'free':>5} {'live':>5} {'snaps':>5}  clear list")
    for step in range(args.steps):
        # hybrid-model snapshots take pages, and some are released again
        for _ in range(rng.randint(0, 2)):
            try:
                ledger.alias_snapshot(next_snapshot, rng.randint(2, 6))
                snapshots.append(next_snapshot)
                next_snapshot += 1
            except OutOfPagesError:
                refused += 1
        while snapshots and rng.random() < 0.6:
            ledger.release_snapshot(snapshots.pop(rng.randrange(len(snapshots))))
        # new requests: whole pages plus a partially filled tail page
        for _ in range(rng.randint(1, 3)):
            tokens = rng.randint(17, 120)
            need = -(-tokens // 16)
            r, next_request = next_request, next_request + 1
            try:
                ledger.reserve(r, need, tenant=f"t{r % 2}")
            except OutOfPagesError:
                refused += 1
                continue
            ledger.commit(r, step, need)
            live[r] = tokens
        # some requests finish (cancel a few, too)
        for r in [r for r in live if rng.random() < 0.35]:
            (ledger.cancel if rng.random() < 0.2 else ledger.finish)(r)
            del live[r]
        plan = ledger.seal_step(step)
        cleared += len(plan.clear_list)
        print(f"{step:>4} {ledger.free_count:>5} {len(live):>5} {len(snapshots):>5}  {list(plan.clear_list)}")
    print(f"\npages cleared: {cleared}; reservations refused under KV pressure: {refused}")
    print(f"events: {ledger.seq}; state digest: {ledger.digest()[:16]}...")


if __name__ == "__main__":
    main()
