"""The step path, phase by phase: what ``run_step`` costs beyond its graph, and where it goes.

One rank, 3 planes of 4,096 pages (16 KiB a page on CUDA, 1 KiB on the CPU), 2 pages
cleared per step (a 2-page snapshot aliased, released, its pages reserved and committed
again: the ledger lists them), one 4 KiB input copy, and a trivial graph (one in-place add
on a one-element tensor). Between steps the commands run outside the clock; what is timed:

    engine overhead   ``await engine.run_step(step, inputs)``, call to return, minus the
                      graph's own time (host time on the CPU; two CUDA events around it on
                      the model stream on a GPU)
    bare              the same graph called directly and waited for the same way
                      (``wait_cuda_event`` on an event recorded after it), minus its own time
    overhead - bare   the target row: <= 25 us on the CPU, <= 30 us on an H200

and, to show where the engine's overhead goes (each timed alone, in the same run):

    ledger            ``seal_step`` + ``complete_step`` on a bare ``Ledger`` in the same state
    input copies      the copy alone, as the executor makes it (host time; CUDA: the rank's
                      stream switch and ``CudaRank.copy_all``, one driver copy here)
    clear             the backend's ``clear_checked`` on the same kind of list (host time)
    executor          ``RankExecutor.run_job`` called directly on the job an inline rank gets
                      (no scope of its own; timings as the engine's default), minus graph,
                      copies and clear: the executor's own bookkeeping (events, the wait,
                      outcome)
    engine machinery  engine overhead - ledger - (run_job - graph): the runner's own work
                      (hand-off to the ranks, scopes, records, hooks)
    checkpoint        one ``anyio.lowlevel.checkpoint()`` (what a cancellation point costs)

On CUDA a second table (``--device cuda``; ``--no-trace`` to skip it) follows one engine
and one bare loop step by step with host timestamps at the phase boundaries (``run_job``,
the rank's copies, the backend's ``clear_checked``, the graph, ``wait_cuda_event``: their
public entry points wrapped for the trace only, a few tenths of a microsecond each), median
per step: where the engine's time goes, the device wait included, next to the bare loop's.
The card's name heads every table.

Timing: every side is built fresh per repeat (an engine in its own event loop), warmed up,
then the sides run segment by segment, alternately (the order flips every segment), with
the collector disabled; each figure is the sum over segments of each segment's best over
the repeats, per step. The machine may be shared: compare rows of one run, not runs. The
parts run alone stay hot in the caches; the engine's step does not (the other sides ran
in between, as a serving loop's own work does): what that costs lands in "machinery".

    python bench/bench_steps.py [--quick] [--device cuda] [--backend triton] [--no-trace] [--json PATH]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table, timed_segments  # noqa: E402

NUM_PAGES = 4096
PLANES = 3
CLEAR = 2  # pages cleared per step
COPY_BYTES = 4096
WARMUP = 5
TARGET_US = {"cpu": 25.0, "cuda": 30.0}
TARGETS = {"overhead_minus_bare_us": ("<=", TARGET_US["cpu"])}


class _Setup:
    """The device, the planes, the trivial graph and its own clock."""

    def __init__(self, device: str, backend: str | None) -> None:
        import torch

        self.torch = torch
        self.cuda = device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.page_bytes = 16384 if self.cuda else 1024
        self.backend = backend or (_best_cuda_backend() if self.cuda else "torch")
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.x = torch.zeros(1, device=self.device)
        pin = self.cuda
        self.src = torch.ones(COPY_BYTES, dtype=torch.uint8, pin_memory=pin)
        self.dst = torch.zeros(COPY_BYTES, dtype=torch.uint8, device=self.device)
        self.events: list[tuple[Any, Any]] = []  # CUDA: (start, end) per graph call, read after a segment
        self.host_graph_s = 0.0  # CPU: the graph's own time, summed
        self.mark: Callable[[str], None] | None = None  # the trace's stamp, while tracing
        self.card = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"

    def planes(self) -> list:
        t = self.torch
        return [t.zeros((NUM_PAGES, self.page_bytes), dtype=t.uint8, device=self.device) for _ in range(PLANES)]

    def graph(self, ctx: Any, step: int, inputs: Any) -> None:
        """The trivial graph: one add; it times itself (host time, or two events on the model stream)."""
        mark = self.mark
        if mark is not None:
            mark("graph")
        if self.cuda:
            t = self.torch
            a, b = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            s = ctx.stream
            a.record(s)
            with t.cuda.stream(s):
                self.x.add_(1)
            b.record(s)
            self.events.append((a, b))
            if mark is not None:
                mark("graph done")
            return
        t0 = time.perf_counter()
        self.x.add_(1)
        self.host_graph_s += time.perf_counter() - t0

    def take_graph_s(self) -> float:
        """The graph time accumulated since the last call (CUDA: waits for the events)."""
        if self.cuda:
            for _, b in self.events:
                b.synchronize()
            total = sum(a.elapsed_time(b) for a, b in self.events) * 1e-3
            self.events.clear()
            return total
        total, self.host_graph_s = self.host_graph_s, 0.0
        return total

    def inputs(self) -> Any:
        from kvledger.engine import StepInputs

        return StepInputs(copies=[(self.src, self.dst)])

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)


def _best_cuda_backend() -> str:
    for name, module in (("triton", "triton"), ("cuda", "cuda.bindings.driver")):
        try:
            __import__(module)
            return name
        except ImportError:
            continue
    return "torch"


def _commands(ledger: Any, step: int, ids: list[int]) -> None:
    """Make ``step``'s clear list 2 pages long: a snapshot's pages released, then committed."""
    s = ids[0]
    ids[0] += 2
    ledger.alias_snapshot(s, CLEAR)
    ledger.release_snapshot(s)
    ledger.reserve(s + 1, CLEAR)
    ledger.commit(s + 1, step, CLEAR)
    if step:
        ledger.finish(s - 1)


# ---------------------------------------------------------------------- sides: segment(k) -> seconds


class _EngineSide:
    """An engine open in its own event loop; a segment runs k steps, timing ``run_step`` only."""

    def __init__(self, s: _Setup) -> None:
        from kvledger import Geometry
        from kvledger.engine import RankSpec, open_engine

        self.s = s
        self.loop = asyncio.new_event_loop()
        self.ids = [1]
        self.step = 0
        self.engine: Any = None
        spec = RankSpec(planes=s.planes(), graph=s.graph, backend=s.backend, stream=s.stream)
        g = Geometry(num_pages=NUM_PAGES, page_tokens=16)

        async def host(ready: asyncio.Event, stop: asyncio.Event) -> None:
            async with open_engine(g, ranks=[spec]) as engine:
                self.engine = engine
                ready.set()
                await stop.wait()

        self._stop = asyncio.Event()
        ready = asyncio.Event()
        self._host = self.loop.create_task(host(ready, self._stop))
        self.loop.run_until_complete(ready.wait())
        self.segment(WARMUP)

    async def _run(self, k: int) -> float:
        engine, s, inputs = self.engine, self.s, self.s.inputs()
        ledger = engine.ledger
        wall = 0.0
        s.take_graph_s()
        for _ in range(k):
            step = self.step
            _commands(ledger, step, self.ids)  # the ledger directly: nothing else runs on it now
            t0 = time.perf_counter()
            await engine.run_step(step, inputs)
            wall += time.perf_counter() - t0
            self.step += 1
        return wall - s.take_graph_s()

    def segment(self, k: int) -> float:
        return self.loop.run_until_complete(self._run(k))

    async def _trace(self, trace: _Trace, k: int) -> None:
        engine, s, inputs = self.engine, self.s, self.s.inputs()
        for _ in range(k):
            step = self.step
            _commands(engine.ledger, step, self.ids)
            trace.mark("run_step")
            await engine.run_step(step, inputs)
            trace.mark("returned")
            trace.end_step()
            self.step += 1
        s.take_graph_s()

    def trace(self, trace: _Trace, k: int) -> None:
        self.loop.run_until_complete(self._trace(trace, k))

    def close(self) -> None:
        self._stop.set()
        self.loop.run_until_complete(self._host)
        self.loop.close()


class _BareSide:
    """The graph called directly, waited for as the executor waits (CUDA: an event, polled)."""

    def __init__(self, s: _Setup) -> None:
        from kvledger.engine import RankContext

        self.s = s
        self.loop = asyncio.new_event_loop()
        self.ctx = RankContext(rank=0, world_size=1, device=s.device, stream=s.stream, planes=(), backend=None)
        self.done = s.torch.cuda.Event() if s.cuda else None
        self.segment(WARMUP)

    async def _run(self, k: int) -> float:
        from kvledger.executors.executor import wait_cuda_event

        s, ctx, done = self.s, self.ctx, self.done
        inputs = s.inputs()
        wall = 0.0
        s.take_graph_s()
        for step in range(k):
            t0 = time.perf_counter()
            s.graph(ctx, step, inputs)
            if done is not None:
                done.record(ctx.stream)
                await wait_cuda_event(done)
            wall += time.perf_counter() - t0
        return wall - s.take_graph_s()

    def segment(self, k: int) -> float:
        return self.loop.run_until_complete(self._run(k))

    async def _trace(self, trace: _Trace, k: int) -> None:
        from kvledger.executors import executor

        s, ctx, done = self.s, self.ctx, self.done
        inputs = s.inputs()
        for step in range(k):
            trace.mark("step")
            s.graph(ctx, step, inputs)
            if done is not None:
                done.record(ctx.stream)
                await executor.wait_cuda_event(done)  # (through the module: the trace wraps it)
            trace.mark("returned")
            trace.end_step()
        s.take_graph_s()

    def trace(self, trace: _Trace, k: int) -> None:
        self.loop.run_until_complete(self._trace(trace, k))

    def close(self) -> None:
        self.loop.close()


class _LedgerSide:
    """seal_step + complete_step on a bare Ledger, with the same commands outside the clock."""

    def __init__(self, s: _Setup) -> None:
        from kvledger import Geometry, Ledger

        self.ledger = Ledger(Geometry(num_pages=NUM_PAGES, page_tokens=16))
        self.ids = [1]
        self.step = 0
        self.segment(WARMUP)

    def segment(self, k: int) -> float:
        ledger = self.ledger
        wall = 0.0
        for _ in range(k):
            step = self.step
            _commands(ledger, step, self.ids)
            t0 = time.perf_counter()
            ledger.seal_step(step)
            ledger.complete_step(step, 0)
            wall += time.perf_counter() - t0
            self.step += 1
        return wall

    def close(self) -> None:
        pass


class _CallSide:
    """One host call per step, alone: ``fn(step)``; the device is drained after the segment."""

    def __init__(self, s: _Setup, fn: Callable[[int], Any]) -> None:
        self.s, self.fn, self.step = s, fn, 0
        self.segment(WARMUP)

    def segment(self, k: int) -> float:
        fn = self.fn
        wall = 0.0
        for _ in range(k):
            t0 = time.perf_counter()
            fn(self.step)
            wall += time.perf_counter() - t0
            self.step += 1
        self.s.sync()
        return wall

    def close(self) -> None:
        self.s.sync()


def _clear_side(s: _Setup) -> _CallSide:
    from kvledger.executors.backend import make_backend

    backend = make_backend(s.backend, s.planes(), stream=s.stream)
    fast = getattr(backend, "clear_checked", backend.clear)  # (a bench may look; the engine may not)
    lists = _lists()
    return _CallSide(s, lambda step: fast(lists[step % len(lists)]))


def _copies_side(s: _Setup) -> _CallSide:
    """The input copy as the executor makes it: on CUDA ``CudaRank.copy_all`` under the rank's
    stream switch (a driver copy for this plain pinned pair), on the CPU ``copy_``."""
    src, dst = s.src, s.dst
    if s.stream is not None:
        from kvledger.executors.cuda_rank import CudaRank

        rank = CudaRank(s.device, s.stream, sanitize=False, timings=False)
        switch, copy_all, pairs = rank.switch, rank.copy_all, [(src, dst)]

        def copy(step: int) -> None:
            with switch:
                copy_all(pairs)
    else:
        def copy(step: int) -> None:
            dst.copy_(src, non_blocking=True)

    return _CallSide(s, copy)


def _lists() -> list[tuple[int, ...]]:
    rng = random.Random(5)
    return [tuple(rng.sample(range(NUM_PAGES), CLEAR)) for _ in range(64)]


class _ExecutorSide:
    """``RankExecutor.run_job`` called directly on prepared jobs; minus the graph's time."""

    def __init__(self, s: _Setup) -> None:
        from kvledger.executors.backend import make_backend
        from kvledger.executors.executor import RankExecutor

        self.s = s
        planes = s.planes()
        backend = make_backend(s.backend, planes, stream=s.stream)
        self.ex = RankExecutor(0, num_pages=NUM_PAGES, backend=backend, graph=s.graph, planes=planes,
                               device=s.device, stream=s.stream, world_size=1, timings=False)
        self.loop = asyncio.new_event_loop()
        self.lists = _lists()
        self.step = 0
        self.segment(WARMUP)

    def _job(self, step: int) -> Any:
        from kvledger.core.events import StepPlan
        from kvledger.executors.executor import StepJob, StepReplies

        plan = StepPlan(step=step, clear_list=self.lists[step % len(self.lists)])
        return StepJob(plan, self.s.inputs(), None, StepReplies(1), checked=True)  # the inline ranks' job

    async def _run(self, k: int) -> float:
        jobs = [self._job(self.step + i) for i in range(k)]
        self.s.take_graph_s()
        wall = 0.0
        run_job = self.ex.run_job
        for job in jobs:
            t0 = time.perf_counter()
            await run_job(job)
            wall += time.perf_counter() - t0
        self.step += k
        return wall - self.s.take_graph_s()

    def segment(self, k: int) -> float:
        return self.loop.run_until_complete(self._run(k))

    def close(self) -> None:
        self.loop.close()


class _CheckpointSide:
    def __init__(self, s: _Setup) -> None:
        self.loop = asyncio.new_event_loop()
        self.segment(WARMUP)

    async def _run(self, k: int) -> float:
        import anyio.lowlevel

        t0 = time.perf_counter()
        for _ in range(k):
            await anyio.lowlevel.checkpoint()
        return time.perf_counter() - t0

    def segment(self, k: int) -> float:
        return self.loop.run_until_complete(self._run(k))

    def close(self) -> None:
        self.loop.close()


# ---------------------------------------------------------------------- the trace (CUDA)


class _Trace:
    """Host timestamps at phase boundaries, per step: ``mark(name)`` appends (name, perf_counter)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, float]]] = []
        self.cur: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.cur.append((name, time.perf_counter()))

    def end_step(self) -> None:
        self.steps.append(self.cur)
        self.cur = []

    def intervals(self) -> dict[str, float]:
        """Median us between consecutive marks, by ``"a -> b"``, over steps with the usual sequence."""
        seqs: dict[tuple[str, ...], int] = {}
        for st in self.steps:
            key = tuple(n for n, _ in st)
            seqs[key] = seqs.get(key, 0) + 1
        common = max(seqs, key=lambda k: seqs[k])
        per: dict[str, list[float]] = {}
        for st in self.steps:
            if tuple(n for n, _ in st) != common:
                continue
            for (a, ta), (b, tb) in zip(st, st[1:], strict=False):
                per.setdefault(f"{a} -> {b}", []).append((tb - ta) * 1e6)
            per.setdefault("total", []).append((st[-1][1] - st[0][1]) * 1e6)
        return {k: statistics.median(v) for k, v in per.items()}


class _Patched:
    """Wrap public entry points for the trace (restored on exit): ``RankExecutor.run_job``,
    ``CudaRank.copy_all``, the backend class's ``clear_checked`` and ``wait_cuda_event``."""

    def __init__(self, trace: _Trace, backend_cls: Any) -> None:
        from kvledger.executors import cuda_rank, executor

        self.trace, self.saved = trace, []
        mark = trace.mark

        def wrap(owner: Any, name: str, before: str, after: str, is_async: bool = False) -> None:
            fn = getattr(owner, name)
            self.saved.append((owner, name, fn))
            if is_async:
                async def wrapped_async(*a: Any, **kw: Any) -> Any:
                    mark(before)
                    try:
                        return await fn(*a, **kw)
                    finally:
                        mark(after)
                setattr(owner, name, wrapped_async)
            else:
                def wrapped(*a: Any, **kw: Any) -> Any:
                    mark(before)
                    try:
                        return fn(*a, **kw)
                    finally:
                        mark(after)
                setattr(owner, name, wrapped)

        wrap(executor.RankExecutor, "run_job", "run_job", "run_job done", is_async=True)
        wrap(cuda_rank.CudaRank, "copy_all", "copies", "copies done")
        if backend_cls is not None and hasattr(backend_cls, "clear_checked"):
            wrap(backend_cls, "clear_checked", "clear", "clear done")
        wrap(executor, "wait_cuda_event", "wait", "wait done", is_async=True)

    def close(self) -> None:
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)


def trace_steps(s: _Setup, steps: int) -> dict[str, dict[str, float]]:
    """The engine's steps and the bare loop's, traced (module docstring); median us per interval."""
    from kvledger.executors.backend import backend_class

    out: dict[str, dict[str, float]] = {}
    for name, side_cls in (("engine", _EngineSide), ("bare", _BareSide)):
        trace = _Trace()
        side = side_cls(s)  # (built and warmed up before the patching: nothing traced yet)
        patched = _Patched(trace, backend_class(s.backend))
        s.mark = trace.mark
        try:
            side.trace(trace, steps)
        finally:
            s.mark = None
            patched.close()
            side.close()
        out[name] = trace.intervals()
    return out


# ---------------------------------------------------------------------- the run


def run(quick: bool, device: str = "cpu", backend: str | None = None, trace: bool = True) -> dict:
    try:
        import anyio  # noqa: F401
        import torch
    except ImportError:
        return {"skipped": "torch or anyio is not installed"}
    if device == "cuda" and not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s = _Setup(device, backend)
        repeats, segments, k = (3, 6, 40) if quick else (5, 12, 40)
        sides: dict[str, Callable[[], Any]] = {
            "engine": lambda: _EngineSide(s),
            "bare": lambda: _BareSide(s),
            "ledger": lambda: _LedgerSide(s),
            "copies": lambda: _copies_side(s),
            "clear": lambda: _clear_side(s),
            "executor": lambda: _ExecutorSide(s),
            "checkpoint": lambda: _CheckpointSide(s),
        }
        t = {name: v * 1e6 for name, v in timed_segments(sides, segments, k, repeats).items()}
        traced = trace_steps(s, 200 if quick else 500) if (trace and s.cuda) else {}
    finally:
        torch.set_num_threads(threads)
    executor_own = t["executor"] - t["copies"] - t["clear"]
    machinery = t["engine"] - t["ledger"] - t["executor"]
    target = TARGET_US[device]
    figures: dict[str, Any] = {
        "device": device, "backend": s.backend, "page_bytes": s.page_bytes, "planes": PLANES, "pages": NUM_PAGES,
        "pages_cleared_per_step": CLEAR, "repeats": repeats, "segments": segments, "steps_per_segment": k,
        "engine_overhead_us": t["engine"], "bare_overhead_us": t["bare"],
        "overhead_minus_bare_us": t["engine"] - t["bare"], "target_us": target,
        "ledger_us": t["ledger"], "copies_us": t["copies"], "clear_checked_us": t["clear"],
        "run_job_us": t["executor"], "executor_own_us": executor_own, "machinery_us": machinery,
        "checkpoint_us": t["checkpoint"], "card": s.card,
        "executor_own_minus_bare_us": executor_own - t["bare"],
    }
    for side_name, iv in traced.items():
        for key, us in iv.items():
            figures[f"trace_{side_name}_{key}_us"] = us
    rows = [
        ("run_step wall - graph time (engine overhead)", f"{t['engine']:.1f}"),
        ("the same graph called bare, waited for the same way", f"{t['bare']:.1f}"),
        (f"overhead - bare (target <= {target:.0f})", f"{t['engine'] - t['bare']:.1f}"),
        ("of the engine's overhead: seal + completion record (the ledger)", f"{t['ledger']:.1f}"),
        ("  the executor's run_job (copies + clear + its own work)", f"{t['executor']:.1f}"),
        ("    input copies (host side)", f"{t['copies']:.1f}"),
        ("    the clear (the backend's clear_checked, host side)", f"{t['clear']:.1f}"),
        ("    executor bookkeeping (the rest of run_job: graph, wait, outcome)", f"{executor_own:.1f}"),
        ("      of it beyond the bare loop's graph + wait", f"{executor_own - t['bare']:.1f}"),
        ("  engine machinery (hand-off to the ranks and back, records, hooks)", f"{machinery:.1f}"),
        ("one anyio.lowlevel.checkpoint() (a cancellation point)", f"{t['checkpoint']:.1f}"),
    ]
    print_table(
        f"the step path by phase on {s.card}, us per step ({device}, backend {s.backend}, 1 rank, {PLANES} planes x "
        f"{NUM_PAGES} x {s.page_bytes // 1024} KiB pages, {CLEAR} pages cleared per step, one "
        f"{COPY_BYTES // 1024} KiB input copy, a trivial graph; best of {repeats} per segment)",
        ["phase", "us per step"], rows,
    )
    for side_name, iv in traced.items():
        print_table(f"{side_name} step traced on {s.card} (host timestamps, median us per step; wrappers add a "
                    "few tenths of a us per mark)", ["interval", "us"], [(k, f"{v:.1f}") for k, v in iv.items()])
    return figures


def _arg(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


if __name__ == "__main__":
    dev = _arg("--device") or "cpu"
    figs = run("--quick" in sys.argv, dev, _arg("--backend"), trace="--no-trace" not in sys.argv)
    out = _arg("--json")
    if out is not None:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(figs, f, indent=1)
