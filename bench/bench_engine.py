"""Engine overhead per step: the async engine against the bare synchronous ledger.

One step of the workload, for N requests (N = 1, 32, 256):

    alias a 2-page snapshot and release it (its pages come back marked)
    N x (reserve 2 pages for a new request, commit them for the step)
    finish the N requests of the previous step
    seal the step; 2 ranks complete it

* ``bare``: ``kvledger.Ledger`` called directly (seal_step, then step_completed for
  ranks 0 and 1): the baseline.
* ``engine``: ``kvledger.engine.open_engine(..., ranks=2)``: the same commands
  awaited, then ``run_step`` (seal, dispatch the plan over bounded streams to two
  in-process rank executors, each validates the clear list and reports back, the
  engine records both completions). The ranks hold no planes, so no bytes are
  zeroed: what is measured is the engine's machinery.
* with a durable log (when ``kvledger.durable`` exists): ``engine_log`` (every
  ledger call in a worker thread) and ``engine_log_batched`` (the step's commands
  in one ``engine.call``: one thread hop) against ``durable``, the bare
  ``DurableLedger`` doing the same calls synchronously, fsync policy "per_step".

    ratio = engine time per step / bare time per step   (1.0 = no overhead)

Each sample opens a fresh ledger/engine outside the clock, runs 3 warm-up steps,
then times a batch of steps with the collector disabled; subject and baseline
alternate; best of 5 (``--quick``: 3).
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import interleaved, print_table  # noqa: E402

from kvledger import Geometry, Ledger  # noqa: E402

SIZES = (1, 32, 256)
NUM_PAGES = 4096
WARMUP = 3


def _steps_for(n: int, quick: bool) -> int:
    base = {1: 400, 32: 40, 256: 8}[n]
    return base if quick else base * 3


class _Ids:
    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 1


def _commands(ledger, step: int, n: int, ids: _Ids, prev: list) -> list:
    """One step's commands on a synchronous ledger (also run inside engine.call)."""
    s = ids.next
    ids.next += 1
    ledger.alias_snapshot(s, 2)
    ledger.release_snapshot(s)
    new = []
    for _ in range(n):
        r = ids.next
        ids.next += 1
        ledger.reserve(r, 2)
        ledger.commit(r, step, 2)
        new.append(r)
    for r in prev:
        ledger.finish(r)
    return new


def _bare_step(ledger, step, n, ids, prev):
    new = _commands(ledger, step, n, ids, prev)
    ledger.seal_step(step)
    ledger.complete_step(step, 0)
    ledger.complete_step(step, 1)
    return new


async def _engine_step(engine, step, n, ids, prev):
    s = ids.next
    ids.next += 1
    await engine.alias_snapshot(s, 2)
    await engine.release_snapshot(s)
    new = []
    for _ in range(n):
        r = ids.next
        ids.next += 1
        await engine.reserve(r, 2)
        await engine.commit(r, step, 2)
        new.append(r)
    for r in prev:
        await engine.finish(r)
    await engine.run_step(step)
    return new


async def _engine_step_batched(engine, step, n, ids, prev):
    new = await engine.call(_commands, step, n, ids, prev)
    await engine.run_step(step)
    return new


def _timed(fn, steps):
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn(steps)
        return (time.perf_counter() - t0) / steps
    finally:
        gc.enable()


def _bare_case(n: int, steps: int, make_ledger, close=None):
    def case() -> float:
        ledger = make_ledger()
        ids, prev = _Ids(), []
        for step in range(WARMUP):
            prev = _bare_step(ledger, step, n, ids, prev)

        def body(k):
            nonlocal prev
            for step in range(WARMUP, WARMUP + k):
                prev = _bare_step(ledger, step, n, ids, prev)

        try:
            return _timed(body, steps)
        finally:
            if close:
                close(ledger)

    return case


def _engine_case(n: int, steps: int, step_fn, open_kwargs):
    import anyio

    from kvledger.engine import open_engine

    async def main() -> float:
        async with open_engine(**open_kwargs()) as engine:
            ids, prev = _Ids(), []
            for step in range(WARMUP):
                prev = await step_fn(engine, step, n, ids, prev)
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                for step in range(WARMUP, WARMUP + steps):
                    prev = await step_fn(engine, step, n, ids, prev)
                return (time.perf_counter() - t0) / steps
            finally:
                gc.enable()

    def case() -> float:
        return anyio.run(main)

    return case


def _quiet_logger():
    """Warnings and errors only, written nowhere: the durable log logs at debug per step."""
    import io
    import logging

    import structlog

    return structlog.wrap_logger(
        structlog.PrintLogger(io.StringIO()), wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
    )


def run(quick: bool) -> dict:
    try:
        import anyio  # noqa: F401
    except ImportError:
        return {"skipped": "anyio is not installed"}
    quiet = _quiet_logger()
    try:
        from kvledger.durable import open_ledger
    except ImportError:
        open_ledger = None
    geometry = Geometry(num_pages=NUM_PAGES, page_tokens=16)
    repeats = 3 if quick else 5
    tmp = tempfile.mkdtemp(prefix="kvledger-bench-engine-")
    counter = [0]

    def fresh_path() -> str:
        counter[0] += 1
        return os.path.join(tmp, f"b{counter[0]}.kvlog")

    figures: dict = {"pages": NUM_PAGES, "ranks": 2, "repeats": repeats, "log": open_ledger is not None,
                     "baseline": "bare synchronous Ledger, same commands"}
    rows = []
    try:
        for n in SIZES:
            steps = _steps_for(n, quick)
            cases = {
                "bare": _bare_case(n, steps, lambda: Ledger(geometry)),
                "engine": _engine_case(n, steps, _engine_step, lambda: dict(geometry=geometry, ranks=2)),
            }
            if open_ledger is not None:
                cases["durable"] = _bare_case(n, steps, lambda: open_ledger(fresh_path(), geometry, logger=quiet),
                                              close=lambda ledger: ledger.close())
                cases["engine_log"] = _engine_case(
                    n, steps, _engine_step, lambda: dict(geometry=geometry, ranks=2, log=fresh_path(), logger=quiet))
                cases["engine_log_batched"] = _engine_case(
                    n, steps, _engine_step_batched,
                    lambda: dict(geometry=geometry, ranks=2, log=fresh_path(), logger=quiet))
            t = interleaved(cases, repeats)
            bare, eng = t["bare"].best, t["engine"].best
            key = f"n{n}_"
            figures.update({
                key + "steps": steps,
                key + "bare_us_per_step": bare * 1e6,
                key + "engine_us_per_step": eng * 1e6,
                key + "engine_overhead_us_per_step": (eng - bare) * 1e6,
                key + "ratio": eng / bare,
                key + "engine_spread": t["engine"].spread,
            })
            rows.append((f"{n} requests", "in memory", f"{bare * 1e6:.1f} us", f"{eng * 1e6:.1f} us",
                         f"{(eng - bare) * 1e6:.1f} us", f"{eng / bare:.2f}"))
            if open_ledger is not None:
                dur = t["durable"].best
                for name in ("engine_log", "engine_log_batched"):
                    e = t[name].best
                    figures[key + name + "_us_per_step"] = e * 1e6
                    figures[key + name + "_ratio"] = e / dur
                    rows.append((f"{n} requests", name.replace("engine_", "").replace("_", ", "),
                                 f"{dur * 1e6:.1f} us", f"{e * 1e6:.1f} us", f"{(e - dur) * 1e6:.1f} us",
                                 f"{e / dur:.2f}"))
                figures[key + "durable_us_per_step"] = dur * 1e6
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(
        "engine overhead per step (2 in-process ranks, no planes); ratio = engine / bare ledger, same commands",
        ["step", "ledger", "bare", "engine", "overhead", "ratio"],
        rows,
    )
    return figures


TARGETS = {"n256_ratio": ("<=", 2.0), "n32_ratio": ("<=", 3.0)}

if __name__ == "__main__":
    run("--quick" in sys.argv)
