"""GPU clear benchmark (issues 15 and 31): every backend against vLLM's own zeroer, a same-size memset,
the memset ceiling and a naive peer.

Cases: clear lists of 16, 128 and 1024 pages over 3 planes and over 128 planes
(64 layers x K/V), 16 KiB per plane page, 2048 pages per plane; page ids either
one adjacent run ("adj") or scattered, no two adjacent ("sc"). Backends:

    triton         TritonClearBackend.clear: list prefetched on a copy stream + one
                   cuLaunchKernel (driver adapter, preset parameters)
    triton-graph   stage(ids) + launch of a captured clear graph
    cuda           cuMemsetD8Async, one call per run of adjacent ids per plane
    torch          the torch backend (index_fill_ / slice fills)
    seed           cuMemsetD8Async per page per plane (helios PR #181)
    naive          the peer written the naive way: a fresh id tensor per call
                   (torch.tensor(ids, device=...)) and one Triton program per
                   page x plane x 4 KiB chunk (byte stores from integer addresses)
    vllm           vLLM 0.33's own KVBlockZeroer over the same planes: its kernel, its
                   __init__ and its zero_block_ids launch (async_tensor_h2d + the kernel),
                   read from the pinned vLLM files at run time (``bench_gpu_vllm.py``)

The triton backend runs with the card's row of ``executors/triton_tuning.py`` (kernel
shape by clear size, where ids live by list length) unless ``--config`` names one shape.
Where ids live is also measured directly: lists of 16, 64 and 128 ids over 3 and 128
planes with every placement (by value in the kernel's parameters, copied on a side
stream, copied on the model stream, read from pinned host memory), device and host time
(``clear_checked``: no id check), the figures the table's ``ids`` row is chosen from.

Figures, all measured in this run on this card:

    ceiling     bytes/s of one cuMemsetD8Async of 2 GiB (median of event-timed runs);
                zero_() of the same buffer is reported beside it
    device us   CUDA events around one clear on the model stream; a sleep kernel ahead
                holds the GPU while the host enqueues, so the figure is GPU time plus
                the host gaps the GPU could not hide; the same list every run (warm L2)
    cold us     triton only: the same, after a 256 MiB memset that fills L2 with dirty lines
    host us     wall time of the clear call (enqueue cost, id checks included)
    memset=     one contiguous cuMemsetD8Async of the same byte count (per-size reference)

Then: the kvledger-vs-vLLM table, the memset table (each clear against one memset of its
bytes), the placement table, and the target table of issues 15 and 31 (every target, its
figure, its ratio: >= 1 is met; the card's name heads every table),
the host cost broken into parts with the floors they sit on (``bench_gpu_host.py``,
run in fresh processes: the default binding, and the opt-in ctypes driver path), and
the evidence that the graph path launches no kernel from the host. ``python bench/bench_gpu.py [--quick]
[--config JSON] [--json PATH]``; without CUDA ``run`` returns ``{"skipped": ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvledger.core.errors import CudaUnavailableError  # noqa: E402  (no CUDA import)

PAGE_BYTES = 16384
NUM_PAGES = 2048
PLANE_COUNTS = (3, 128)
LIST_SIZES = (16, 128, 1024)
PLACEMENT_SIZES = (16, 64, 128)
CEILING_BYTES = 2 << 30
BIG_CASE = 32e6  # bandwidth targets apply from here up
GHZ = 2.0e9  # SM clock used to size the sleep kernel (H200 boost ~1.98 GHz)
TARGETS: dict[str, tuple[str, float]] = {}  # filled by _targets (the runner reads it after run)
TUNING: list[Any] = [None]  # the triton backend's CardTuning for this run (None: the table's, or --config)


class Timer:
    """Event-timed runs of ``fn`` on ``stream`` behind a sleep kernel; medians of device and host time."""

    def __init__(self, torch, stream, flush: Any = None) -> None:
        self.torch, self.stream, self.flush = torch, stream, flush
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn, reps: int, cold: bool = False) -> tuple[float, float]:
        torch, s = self.torch, self.stream
        with torch.cuda.stream(s):
            fn()  # warm-up: compilation, first touch
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            est = time.perf_counter() - t0
            torch.cuda.synchronize()
        cycles = int(min(3 * est + 100e-6, 20e-3) * GHZ)
        dev, host = [], []
        for _ in range(reps):
            with torch.cuda.stream(s):
                if cold:
                    self.flush.zero_()
                torch.cuda._sleep(cycles)
                self.start.record(s)
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                self.end.record(s)
            self.end.synchronize()
            dev.append(self.start.elapsed_time(self.end) * 1e-3)
            host.append(t1 - t0)
        return statistics.median(dev), statistics.median(host)


def median_host(fn, reps: int = 300) -> float:
    """Median wall time of ``fn()`` (no device wait between calls; the GC off while timing, as bench/_common)."""
    samples = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return statistics.median(samples)


def host_in_fresh_processes(res: dict, ctypes_too: bool = True) -> None:
    """The host figures (bench_gpu_host.py) from fresh processes: the default (cuda-python binding), then
    the opt-in ctypes driver path (``KVLEDGER_CUDA_CTYPES=1``, figures under ``ctypes_``).

    A long benchmark process was seen to double every host figure (pure-Python checks
    included), so the host cost is measured in a process that does only that.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    for prefix, ctypes_on in (("", "0"), ("ctypes_", "1"))[:2 if ctypes_too else 1]:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = dict(os.environ, KVLEDGER_CUDA_CTYPES=ctypes_on)
            proc = subprocess.run([sys.executable, "-P", os.path.join(here, "bench_gpu_host.py"), "--json", out.name],
                                  env=env, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                res[f"{prefix}host_error"] = proc.stderr[-300:]
                continue
            with open(out.name) as f:
                figures = json.load(f)
        res.update({f"{prefix}{k}": v for k, v in figures.items()})


# --------------------------------------------------------------------------- the naive peer

def _naive_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def naive_zero_kernel(ptrs_ptr, ids_ptr, num_planes, page_bytes, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        chunks = page_bytes // BLOCK
        chunk = pid % chunks
        task = pid // chunks
        plane = task % num_planes
        page = tl.load(ids_ptr + task // num_planes)
        base = tl.load(ptrs_ptr + plane).to(tl.pointer_type(tl.uint8))
        offs = page * page_bytes + chunk * BLOCK + tl.arange(0, BLOCK)
        tl.store(base + offs, tl.zeros([BLOCK], dtype=tl.uint8))

    return naive_zero_kernel


class NaiveClear:
    """The peer: ``torch.tensor(ids, device=...)`` per call, one program per page x plane x 4 KiB."""

    def __init__(self, torch, planes) -> None:
        self.torch = torch
        self.kernel = _naive_kernel()
        self.ptrs = torch.tensor([p.data_ptr() for p in planes], dtype=torch.int64, device=planes[0].device)
        self.num_planes = len(planes)
        self.device = planes[0].device

    def clear(self, ids) -> None:
        idx = self.torch.tensor(ids, dtype=self.torch.int64, device=self.device)
        grid = len(ids) * self.num_planes * (PAGE_BYTES // 4096)
        self.kernel[(grid,)](self.ptrs, idx, self.num_planes, PAGE_BYTES, BLOCK=4096)


# --------------------------------------------------------------------------- set-up

def _lists(rng: random.Random, n: int) -> dict[str, list[int]]:
    first = rng.randrange(NUM_PAGES - n + 1)
    return {"adj": list(range(first, first + n)), "sc": rng.sample(range(0, NUM_PAGES, 2), n)}


def _backends(torch, planes, stream, config, res: dict) -> tuple[dict[str, Callable[[Any], None]], dict[str, Any]]:
    """The clear callables to time, by name, and the objects behind some of them."""
    from kvledger.executors.cuda_backend import CudaClearBackend
    from kvledger.executors.torch_backend import TorchClearBackend
    from kvledger.executors.triton_backend import TritonClearBackend

    tb = TritonClearBackend(planes, stream=stream, config=config, tuning=TUNING[0])
    gb = TritonClearBackend(planes, stream=stream, config=config, tuning=TUNING[0])
    tb.warmup()
    gb.graph_clear([])  # capture once
    out = {"triton": tb.clear, "triton-graph": gb.graph_clear,
           "cuda": CudaClearBackend(planes, stream=stream).clear,
           "torch": TorchClearBackend(planes, stream=stream).clear,
           "seed": CudaClearBackend(planes, stream=stream, mode="per_page").clear,
           "naive": NaiveClear(torch, planes).clear}
    try:
        from bench_gpu_vllm import VllmZeroer

        z = VllmZeroer.over(planes)
        z.zeroer.warmup(len(planes))
        out["vllm"] = z.clear
        res["vllm_files"] = ", ".join(z.paths.values())
    except Exception as exc:  # noqa: BLE001  (reported: the pinned files are not here)
        res["vllm_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return out, {"triton": tb, "triton-graph": gb}


def _verify(torch, clear, planes, ids, stream) -> int:
    """Refill the listed pages with 0xA5 on the model stream, clear them once, return bytes left non-zero."""
    idx = torch.tensor(ids, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for p in planes:
            p.index_fill_(0, idx, 0xA5)
        clear(ids)
    torch.cuda.synchronize()
    return sum(int(p.index_select(0, idx).count_nonzero().item()) for p in planes)


def _environment(torch) -> dict:
    props = torch.cuda.get_device_properties(0)
    res: dict = {"card": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                 "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
                 "page_bytes": PAGE_BYTES, "num_pages": NUM_PAGES}
    for mod in ("triton", "cuda.bindings"):
        try:
            res[mod.replace(".", "_")] = __import__(mod, fromlist=["_"]).__version__
        except ImportError:
            res[mod.replace(".", "_")] = "missing"
    return res


# --------------------------------------------------------------------------- one run

class Run:
    """What one run accumulates: figures, table rows, verification counts."""

    def __init__(self, torch, res: dict, reps: int, config) -> None:
        from kvledger.executors import cuda_driver

        self.torch, self.res, self.reps, self.config = torch, res, reps, config
        self.stream = torch.cuda.Stream()
        self.cu = cuda_driver.as_custream(self.stream.cuda_stream)
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.timer = Timer(torch, self.stream, self.flush)
        self.buf = torch.empty(CEILING_BYTES, dtype=torch.uint8, device="cuda")
        ptr = int(self.buf.data_ptr())
        self.memset = lambda nbytes: cuda_driver.memset_d8_async(ptr, 0, nbytes, self.cu)
        self.ceiling = CEILING_BYTES / self.timer(lambda: self.memset(CEILING_BYTES), reps)[0]
        res["ceiling_memset_bytes_per_s"] = self.ceiling
        res["zero_2gib_bytes_per_s"] = CEILING_BYTES / self.timer(self.buf.zero_, reps)[0]
        self.rng = random.Random(2026)
        self.rows: list = []
        self.cases: list[tuple[str, int]] = []
        self.verified = self.bad_bytes = 0

    def case(self, backends: dict, planes, tag: str, ids: list[int], nbytes: int) -> None:
        """Time every backend on one list (and verify it); figures under ``{tag}_{backend}_*``."""
        res = self.res
        same = self.timer(lambda: self.memset(nbytes), self.reps)[0]
        res[f"{tag}_memset_same_size_device_us"] = same * 1e6
        timings = {}
        for name, clear in backends.items():
            big_loop = name in ("seed", "cuda") and len(ids) * len(planes) >= 16384
            r = 2 if big_loop else self.reps
            timings[name] = self.timer(lambda clear=clear: clear(ids), r)
            if not big_loop:  # the long loops are checked by the tests
                bad = _verify(self.torch, clear, planes, ids, self.stream)
                res[f"{tag}_{name}_verify_nonzero_bytes"] = bad
                self.bad_bytes += bad
                self.verified += 1
        cold = self.timer(lambda: backends["triton"](ids), self.reps, cold=True)[0]
        res[f"{tag}_triton_cold_device_us"] = cold * 1e6
        dev = timings["triton"][0]
        res[f"{tag}_triton_x_memset"] = same / dev
        if "vllm" in timings:
            res[f"{tag}_triton_x_vllm"] = timings["vllm"][0] / dev
            cold_v = self.timer(lambda: backends["vllm"](ids), self.reps, cold=True)[0]
            res[f"{tag}_vllm_cold_device_us"] = cold_v * 1e6
            res[f"{tag}_triton_x_vllm_cold"] = cold_v / cold
        self.cases.append((tag, nbytes))
        naive_dev, naive_host = timings["naive"]
        for name, (dev, host) in timings.items():
            key = f"{tag}_{name}".replace("-", "_")
            res[key + "_device_us"], res[key + "_host_us"] = dev * 1e6, host * 1e6
            res[key + "_ceiling"] = nbytes / dev / self.ceiling
            res[key + "_x_naive"] = naive_dev / dev
            res[key + "_x_naive_host"] = naive_host / host
            self.rows.append([tag, name, f"{nbytes / 1e6:.1f}", f"{dev * 1e6:.1f}", f"{host * 1e6:.1f}",
                              f"{nbytes / dev / 1e9:.0f}", f"{100 * nbytes / dev / self.ceiling:.1f}%",
                              f"{naive_dev / dev:.2f}", f"{timings['cuda'][0] / dev:.2f}",
                              f"{same * 1e6:.1f}", f"{cold * 1e6:.1f}" if name == "triton" else ""])

    def plane_count(self, num_planes: int) -> None:
        """Every list size and pattern over ``num_planes`` planes; host figures on the first count."""
        torch = self.torch
        planes = [torch.randint(0, 256, (NUM_PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda")
                  for _ in range(num_planes)]
        torch.cuda.synchronize()
        backends, objs = _backends(torch, planes, self.stream, self.config, self.res)
        for n in LIST_SIZES:
            for pattern, ids in _lists(self.rng, n).items():
                self.case(backends, planes, f"p{num_planes}_n{n}_{pattern}", ids, n * num_planes * PAGE_BYTES)
        self.placements(planes, num_planes)
        del backends, objs

    def placements(self, planes, num_planes: int) -> None:
        """Where the ids live, measured (module docstring): ``place_p{planes}_n{n}_{how}_{device,host}_us``."""
        from kvledger.executors.triton_backend import IdsPlan, TritonClearBackend

        plans = {"value": IdsPlan(128, "side"), "side": IdsPlan(0, "side"), "stream": IdsPlan(0, "stream"),
                 "mapped": IdsPlan(0, "mapped")}
        made = {how: TritonClearBackend(planes, stream=self.stream, config=self.config, ids=plan, tuning=TUNING[0])
                for how, plan in plans.items()}
        for n in PLACEMENT_SIZES:
            ids = tuple(self.rng.sample(range(0, NUM_PAGES, 2), n))
            for how, b in made.items():
                dev, host = self.timer(lambda b=b, ids=ids: b.clear_checked(ids), self.reps)
                key = f"place_p{num_planes}_n{n}_{how}"
                self.res[key + "_device_us"], self.res[key + "_host_us"] = dev * 1e6, host * 1e6


def run(quick: bool = False, config_path: str | None = None, tuning_path: str | None = None) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    try:
        import triton  # noqa: F401

        from kvledger.executors import cuda_driver

        cuda_driver.driver()
    except (ImportError, CudaUnavailableError) as exc:
        return {"skipped": f"needs triton and cuda-python: {exc}"}
    from kvledger.executors.triton_kernels import FillConfig

    config = None  # the card's row of triton_tuning
    if config_path and os.path.exists(config_path):
        with open(config_path) as f:
            config = FillConfig(**json.load(f)["best"])
    res = _environment(torch)
    from kvledger.executors.triton_tuning import tuning_for

    row = tuning_for(res["card"])
    if tuning_path and os.path.exists(tuning_path):  # this run's sweep: its two shapes as the card's row
        from kvledger.executors.triton_tuning import INF, SMALL, CardTuning

        with open(tuning_path) as f:
            swept = json.load(f)
        row = CardTuning(shapes=((SMALL, FillConfig(**swept["best_small"])), (INF, FillConfig(**swept["best"]))),
                         ids=row.ids, source=f"this run's sweep ({tuning_path})")
    TUNING[0] = row if config is None else None
    res["tuning"] = (f"{[(up_to, c.tag()) for up_to, c in row.shapes]} ids={row.ids} ({row.source})"
                     if config is None else f"one shape from {config_path}: {config.tag()}")
    if config is not None:
        res.update({f"config_{k}": v for k, v in dataclasses.asdict(config).items()})
    host_in_fresh_processes(res, ctypes_too=not quick)
    state = Run(torch, res, reps=5 if quick else 15, config=config)
    for num_planes in PLANE_COUNTS:
        state.plane_count(num_planes)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    res["verified_cases"], res["verified_nonzero_bytes"] = state.verified, state.bad_bytes
    from bench_gpu_host import report

    report(state)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="accepted for scripts/gpu-check; the sweep is bench_gpu_tune")
    ap.add_argument("--config", help="bench_gpu_tune.py's JSON: time the kernel with its large class's knobs alone")
    ap.add_argument("--tuning", help="bench_gpu_tune.py's JSON: its two shapes as this card's row of triton_tuning")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    res = run(quick=args.quick, config_path=args.config, tuning_path=args.tuning)
    if "skipped" in res:
        print(f"bench_gpu skipped: {res['skipped']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
