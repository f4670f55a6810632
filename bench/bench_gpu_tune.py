"""Tuning sweep of the Triton fill kernel's shape (``FillConfig``) per clear size (issue 31).

For each configuration: device time of ``TritonClearBackend.clear_checked`` (CUDA events
behind a sleep kernel, median, the same list every run; ids where the card's row of
``executors/triton_tuning.py`` puts them) on 16, 128 and 1,024 scattered pages over 3 and
over 128 planes (16 KiB per plane page), against one memset of the same bytes in the same
run. The small class (clears under 32 MB) picks the configuration with the best worst
ratio to the fastest configuration of each of its cases; the large class (32 MB and up)
the best mean ratio to the same-size memset (ties: the worst). The printed row is what
``triton_tuning.TABLE`` takes for this card. ``python bench/bench_gpu_tune.py [--quick]
[--json PATH]``; the JSON's ``best`` is the large class's configuration (what
``bench_gpu.py --config`` reads to time one shape) and ``best_small`` the small one's
(``bench_gpu.py --tuning`` times the two as this card's row).
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

CASES = {3: (16, 128, 1024), 128: (16, 128, 1024)}
SMALL_CLASS = 32e6  # bytes: the classes' boundary (the bandwidth targets apply from here up)


def configs(quick: bool) -> list[Any]:
    from kvledger.executors.triton_kernels import FillConfig as C

    out = [C(block_bytes=4096, programs_per_sm=16), C(block_bytes=4096, programs_per_sm=8),
           C(block_bytes=8192, programs_per_sm=16), C(), C(programs_per_sm=8), C(num_warps=8, programs_per_sm=8),
           C(programs_per_sm=32)]
    if not quick:
        out += [C(block_bytes=4096, num_warps=8, programs_per_sm=16), C(block_bytes=8192, programs_per_sm=8),
                C(programs_per_sm=16, streaming=True), C(plane_major=True)]
    return out


def _sweep(torch, timer, memset, reps: int, quick: bool) -> dict[Any, dict[str, float]]:
    """Device seconds by config and case; the same-size memset under ``"memset"``."""
    from bench_gpu import NUM_PAGES, PAGE_BYTES

    from kvledger.executors.triton_backend import TritonClearBackend

    rng = random.Random(11)
    table: dict[Any, dict[str, float]] = {"memset": {}}
    for p, sizes in CASES.items():
        planes = [torch.randint(0, 256, (NUM_PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda") for _ in range(p)]
        lists = {n: tuple(rng.sample(range(0, NUM_PAGES, 2), n)) for n in sizes}
        for n in sizes:
            table["memset"][f"p{p}_n{n}"] = timer(lambda nb=n * p * PAGE_BYTES: memset(nb), reps)[0]
        for cfg in configs(quick):
            b = TritonClearBackend(planes, stream=timer.stream, config=cfg)
            row = table.setdefault(cfg, {})
            for n, ids in lists.items():
                row[f"p{p}_n{n}"] = timer(lambda b=b, ids=ids: b.clear_checked(ids), reps)[0]
            del b
        del planes
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return table


def run(quick: bool = False) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    from bench_gpu import CEILING_BYTES, PAGE_BYTES, Timer

    from kvledger.executors import cuda_driver

    stream = torch.cuda.Stream()
    timer = Timer(torch, stream)
    buf: Any = torch.empty(CEILING_BYTES, dtype=torch.uint8, device="cuda")
    cu = cuda_driver.as_custream(stream.cuda_stream)
    ptr = int(buf.data_ptr())

    def memset(nbytes: int) -> None:
        cuda_driver.memset_d8_async(ptr, 0, nbytes, cu)

    card = torch.cuda.get_device_name(0)
    table = _sweep(torch, timer, memset, 5 if quick else 9, quick)
    same = table.pop("memset")
    cases = list(same)
    small = [c for c in cases if _bytes(c, PAGE_BYTES) < SMALL_CLASS]
    big = [c for c in cases if _bytes(c, PAGE_BYTES) >= SMALL_CLASS]
    fastest = {c: min(row[c] for row in table.values()) for c in cases}
    scored = []
    for cfg, row in table.items():
        to_best = [fastest[c] / row[c] for c in small]
        to_memset = [same[c] / row[c] for c in big]
        scored.append((cfg, min(to_best), statistics.mean(to_best), min(to_memset), statistics.mean(to_memset)))
    res: dict = {"card": card, "memset_us": {c: v * 1e6 for c, v in same.items()},
                 "configs": {cfg.tag(): {c: v * 1e6 for c, v in row.items()} for cfg, row in table.items()}}
    print_table(f"fill kernel sweep on {card}: device us per case (and x the same-size memset); small: worst "
                "ratio to the fastest config, large: worst x memset (chosen by the mean)",
                ["config", *cases, "small worst", "large worst"],
                [[cfg.tag(), *[f"{table[cfg][c] * 1e6:.1f} ({same[c] / table[cfg][c]:.2f})" for c in cases],
                  f"{lo_s:.2f}", f"{lo_b:.2f}"] for cfg, lo_s, _, lo_b, _ in scored]
                + [["memset", *[f"{same[c] * 1e6:.1f}" for c in cases], "", ""]])
    best_small = max(scored, key=lambda t: (t[1], t[2]))[0]
    best_big = max(scored, key=lambda t: (t[4], t[3]))[0]
    res.update({f"best_{k}": v for k, v in dataclasses.asdict(best_big).items()})
    res["best_small"] = dataclasses.asdict(best_small)
    print(f"{card}: shapes=(({SMALL_CLASS:.0f}, {_literal(best_small)}), (INF, {_literal(best_big)}))")
    return res


def _literal(cfg: Any) -> str:
    """The config as the table writes it (only the fields that differ from the defaults)."""
    from kvledger.executors.triton_kernels import FillConfig

    base = dataclasses.asdict(FillConfig())
    diff = {k: v for k, v in dataclasses.asdict(cfg).items() if base[k] != v}
    return "FillConfig(" + ", ".join(f"{k}={v!r}" for k, v in diff.items()) + ")"


def _bytes(case: str, page_bytes: int) -> int:
    p, n = case.split("_")[:2]
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
        best = {k[5:]: v for k, v in res.items() if k.startswith("best_") and k != "best_small"}
        with open(args.json, "w") as f:
            json.dump({**res, "best": best}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
