"""Shared helpers for the ``bench/bench_*.py`` modules: timing, statistics, tables.

Conventions every benchmark module follows (``bench/run.py`` relies on them):

* ``run(quick: bool) -> dict`` returns a *flat* dict of named figures (int, float,
  str or bool) and prints a human table, including a ratio against a baseline
  timed in the same run. A module that cannot run on this machine returns
  ``{"skipped": "<reason>"}``.
* An optional ``TARGETS = {figure: (op, value)}`` declares performance targets;
  the runner reports PASS/MISS for each and never fails the run on a miss.

Timing rules (also described in bench/README.md):

* ``time.perf_counter`` around the measured call only; set-up (building the
  trace, constructing fresh state) happens outside it.
* The garbage collector is collected first and disabled while the clock runs,
  for the subject and the baseline alike (what ``timeit`` does): cyclic GC
  pauses land on whichever side happens to allocate at the wrong moment and
  are the largest source of run-to-run noise for allocation-heavy Python.
* Subject and baseline are timed alternately (A, B, A, B, ...) after one
  discarded warm-up round, so load from other processes on a shared box falls
  on both sides; the best run of each is the figure, and the spread across
  repeats is reported next to it.
* For long replays (``interleaved_segments``) the alternation is per segment of
  the workload (a few milliseconds each) and the figure is the sum over
  segments of each segment's best time across repeats; whole-run totals and
  their spread are reported next to it.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import sys
import time
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

__all__ = [
    "SegmentedTiming",
    "Timing",
    "fmt_count",
    "fmt_rate",
    "fmt_seconds",
    "interleaved",
    "interleaved_segments",
    "machine_info",
    "print_table",
    "summarize",
    "time_call",
]


class Timing(NamedTuple):
    """Wall-clock samples of one measured case, in seconds."""

    samples: tuple[float, ...]
    best: float
    median: float
    worst: float
    spread: float  # (worst - best) / best: 0.05 means the slowest run took 5 % longer


def summarize(samples: Sequence[float]) -> Timing:
    """Best / median / worst / relative spread of ``samples`` (at least one, all > 0).

    Raises ``ValueError`` for an empty sequence or a non-positive sample.
    """
    if not samples:
        raise ValueError("no timing samples")
    s = tuple(float(x) for x in samples)
    if min(s) <= 0.0:
        raise ValueError(f"timing samples must be positive, got {s!r}")
    best, worst = min(s), max(s)
    return Timing(s, best, statistics.median(s), worst, (worst - best) / best)


def time_call(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Call ``fn(*args)`` once with the collector disabled; return (seconds, result).

    The collector is re-enabled afterwards (if it was on) even when ``fn`` raises;
    the exception propagates.
    """
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        result = fn(*args)
        elapsed = time.perf_counter() - t0
    finally:
        if was_on:
            gc.enable()
    return elapsed, result


def interleaved(cases: dict[str, Callable[[], float]], repeats: int, *, warmup: int = 1) -> dict[str, Timing]:
    """Run each case ``warmup`` + ``repeats`` times, alternating between cases; the
    warm-up rounds are discarded (first-run effects: allocator arenas, caches).

    A case is a callable that does its own untimed set-up, times its work (usually
    with ``time_call``) and returns the elapsed seconds. Exceptions propagate.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        for case in cases.values():
            case()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            samples[name].append(case())
    return {name: summarize(s) for name, s in samples.items()}


class SegmentedTiming(NamedTuple):
    """One side of ``interleaved_segments``.

    ``runs``: whole-run totals (one per repeat); ``best``: the sum over segments
    of each segment's fastest time across repeats (the noise-resistant figure);
    ``segments``: per-segment times, one tuple per repeat.
    """

    runs: Timing
    best: float
    segments: tuple[tuple[float, ...], ...]


# A side of a segmented comparison: called once per repeat (untimed) to build a
# fresh state; returns (run_segment(i), check()): run_segment is timed, check is
# called untimed after the last segment and raises if the run went wrong.
SegmentedSide = Callable[[], "tuple[Callable[[int], Any], Callable[[], Any]]"]


def interleaved_segments(
    sides: dict[str, SegmentedSide], n_segments: int, repeats: int, *, warmup: int = 1
) -> dict[str, SegmentedTiming]:
    """Time sides segment by segment, alternating sides within each segment.

    Each repeat builds a fresh state for every side, then for i in 0..n-1 runs
    segment i of each side back to back (the order flips every segment), each
    under its own ``perf_counter`` pair, with the collector disabled for the whole
    repeat. Load that comes and goes on a shared machine therefore hits both
    sides' same segment within milliseconds of each other, and taking each
    segment's minimum over repeats filters out a stall that hit one repeat. The
    ``warmup`` repeats are run in full and discarded. Exceptions propagate (the
    collector is re-enabled first).
    """
    if repeats < 1 or warmup < 0 or n_segments < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, n_segments >= 1; got {repeats}, {warmup}, {n_segments}")
    names = list(sides)
    per: dict[str, list[tuple[float, ...]]] = {name: [] for name in names}
    clock = time.perf_counter
    for rep in range(warmup + repeats):
        built = {name: sides[name]() for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        order = names[:]
        gc.collect()
        was_on = gc.isenabled()
        gc.disable()
        try:
            for i in range(n_segments):
                for name in order:
                    seg = built[name][0]
                    t0 = clock()
                    seg(i)
                    times[name].append(clock() - t0)
                order.reverse()
        finally:
            if was_on:
                gc.enable()
        for name in names:
            built[name][1]()
        if rep >= warmup:
            for name in names:
                per[name].append(tuple(times[name]))
    out = {}
    for name in names:
        runs = per[name]
        best = sum(min(col) for col in zip(*runs, strict=False))
        out[name] = SegmentedTiming(summarize([sum(r) for r in runs]), best, tuple(runs))
    return out


def timed_segments(sides: dict[str, Callable[[], Any]], n_segments: int, k: int, repeats: int) -> dict[str, float]:
    """Seconds per unit of each side, for sides that time themselves: each builder returns an
    object with ``segment(k) -> seconds`` (k units) and ``close()``. The sum over segments of each
    segment's fastest time over ``repeats`` (sides alternate within a segment, the order flips
    every segment, the collector off meanwhile), divided by the units run."""
    names = list(sides)
    best = {name: [float("inf")] * n_segments for name in names}
    for _ in range(repeats):
        built = {name: sides[name]() for name in names}
        order = names[:]
        gc.collect()
        gc.disable()
        try:
            for i in range(n_segments):
                for name in order:
                    best[name][i] = min(best[name][i], built[name].segment(k))
                order.reverse()
        finally:
            gc.enable()
            for side in built.values():
                side.close()
    return {name: sum(times) / (n_segments * k) for name, times in best.items()}


def machine_info() -> dict[str, Any]:
    """What produced the figures: Python, platform, CPU count, date (UTC)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "",
        "cpu_count": os.cpu_count(),
        "cpu_usable": usable,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": " ".join(sys.argv),
    }


def fmt_rate(per_second: float, unit: str = "/s") -> str:
    """``1234567.0`` -> ``'1.23 M/s'``."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if per_second >= scale:
            return f"{per_second / scale:.2f} {prefix}{unit}"
    return f"{per_second:.1f} {unit}"


def fmt_seconds(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return "%.1f ms" % (seconds * 1e3)
    return "%.1f us" % (seconds * 1e6)


def fmt_count(n: int) -> str:
    return f"{n:,}"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], *, file=None) -> None:
    """Print an aligned plain-text table (first column left-aligned, the rest right)."""
    out = sys.stdout if file is None else file
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=False)]
        return "  ".join(parts).rstrip()

    print(title, file=out)
    print(line(cells[0]), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells[1:]:
        print(line(row), file=out)
    out.flush()
