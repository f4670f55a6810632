"""GPU clear benchmark: every backend against the write ceiling and the seed's per-page loop.

Cases: clear lists of 16, 128 and 1024 pages over 3 planes and over 128 planes
(64 layers x K/V), 16 KiB per plane page, 2048 pages per plane; page ids either
one adjacent run or scattered (no two adjacent). Backends:

    triton         one Triton launch (plus one H2D copy of the page list)
    triton-graph   stage(ids) + replay of a captured clear graph: no kernel launch from the host
    cuda           cuMemsetD8Async, one call per run of adjacent ids per plane
    torch          the engine's torch backend, when it is importable
    seed           cuMemsetD8Async per page per plane (helios PR #181): the baseline

Figures, all measured in this run on this card:

    ceiling     bytes/s of one large ``zero_()`` (2 GiB), median of event-timed runs
                (one ``cuMemsetD8Async`` of the same 2 GiB is reported beside it)
    device us   CUDA events around one clear on the model stream; a sleep kernel
                ahead of them holds the GPU while the host enqueues, so the figure
                is GPU time plus only those host gaps the GPU could not hide
                (launch-bound loops: the seed, scattered cuda)
    host us     wall time of the ``clear`` call itself (enqueue cost)
    % ceiling   (bytes zeroed / device time) / ceiling
    % memset    the same against the 2 GiB cuMemsetD8Async reference
    x seed      seed device time / backend device time (> 1: faster than the seed)

Medians over ``reps`` runs (quick: fewer). After timing, each case (except
the 10^4+ call loops) refills the listed pages with 0xA5, clears once and
counts bytes left non-zero (reported; must be 0). The triton host cost is split
into validation, list copy, launch and graph replay. ``python bench/bench_gpu.py [--quick]
[--tune] [--json PATH]``; on a machine without CUDA ``run`` returns
``{"skipped": "no CUDA"}`` at once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table  # noqa: E402

from kvledger.core.errors import CudaUnavailableError  # noqa: E402  (no CUDA import)

PAGE_BYTES = 16384
NUM_PAGES = 2048
PLANE_COUNTS = (3, 128)
LIST_SIZES = (16, 128, 1024)
CEILING_BYTES = 2 << 30
GHZ = 2.0e9  # SM clock used to size the sleep kernel (H200 boost ~1.98 GHz)

TARGETS = {
    "p3_n16_adj_triton_device_us": ("<=", 10.0),
    "p3_n16_sc_triton_device_us": ("<=", 10.0),
    "p128_n128_adj_triton_ceiling": (">=", 0.90),
    "p128_n128_sc_triton_ceiling": (">=", 0.90),
    "p128_n1024_adj_triton_ceiling": (">=", 0.90),
    "p128_n1024_sc_triton_ceiling": (">=", 0.90),
    "graph_host_kernel_launches": ("==", 0),
    "profiler_graph_kernel_launches": ("==", 0),
    "cuda_adjacent_min_x_seed": (">", 1.0),
}


def _key(name: str) -> str:
    return name.replace("-", "_")


class _Timer:
    """Event-timed runs of ``fn`` on ``stream`` behind a sleep kernel; medians of device and host time."""

    def __init__(self, torch, stream) -> None:
        self.torch = torch
        self.stream = stream
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn, reps: int) -> tuple[float, float]:
        torch, s = self.torch, self.stream
        with torch.cuda.stream(s):
            fn()  # warm-up: compilation, first-touch
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            est = time.perf_counter() - t0
            torch.cuda.synchronize()
        cycles = int(min(3 * est + 100e-6, 20e-3) * GHZ)
        dev, host = [], []
        for _ in range(reps):
            with torch.cuda.stream(s):
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


def _ceiling(torch, timer, reps: int) -> tuple[float, float | None]:
    """Bytes/s of ``zero_()`` over 2 GiB (the ceiling) and of one cuMemsetD8Async over it (a second reference)."""
    buf = torch.empty(CEILING_BYTES, dtype=torch.uint8, device="cuda")
    dev, _ = timer(buf.zero_, reps)
    memset = None
    try:
        from kvledger.executors import cuda_driver

        cu = cuda_driver.as_custream(timer.stream.cuda_stream)
        ptr = int(buf.data_ptr())
        mdev, _ = timer(lambda: cuda_driver.memset_d8_async(ptr, 0, CEILING_BYTES, cu), reps)
        memset = CEILING_BYTES / mdev
    except CudaUnavailableError:
        pass
    buf = None
    torch.cuda.empty_cache()
    return CEILING_BYTES / dev, memset


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


def _host_breakdown(planes, stream, ids, reps: int = 200) -> dict:
    """Median host cost of each part of the triton paths for ``ids`` (validation, list copy, launch, replay)."""
    from kvledger.core import checks
    from kvledger.executors.triton_backend import TritonClearBackend

    tb = TritonClearBackend(planes, stream=stream)
    tb.clear(ids)
    tb.graph_clear(ids)
    parts = {
        "validate": lambda: checks.page_ids(ids, NUM_PAGES),
        "stage": lambda: tb.stage(ids),
        "clear": lambda: tb.clear(ids),
        "graph_clear": lambda: tb.graph_clear(ids),
    }
    out = {}
    for name, fn in parts.items():
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        stream.synchronize()
        out[name] = statistics.median(samples)
    return out


def _lists(rng: random.Random, n: int) -> dict:
    first = rng.randrange(NUM_PAGES - n + 1)
    return {
        "adj": list(range(first, first + n)),
        "sc": rng.sample(range(0, NUM_PAGES, 2), n),  # even ids only: no two adjacent
    }


def _backends(torch, planes, stream) -> tuple[dict[str, Callable[[list[int]], None]], dict[str, Any]]:
    """The clear callables to time, by name, and notes: why one is missing, the graph backend."""
    out: dict[str, Callable[[list[int]], None]] = {}
    notes: dict[str, Any] = {}
    try:
        from kvledger.executors.triton_backend import TritonClearBackend

        tb = TritonClearBackend(planes, stream=stream)
        out["triton"] = tb.clear
        gb = TritonClearBackend(planes, stream=stream)
        gb.graph_clear([])  # capture once
        out["triton-graph"] = gb.graph_clear
        notes["triton-graph"] = gb
    except (ImportError, CudaUnavailableError) as exc:
        notes["triton_missing"] = str(exc)
    try:
        from kvledger.executors.cuda_backend import CudaClearBackend

        out["cuda"] = CudaClearBackend(planes, stream=stream).clear
        out["seed"] = CudaClearBackend(planes, stream=stream, mode="per_page").clear
    except (ImportError, CudaUnavailableError) as exc:
        notes["cuda_missing"] = str(exc)
    try:
        from kvledger.executors.torch_backend import TorchClearBackend

        out["torch"] = TorchClearBackend(planes, stream=stream).clear
    except ImportError as exc:
        notes["torch_missing"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - another helper's backend: report, keep measuring the rest
        notes["torch_error"] = f"{type(exc).__name__}: {exc}"
    return out, notes


def _profile_launches(torch, fn, stream):
    """Count kernel-launch and graph-launch API calls the profiler sees during ``fn()``; None if unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            stream.synchronize()
        names = [e.name for e in prof.events()]
    except Exception:  # noqa: BLE001 - the profiler is optional evidence
        return None
    kernels = sum(1 for n in names if "LaunchKernel" in n)
    graphs = sum(1 for n in names if "GraphLaunch" in n)
    return kernels, graphs


def _tune(torch, planes, stream, timer, ceiling, reps, res, rows) -> None:
    from kvledger.executors.triton_backend import TritonClearBackend

    rng = random.Random(7)
    P = len(planes)
    for n in (16, 1024) if P <= 8 else (128, 1024):
        ids = _lists(rng, n)["sc"]
        nbytes = n * P * PAGE_BYTES
        for pps in (4, 8, 16, 32):
            b = TritonClearBackend(planes, stream=stream, programs_per_sm=pps)
            for mode, fn in (("eager", b.clear), ("graph", b.graph_clear)):
                dev, host = timer(lambda fn=fn, ids=ids: fn(ids), reps)
                frac = nbytes / dev / ceiling
                tag = f"tune_p{P}_n{n}_pps{pps}_{mode}"
                res[tag + "_device_us"] = dev * 1e6
                res[tag + "_ceiling"] = frac
                rows.append([f"p{P} n{n} programs/SM={pps} {mode}", f"{dev * 1e6:.1f}", f"{100 * frac:.1f}%"])


def _environment(torch) -> dict:
    """The card, the date and the versions the figures belong to."""
    props = torch.cuda.get_device_properties(0)
    res: dict = {
        "card": props.name,
        "sms": props.multi_processor_count,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "page_bytes": PAGE_BYTES,
        "num_pages": NUM_PAGES,
    }
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = "missing"
    try:
        import cuda.bindings

        res["cuda_bindings"] = cuda.bindings.__version__
    except ImportError:
        res["cuda_bindings"] = "missing"
    return res


class _Run:
    """What one run accumulates: figures, table rows, verification counts."""

    def __init__(self, torch, res: dict, reps: int) -> None:
        self.torch = torch
        self.res = res
        self.reps = reps
        self.stream = torch.cuda.Stream()
        self.timer = _Timer(torch, self.stream)
        self.ceiling, self.memset_ref = _ceiling(torch, self.timer, reps)
        res["ceiling_bytes_per_s"] = self.ceiling
        if self.memset_ref is not None:
            res["memset_2gib_bytes_per_s"] = self.memset_ref
        self.rng = random.Random(2026)
        self.rows: list = []
        self.tune_rows: list = []
        self.cuda_vs_seed: list[float] = []
        self.verified = 0
        self.bad_bytes = 0

    def case(self, backends: dict, planes, tag: str, ids: list[int], nbytes: int) -> dict:
        """Time every backend on one list (and verify it); returns ``{name: (device s, host s)}``."""
        timings = {}
        for name, clear in backends.items():
            big_loop = name in ("seed", "cuda") and len(ids) * len(planes) >= 16384
            r = max(2, self.reps // 5) if big_loop else self.reps
            timings[name] = self.timer(lambda clear=clear: clear(ids), r)
            if not big_loop:  # the long loops are checked by the tests
                bad = _verify(self.torch, clear, planes, ids, self.stream)
                self.res[f"{tag}_{_key(name)}_verify_nonzero_bytes"] = bad
                self.bad_bytes += bad
                self.verified += 1
        seed_dev, seed_host = timings.get("seed", (float("nan"), float("nan")))
        for name, (dev, host) in timings.items():
            self._figures(f"{tag}_{_key(name)}", nbytes, dev, host, seed_dev, seed_host)
            self.rows.append(self._row(tag, name, nbytes, dev, host, seed_dev, seed_host))
        return timings

    def _figures(self, key: str, nbytes: int, dev: float, host: float, seed_dev: float, seed_host: float) -> None:
        res = self.res
        res[key + "_device_us"] = dev * 1e6
        res[key + "_host_us"] = host * 1e6
        res[key + "_bytes_per_s"] = nbytes / dev
        res[key + "_ceiling"] = nbytes / dev / self.ceiling
        if self.memset_ref:
            res[key + "_memset_frac"] = nbytes / dev / self.memset_ref
        res[key + "_x_seed"] = seed_dev / dev
        res[key + "_x_seed_host"] = seed_host / host

    def _row(self, tag: str, name: str, nbytes: int, dev: float, host: float, seed_dev: float,
             seed_host: float) -> list[str]:
        memset = f"{100 * nbytes / dev / self.memset_ref:.0f}%" if self.memset_ref else "n/a"
        return [tag, name, f"{nbytes / 1e6:.1f}", f"{dev * 1e6:.1f}", f"{host * 1e6:.1f}",
                f"{nbytes / dev / 1e9:.1f}", f"{100 * nbytes / dev / self.ceiling:.1f}%", memset,
                f"{seed_dev / dev:.1f}", f"{seed_host / host:.1f}"]

    def graph_evidence(self, gb, eager) -> None:
        """Host kernel launches of 10 stage + replay steps, and what the profiler saw."""
        torch, stream, res = self.torch, self.stream, self.res
        ids = _lists(self.rng, 16)["sc"]
        before = gb.statistics()["kernel_launches"]
        for _ in range(10):
            gb.graph_clear(ids)
        stream.synchronize()
        res["graph_host_kernel_launches"] = gb.statistics()["kernel_launches"] - before
        prof_graph = _profile_launches(torch, lambda: gb.graph_clear(ids), stream)
        prof_eager = _profile_launches(torch, lambda: eager(ids), stream)
        if prof_graph is not None and prof_eager is not None and prof_eager[0] >= 1:
            res["profiler_eager_kernel_launches"] = prof_eager[0]
            res["profiler_graph_kernel_launches"] = prof_graph[0]
            res["profiler_graph_launches"] = prof_graph[1]
        else:
            res["profiler_graph_kernel_launches"] = "n/a"

    def plane_count(self, num_planes: int, tune: bool) -> None:
        """Every list size and pattern over ``num_planes`` planes, then the graph and host figures."""
        torch, res = self.torch, self.res
        planes = [torch.randint(0, 256, (NUM_PAGES, PAGE_BYTES), dtype=torch.uint8, device="cuda")
                  for _ in range(num_planes)]
        torch.cuda.synchronize()
        backends, notes = _backends(torch, planes, self.stream)
        for k, v in notes.items():
            if isinstance(v, str):
                res[f"p{num_planes}_{k}"] = v
        for n in LIST_SIZES:
            for pattern, ids in _lists(self.rng, n).items():
                timings = self.case(backends, planes, f"p{num_planes}_n{n}_{pattern}", ids,
                                    n * num_planes * PAGE_BYTES)
                if pattern == "adj" and "cuda" in timings and "seed" in timings:
                    self.cuda_vs_seed.append(timings["seed"][0] / timings["cuda"][0])
        first = num_planes == PLANE_COUNTS[0]
        gb = notes.get("triton-graph")
        if gb is not None and first:
            self.graph_evidence(gb, backends["triton"])
        if first and "triton" in backends:
            ids = _lists(self.rng, 16)["sc"]
            for name, sec in _host_breakdown(planes, self.stream, ids).items():
                res[f"host_p{num_planes}_n16_{name}_us"] = sec * 1e6
        if tune and "triton" in backends:
            _tune(torch, planes, self.stream, self.timer, self.ceiling, self.reps, res, self.tune_rows)


def _report(run: _Run) -> None:
    """Print the tables, the graph and host figures, and each target's PASS / MISS."""
    res, ceiling, memset_ref = run.res, run.ceiling, run.memset_ref
    memset = f"{memset_ref / 1e12:.2f} TB/s" if memset_ref else "n/a"
    print_table(
        f"GPU clear backends on {res['card']}, {res['date']} (ceiling: zero_() of 2 GiB = {ceiling / 1e12:.2f} TB/s; "
        f"cuMemsetD8Async of 2 GiB = {memset}; 16 KiB per plane page)",
        ["case", "backend", "MB", "device us", "host us", "GB/s", "% ceiling", "% memset", "x seed dev",
         "x seed host"],
        run.rows,
    )
    if "graph_host_kernel_launches" in res:
        print(f"triton in a captured graph: {res['graph_host_kernel_launches']} host kernel launches over 10 "
              f"stage+replay steps; profiler: eager clear {res.get('profiler_eager_kernel_launches', 'n/a')} "
              f"kernel launches, stage+replay {res.get('profiler_graph_kernel_launches', 'n/a')} kernel launches "
              f"and {res.get('profiler_graph_launches', 'n/a')} graph launches")
    print(f"verified after timing: {run.verified} cases, {run.bad_bytes} listed bytes not zero")
    if "host_p3_n16_clear_us" in res:
        validate, stage, clear, graph_clear = (res[f"host_p3_n16_{k}_us"]
                                               for k in ("validate", "stage", "clear", "graph_clear"))
        print(f"triton host cost, 16 pages x 3 planes (median of 200): validate {validate:.1f} us, list copy "
              f"{stage:.1f} us, clear (copy + launch) {clear:.1f} us, graph_clear (copy + replay) {graph_clear:.1f} us")
    if run.tune_rows:
        print_table("triton tuning (scattered ids; eager clear and stage + graph replay)",
                    ["variant", "device us", "% ceiling"], run.tune_rows)
    for name, (op, want) in TARGETS.items():
        got = res.get(name)
        ok = isinstance(got, (int, float)) and {"<=": got <= want, ">=": got >= want, "==": got == want,
                                                 ">": got > want}[op]
        shown = f"{got:.4g}" if isinstance(got, float) else str(got)
        print(f"target {name:<34} {op} {want!s:<6} got {shown:<12} {'PASS' if ok else 'MISS'}")


def run(quick: bool = False, tune: bool = False) -> dict:
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    res = _environment(torch)
    state = _Run(torch, res, reps=5 if quick else 15)
    for num_planes in PLANE_COUNTS:
        state.plane_count(num_planes, tune)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the planes of this count are gone: free them before the next
    if state.cuda_vs_seed:
        res["cuda_adjacent_min_x_seed"] = min(state.cuda_vs_seed)
    res["verified_cases"] = state.verified
    res["verified_nonzero_bytes"] = state.bad_bytes
    _report(state)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tune", action="store_true", help="also sweep the triton grid knobs")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    res = run(quick=args.quick, tune=args.tune)
    if "skipped" in res:
        print(f"bench_gpu skipped: {res['skipped']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
