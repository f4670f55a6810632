"""Fold benchmark: page transitions per second through ``Ledger`` command + fold.

A serving trace over 10,000 pages is generated up front from a seeded RNG and
then replayed, timed, against two implementations of the same allocator:

* the subject: ``kvledger.Ledger`` (argument checks, validation, an immutable
  event per command, the fold with marks and clear lists, step plans);
* the baseline: ``PlainPool``, a list free stack plus a dict page -> owner, with
  no validation and no events; the yardstick a scheduler would write by hand.

The trace never names page ids: it says "reserve n for request r", "commit n of
r's reserved pages for step t", "alias n pages for snapshot s", "alias the first
k pages of snapshot t for snapshot s", and each implementation's own allocator
picks the pages. All free pages are interchangeable for these operations, so
both implementations see the same counts at every point (checked after every
timed run) and the same number of page transitions, which the generator counts.

Trace, per step (one step = one scheduler iteration):

    admit new requests (1-64 pages each) while fewer than 32 are growing and
      at least 512 pages are free
    every growing request reserves a chunk of 1-16 pages (capped at what it
      still needs); 1 % of them are cancelled before they commit
    each reserved chunk is committed for the step; 5 % commit part of it and
      return the rest; a request that has all its pages is done
    snapshots: 50 %: alias 1-16 pages from the allocator; 30 %: alias the first
      k pages of a live snapshot (reuse); 80 %: release a random live snapshot
      (always while more than 48 are live)
    5 %: cancel a random live request
    finish done requests while fewer than 1,500 pages are free:
      lifo    the most recently completed one (pages go back stack-wise)
      random  a random done one (free order is shuffled)
    seal the step

A page transition is a page changing holder (free, reserved(r), kv(r), alias):
reserve, commit, return, cancel/finish (reserved and kv pages), aliasing a free
page, and releasing a page's last alias. Aliasing an already-aliased page and
sealing a step move no page. A verification pass (untimed) replays the trace
into a ledger and, for every command in three stretches of the trace (the
fill-up and two in the steady state, about 3,600 commands), counts how many
pages changed holder; it must equal the generator's count exactly. The pass
also checks every invariant at the end, and that ledger and baseline end with
the same free count, per-request reserved/kv counts and snapshot sizes.

Timing: both sides replay the identical trace through the identical driver loop
(``calls[code](*args)``), each from a fresh state built outside the clock, with
the collector disabled for both (see ``_common``). The trace is cut into 100
segments; ledger and baseline run segment i back to back (order alternating),
each timed on its own, so load from elsewhere on a shared box hits both sides
alike. After one discarded warm-up repeat, 5 repeats (``--quick``: 3); a side's
time is the sum over segments of the segment's best time across repeats.
ratio = baseline time / ledger time (= ledger rate / baseline rate). Whole-run
best, median and spread ((worst - best) / best) are reported next to it.
"""

from __future__ import annotations

import os
import random
import sys
from typing import NamedTuple

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _common import fmt_count, fmt_rate, interleaved_segments, print_table  # noqa: E402

from kvledger import Geometry, Ledger, check_invariants  # noqa: E402
from kvledger.core.state import ALIAS as HOLDER_ALIAS  # noqa: E402

NUM_PAGES = 10_000
PAGE_TOKENS = 16
SEED = 20261130
STEPS = 2_400  # about 180k commands, 1.7M page transitions per variant
SEGMENTS = 100  # timed slices of the trace; ledger and baseline alternate per slice
# Parts of the trace (fractions) in which the verification pass counts holder changes
# after every command: the fill-up, and two stretches of the steady state (finishes,
# cancels, releases). Each counted command costs a full O(num_pages) holder scan.
VERIFY_WINDOWS = ((0.0, 0.008), (0.4, 0.406), (0.8, 0.806))
VARIANTS = ("lifo", "random")

# Trace shape (see the module docstring).
MAX_GROWING = 32
ADMIT_FREE = 512
REQUEST_PAGES = (1, 64)
CHUNK_PAGES = (1, 16)
P_CANCEL_BEFORE_COMMIT = 0.01
P_PARTIAL_COMMIT = 0.05
P_ALIAS = 0.5
ALIAS_PAGES = (1, 16)
P_REUSE = 0.3
P_RELEASE = 0.8
MAX_SNAPSHOTS = 48
P_CANCEL = 0.05
LOW_WATER = 1_500

# Operation codes: the index of the implementation's callable in ``calls``.
RESERVE, COMMIT, RETURN, CANCEL, FINISH, ALIAS, REUSE, RELEASE, SEAL = range(9)
OP_NAMES = ("reserve", "commit", "return", "cancel", "finish", "alias", "reuse", "release", "seal")

TARGETS = {"ratio": (">=", 0.5)}


class Trace(NamedTuple):
    ops: list  # [(code, args tuple)]
    transitions: int  # page transitions the whole trace makes
    per_op: list  # transitions of each op (for the verification pass)
    steps: int


# --------------------------------------------------------------------------- trace


def make_trace(variant: str, steps: int = STEPS, seed: int = SEED, num_pages: int = NUM_PAGES) -> Trace:
    """Generate the operation list for ``variant`` ('lifo' or 'random').

    Tracks only counts (and, for snapshots, abstract page identities so that
    reuse and last-alias releases are counted exactly); never fails an operation
    on either implementation. Raises ``ValueError`` for an unknown variant.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    rng = random.Random(f"{variant}:{seed}")
    rand, randint = rng.random, rng.randint
    ops: list = []
    per_op: list = []
    emit_op, emit_n = ops.append, per_op.append

    free = num_pages
    need: dict[int, int] = {}  # live request -> pages it still has to get
    held: dict[int, int] = {}  # live request -> pages it holds (reserved + kv)
    growing: list[int] = []  # requests still allocating, in admission order
    done: list[int] = []  # requests with all their pages, in completion order
    snaps: dict[int, list[int]] = {}  # live snapshot -> abstract page ids, in order
    snap_ids: list[int] = []
    alias_n: dict[int, int] = {}  # abstract page -> live snapshots aliasing it
    next_r = next_s = next_page = 0

    def emit(code: int, args: tuple, n: int) -> None:
        emit_op((code, args))
        emit_n(n)

    for step in range(steps):
        # admission
        while len(growing) < MAX_GROWING and free >= ADMIT_FREE:
            r = next_r
            next_r += 1
            need[r] = randint(*REQUEST_PAGES)
            held[r] = 0
            growing.append(r)
        # reserve phase
        chunks: list[tuple[int, int]] = []
        for r in growing:
            n = min(randint(*CHUNK_PAGES), need[r])
            if n > free:
                continue  # waits for pages this step
            free -= n
            held[r] += n
            emit(RESERVE, (r, n), n)
            chunks.append((r, n))
        # commit phase (a few requests are cancelled between reserve and commit)
        for r, n in chunks:
            if rand() < P_CANCEL_BEFORE_COMMIT:
                h = held.pop(r)
                free += h
                del need[r]
                growing.remove(r)
                emit(CANCEL, (r,), h)
                continue
            k = n
            if n >= 2 and rand() < P_PARTIAL_COMMIT:
                k = randint(1, n - 1)
            emit(COMMIT, (r, step, k), k)
            if k < n:
                free += n - k
                held[r] -= n - k
                emit(RETURN, (r,), n - k)
            need[r] -= k
            if need[r] == 0:
                growing.remove(r)
                done.append(r)
        # snapshots
        if rand() < P_ALIAS:
            n = randint(*ALIAS_PAGES)
            if free - n >= ADMIT_FREE:
                s = next_s
                next_s += 1
                pages = list(range(next_page, next_page + n))
                next_page += n
                for p in pages:
                    alias_n[p] = 1
                snaps[s] = pages
                snap_ids.append(s)
                free -= n
                emit(ALIAS, (s, n), n)
        if snap_ids and rand() < P_REUSE:
            t = snap_ids[randint(0, len(snap_ids) - 1)]
            k = randint(1, len(snaps[t]))
            s = next_s
            next_s += 1
            pages = snaps[t][:k]
            for p in pages:
                alias_n[p] += 1
            snaps[s] = pages
            snap_ids.append(s)
            emit(REUSE, (s, t, k), 0)
        while snap_ids and (len(snap_ids) > MAX_SNAPSHOTS or rand() < P_RELEASE):
            i = randint(0, len(snap_ids) - 1)
            s = snap_ids[i]
            snap_ids[i] = snap_ids[-1]
            snap_ids.pop()
            gone = 0
            for p in snaps.pop(s):
                c = alias_n[p] - 1
                if c:
                    alias_n[p] = c
                else:
                    del alias_n[p]
                    gone += 1
            free += gone
            emit(RELEASE, (s,), gone)
            if len(snap_ids) <= MAX_SNAPSHOTS:
                break
        # random cancellation of a live request
        if held and rand() < P_CANCEL:
            live = growing + done
            r = live[randint(0, len(live) - 1)]
            (growing if need[r] else done).remove(r)
            h = held.pop(r)
            free += h
            del need[r]
            emit(CANCEL, (r,), h)
        # finish done requests to keep pages free
        while free < LOW_WATER and done:
            if variant == "lifo":
                r = done.pop()
            else:
                i = randint(0, len(done) - 1)
                r = done[i]
                done[i] = done[-1]
                done.pop()
            h = held.pop(r)
            free += h
            del need[r]
            emit(FINISH, (r,), h)
        emit(SEAL, (step,), 0)
    return Trace(ops, sum(per_op), per_op, steps)


# --------------------------------------------------------------------------- baseline


class PlainPool:
    """The yardstick: a list free stack, a dict page -> owner, per-request page lists.

    No validation, no events, no marks: what a scheduler writes by hand. Same
    command signatures as ``Ledger`` so both run through the same driver loop.
    """

    __slots__ = ("free", "owner", "requests", "snapshots", "alias_n", "open_step")

    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages - 1, -1, -1))
        self.owner: dict[int, int] = {}
        self.requests: dict[int, list[list[int]]] = {}  # r -> [reserved, kv]
        self.snapshots: dict[int, list[int]] = {}
        self.alias_n: dict[int, int] = {}
        self.open_step = 0

    def reserve(self, r: int, n: int) -> list[int]:
        free = self.free
        pages = free[-n:]
        del free[-n:]
        self.owner.update(dict.fromkeys(pages, r))
        rec = self.requests.get(r)
        if rec is None:
            rec = self.requests[r] = [[], []]
        rec[0] += pages
        return pages

    def commit(self, r: int, step: int, n: int) -> list[int]:
        rec = self.requests[r]
        reserved = rec[0]
        pages = reserved[:n]
        del reserved[:n]
        rec[1] += pages
        self.owner.update(dict.fromkeys(pages, r))
        return pages

    def return_reservation(self, r: int) -> list[int]:
        rec = self.requests[r]
        pages = rec[0]
        rec[0] = []
        owner = self.owner
        for p in pages:
            del owner[p]
        self.free += pages
        return pages

    def finish(self, r: int) -> None:
        reserved, kv = self.requests.pop(r)
        owner = self.owner
        for p in reserved:
            del owner[p]
        for p in kv:
            del owner[p]
        free = self.free
        free += reserved
        free += kv

    cancel = finish

    def alias_snapshot(self, s: int, n: int) -> list[int]:
        free = self.free
        pages = free[-n:]
        del free[-n:]
        self.alias_n.update(dict.fromkeys(pages, 1))
        self.snapshots[s] = pages
        return pages

    def reuse_snapshot(self, s: int, t: int, k: int) -> list[int]:
        pages = self.snapshots[t][:k]
        an = self.alias_n
        for p in pages:
            an[p] += 1
        self.snapshots[s] = pages
        return pages

    def release_snapshot(self, s: int) -> None:
        an = self.alias_n
        freed = []
        for p in self.snapshots.pop(s):
            c = an[p] - 1
            if c:
                an[p] = c
            else:
                del an[p]
                freed.append(p)
        self.free += freed

    def seal_step(self, step: int) -> None:
        self.open_step = step + 1


def plain_calls(pool: PlainPool) -> tuple:
    return (
        pool.reserve,
        pool.commit,
        pool.return_reservation,
        pool.cancel,
        pool.finish,
        pool.alias_snapshot,
        pool.reuse_snapshot,
        pool.release_snapshot,
        pool.seal_step,
    )


def ledger_calls(ledger: Ledger) -> tuple:
    alias, snapshot_pages = ledger.alias_snapshot, ledger.snapshot_pages

    def reuse(s: int, t: int, k: int):
        return alias(s, pages=snapshot_pages(t)[:k])

    return (
        ledger.reserve,
        ledger.commit,
        ledger.return_reservation,
        ledger.cancel,
        ledger.finish,
        alias,
        reuse,
        ledger.release_snapshot,
        ledger.seal_step,
    )


def new_ledger() -> Ledger:
    return Ledger(Geometry(num_pages=NUM_PAGES, page_tokens=PAGE_TOKENS))


def drive(calls: tuple, ops: list) -> None:
    """The replay loop both sides share."""
    for code, args in ops:
        calls[code](*args)


# --------------------------------------------------------------------------- checks


class CheckError(AssertionError):
    """The benchmark's own consistency check failed: the figures would be meaningless."""


def shape_of_ledger(ledger: Ledger) -> tuple:
    st = ledger.state
    reqs = tuple(sorted((r, len(rec.reserved), len(rec.kv)) for r, rec in st.requests.items()))
    snaps = tuple(sorted((s, len(p)) for s, p in st.snapshots.items()))
    aliased = bytes(st.holder_codes()).count(HOLDER_ALIAS)
    return ledger.free_count, reqs, snaps, aliased, ledger.open_step


def shape_of_pool(pool: PlainPool) -> tuple:
    reqs = tuple(sorted((r, len(rec[0]), len(rec[1])) for r, rec in pool.requests.items()))
    snaps = tuple(sorted((s, len(p)) for s, p in pool.snapshots.items()))
    return len(pool.free), reqs, snaps, len(pool.alias_n), pool.open_step


def _holder_bits(st) -> int:
    return int.from_bytes(bytes(st.holder_codes()), "little")


def verify(trace: Trace, windows: tuple = VERIFY_WINDOWS) -> dict:
    """Untimed: replay into a ledger; for every command inside ``windows`` (fractions
    of the trace, ``(start, stop)``), count how many pages changed holder.

    Raises ``CheckError`` if a command's count differs from the generator's, if the
    final state breaks an invariant, or if the baseline ends in a different shape.
    Returns figures of the ledger's extra work (events, step plans, cleared pages)
    and the shape (counts per request and snapshot) every timed run must end in.
    """
    n_ops = len(trace.ops)
    mask = bytearray(n_ops)
    for a, z in windows:
        lo, hi = int(a * n_ops), int(z * n_ops)
        mask[lo:hi] = b"\x01" * (hi - lo)
    ledger = new_ledger()
    pool = PlainPool(NUM_PAGES)
    calls = ledger_calls(ledger)
    st = ledger.state
    nbytes = NUM_PAGES
    before = None
    cleared = plans = 0
    seq0 = ledger.seq
    for i, (code, args) in enumerate(trace.ops):
        if mask[i]:
            if before is None:
                before = _holder_bits(st)
            out = calls[code](*args)
            after = _holder_bits(st)
            changed = nbytes - (before ^ after).to_bytes(nbytes, "little").count(0)
            if changed != trace.per_op[i]:
                raise CheckError(
                    f"op {i} {OP_NAMES[code]}{args!r} changed {changed} holders, the trace says {trace.per_op[i]}"
                )
            before = after
        else:
            before = None
            out = calls[code](*args)
        if code == SEAL:
            plans += 1
            cleared += len(out.clear_list)
    check_invariants(st)
    drive(plain_calls(pool), trace.ops)
    shape = shape_of_pool(pool)
    if shape_of_ledger(ledger) != shape:
        raise CheckError("ledger and baseline end in different shapes")
    return {
        "events": ledger.seq - seq0,
        "plans": plans,
        "cleared_pages": cleared,
        "verified_ops": sum(mask),
        "shape": shape,
    }


# --------------------------------------------------------------------------- run


def _segments(ops: list, n: int) -> list:
    k = len(ops)
    return [ops[i * k // n : (i + 1) * k // n] for i in range(n)]


def _ledger_side(segments: list, n_ops: int, expect: tuple):
    def build():
        ledger = new_ledger()
        calls = ledger_calls(ledger)
        seq0 = ledger.seq

        def segment(i: int) -> None:
            drive(calls, segments[i])

        def check() -> None:
            if ledger.seq - seq0 != n_ops or shape_of_ledger(ledger) != expect:
                raise CheckError("ledger run diverged from the trace")

        return segment, check

    return build


def _plain_side(segments: list, expect: tuple):
    def build():
        pool = PlainPool(NUM_PAGES)
        calls = plain_calls(pool)

        def segment(i: int) -> None:
            drive(calls, segments[i])

        def check() -> None:
            if shape_of_pool(pool) != expect:
                raise CheckError("baseline run diverged from the trace")

        return segment, check

    return build


def run(quick: bool) -> dict:
    """Generate both traces, verify them, time ledger vs baseline; print a table.

    Raises ``CheckError`` if the trace and an implementation disagree (no figures
    are worth reporting then).
    """
    repeats = 3 if quick else 5
    figures: dict = {
        "pages": NUM_PAGES,
        "steps": STEPS,
        "repeats": repeats,
        "segments": SEGMENTS,
        "gc": "disabled while timed",
        "baseline": "list free stack + dict page->owner, no validation, no events",
    }
    rows = []
    ratios = []
    for variant in VARIANTS:
        trace = make_trace(variant)
        extra = verify(trace)
        segments = _segments(trace.ops, SEGMENTS)
        n_ops, n_tr = len(trace.ops), trace.transitions
        t = interleaved_segments(
            {
                "ledger": _ledger_side(segments, n_ops, extra["shape"]),
                "plain": _plain_side(segments, extra["shape"]),
            },
            SEGMENTS,
            repeats,
        )
        led, plain = t["ledger"], t["plain"]
        ratio = plain.best / led.best
        # Ledger and baseline ran the same segments interleaved in each repeat, so
        # each repeat gives a paired ratio; their range is the ratio's spread.
        paired = [p / q for p, q in zip(plain.runs.samples, led.runs.samples, strict=False)]
        ratios.append(ratio)
        v = variant + "_"
        figures.update(
            {
                v + "commands": n_ops,
                v + "transitions": n_tr,
                v + "events": extra["events"],
                v + "cleared_pages": extra["cleared_pages"],
                v + "verified_ops": extra["verified_ops"],
                v + "transitions_per_s": n_tr / led.best,
                v + "commands_per_s": n_ops / led.best,
                v + "events_per_s": extra["events"] / led.best,
                v + "baseline_transitions_per_s": n_tr / plain.best,
                v + "ledger_s": led.best,
                v + "baseline_s": plain.best,
                v + "ratio": ratio,
                v + "ledger_best_run_s": led.runs.best,
                v + "ledger_median_run_s": led.runs.median,
                v + "ledger_spread": led.runs.spread,
                v + "baseline_best_run_s": plain.runs.best,
                v + "baseline_median_run_s": plain.runs.median,
                v + "baseline_spread": plain.runs.spread,
                v + "ratio_run_min": min(paired),
                v + "ratio_run_max": max(paired),
            }
        )
        rows.append(
            (
                variant,
                fmt_count(n_ops),
                fmt_count(n_tr),
                fmt_rate(n_tr / led.best),
                fmt_rate(n_ops / led.best),
                fmt_rate(n_tr / plain.best),
                f"{ratio:.3f}",
                f"{min(paired):.3f}-{max(paired):.3f}",
                f"{100 * led.runs.spread:.0f}% / {100 * plain.runs.spread:.0f}%",
                fmt_count(extra["cleared_pages"]),
            )
        )
    figures["ratio"] = min(ratios)
    print_table(
        f"fold: Ledger command + fold vs plain list+dict pool, {fmt_count(NUM_PAGES)} pages, "
        f"{repeats} repeats x {SEGMENTS} segments",
        (
            "free order",
            "commands",
            "transitions",
            "ledger tr/s",
            "ledger cmd/s",
            "plain tr/s",
            "ratio",
            "ratio per run",
            "spread L / P",
            "cleared",
        ),
        rows,
    )
    print(
        "ratio = plain time / ledger time, each the sum of per-segment best times (worse variant: {:.3f});\n"
        "ratio per run: the range of whole-run paired ratios; spread: (worst - best) / best of whole runs;\n"
        "cleared: pages the ledger listed in step plans; events/s = commands/s (one event per command)."
        .format(figures["ratio"])
    )
    return figures


if __name__ == "__main__":
    run("--quick" in sys.argv[1:])
