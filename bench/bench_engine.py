"""Engine overhead: the async engine against the bare synchronous ledger, per step and per command.

Per step. One step of the workload, for N requests (N = 1, 32, 256):

    alias a 2-page snapshot and release it (its pages come back marked)
    N x (reserve 2 pages for a new request, commit them for the step)
    finish the N requests of the previous step
    seal the step; 2 ranks complete it

* ``bare``: ``kvledger.Ledger`` called directly (seal_step, then complete_step for
  ranks 0 and 1): the baseline.
* ``engine``: ``open_engine(..., ranks=2)``: the same commands awaited, then
  ``run_step`` (seal, each rank's job: it validates the clear list and reports,
  the engine records both completions). The ranks hold no planes and have no
  graph, so they run inline in ``run_step``'s task: what is measured is the
  engine's machinery. ``overhead`` = engine - bare, in us per step (target for
  one request: <= 25 us).
* with a durable log (fsync "per_step": the seal writes and fsyncs): ``log``
  (the log fsyncs inline, so every ledger call is a worker-thread hop),
  ``log, batched`` (the step's commands in one ``engine.call``: one hop) against
  ``durable``, the bare ``DurableLedger``; ``log, background`` (the log's writer
  thread writes and fsyncs: ledger calls run on the loop) against the bare
  ``DurableLedger`` with the same writer thread. The logs live on tmpfs (/dev/shm)
  when there is one: an fsync there is cheap, so these rows show what the engine
  adds (thread hops), not how a shared disk's fsync latency varies.

Sanitize mode. The same step with 2 ranks holding CPU planes (torch backend, two
planes of 64 bytes a page, inline): ``planes`` (sanitize off) against ``planes,
sanitize`` (``ExtraOptions(sanitize=True)``: the ledger observer that tracks
marks, commits and page histories; each rank poisons the marked pages, clears, and
checks the clear list and the committed pages before the graph). ``overhead`` =
sanitize - off, in us per step.

Per command. ``reserve``, ``commit``, ``finish`` for 64 requests into an open step
(no seal, so no fsync): (engine - bare) / commands, in memory, with a log that
fsyncs inline (worker-thread hop per command) and with a background log (on the
loop: target <= 5 us, no thread hop).

Timing (the machine is noisy): each side opens a fresh ledger/engine outside the
clock (an engine in its own event loop, kept open by a host task) and runs 3
warm-up steps; the workload is cut into segments of a few milliseconds; for each
segment the sides run back to back (the order flips every segment) with the
collector disabled, each timing itself; the figure is the sum over segments of
each segment's fastest run over the repeats (``--quick``: 3 repeats, else 7).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import print_table, timed_segments  # noqa: E402

from kvledger import Geometry, Ledger  # noqa: E402
from kvledger.engine import ExtraOptions, LogOptions  # noqa: E402

SIZES = (1, 32, 256)
NUM_PAGES = 4096
WARMUP = 3
COMMAND_REQUESTS = 64  # per segment of the per-command workload: 3 commands each
STEP_TARGET_US = 25.0
COMMAND_TARGET_US = 5.0


def _steps_per_segment(n: int) -> int:
    return {1: 40, 32: 2, 256: 1}[n]


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


def _bare_commands(ledger, step, n, ids, prev):
    for _ in range(n):
        r = ids.next
        ids.next += 1
        ledger.reserve(r, 2)
        ledger.commit(r, 0, 2)
        ledger.finish(r)
    return prev


async def _engine_commands(engine, step, n, ids, prev):
    for _ in range(n):
        r = ids.next
        ids.next += 1
        await engine.reserve(r, 2)
        await engine.commit(r, 0, 2)
        await engine.finish(r)
    return prev


# ---------------------------------------------------------------------- sides


class _BareSide:
    """A bare ledger running the workload; ``segment(k)`` runs k units and times itself."""

    def __init__(self, make_ledger: Callable[[], Any], n: int, step_fn: Callable, close: bool) -> None:
        self.ledger = make_ledger()
        self.n, self.step_fn, self._close = n, step_fn, close
        self.ids, self.prev, self.step = _Ids(), list[int](), 0
        self.segment(WARMUP)

    def segment(self, k: int) -> float:
        ledger, n, ids, fn = self.ledger, self.n, self.ids, self.step_fn
        prev, first = self.prev, self.step
        t0 = time.perf_counter()
        for step in range(first, first + k):
            prev = fn(ledger, step, n, ids, prev)
        elapsed = time.perf_counter() - t0
        self.prev, self.step = prev, first + k
        return elapsed

    def close(self) -> None:
        if self._close:
            self.ledger.close()


class _EngineSide:
    """An engine open in its own event loop (a host task holds the ``async with``); each
    ``segment(k)`` runs k units in a task of that loop, timed inside the task."""

    def __init__(self, open_kwargs: dict, n: int, step_fn: Callable, opener: Callable | None = None) -> None:
        from kvledger.engine import open_engine

        open_engine = opener or open_engine  # (another engine build, for before/after comparisons)
        self.loop = asyncio.new_event_loop()
        self.n, self.step_fn = n, step_fn
        self.ids, self.prev, self.step = _Ids(), list[int](), 0
        self.engine: Any = None

        async def host(ready: asyncio.Event, stop: asyncio.Event) -> None:
            async with open_engine(**open_kwargs) as engine:
                self.engine = engine
                ready.set()
                await stop.wait()

        self._stop = asyncio.Event()
        ready = asyncio.Event()
        self._host = self.loop.create_task(host(ready, self._stop))
        self.loop.run_until_complete(ready.wait())
        self.segment(WARMUP)

    async def _run(self, k: int) -> float:
        engine, n, ids, fn = self.engine, self.n, self.ids, self.step_fn
        prev, first = self.prev, self.step
        t0 = time.perf_counter()
        for step in range(first, first + k):
            prev = await fn(engine, step, n, ids, prev)
        elapsed = time.perf_counter() - t0
        self.prev, self.step = prev, first + k
        return elapsed

    def segment(self, k: int) -> float:
        return self.loop.run_until_complete(self._run(k))

    def close(self) -> None:
        self._stop.set()
        self.loop.run_until_complete(self._host)
        self.loop.close()


# ---------------------------------------------------------------------- the tables


def _quiet_logger():
    """Warnings and errors only, written nowhere: the durable log logs at debug per step."""
    import io
    import logging

    import structlog

    return structlog.wrap_logger(
        structlog.PrintLogger(io.StringIO()), wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
    )


class _Setup:
    def __init__(self, quick: bool, tmp: str, open_ledger: Any) -> None:
        self.geometry = Geometry(num_pages=NUM_PAGES, page_tokens=16)
        self.repeats = 3 if quick else 7
        self.segments = 6 if quick else 12
        self.tmp, self.open_ledger, self.quiet = tmp, open_ledger, _quiet_logger()
        self.counter = 0

    def path(self) -> str:
        self.counter += 1
        return os.path.join(self.tmp, f"b{self.counter}.kvlog")

    def durable(self, background: bool) -> Any:
        return self.open_ledger(self.path(), self.geometry, logger=self.quiet,
                                log_options=LogOptions(fsync="per_step", background=background))

    def engine_kwargs(self, log: str | None, *, planes: bool = False, sanitize: bool = False) -> dict:
        kw: dict[str, Any] = {"geometry": self.geometry, "ranks": 2}
        if planes:
            import torch

            from kvledger.engine import RankSpec

            kw["ranks"] = [RankSpec(planes=[torch.ones((NUM_PAGES, 64), dtype=torch.uint8) for _ in range(2)])
                           for _ in range(2)]
            kw["extras"] = ExtraOptions(sanitize=sanitize)
        if log is not None:
            kw.update(log=self.path(), logger=self.quiet,
                      log_options=LogOptions(fsync="per_step", background=log == "background"))
        return kw


def _step_cases(s: _Setup, n: int) -> dict[str, Callable[[], Any]]:
    g = s.geometry
    cases: dict[str, Callable[[], Any]] = {
        "bare": lambda: _BareSide(lambda: Ledger(g), n, _bare_step, False),
        "engine": lambda: _EngineSide(s.engine_kwargs(None), n, _engine_step),
    }
    if s.open_ledger is not None:
        cases.update({
            "durable": lambda: _BareSide(lambda: s.durable(False), n, _bare_step, True),
            "engine_log": lambda: _EngineSide(s.engine_kwargs("inline"), n, _engine_step),
            "engine_log_batched": lambda: _EngineSide(s.engine_kwargs("inline"), n, _engine_step_batched),
            "durable_background": lambda: _BareSide(lambda: s.durable(True), n, _bare_step, True),
            "engine_log_background": lambda: _EngineSide(s.engine_kwargs("background"), n, _engine_step),
        })
    return cases


def _per_step(s: _Setup, figures: dict, rows: list) -> None:
    for n in SIZES:
        t = timed_segments(_step_cases(s, n), s.segments, _steps_per_segment(n), s.repeats)
        bare, eng = t["bare"], t["engine"]
        key = f"n{n}_"
        figures.update({key + "bare_us_per_step": bare * 1e6, key + "engine_us_per_step": eng * 1e6,
                        key + "engine_overhead_us_per_step": (eng - bare) * 1e6, key + "ratio": eng / bare})
        rows.append((f"{n} requests", "in memory", f"{bare * 1e6:.1f} us", f"{eng * 1e6:.1f} us",
                     f"{(eng - bare) * 1e6:.1f} us", f"{eng / bare:.2f}"))
        if s.open_ledger is None:
            continue
        for name, base in (("engine_log", "durable"), ("engine_log_batched", "durable"),
                           ("engine_log_background", "durable_background")):
            e, b = t[name], t[base]
            figures[key + name + "_us_per_step"] = e * 1e6
            figures[key + name + "_overhead_us_per_step"] = (e - b) * 1e6
            figures[key + name + "_ratio"] = e / b
            label = {"engine_log": "log", "engine_log_batched": "log, batched",
                     "engine_log_background": "log, background"}[name]
            rows.append((f"{n} requests", label, f"{b * 1e6:.1f} us", f"{e * 1e6:.1f} us",
                         f"{(e - b) * 1e6:.1f} us", f"{e / b:.2f}"))
        figures[key + "durable_us_per_step"] = t["durable"] * 1e6
        figures[key + "durable_background_us_per_step"] = t["durable_background"] * 1e6


def _sanitize_rows(s: _Setup, figures: dict) -> list:
    """Sanitize mode against the same engine with planes, per step (SIZES[:2])."""
    try:
        import torch  # noqa: F401
    except ImportError:
        figures["sanitize"] = "skipped: torch is not installed"
        return []
    rows = []
    for n in SIZES[:2]:
        def side(sanitize: bool, n: int = n) -> _EngineSide:
            return _EngineSide(s.engine_kwargs(None, planes=True, sanitize=sanitize), n, _engine_step)

        t = timed_segments({"off": lambda: side(False), "sanitize": lambda: side(True)},
                       s.segments, _steps_per_segment(n), s.repeats)
        off, on = t["off"], t["sanitize"]
        key = f"n{n}_sanitize_"
        figures.update({key + "off_us_per_step": off * 1e6, key + "on_us_per_step": on * 1e6,
                        key + "overhead_us_per_step": (on - off) * 1e6})
        rows.append((f"{n} requests", f"{off * 1e6:.1f} us", f"{on * 1e6:.1f} us", f"{(on - off) * 1e6:.1f} us",
                     f"{on / off:.2f}"))
    return rows


def _per_command(s: _Setup, figures: dict) -> list:
    g, n = s.geometry, COMMAND_REQUESTS
    pairs = [("in memory", lambda: _BareSide(lambda: Ledger(g), n, _bare_commands, False),
              lambda: _EngineSide(s.engine_kwargs(None), n, _engine_commands))]
    if s.open_ledger is not None:
        pairs += [
            ("log, fsync inline (thread hop)", lambda: _BareSide(lambda: s.durable(False), n, _bare_commands, True),
             lambda: _EngineSide(s.engine_kwargs("inline"), n, _engine_commands)),
            ("log, background (on the loop)", lambda: _BareSide(lambda: s.durable(True), n, _bare_commands, True),
             lambda: _EngineSide(s.engine_kwargs("background"), n, _engine_commands)),
        ]
    rows = []
    for label, bare_side, engine_side in pairs:
        t = timed_segments({"bare": bare_side, "engine": engine_side}, s.segments, 1, s.repeats)
        per = 3 * n
        b, e = t["bare"] / per, t["engine"] / per
        key = "cmd_" + label.split(" (")[0].replace(", ", "_").replace(" ", "_") + "_"
        figures[key + "bare_us"] = b * 1e6
        figures[key + "engine_us"] = e * 1e6
        figures[key + "overhead_us"] = (e - b) * 1e6
        rows.append((label, f"{b * 1e6:.2f} us", f"{e * 1e6:.2f} us", f"{(e - b) * 1e6:.2f} us"))
    return rows


def run(quick: bool) -> dict:
    try:
        import anyio  # noqa: F401
    except ImportError:
        return {"skipped": "anyio is not installed"}
    open_ledger: Any
    try:
        from kvledger.durable import open_ledger
    except ImportError:
        open_ledger = None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    tmp = tempfile.mkdtemp(prefix="kvledger-bench-engine-", dir=shm)
    s = _Setup(quick, tmp, open_ledger)
    figures: dict = {"pages": NUM_PAGES, "ranks": 2, "repeats": s.repeats, "segments": s.segments,
                     "log": open_ledger is not None, "log_on_tmpfs": shm is not None,
                     "baseline": "bare synchronous Ledger, same commands",
                     "step_target_us": STEP_TARGET_US, "command_target_us": COMMAND_TARGET_US}
    rows: list = []
    try:
        _per_step(s, figures, rows)
        sanitize_rows = _sanitize_rows(s, figures)
        command_rows = _per_command(s, figures)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(
        "engine overhead per step (2 in-process ranks, no planes); ratio = engine / bare ledger, same commands; "
        f"target for 1 request in memory: overhead <= {STEP_TARGET_US:.0f} us",
        ["step", "ledger", "bare", "engine", "overhead", "ratio"],
        rows,
    )
    if sanitize_rows:
        print_table(
            "sanitize mode per step (2 in-process CPU ranks, 2 planes x 64 B a page, torch backend): "
            "planes = sanitize off, sanitize = open_engine(..., extras=ExtraOptions(sanitize=True))",
            ["step", "planes", "sanitize", "overhead", "ratio"],
            sanitize_rows,
        )
    print_table(
        f"engine overhead per command (reserve, commit, finish; {COMMAND_REQUESTS} requests per segment, no seal); "
        f"target with a background log: overhead <= {COMMAND_TARGET_US:.0f} us",
        ["ledger", "bare", "engine", "overhead"],
        command_rows,
    )
    return figures


TARGETS = {
    "n1_engine_overhead_us_per_step": ("<=", STEP_TARGET_US),
    "n256_ratio": ("<=", 2.0),
    "n32_ratio": ("<=", 3.0),
    "cmd_log_background_overhead_us": ("<=", COMMAND_TARGET_US),
}

if __name__ == "__main__":
    run("--quick" in sys.argv)
