"""Flat per-command cost: the slow paths of a command against its fast path, at 1 k and 1 M pages.

Each row times one command on a path that used to cost O(pages) or worse, next
to the same command on its common path, in the same run, at a small and a large
geometry. A command's cost must not depend on the geometry's size.

    restore   reserve(16) while a restore is writing the 16 pages on top of the
              free stack (the allocator skips them), vs a plain reserve(16) after
              the same alias and release without the restore
    parked    reserve(16) while 4,096 pages a restore is writing sit on top of the
              free stack (released mid-restore), vs a plain reserve(16)
    alias     alias_snapshot(pages=...) naming 16 free pages deep in the free
              stack (lazy deletion), vs alias_snapshot(n=16) from the top
    abort     abort_step of a step whose plan lists 8,192 pages held by 64
              requests, per listed page, vs the same at 1,024 listed pages

Ratios: slow path time / fast path time (target <= 2 for restore, parked and alias, at
1 M pages), and for abort the per-page cost at 8,192 over the per-page cost at
1,024 (linear: about 1). Each case does its untimed set-up, then times only the
command (``_common.time_call``); cases alternate after a warm-up round and the
best repeat is the figure.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gc  # noqa: E402
import time  # noqa: E402

from _common import fmt_seconds, interleaved, print_table  # noqa: E402

from kvledger import Geometry, Ledger  # noqa: E402

TARGETS = {
    "restore_ratio_1m": ("<=", 2.0),
    "parked_ratio_1m": ("<=", 2.0),
    "alias_ratio_1m": ("<=", 2.0),
    "abort_linearity": ("<=", 1.5),
}
K = 16
PARKED = 4096
REPEATS_PER_CASE = 200


def _timed(fn, *args) -> float:
    """Seconds one call takes (the collector is off for the whole case: see ``_case``)."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _case(body):
    """Run ``body()`` with the collector collected first and off while it runs."""

    def case() -> float:
        gc.collect()
        gc.disable()
        try:
            return body()
        finally:
            gc.enable()

    return case


def _reserve_case(num_pages: int, restoring: bool):
    """Time ``reserve(16)``; with ``restoring``, 16 pages a restore writes sit on top of the stack."""
    L = Ledger(Geometry(num_pages=num_pages, page_tokens=16))
    L.reserve(10**6, num_pages // 2)  # a half-full cache
    ids = iter(range(10**7))

    def body() -> float:
        total = 0.0
        for _ in range(REPEATS_PER_CASE):
            s, r = next(ids), next(ids)
            # both cases run the same untimed commands around the timed reserve (the caches are
            # as warm or cold on both sides); only the restore differs
            pages = L.alias_snapshot(s, K)
            if restoring:
                L.start_restore(pages, snapshot=s)
            L.release_snapshot(s)  # restoring: free, marked, still restoring: on top, unreservable
            total += _timed(L.reserve, r, K)
            if restoring:
                L.complete_restore(pages, snapshot=s)
            L.finish(r)
        return total / REPEATS_PER_CASE

    return _case(body)


def _parked_case(num_pages: int, parked: int):
    """Time ``reserve(16)`` while ``parked`` pages, released while a restore still writes them,
    sit on top of the free stack for the whole case (the restore never completes in it)."""
    L = Ledger(Geometry(num_pages=num_pages, page_tokens=16))
    L.reserve(10**6, num_pages // 2)  # a half-full cache
    rows = L.alias_snapshot(1, parked)
    L.start_restore(rows, snapshot=1)
    L.release_snapshot(1)  # free, marked, still restoring: on top, unreservable
    ids = iter(range(2, 10**7))

    def body() -> float:
        total = 0.0
        for _ in range(REPEATS_PER_CASE):
            r = next(ids)
            total += _timed(L.reserve, r, K)
            L.finish(r)  # (untimed) back on top, above the restoring pages
        return total / REPEATS_PER_CASE

    return _case(body)


def _alias_case(num_pages: int, named: bool):
    """Time ``alias_snapshot`` of 16 pages: named pages deep in the stack, or the allocator's top."""
    L = Ledger(Geometry(num_pages=num_pages, page_tokens=16))
    ids = iter(range(10**7))
    deep = list(range(K, 2 * K))  # near the bottom of a fresh stack (ids ascend from the top)
    deep = [num_pages - 1 - p for p in deep]

    def body() -> float:
        total = 0.0
        for _ in range(REPEATS_PER_CASE):
            s = next(ids)
            if named:
                total += _timed(lambda: L.alias_snapshot(s, pages=deep))  # noqa: B023  (called at once)
            else:
                total += _timed(L.alias_snapshot, s, K)
            L.release_snapshot(s)  # (untimed) the pages go back on top
            if named:
                L.state.compact_free_stack()  # (untimed) the same deep pages again next time: no stale build-up
        return total / REPEATS_PER_CASE

    return _case(body)


def _abort_case(num_pages: int, listed: int):
    """Time ``abort_step`` of a plan listing ``listed`` pages over 64 requests; per listed page."""

    def body() -> float:
        L = Ledger(Geometry(num_pages=num_pages, page_tokens=16))
        per = listed // 64
        pages = L.alias_snapshot(1, listed)
        L.release_snapshot(1)  # every page marked
        for r in range(64):
            L.reserve(r, per)
            L.commit(r, 0, per)  # listed: the step's clear list holds all of them
        L.seal_step(0)
        dt = _timed(L.abort_step, 0, "bench")
        assert len(pages) == listed
        return dt / listed

    return _case(body)


def run(quick: bool) -> dict:
    repeats = 3 if quick else 7
    figures: dict = {}
    rows = []
    for label, n in (("1k", 1024 * 16), ("1m", 1 << 20)):
        t = interleaved({"plain": _reserve_case(n, False), "restore": _reserve_case(n, True)}, repeats)
        r = t["restore"].best / t["plain"].best
        figures[f"restore_ratio_{label}"] = round(r, 3)
        rows.append(("reserve(16), restore on top", f"{n:,}", fmt_seconds(t["plain"].best),
                     fmt_seconds(t["restore"].best), f"{r:.2f}"))
        t = interleaved({"plain": _reserve_case(n, False), "parked": _parked_case(n, PARKED)}, repeats)
        r = t["parked"].best / t["plain"].best
        figures[f"parked_ratio_{label}"] = round(r, 3)
        rows.append((f"reserve(16), {PARKED:,} restoring on top", f"{n:,}", fmt_seconds(t["plain"].best),
                     fmt_seconds(t["parked"].best), f"{r:.2f}"))
        t = interleaved({"top": _alias_case(n, False), "named": _alias_case(n, True)}, repeats)
        r = t["named"].best / t["top"].best
        figures[f"alias_ratio_{label}"] = round(r, 3)
        rows.append(("alias 16 named deep pages", f"{n:,}", fmt_seconds(t["top"].best),
                     fmt_seconds(t["named"].best), f"{r:.2f}"))
    n = 1 << 20
    t = interleaved({"1024": _abort_case(n, 1024), "8192": _abort_case(n, 8192)}, repeats)
    lin = t["8192"].best / t["1024"].best
    figures["abort_linearity"] = round(lin, 3)
    figures["abort_us_per_page_8192"] = round(t["8192"].best * 1e6, 4)
    rows.append(("abort_step, per listed page", f"{n:,}", fmt_seconds(t["1024"].best) + " (1,024)",
                 fmt_seconds(t["8192"].best) + " (8,192)", f"{lin:.2f}"))
    print_table("flat: slow path vs fast path of one command",
                ("case", "pages", "fast path", "slow path", "ratio"), rows)
    print("ratio = slow path / fast path (abort: per-page cost at 8,192 listed / at 1,024); targets: <= 2, <= 2, ~1")
    return figures


if __name__ == "__main__":
    run("--quick" in sys.argv[1:])
