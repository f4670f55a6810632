"""The async engine with two in-process ranks (CPU torch planes) under KV pressure.

Each rank holds FP8 K/V cache planes. Hybrid-model snapshots alias pages and write
row bytes (0x7F: NaN in e4m3fn) through them; released snapshots hand those pages
back to the free list, and new requests receive them as partially filled tail
pages. Every step the engine seals the step, and each rank runs
input copies -> zero the step's clear list -> its graph, which attends over every
live request's pages with a mask past its last token and counts non-finite outputs
(always 0: the listed pages were zeroed first). From step 4 on, the first step with
a clear list shows a failing rank: the step is aborted and its clear list is
carried into the next step, where every rank zeroes it.

    python examples/async_engine.py [--steps 8] [--pages 48] [--log new.kvlog]

It needs torch (the ranks' planes and graphs are torch's); without it, it exits 2 naming
the install command (``pip install 'kvledger[torch]'``).

With ``--log`` the ledger is durable: every ledger call runs in a worker thread and
the log can be replayed and audited afterwards.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys

import anyio

try:
    import torch
    import torch.nn.functional as F
except ModuleNotFoundError:
    print("async_engine.py needs torch, which is not installed here: pip install 'kvledger[torch]'", file=sys.stderr)
    raise SystemExit(2) from None

import kvledger
from kvledger import StepFailedError
from kvledger.engine import RankSpec, StepInputs, open_engine

PAGE_TOKENS, HEADS, DIM = 16, 2, 32
FAIL_STEP, FAIL_RANK = 4, 1  # rank 1 faults in the first step from 4 on that lists pages


def make_rank(num_pages):
    """One rank's cache planes (K and V, FP8) and the buffer its step input lands in."""
    k = torch.zeros((num_pages, PAGE_TOKENS, HEADS, DIM), dtype=torch.float8_e4m3fn)
    return [k, torch.zeros_like(k)], torch.zeros(HEADS, 1, DIM)


QUERY: list = []  # per rank: the query buffer the input copy fills
NONFINITE = [0, 0]  # per rank: requests whose attention output was not finite this step


def graph(ctx, step, inputs):
    """The step graph: write each live request's tokens, attend with a mask, check outputs."""
    batch, fault = inputs.data
    if fault:
        raise RuntimeError("simulated device fault")
    k_plane, v_plane = ctx.planes
    q = QUERY[ctx.rank]  # filled by this step's input copy
    bad = 0
    k_slots, v_slots = k_plane.view(-1, HEADS, DIM), v_plane.view(-1, HEADS, DIM)  # [page*token, ...]
    for block_table, tokens in batch:
        idx = torch.tensor(block_table)
        slots = (idx[:, None] * PAGE_TOKENS + torch.arange(PAGE_TOKENS)).reshape(-1)[:tokens]
        k_slots[slots] = 0.5  # the KV of the request's valid tokens (finite values)
        v_slots[slots] = 0.25
        k = k_plane[idx].reshape(-1, HEADS, DIM).float().transpose(0, 1)
        v = v_plane[idx].reshape(-1, HEADS, DIM).float().transpose(0, 1)
        mask = torch.arange(k.shape[1]).lt(tokens).unsqueeze(0)  # valid tokens only
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        bad += int((~torch.isfinite(out)).any())
    NONFINITE[ctx.rank] = bad


async def main(args) -> None:
    rng = random.Random(args.seed)
    geometry = kvledger.Geometry(num_pages=args.pages, page_tokens=PAGE_TOKENS)
    ranks = [make_rank(args.pages) for _ in range(2)]
    QUERY[:] = [buf for _, buf in ranks]
    specs = [RankSpec(planes=planes, graph=graph) for planes, _ in ranks]
    live: dict[int, int] = {}  # request -> tokens
    snapshots: list[int] = []
    ids = iter(range(1, 1 << 30))

    async with open_engine(geometry, log=args.log, ranks=specs) as engine:
        print(f"{args.pages} pages x {PAGE_TOKENS} tokens, 2 ranks, FP8 K/V planes\n")
        print("                                              copy / clear / graph (us)")
        print("step  free  live  clear list                  rank 0             rank 1             nonfinite")
        for step in range(args.steps):
            # snapshot rows come and go; their pages hold row bytes when released
            for _ in range(rng.randint(1, 2)):
                try:
                    s = next(ids)
                    rows = await engine.alias_snapshot(s, rng.randint(2, 5))
                    for planes, _ in ranks:
                        for plane in planes:
                            plane.view(torch.uint8)[list(rows)] = 0x7F  # written through the alias
                    snapshots.append(s)
                except kvledger.OutOfPagesError:
                    pass
            while snapshots and rng.random() < 0.6:
                await engine.release_snapshot(snapshots.pop(rng.randrange(len(snapshots))))
            # new requests: whole pages plus a partially filled tail page
            listed = []
            for _ in range(rng.randint(1, 3)):
                r, tokens = next(ids), rng.randint(PAGE_TOKENS + 1, 5 * PAGE_TOKENS)
                need = -(-tokens // PAGE_TOKENS)
                try:
                    await engine.reserve(r, need)
                except kvledger.OutOfPagesError:
                    continue  # KV pressure: admit it later
                listed += await engine.commit(r, step, need)  # marked pages it got, if any
                live[r] = tokens
            batch = [(engine.ledger.kv_pages(r), t) for r, t in live.items()]
            # per rank: the query arrives by an input copy (host -> the rank's buffer)
            fault = step >= FAIL_STEP and bool(listed) and not engine.statistics()["steps_aborted"]
            inputs = [StepInputs(copies=[(torch.randn(HEADS, 1, DIM), buf)], data=(batch, fault and rank == FAIL_RANK))
                      for rank, (_, buf) in enumerate(ranks)]
            try:
                result = await engine.run_step(step, inputs)
            except StepFailedError as err:
                print(f"{step:4d}  {engine.free_count:4d}  {len(live):4d}  {str(list(err.clear_list)):<26}  "
                      f"rank {err.rank} failed ({err.__cause__}): step aborted, its clear list carried")
            else:
                t = [f"{x.copies_s * 1e6:4.0f} /{x.clear_s * 1e6:4.0f} /{x.graph_s * 1e6:6.0f}" for x in result.ranks]
                cl = str(list(result.clear_list))
                cl = cl if len(cl) <= 26 else cl[:23] + "..."
                print(f"{step:4d}  {engine.free_count:4d}  {len(live):4d}  {cl:<26}  {t[0]:<17}  {t[1]:<17}  "
                      f"{sum(NONFINITE)}")
            # some requests finish
            for r in [r for r in live if rng.random() < 0.3]:
                await engine.finish(r)
                del live[r]
        stats = engine.statistics()
        digest = await engine.digest()
        print(f"\nsteps completed {stats['steps_completed']}, aborted {stats['steps_aborted']}, pages zeroed on "
              f"every rank {stats['pages_cleared']}; events {engine.seq}, digest {digest[:16]}...")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pages", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default=None, help="path of a new durable event log")
    # The library logs through the standard logging module (the "kvledger" logger) and
    # never configures it; the application does. We print failures ourselves, so the
    # library's warnings (step_aborted) are left out here: errors only, to stderr.
    logging.basicConfig(level=logging.ERROR, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # tiny kernels: intra-op threads only add contention on a small CPU
    anyio.run(main, ap.parse_args())
