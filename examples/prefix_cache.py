"""Prefix caching on the bare ledger: requests of two tenants share their system prompt's KV pages.

Each request's prompt is its tenant's system prompt followed by a question. A request
looks up how many leading blocks of its prompt are already cached, shares those pages,
reserves and commits pages for the rest, runs a step, then publishes its full blocks
so later requests can share them. Finished requests leave their published pages
cached; when free pages run out, ``reserve`` evicts the least recently used. The KV
events a router would read (vLLM's format) are printed as they leave at each seal.

    python examples/prefix_cache.py [--requests 24] [--pages 48] [--policy cross_tenant]
"""

from __future__ import annotations

import argparse
import random

from kvledger import CLEAR_POLICIES, Geometry, Ledger, OutOfPagesError
from kvledger.core.hashing import block_hashes
from kvledger.kvevents.batcher import KVEventBatcher

PAGE_TOKENS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--pages", type=int, default=48)
    ap.add_argument("--policy", choices=CLEAR_POLICIES, default="cross_tenant")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    system = {t: [rng.randrange(32_000) for _ in range(4 * PAGE_TOKENS)] for t in ("a", "b")}

    batches: list = []
    batcher = KVEventBatcher(batches.append)
    ledger = Ledger(Geometry(num_pages=args.pages, page_tokens=PAGE_TOKENS), policy=args.policy,
                    check=True, observer=batcher.observe)
    live: list[int] = []
    shared = computed = refused = 0
    for r in range(args.requests):
        tenant = "ab"[r % 2]
        prompt = system[tenant] + [rng.randrange(32_000) for _ in range(rng.randrange(8, 40))]
        hashes = block_hashes(prompt, PAGE_TOKENS, extra_keys=(tenant,))
        hits = ledger.lookup(hashes, tenant=tenant)
        need = -(-len(prompt) // PAGE_TOKENS) - hits
        try:
            ledger.reserve(r, need, tenant=tenant)  # evicts LRU cached pages if it must
        except OutOfPagesError:
            refused += 1
            continue
        if hits:
            ledger.share(r, hashes[:hits], tenant=tenant)
        ledger.commit(r, r, need)
        plan = ledger.seal_step(r)  # zero plan.clear_list, then run the step
        ledger.complete_step(r, 0)
        if len(hashes) > hits:  # the request's own full blocks, now written
            ledger.publish(r, hashes[hits:], prompt[hits * PAGE_TOKENS : len(hashes) * PAGE_TOKENS])
        shared += hits
        computed += need
        live.append(r)
        print(f"step {r:>2} tenant {tenant}: {hits} blocks shared, {need} pages new, "
              f"clear list {list(plan.clear_list)}, cached {ledger.cached_count}")
        if len(live) > 2:
            ledger.finish(live.pop(0))  # its published pages stay cached for later requests
    for r in live:
        ledger.finish(r)
    ledger.seal_step(args.requests)
    stored = sum(e.__struct_config__.tag == "BlockStored" for b in batches for e in b.events)
    removed = sum(e.__struct_config__.tag == "BlockRemoved" for b in batches for e in b.events)
    print(f"\n{shared} blocks shared, {computed} pages computed, {refused} requests refused; "
          f"KV events: {len(batches)} batches, {stored} BlockStored, {removed} BlockRemoved")


if __name__ == "__main__":
    main()
