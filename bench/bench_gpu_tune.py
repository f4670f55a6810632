"""Tuning sweep of the Triton fill kernel's knobs (``FillConfig``) on the cases of issue #15.

For each configuration: device time of ``TritonClearBackend.clear`` (CUDA events
behind a sleep kernel, median, the same list every run) on 3 planes x 1024 pages
and 128 planes x 16 / 128 / 1024 pages (16 KiB per plane page; adjacent and
scattered ids), as a fraction of the ceiling (one cuMemsetD8Async of 2 GiB in
the same run), plus 3 x 16 adjacent (latency). The best configuration maximizes
the worst fraction over the cases of 32 MB and more (ties: the mean). ``python
bench/bench_gpu_tune.py [--quick] [--json PATH]``; the JSON's ``best`` is what
``bench_gpu.py --config`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table  # noqa: E402

CASES = {3: (16, 1024), 128: (16, 128, 1024)}


def configs():
    from kvledger.executors.triton_kernels import FillConfig as C

    return [
        C(), C(block_bytes=16384), C(block_bytes=16384, num_warps=8), C(num_warps=8, programs_per_sm=8),
        C(block_bytes=16384, programs_per_sm=8), C(block_bytes=16384, programs_per_sm=16),
        C(block_bytes=4096, programs_per_sm=8, chunked=True), C(block_bytes=4096, programs_per_sm=16, chunked=True),
        C(programs_per_sm=8, chunked=True), C(num_warps=8, programs_per_sm=8, chunked=True),
        C(block_bytes=16384, num_warps=8, chunked=True), C(programs_per_sm=8, chunked=True, plane_major=True),
        C(block_bytes=16384, programs_per_sm=8, plane_major=True),
        C(block_bytes=16384, programs_per_sm=8, streaming=True),
        C(programs_per_sm=8, chunked=True, streaming=True), C(block_bytes=4096, programs_per_sm=32, chunked=True),
        C(block_bytes=16384, num_warps=16, programs_per_sm=2), C(programs_per_sm=2),
    ]


def _sweep(torch, timer, ceiling, reps, res, table) -> None:
    from bench_gpu import NUM_PAGES, PAGE_BYTES, _lists

    from kvledger.executors.triton_backend import TritonClearBackend

    rng = random.Random(11)
    for p, sizes in CASES.items():
        planes = [torch.randint(0, 256, (NUM_PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda") for _ in range(p)]
        lists = {(n, pat): ids for n in sizes for pat, ids in _lists(rng, n).items()}
        for cfg in configs():
            b = TritonClearBackend(planes, stream=timer.stream, config=cfg)
            row = table.setdefault(cfg, {})
            for (n, pat), ids in lists.items():
                if p == 3 and n == 16 and pat == "sc":
                    continue
                dev = timer(lambda b=b, ids=ids: b.clear(ids), reps)[0]
                frac = n * p * PAGE_BYTES / dev / ceiling
                row[f"p{p}_n{n}_{pat}"] = (dev, frac)
                res[f"{cfg.tag().replace(' ', '_')}_p{p}_n{n}_{pat}_ceiling"] = frac
        del planes
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run(quick: bool = False) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    from bench_gpu import BIG_CASE, CEILING_BYTES, PAGE_BYTES, Timer

    from kvledger.executors import cuda_driver

    stream = torch.cuda.Stream()
    timer = Timer(torch, stream)
    buf: Any = torch.empty(CEILING_BYTES, dtype=torch.uint8, device="cuda")
    cu = cuda_driver.as_custream(stream.cuda_stream)
    ptr = int(buf.data_ptr())
    ceiling = CEILING_BYTES / timer(lambda: cuda_driver.memset_d8_async(ptr, 0, CEILING_BYTES, cu), 9)[0]
    buf = None
    res: dict = {"ceiling_memset_bytes_per_s": ceiling}
    table: dict = {}
    _sweep(torch, timer, ceiling, 5 if quick else 9, res, table)
    scored = []
    for cfg, row in table.items():
        big = [f for case, (_, f) in row.items() if _bytes(case, PAGE_BYTES) >= BIG_CASE]
        scored.append((min(big), statistics.mean(big), cfg, row))
    scored.sort(key=lambda t: (t[0], t[1]), reverse=True)
    cases = list(scored[0][3])
    print_table(f"fill kernel sweep: % of the memset ceiling ({ceiling / 1e12:.2f} TB/s); 3x16 adj in us",
                ["config", *cases, "min big", "mean big"],
                [[cfg.tag(), *[(f"{row[c][0] * 1e6:.1f}" if c == "p3_n16_adj" else f"{100 * row[c][1]:.0f}")
                               for c in cases], f"{100 * lo:.1f}", f"{100 * mean:.1f}"]
                 for lo, mean, cfg, row in scored])
    best = scored[0][2]
    res.update({f"best_{k}": v for k, v in dataclasses.asdict(best).items()})
    res["best_min_ceiling"], res["best_mean_ceiling"] = scored[0][0], scored[0][1]
    print(f"best: {best.tag()} (worst big case {100 * scored[0][0]:.1f}% of the ceiling)")
    return res


def _bytes(case: str, page_bytes: int) -> int:
    p, n, _ = case.split("_")
    return int(p[1:]) * int(n[1:]) * page_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="accepted for scripts/gpu-check")
    ap.add_argument("--json", help="write the figures (and the best config under 'best') here")
    args = ap.parse_args(argv)
    res = run(quick=args.quick)
    if "skipped" in res:
        print(f"bench_gpu_tune skipped: {res['skipped']}")
    if args.json:
        best = {k[5:]: v for k, v in res.items() if k.startswith("best_") and not k.endswith("_ceiling")}
        with open(args.json, "w") as f:
            json.dump({**res, "best": best}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
