"""Lifecycle benchmark: the fixed cost of a request's life in the ledger, at 1 Ki and 1 Mi pages.

The allocation trace of a serving engine's block pool (vLLM's ``get_new_blocks``
/ ``free_blocks``), replayed against two implementations in the same run:

* the subject: ``kvledger.Ledger``, the plain in-memory ledger; an allocation
  call is ``allocate(r, step, n)`` (the ``reserve(r, n)`` + ``commit(r, step, n)``
  pair in one command: two events, each validated by its precondition and folded
  through the ledger's one submit path), a free is ``finish(r)``, a step ends in
  ``seal_step(step)``; every one is an event;
* the baseline: ``PlainPool``, a list free stack plus a dict page -> request and
  per-request page lists; no validation, no events, no steps.

Trace (seeded, generated before any clock runs), per step:

    admit new requests (1-64 pages each) while fewer than 8 are growing and at
      least 128 pages are free (until the trace's number of requests is reached)
    every growing request allocates its next chunk: 1-16 pages, capped at what
      it still needs; a request that has all its pages is done
    finish done requests while fewer than 256 pages are free (and, once every
      request was admitted, all of them: the trace drains the pool):
      lifo    the most recently completed one
      random  a random done one
    seal the step

Every request lives a whole lifecycle (allocations, then one finish) and the
trace ends with every page free. The trace names no page ids; both sides take
the top of a LIFO free stack (the lowest ids first in a fresh pool) and push a
finished request's pages in allocation order, so they hand out the *same* page
ids at every call. The verification pass (untimed) replays the trace through
both sides op by op and compares the ids of every allocation, the event count
(one per command) and every invariant (halfway and at the end); every timed
run must end with the same free stack, in the same order, as the verification
pass. A mismatch raises and the module reports no figures.

Geometries: 1,024 pages (40,000 requests; ``--quick``: 12,000) and 1,048,576
pages (80,000 requests, the first ~32,000 fill the pool; ``--quick``: 40,000).

Timing (``_common.interleaved_segments``): the trace is cut into segments of
500 ops (about a millisecond of ledger work: short enough that a segment often
runs without being preempted on a loaded box, for the slower side too); in each
repeat both sides start from a fresh pool (built outside the clock) and run
segment i back to back, order alternating, the collector disabled; after one
discarded warm-up repeat, 5 repeats (``--quick``: 3). A side's time is the sum
over segments of that segment's best time across repeats.
ratio = baseline time / ledger time (= ledger rate / baseline rate). Each
repeat also gives a paired whole-run ratio; their median and range are reported
next to it.

    python bench/bench_lifecycle.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _common import fmt_count, fmt_rate, interleaved_segments, print_table  # noqa: E402

from kvledger import Geometry, Ledger, check_invariants  # noqa: E402

SEED = 20261201
PAGE_TOKENS = 16
SEGMENT_OPS = 500  # ops per timed segment: about a millisecond of ledger work
VARIANTS = ("lifo", "random")

# Trace shape (see the module docstring).
MAX_GROWING = 8
REQUEST_PAGES = (1, 64)
CHUNK_PAGES = (1, 16)
ADMIT_FREE = 128
LOW_WATER = 256


class Shape(NamedTuple):
    """One geometry: its pages and how many request lifecycles its trace holds."""

    name: str
    num_pages: int
    requests: int
    quick_requests: int


# At 1 Mi pages the pool fills up first (about 32 k requests), so the trace is longer.
SHAPES = (
    Shape("1k", 1_024, 40_000, 12_000),
    Shape("1M", 1_048_576, 80_000, 40_000),
)

# Operation codes: the index of a side's callable in its ``calls`` tuple.
ALLOC, FINISH, SEAL = range(3)


class Trace(NamedTuple):
    ops: list  # [(code, args)]: ALLOC (r, step, n), FINISH (r,), SEAL (step,)
    num_pages: int
    requests: int  # lifecycles: every request is admitted, grows and is finished
    allocs: int
    finishes: int
    steps: int
    pages: int  # pages allocated (each also freed once: the trace drains the pool)


class CheckError(AssertionError):
    """The benchmark's own consistency check failed: the figures would be meaningless."""


# --------------------------------------------------------------------------- trace


def make_trace(variant: str, num_pages: int, requests: int, seed: int = SEED) -> Trace:
    """Generate the lifecycle trace of ``requests`` requests over ``num_pages`` pages.

    Tracks only counts; never asks either side for more pages than are free.
    Raises ``ValueError`` for an unknown variant or a pool too small for the shape.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if num_pages < LOW_WATER + MAX_GROWING * REQUEST_PAGES[1]:
        raise ValueError(
            f"num_pages must be >= {LOW_WATER + MAX_GROWING * REQUEST_PAGES[1]}, got {num_pages}"
        )
    rng = random.Random(f"{variant}:{num_pages}:{seed}")
    randint = rng.randint
    ops: list = []
    emit = ops.append
    free = num_pages
    need: dict[int, int] = {}  # growing request -> pages it still has to get
    size: dict[int, int] = {}  # live request -> pages it will hold when done
    growing: list[int] = []
    done: list[int] = []  # requests with all their pages, in completion order
    admitted = allocs = finishes = pages = step = 0
    while admitted < requests or growing or done:
        while admitted < requests and len(growing) < MAX_GROWING and free >= ADMIT_FREE:
            r = admitted
            admitted += 1
            need[r] = size[r] = randint(*REQUEST_PAGES)
            growing.append(r)
        still = []
        for r in growing:
            n = min(randint(*CHUNK_PAGES), need[r])
            if n > free:
                still.append(r)  # waits for pages this step
                continue
            free -= n
            pages += n
            allocs += 1
            emit((ALLOC, (r, step, n)))
            need[r] -= n
            if need[r]:
                still.append(r)
            else:
                del need[r]
                done.append(r)
        growing = still
        draining = admitted == requests
        while done and (free < LOW_WATER or draining):
            if variant == "lifo":
                r = done.pop()
            else:
                i = randint(0, len(done) - 1)
                r = done[i]
                done[i] = done[-1]
                done.pop()
            free += size.pop(r)
            finishes += 1
            emit((FINISH, (r,)))
        emit((SEAL, (step,)))
        step += 1
    return Trace(ops, num_pages, requests, allocs, finishes, step, pages)


def drive(calls: tuple, ops: list) -> None:
    """The replay loop every side shares."""
    for code, args in ops:
        calls[code](*args)


# --------------------------------------------------------------------------- sides


class Side(NamedTuple):
    """One implementation under test.

    ``build(num_pages)`` -> ``(calls, handle)``: ``calls`` = (alloc(r, step, n),
    finish(r), seal(step)), all on a fresh pool. ``ids(result)``: the page ids an
    alloc returned, in the ledger's numbering. ``fingerprint(handle)``: (free count,
    live requests, the free stack top first, in the ledger's numbering).
    """

    build: Callable[[int], tuple]
    ids: Callable[[Any], tuple]
    fingerprint: Callable[[Any], tuple]


def _ledger_build(num_pages: int) -> tuple:
    ledger = Ledger(Geometry(num_pages=num_pages, page_tokens=PAGE_TOKENS))
    return (ledger.allocate, ledger.finish, ledger.seal_step), ledger


def _ledger_fingerprint(ledger: Ledger) -> tuple:
    st = ledger.state
    return ledger.free_count, len(st.requests), tuple(reversed(st.free_stack))


class PlainPool:
    """The yardstick: a list free stack, a dict page -> request, per-request page lists.

    No validation, no events, no steps: what a scheduler writes by hand. The free
    stack starts with the lowest ids on top and a finish pushes the request's
    pages in allocation order, as the ledger's allocator does.
    """

    __slots__ = ("free", "holder", "open_step", "requests")

    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages - 1, -1, -1))
        self.holder: dict[int, int] = {}
        self.requests: dict[int, list[int]] = {}
        self.open_step = 0

    def alloc(self, r: int, step: int, n: int) -> list[int]:
        free = self.free
        pages = free[: -n - 1 : -1]  # the top of the stack first
        del free[-n:]
        self.holder.update(dict.fromkeys(pages, r))
        mine = self.requests.get(r)
        if mine is None:
            mine = self.requests[r] = []
        mine += pages
        return pages

    def finish(self, r: int) -> None:
        pages = self.requests.pop(r)
        holder = self.holder
        for p in pages:
            del holder[p]
        self.free += pages

    def seal_step(self, step: int) -> None:
        self.open_step = step + 1


def _plain_build(num_pages: int) -> tuple:
    pool = PlainPool(num_pages)
    return (pool.alloc, pool.finish, pool.seal_step), pool


def _plain_fingerprint(pool: PlainPool) -> tuple:
    return len(pool.free), len(pool.requests), tuple(reversed(pool.free))


LEDGER = Side(_ledger_build, tuple, _ledger_fingerprint)
PLAIN = Side(_plain_build, tuple, _plain_fingerprint)


# --------------------------------------------------------------------------- checks


def verify(trace: Trace, sides: dict[str, Side]) -> dict:
    """Untimed: replay ``trace`` through a fresh ledger and every side, op by op.

    Raises ``CheckError`` if a side's allocation hands out other page ids than the
    ledger's, if the ledger's event count is not one per command (+ the configure
    event), if an invariant breaks (checked halfway and at the end), or if a side
    ends with another free stack. Returns the ledger's event count and the
    fingerprint every timed run must end with.
    """
    built = {name: side.build(trace.num_pages) for name, side in sides.items()}
    led_calls, ledger = LEDGER.build(trace.num_pages)
    seq0 = ledger.seq
    half = len(trace.ops) // 2
    for i, (code, args) in enumerate(trace.ops):
        want = led_calls[code](*args)
        for name, (calls, _) in built.items():
            got = calls[code](*args)
            if code == ALLOC and sides[name].ids(got) != want:
                raise CheckError(
                    f"op {i} alloc{args}: {name} gave {sides[name].ids(got)}, the ledger {want}"
                )
        if i == half:
            check_invariants(ledger.state)
    check_invariants(ledger.state)
    events = ledger.seq - seq0
    if events != 2 * trace.allocs + trace.finishes + trace.steps:
        raise CheckError(f"ledger folded {events} events for {len(trace.ops)} ops")
    expect = _ledger_fingerprint(ledger)
    if expect[:2] != (trace.num_pages, 0) or ledger.open_step != trace.steps:
        raise CheckError("the trace did not drain the pool")
    for name, (_, handle) in built.items():
        if sides[name].fingerprint(handle) != expect:
            raise CheckError(f"{name} ended with another free stack than the ledger")
    return {"events": events, "fingerprint": expect}


def timed_side(side: Side, trace: Trace, segments: list, expect: tuple):
    """An ``interleaved_segments`` side: a fresh pool per repeat, checked after the last segment."""

    def build():
        calls, handle = side.build(trace.num_pages)

        def segment(i: int) -> None:
            drive(calls, segments[i])

        def check() -> None:
            if side.fingerprint(handle) != expect:
                raise CheckError("a timed run diverged from the trace")

        return segment, check

    return build


def split(ops: list) -> list:
    """Cut ``ops`` into segments of about ``SEGMENT_OPS`` ops (at least one)."""
    k = len(ops)
    n = max(1, k // SEGMENT_OPS)
    return [ops[i * k // n : (i + 1) * k // n] for i in range(n)]


def compare(trace: Trace, sides: dict[str, Side], repeats: int) -> tuple[dict, dict]:
    """Verify ``trace`` against every side, then time them interleaved per segment.

    Returns (verify's figures, ``{name: SegmentedTiming}``). Raises ``CheckError``.
    """
    checked = verify(trace, sides)
    segments = split(trace.ops)
    builders = {
        name: timed_side(side, trace, segments, checked["fingerprint"])
        for name, side in sides.items()
    }
    return checked, interleaved_segments(builders, len(segments), repeats)


# --------------------------------------------------------------------------- run


def rates(trace: Trace, seconds: float) -> dict:
    """calls/s (alloc + finish calls), pages/s (allocated) and µs per request lifecycle."""
    return {
        "calls_per_s": (trace.allocs + trace.finishes) / seconds,
        "pages_per_s": trace.pages / seconds,
        "us_per_lifecycle": seconds / trace.requests * 1e6,
    }


def _case_figures(key: str, trace: Trace, checked: dict, t: dict) -> dict:
    led, plain = t["ledger"], t["plain"]
    paired = [p / q for p, q in zip(plain.runs.samples, led.runs.samples, strict=True)]
    out = {
        "requests": trace.requests,
        "allocs": trace.allocs,
        "finishes": trace.finishes,
        "steps": trace.steps,
        "pages": trace.pages,
        "events": checked["events"],
        "ratio": plain.best / led.best,
        "ratio_run_median": statistics.median(paired),
        "ratio_run_min": min(paired),
        "ratio_run_max": max(paired),
        "ledger_s": led.best,
        "plain_s": plain.best,
        "ledger_spread": led.runs.spread,
        "plain_spread": plain.runs.spread,
    }
    out.update({f"ledger_{k}": v for k, v in rates(trace, led.best).items()})
    out.update({f"plain_{k}": v for k, v in rates(trace, plain.best).items()})
    return {f"{key}_{k}": v for k, v in out.items()}


def _row(key: str, f: dict) -> tuple:
    g = {k[len(key) + 1 :]: v for k, v in f.items() if k.startswith(key + "_")}
    return (
        key,
        fmt_count(g["requests"]),
        fmt_count(g["allocs"] + g["finishes"]),
        fmt_rate(g["ledger_calls_per_s"]),
        fmt_rate(g["ledger_pages_per_s"]),
        f"{g['ledger_us_per_lifecycle']:.2f}",
        fmt_rate(g["plain_calls_per_s"]),
        f"{g['plain_us_per_lifecycle']:.2f}",
        f"{g['ratio']:.3f}",
        f"{g['ratio_run_median']:.3f} ({g['ratio_run_min']:.3f}-{g['ratio_run_max']:.3f})",
        f"{100 * g['ledger_spread']:.0f}% / {100 * g['plain_spread']:.0f}%",
    )


def run(quick: bool) -> dict:
    """Generate, verify and time every (geometry, free order) case; print a table.

    Raises ``CheckError`` if a side and the trace disagree (no figures then).
    """
    repeats = 3 if quick else 5
    figures: dict = {
        "repeats": repeats,
        "segment_ops": SEGMENT_OPS,
        "gc": "disabled while timed",
        "baseline": "list free stack + dict page->request, per-request page lists; no validation, no events",
    }
    rows = []
    for shape in SHAPES:
        for variant in VARIANTS:
            key = f"{shape.name}_{variant}"
            trace = make_trace(
                variant,
                shape.num_pages,
                shape.quick_requests if quick else shape.requests,
            )
            checked, t = compare(trace, {"ledger": LEDGER, "plain": PLAIN}, repeats)
            figures[f"{shape.name}_pages"] = shape.num_pages
            figures.update(_case_figures(key, trace, checked, t))
            rows.append(_row(key, figures))
    figures["ratio"] = min(v for k, v in figures.items() if k.endswith("_ratio"))
    print_table(
        f"lifecycle: Ledger allocate (reserve+commit) / finish / seal vs plain list+dict pool, "
        f"{repeats} repeats, segments of {SEGMENT_OPS} ops",
        (
            "pages_order",
            "requests",
            "calls",
            "ledger calls/s",
            "ledger pages/s",
            "ledger us/req",
            "plain calls/s",
            "plain us/req",
            "ratio",
            "ratio per run: median (range)",
            "spread L / P",
        ),
        rows,
    )
    print(
        "calls = allocation calls (allocate = reserve+commit on the ledger) + finishes;"
        " pages/s = pages allocated per s;\n"
        "us/req = time per request lifecycle (its allocations, its finish, its share of the seals);\n"
        "ratio = plain time / ledger time, each the sum of per-segment best times"
        f" (worst case: {figures['ratio']:.3f});\n"
        "ratio per run: plain / ledger whole-run times of each repeat; spread: (worst - best) / best of whole runs."
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/bench_lifecycle.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="shorter traces, fewer repeats"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = parser.parse_args(argv)
    figures = run(args.quick)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2, sort_keys=True)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
