"""Host cost of the GPU clear paths, part by part, against the floors it sits on; and the target table.

Part of ``bench_gpu.py`` (which calls :func:`host_figures` on its 3-plane set-up and
:func:`report` at the end); run alone it measures the host figures on 3 planes of
2048 x 16 KiB pages. Medians of 300 calls, the GPU left running between them
(a clear never waits for it).

    parts      validate (checks.page_ids), pack (struct.pack_into a pinned row),
               clear via each launch path, stage, graph_clear
    floors     one Triton JIT launch, a direct cuLaunchKernel, cuMemcpyHtoDAsync of
               512 B from pinned memory, torch copy_ of 512 B, cuMemsetD8Async,
               cuEventRecord, CUDAGraph.replay(), cuGraphLaunch
    evidence   host kernel launches of 10 graph_clear calls (backend counter, profiler);
               64 eager clears behind a 0.5 s sleep kernel: did the host ever wait?
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table  # noqa: E402

HOST_SIZES = (16, 128, 1024)


def _parts(torch, planes, stream, n: int) -> dict[str, Any]:
    from bench_gpu import NUM_PAGES

    from kvledger.core import checks
    from kvledger.executors.page_lists import ListRing
    from kvledger.executors.triton_backend import TritonClearBackend

    ids = tuple(random.Random(n).sample(range(NUM_PAGES), n))
    from kvledger.executors.triton_backend import IdsPlan

    make: dict[str, dict[str, Any]] = {"clear": {}, "clear_no_prefetch": {"prefetch": False},
            "clear_copied": {"ids": IdsPlan(0, "side")},
            "clear_triton_launcher": {"launch": "triton", "prefetch": False},
            "clear_jit": {"launch": "jit", "prefetch": False}}
    backends = {k: TritonClearBackend(planes, stream=stream, **kw) for k, kw in make.items()}
    g = backends["clear"]
    ring = ListRing(torch, 1 + NUM_PAGES, planes[0].device)
    slot = ring.acquire()
    parts: dict[str, Any] = {"validate": lambda: checks.page_ids(ids, NUM_PAGES),
                             "pack": lambda: ListRing.pack(slot, (n,), ids),
             "stage": lambda: g.stage(ids), "graph_clear": lambda: g.graph_clear(ids),
             "graph_clear_checked": lambda: g.graph_clear_checked(ids)}
    parts.update({k: (lambda b=b: b.clear(ids)) for k, b in backends.items()})
    parts["clear_checked"] = lambda: g.clear_checked(ids)  # the engine's path: a sealed plan, no recheck
    c = backends["clear_copied"]
    parts["clear_checked_copied"] = lambda: c.clear_checked(ids)  # the same with the list always copied
    return parts


def _floors(torch, planes, stream) -> dict[str, Any]:
    from kvledger.executors import cuda_driver
    from kvledger.executors.triton_backend import TritonClearBackend

    cu = cuda_driver.as_custream(stream.cuda_stream)
    b = TritonClearBackend(planes, stream=stream)
    graph = b.capture()  # the clear-only graph over the staged list: the replay floor
    gexec = cuda_driver.as_cugraphexec(graph.raw_cuda_graph_exec())
    jit = TritonClearBackend(planes, stream=stream, launch="jit", prefetch=False)
    jit.warmup()
    fill_jit, fill = jit._fill(False), b._fill(False)
    empty = torch.zeros(1, dtype=torch.int32, device=planes[0].device)
    eptr = int(empty.data_ptr())
    host = torch.zeros(128, dtype=torch.int32, pin_memory=True)
    dev = torch.zeros(128, dtype=torch.int32, device=planes[0].device)
    hptr, dptr = int(host.data_ptr()), int(dev.data_ptr())
    ev = cuda_driver.event_create()

    def jit_launch():
        with torch.cuda.stream(stream):
            fill_jit(empty, eptr, 1, cu)

    def torch_copy():
        dev.copy_(host, non_blocking=True)

    def replay():
        with torch.cuda.stream(stream):
            graph.replay()

    return {"triton_jit_launch": jit_launch, "direct_launch": lambda: fill(empty, eptr, 1, cu),
            "memcpy_htod_512b": lambda: cuda_driver.memcpy_htod_async(dptr, hptr, 512, cu),
            "torch_copy_512b": torch_copy, "memset_d8": lambda: cuda_driver.memset_d8_async(dptr, 0, 512, cu),
            "event_record": lambda: cuda_driver.event_record(ev, cu), "graph_replay": replay,
            "graph_launch": lambda: cuda_driver.graph_launch(gexec, cu)}


def _evidence(torch, planes, stream, res: dict) -> None:
    from kvledger.executors.triton_backend import TritonClearBackend

    gb = TritonClearBackend(planes, stream=stream)
    ids = random.Random(7).sample(range(planes[0].shape[0]), 16)
    for _ in range(8):  # every row of the graph ring has its graph for this size class
        gb.graph_clear(ids)
    stream.synchronize()
    before = gb.statistics()["kernel_launches"]
    for _ in range(10):
        gb.graph_clear(ids)
    stream.synchronize()
    res["graph_host_kernel_launches"] = gb.statistics()["kernel_launches"] - before
    try:
        from torch.profiler import ProfilerActivity, profile

        counts = {}
        for name, fn in (("graph", gb.graph_clear), ("eager", gb.clear)):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn(ids)
                stream.synchronize()
            names = [e.name for e in prof.events()]
            counts[name] = (sum("LaunchKernel" in n for n in names), sum("GraphLaunch" in n for n in names))
        res["profiler_eager_kernel_launches"] = counts["eager"][0]
        res["profiler_graph_kernel_launches"] = counts["graph"][0]
        res["profiler_graph_launches"] = counts["graph"][1]
    except Exception as exc:  # noqa: BLE001 - the profiler is optional evidence
        res["profiler_error"] = repr(exc)[:200]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s
    t0 = time.perf_counter()
    for i in range(64):
        gb.clear([i, 2 * i + 500])
    res["busy_gpu_64_clears_host_ms"] = (time.perf_counter() - t0) * 1e3
    res["host_never_waited"] = int(not stream.query())
    res["ring_slots_after_busy"] = gb.statistics()["ring_slots"]
    stream.synchronize()


def host_figures(torch, run: Any, planes, objs: dict) -> None:
    """Host parts for 16/128/1024 ids, the floors, the graph evidence: into ``run.res``."""
    from bench_gpu import median_host

    res, stream = run.res, run.stream
    for n in HOST_SIZES:
        for name, fn in _parts(torch, planes, stream, n).items():
            fn()
            res[f"host_n{n}_{name}_us"] = median_host(fn) * 1e6
            stream.synchronize()
    for name, fn in _floors(torch, planes, stream).items():
        fn()
        res[f"floor_{name}_us"] = median_host(fn) * 1e6
        stream.synchronize()
    _evidence(torch, planes, stream, res)


# --------------------------------------------------------------------------- the report

def _targets(res: dict) -> list[tuple[str, str, float, Any]]:
    """Issue 31's targets, and issue 15's it did not replace, as (figure, op, want, got). The host
    targets are the sealed plan's (``clear_checked``): ``clear`` of user input adds the id check
    (``core.checks.page_ids``), shown in the host table."""
    from bench_gpu import BIG_CASE, LIST_SIZES, PAGE_BYTES, PLANE_COUNTS

    rows: list[tuple[str, str, float, Any]] = []
    for p in PLANE_COUNTS:
        for n in LIST_SIZES:
            for pat in ("adj", "sc"):
                tag = f"p{p}_n{n}_{pat}"
                if f"{tag}_triton_device_us" not in res:
                    continue
                if f"{tag}_triton_x_vllm" in res:
                    rows.append((f"{tag}_triton_x_vllm", ">=", 1.0, res[f"{tag}_triton_x_vllm"]))
                if n * p * PAGE_BYTES >= BIG_CASE:
                    rows.append((f"{tag}_triton_x_memset", ">=", 0.9, res[f"{tag}_triton_x_memset"]))
                res[f"{tag}_triton_x_cuda"] = res[f"{tag}_cuda_device_us"] / res[f"{tag}_triton_device_us"]
                rows.append((f"{tag}_triton_x_cuda", ">=", 1.0, res[f"{tag}_triton_x_cuda"]))
    if not any(k.endswith("_triton_x_vllm") for k in res):
        rows.append(("vllm_zeroer_ran", "==", 1, 0))
    for pat in ("adj", "sc"):
        rows.append((f"p3_n1024_{pat}_triton_x_naive", ">=", 1.5, res.get(f"p3_n1024_{pat}_triton_x_naive")))
    for n, want in ((16, 15.0), (128, 15.0), (1024, 30.0)):  # per engine step: the plan needs no recheck
        rows.append((f"host_n{n}_clear_checked_us", "<=", want, res.get(f"host_n{n}_clear_checked_us")))
    floor = res.get("floor_graph_replay_us")
    bound = max(10.0, 1.2 * floor) if isinstance(floor, float) else 10.0
    res["graph_clear_bound_us"] = bound
    for n in (16, 128):  # the graph path: of user input (the id check included), and of a sealed plan
        rows.append((f"host_n{n}_graph_clear_us", "<=", round(bound, 2), res.get(f"host_n{n}_graph_clear_us")))
        rows.append((f"host_n{n}_graph_clear_checked_us", "<=", round(bound, 2),
                     res.get(f"host_n{n}_graph_clear_checked_us")))
    for key in ("graph_host_kernel_launches", "profiler_graph_kernel_launches"):
        rows.append((key, "==", 0, res.get(key)))
    rows.append(("host_never_waited", "==", 1, res.get("host_never_waited")))
    return rows


def _ratio(op: str, want: float, got: Any) -> float | None:
    if not isinstance(got, (int, float)):
        return None
    if op == "==":
        return 1.0 if got == want else 0.0
    if op == ">=":
        return got / want
    return want / got if got else float("inf")


def report(run: Any) -> None:
    """Print the clear table, the vLLM and memset tables, the placements, the host table and the
    target table, each headed by the card's name; targets into ``run.res`` and TARGETS."""
    import bench_gpu

    res = run.res
    card = f"{res['card']}, {res['date']}"
    print_table(
        f"GPU clears on {card} (ceiling: cuMemsetD8Async of 2 GiB = "
        f"{res['ceiling_memset_bytes_per_s'] / 1e12:.2f} TB/s; zero_() {res['zero_2gib_bytes_per_s'] / 1e12:.2f} TB/s; "
        f"16 KiB per plane page; triton: {res['tuning']})",
        ["case", "backend", "MB", "device us", "host us", "GB/s", "% ceiling", "x naive", "x cuda", "memset=",
         "cold us"], run.rows)
    print(f"verified after timing: {run.verified} cases, {run.bad_bytes} listed bytes not zero")
    if "vllm_error" in res:
        print(f"vLLM's zeroer did not run: {res['vllm_error']}")
    else:
        print_table(f"kvledger's clear (triton) against vLLM 0.33's own zeroer on {card}, same planes and ids, "
                    "device us (CUDA events behind a sleep kernel; cold: after a 256 MiB memset)",
                    ["case", "MB", "vLLM", "kvledger", "x vLLM (>= 1)", "vLLM cold", "kvledger cold", "x cold",
                     "host vLLM", "host kvledger"],
                    [[tag, f"{nb / 1e6:.1f}", f"{res[f'{tag}_vllm_device_us']:.1f}",
                      f"{res[f'{tag}_triton_device_us']:.1f}", f"{res[f'{tag}_triton_x_vllm']:.2f}",
                      f"{res[f'{tag}_vllm_cold_device_us']:.1f}", f"{res[f'{tag}_triton_cold_device_us']:.1f}",
                      f"{res[f'{tag}_triton_x_vllm_cold']:.2f}", f"{res[f'{tag}_vllm_host_us']:.1f}",
                      f"{res[f'{tag}_triton_host_us']:.1f}"] for tag, nb in run.cases])
    print_table(f"kvledger's clear (triton) against one memset of the same bytes on {card}, device us",
                ["case", "MB", "memset", "kvledger", "x memset", "target"],
                [[tag, f"{nb / 1e6:.1f}", f"{res[f'{tag}_memset_same_size_device_us']:.1f}",
                  f"{res[f'{tag}_triton_device_us']:.1f}", f"{res[f'{tag}_triton_x_memset']:.2f}",
                  ">= 0.9" if nb >= bench_gpu.BIG_CASE else "-"] for tag, nb in run.cases])
    hows = ("value", "side", "stream", "mapped")
    rows = []
    for p in bench_gpu.PLANE_COUNTS:
        for n in bench_gpu.PLACEMENT_SIZES:
            key = f"place_p{p}_n{n}"
            if f"{key}_value_device_us" in res:
                rows.append([f"{p} planes x {n} ids", *[f"{res[f'{key}_{h}_device_us']:.1f} / "
                                                          f"{res[f'{key}_{h}_host_us']:.1f}" for h in hows]])
    print_table(f"where the ids live, on {card}: device / host us of clear_checked (by value: the kernel's "
                "parameters; side: copied on a copy stream; stream: copied on the model stream; mapped: read "
                "from pinned host memory)", ["list", *hows], rows)
    parts = [k for k in ("validate", "pack", "stage", "clear", "clear_checked", "clear_checked_copied",
                         "clear_no_prefetch", "clear_copied", "clear_triton_launcher",
                         "clear_jit", "graph_clear", "graph_clear_checked") if f"host_n16_{k}_us" in res]
    sizes = list(HOST_SIZES)
    active = res.get("ctypes_ctypes_driver_path", "n/a")
    print_table(f"host cost on {card}, 3 planes, median of 300 calls (us), fresh processes: the default "
                f"(cuda-python binding) / the opt-in ctypes path (active: {active})",
                ["part", *[f"{n} ids" for n in sizes]],
                [[k, *[f"{res[f'host_n{n}_{k}_us']:.1f} / {res.get(f'ctypes_host_n{n}_{k}_us', float('nan')):.1f}"
                       for n in sizes]] for k in parts])
    for prefix in ("", "ctypes_"):
        floors = sorted(k for k in res if k.startswith(f"{prefix}floor_"))
        if floors:
            print(f"floors{' (ctypes path)' if prefix else ''} (us): "
                  + ", ".join(f"{k[len(prefix) + 6:-3]} {res[k]:.1f}" for k in floors))
    rows = []
    for name, op, want, got in _targets(res):
        ratio = _ratio(op, want, got)
        met = ratio is not None and ratio >= 1.0
        bench_gpu.TARGETS[f"target_{name}"] = (op, want)
        res[f"target_{name}"] = got if isinstance(got, (int, float)) else float("nan")
        res[f"target_{name}_ratio"] = ratio if ratio is not None else float("nan")
        shown = f"{got:.4g}" if isinstance(got, float) else str(got)
        rows.append([name, f"{op} {want}", shown, "n/a" if ratio is None else f"{ratio:.2f}",
                     "PASS" if met else "MISS"])
    print_table(f"issue 31 / 15 targets on {card} (ratio >= 1: met)", ["target", "want", "got", "ratio", ""], rows)
    print()
    res["targets_met"] = sum(r[-1] == "PASS" for r in rows)
    res["targets_total"] = len(rows)


def run(quick: bool = False) -> dict:
    """Standalone: the host figures on 3 planes (bench_gpu.py runs this in fresh processes)."""
    try:
        import torch
    except ImportError:
        return {"skipped": "no torch"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA"}
    from bench_gpu import NUM_PAGES, PAGE_BYTES

    class _Run:
        res: dict = {}
        stream = torch.cuda.Stream()

    from kvledger.executors import cuda_driver

    planes = [torch.zeros(NUM_PAGES, PAGE_BYTES, dtype=torch.uint8, device="cuda") for _ in range(3)]
    host_figures(torch, _Run, planes, {})
    _Run.res["ctypes_driver_path"] = int(bool(cuda_driver._direct()))
    for k, v in sorted(_Run.res.items()):
        print(f"{k:40} {v:.2f}" if isinstance(v, float) else f"{k:40} {v}")
    return dict(_Run.res)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    figures = run(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, sort_keys=True)
