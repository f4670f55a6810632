"""What the sanitizer (debug mode) costs per step: RankExecutor steps with ``sanitize`` off and on.

Each step, like the ledger's steps: the pages poisoned last step are committed and
listed (clear list, 128 pages), 64 fresh pages are committed beside them, and 128
other pages are released and poisoned. 3 planes of 16 KiB pages, no graph. On
the CPU (torch backend; 512 pages) and, where CUDA is there, on the GPU (torch,
cuda and triton backends; 2048 pages). Off and on alternate in blocks of 10
steps; figures are medians over 60 steps each: the step's host total, the
sanitize phases (device time on CUDA), and the overhead. Every sanitized step
must pass the check (violations are counted and reported). ``python
bench/bench_gpu_sanitize.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table  # noqa: E402

PAGE_BYTES = 16384
LISTED, FRESH, RELEASED = 128, 64, 128


def _steps(num_pages: int, count: int, seed: int):
    """(clear_list, poison, committed) per step: released pages come back listed one step later."""
    rng = random.Random(seed)
    pending: list[int] = []
    for _ in range(count):
        pages = rng.sample(range(num_pages), LISTED + FRESH + RELEASED)
        released = [p for p in pages if p not in pending][:RELEASED]
        listed = pending
        fresh = [p for p in pages if p not in pending and p not in released][:FRESH]
        yield tuple(listed), tuple(released), tuple(listed) + tuple(fresh)
        pending = released


async def _measure(ex_on, ex_off, num_pages: int, steps: int) -> dict[str, list]:
    import anyio

    from kvledger.core.events import StepPlan
    from kvledger.executors.executor import StepInputs, StepJob, StepReplies

    out: dict[str, list] = {"off": [], "on": [], "sanitize": [], "clear": [], "clear_host": [], "violations": []}
    plans = list(_steps(num_pages, steps + 20, 5))
    for i, (clear_list, poison, committed) in enumerate(plans):
        on = (i // 10) % 2 == 1
        ex = ex_on if on else ex_off
        job = StepJob(StepPlan(step=i, clear_list=clear_list), StepInputs(), anyio.CancelScope(), StepReplies(1),
                      poison=poison, committed=committed)
        outcome = await ex.run_job(job)
        if i < 20 or outcome.timing is None:  # warm-up
            continue
        t = outcome.timing
        out["on" if on else "off"].append(t.total_s)
        if on:
            out["sanitize"].append(t.sanitize_s)
            out["violations"].append(len(outcome.violations))
        out["clear"].append(t.clear_s)
        out["clear_host"].append(t.clear_host_s)
    return out


def _one(name: str, device: str, num_pages: int, steps: int) -> dict:
    import anyio
    import torch

    from kvledger.executors.executor import RankExecutor

    planes = [torch.randint(0, 255, (num_pages, PAGE_BYTES), dtype=torch.uint8, device=device) for _ in range(3)]
    stream = torch.cuda.Stream() if device == "cuda" else None

    def backend():
        if name == "torch":
            from kvledger.executors.torch_backend import TorchClearBackend

            return TorchClearBackend(planes, stream=stream)
        if name == "cuda":
            from kvledger.executors.cuda_backend import CudaClearBackend

            return CudaClearBackend(planes, stream=stream)
        from kvledger.executors.triton_backend import TritonClearBackend

        return TritonClearBackend(planes, stream=stream)

    dev = planes[0].device
    b = backend()
    on = RankExecutor(0, num_pages=num_pages, backend=b, planes=planes, device=dev, stream=stream, sanitize=True)
    off = RankExecutor(0, num_pages=num_pages, backend=b, planes=planes, device=dev, stream=stream)
    got = anyio.run(_measure, on, off, num_pages, steps)
    med = {k: statistics.median(v) if v else 0.0 for k, v in got.items() if k != "violations"}
    return {"step_off_ms": med["off"] * 1e3, "step_on_ms": med["on"] * 1e3,
            "overhead_ms": (med["on"] - med["off"]) * 1e3, "sanitize_ms": med["sanitize"] * 1e3,
            "clear_ms": med["clear"] * 1e3, "clear_host_us": med["clear_host"] * 1e6,
            "violations": sum(got["violations"])}


def run(quick: bool = False) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    steps = 20 if quick else 60
    res: dict = {}
    combos = [("torch", "cpu", 512)]
    if torch.cuda.is_available():
        combos += [("torch", "cuda", 2048), ("cuda", "cuda", 2048), ("triton", "cuda", 2048)]
    rows = []
    for name, device, num_pages in combos:
        try:
            figs = _one(name, device, num_pages, steps)
        except ImportError as exc:
            res[f"{device}_{name}_skipped"] = str(exc)
            continue
        res.update({f"{device}_{name}_{k}": v for k, v in figs.items()})
        rows.append([f"{name} on {device}", f"{figs['step_off_ms']:.3f}", f"{figs['step_on_ms']:.3f}",
                     f"{figs['overhead_ms']:.3f}", f"{figs['sanitize_ms']:.3f}", f"{figs['clear_ms']:.3f}",
                     str(figs["violations"])])
    print_table(f"sanitize mode per step: {LISTED} listed + {FRESH} fresh committed, {RELEASED} poisoned, "
                "3 planes x 16 KiB (medians, ms)",
                ["backend", "step off", "step on", "overhead", "sanitize phases", "clear", "violations"], rows)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="accepted for scripts/gpu-check")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    res = run(quick=args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
