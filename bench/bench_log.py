"""Log benchmark: appending through the durable log, and replaying it from disk.

The serving trace of the fold benchmark (``bench_fold.make_trace``: 10,000 pages,
requests of 1-64 pages growing in chunks of 1-16, lifo and random finish order,
snapshots aliased, reused and released) is run four ways in the same process:

* baseline A, the in-memory fold: a plain ``Ledger`` running the trace's commands;
* append, inline: ``open_ledger(fsync="per_step")``, the same commands; every
  ``seal_step`` writes its step's record and fsyncs before it returns;
* append, background: ``open_ledger(fsync="per_step", background=True)``: the
  seal hands the step's record to a writer thread that writes and fsyncs
  (grouping steps sealed meanwhile into one fsync); the clock stops only when
  everything is durable (``sync()``);
* baseline B, the in-memory fold of the recorded events: ``kvledger.replay(events)``
  (validate + apply every event object);
* replay from disk: ``replay_log(path)`` on the log the append run wrote: read,
  verify every record (CRC, hash chain, seq), decode, validate + apply every
  event, compare each checkpoint's digest (invariants off, like baseline B; the
  default ``auto`` invariant schedule is timed too).

append ratio = baseline A time / append time; replay ratio = baseline B time /
replay time (targets: append with per-step fsync >= 0.5, replay >= 0.7). The
cases are timed alternately (after a discarded warm-up round), the collector
disabled while the clock runs, best of N; the spread is reported.

fsync latency belongs to the disk, not to kvledger: on the shared box this was
measured on it varied from 0.1 ms to 6 ms between runs (the figure of the run is
printed). With one write and one fsync per step on the critical path the inline
ratio is bounded by fold time per step / (fold time per step + write + fsync);
the background writer takes both off the critical path. Its fsyncs then cover
many steps each: while the caller's thread keeps the GIL busy, the writer gets
it back only every few switch intervals (5 ms each), so a step becomes durable
some milliseconds after its seal (``durable_seq`` says exactly which).

``python bench/bench_log.py --10m`` (or ``KVLEDGER_BENCH_10M=1`` for the
runner) also writes a 10-million-event log of the same serving shape (about
0.7 GB) and times its replay from disk.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import shutil
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import structlog  # noqa: E402
from _common import fmt_count, fmt_rate, interleaved, interleaved_segments, print_table, time_call  # noqa: E402

import bench_fold  # noqa: E402
from kvledger import Geometry, Ledger, OutOfPagesError, replay  # noqa: E402
from kvledger.durable import open_ledger  # noqa: E402
from kvledger.replay_log import replay_log  # noqa: E402

TARGETS = {"append_ratio": (">=", 0.5), "replay_ratio": (">=", 0.7)}
GEOMETRY = Geometry(num_pages=bench_fold.NUM_PAGES, page_tokens=bench_fold.PAGE_TOKENS)
QUIET = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def _fsync_latency(directory: str, n: int = 30) -> float:
    """Median seconds of a 4 KiB append + fdatasync on this disk, now."""
    path = os.path.join(directory, "fsync.probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"x" * 4096)
            os.fdatasync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    times.sort()
    return times[len(times) // 2]


SEGMENTS = 50


def _segments(ops: list, n: int) -> list:
    k = len(ops)
    return [ops[i * k // n : (i + 1) * k // n] for i in range(n)]


class _Run:
    """Paths and end states of the timed runs (checked after timing, untimed)."""

    def __init__(self, directory: str, variant: str) -> None:
        self.directory = directory
        self.variant = variant
        self.n = 0
        self.digests: dict = {}
        self.syncs: dict = {}
        self.log = None

    def path(self, name: str) -> str:
        self.n += 1
        p = os.path.join(self.directory, "%s-%s-%d.kvlog" % (self.variant, name, self.n))
        if os.path.exists(p):
            os.unlink(p)
        return p


def _memory_side(segments: list, run: _Run):
    def build():
        led = Ledger(GEOMETRY)
        calls = bench_fold.ledger_calls(led)

        def segment(i: int) -> None:
            bench_fold.drive(calls, segments[i])

        def check() -> None:
            run.digests["memory"] = led.digest()

        return segment, check

    return build


def _append_side(segments: list, run: _Run, background: bool):
    """A durable ledger; the last segment ends with sync(): the clock stops when all is durable."""
    last = len(segments) - 1

    def build():
        path = run.path("bg" if background else "inline")
        led = open_ledger(path, GEOMETRY, background=background, logger=QUIET)
        calls = bench_fold.ledger_calls(led)

        def segment(i: int) -> None:
            bench_fold.drive(calls, segments[i])
            if i == last:
                led.sync()

        def check() -> None:
            name = "background" if background else "inline"
            run.digests[name] = led.digest()
            run.syncs[name] = led.log.statistics().syncs
            led.close()
            if background:  # the replay cases read the background run's log
                if run.log and os.path.exists(run.log):
                    os.unlink(run.log)
                run.log = path
            else:
                os.unlink(path)

        return segment, check

    return build


def _replay_cases(events: list, run: _Run) -> dict:
    def fold_events() -> float:
        dt, st = time_call(replay, events)
        run.digests["events"] = st.digest()
        return dt

    def from_disk(invariants: str):
        def case() -> float:
            dt, s = time_call(lambda: replay_log(run.log, invariants=invariants))
            if not s.ok:
                raise RuntimeError("replay failed: %s" % (s.error,))
            run.digests["replay_" + invariants] = s.digest
            return dt

        return case

    return {"fold_events": fold_events, "replay": from_disk("none"), "replay_auto": from_disk("auto")}


def run(quick: bool, *, ten_million: bool | None = None) -> dict:
    """Time append and replay against the in-memory fold on the serving trace; print a table."""
    if ten_million is None:
        ten_million = os.environ.get("KVLEDGER_BENCH_10M") == "1"
    steps = 800 if quick else 2400
    repeats = 3 if quick else 5
    directory = tempfile.mkdtemp(prefix="kvledger-bench-log-")
    figures: dict = {"pages": GEOMETRY.num_pages, "steps": steps, "repeats": repeats, "segments": SEGMENTS,
                     "gc": "disabled while timed", "fsync": "per_step"}
    rows = []
    ratios = {"append_ratio": [], "append_inline_ratio": [], "replay_ratio": [], "replay_auto_ratio": []}
    try:
        figures["fsync_latency_ms"] = _fsync_latency(directory) * 1e3
        for variant in bench_fold.VARIANTS:
            trace = bench_fold.make_trace(variant, steps=steps)
            rec = Ledger(GEOMETRY, record=True)
            bench_fold.drive(bench_fold.ledger_calls(rec), trace.ops)
            events = rec.events
            run_ = _Run(directory, variant)
            segs = _segments(trace.ops, SEGMENTS)
            ta = interleaved_segments({"memory": _memory_side(segs, run_),
                                       "background": _append_side(segs, run_, True)}, SEGMENTS, repeats)
            # inline pays one fsync per step on the critical path: one run (after the others warmed up)
            ti = interleaved_segments({"memory": _memory_side(segs, run_),
                                       "inline": _append_side(segs, run_, False)}, SEGMENTS, 1, warmup=0)
            tr = interleaved(_replay_cases(events, run_), repeats + 2)
            want = rec.digest()
            if any(d != want for d in run_.digests.values()):
                raise RuntimeError("the runs of %s disagree on the final state digest: %s" % (variant, run_.digests))
            n_ev, n_tr = len(events), trace.transitions
            size = os.path.getsize(run_.log)
            mem, bg = ta["memory"].best, ta["background"].best
            mem_i, inl = ti["memory"].best, ti["inline"].best
            fe, rp, ra = tr["fold_events"].best, tr["replay"].best, tr["replay_auto"].best
            v = variant + "_"
            figures.update({
                v + "events": n_ev,
                v + "transitions": n_tr,
                v + "log_bytes": size,
                v + "bytes_per_event": size / n_ev,
                v + "memory_events_per_s": n_ev / mem,
                v + "memory_transitions_per_s": n_tr / mem,
                v + "append_events_per_s": n_ev / bg,
                v + "append_transitions_per_s": n_tr / bg,
                v + "append_ratio": mem / bg,
                v + "append_fsyncs": run_.syncs["background"],
                v + "append_ratio_run_min": min(m / b for m, b in zip(ta["memory"].runs.samples, ta["background"].runs.samples)),
                v + "append_inline_events_per_s": n_ev / inl,
                v + "append_inline_ratio": mem_i / inl,
                v + "append_inline_fsyncs": run_.syncs["inline"],
                v + "fold_events_per_s": n_ev / fe,
                v + "replay_events_per_s": n_ev / rp,
                v + "replay_transitions_per_s": n_tr / rp,
                v + "replay_mb_per_s": size / rp / 1e6,
                v + "replay_ratio": fe / rp,
                v + "replay_auto_ratio": fe / ra,
                v + "memory_spread": ta["memory"].runs.spread,
                v + "append_spread": ta["background"].runs.spread,
                v + "replay_spread": tr["replay"].spread,
            })
            ratios["append_ratio"].append(mem / bg)
            ratios["append_inline_ratio"].append(mem_i / inl)
            ratios["replay_ratio"].append(fe / rp)
            ratios["replay_auto_ratio"].append(fe / ra)
            pct = lambda x: "%.0f%%" % (100 * x)  # noqa: E731
            rows += [
                (variant, "in-memory fold (commands)", fmt_rate(n_ev / mem, " ev/s"), fmt_rate(n_tr / mem, " tr/s"),
                 "1.000", "-", pct(ta["memory"].runs.spread)),
                (variant, "append, per_step, background", fmt_rate(n_ev / bg, " ev/s"), fmt_rate(n_tr / bg, " tr/s"),
                 "%.3f" % (mem / bg), fmt_count(run_.syncs["background"]), pct(ta["background"].runs.spread)),
                (variant, "append, per_step, inline (1 run)", fmt_rate(n_ev / inl, " ev/s"),
                 fmt_rate(n_tr / inl, " tr/s"), "%.3f" % (mem_i / inl), fmt_count(run_.syncs["inline"]), "-"),
                (variant, "in-memory fold (event objects)", fmt_rate(n_ev / fe, " ev/s"), fmt_rate(n_tr / fe, " tr/s"),
                 "1.000", "-", pct(tr["fold_events"].spread)),
                (variant, "replay from disk", fmt_rate(n_ev / rp, " ev/s"), fmt_rate(n_tr / rp, " tr/s"),
                 "%.3f" % (fe / rp), "-", pct(tr["replay"].spread)),
                (variant, "replay, invariants auto", fmt_rate(n_ev / ra, " ev/s"), fmt_rate(n_tr / ra, " tr/s"),
                 "%.3f" % (fe / ra), "-", pct(tr["replay_auto"].spread)),
            ]
            if run_.log and os.path.exists(run_.log):
                os.unlink(run_.log)
        for k, vals in ratios.items():
            figures[k] = min(vals)
        print_table(
            "log: append and replay vs the in-memory fold, %s pages, %d steps per variant; append: %d repeats x %d "
            "segments (sum of per-segment bests), replay: best of %d; fsync (4 KiB append + fdatasync) %.2f ms now"
            % (fmt_count(GEOMETRY.num_pages), steps, repeats, SEGMENTS, repeats + 2, figures["fsync_latency_ms"]),
            ("order", "case", "events/s", "transitions/s", "ratio", "fsyncs", "spread"), rows)
        print("append ratio = in-memory command fold time / append time with per-step fsync (target >= 0.5: the\n"
              "background writer; the inline run pays every fsync on the critical path); replay ratio = in-memory\n"
              "fold of the event objects / replay from the file (target >= 0.7). Worse variant: append %.3f\n"
              "(inline %.3f), replay %.3f (with the auto invariant schedule %.3f). spread: (worst - best) / best."
              % (figures["append_ratio"], figures["append_inline_ratio"], figures["replay_ratio"],
                 figures["replay_auto_ratio"]))
        if ten_million:
            figures.update(_ten_million(directory, figures))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return figures


# ---------------------------------------------------------------------- 10 million events


def _serve(led, rng: random.Random, steps: int, state: dict) -> None:
    """The fold benchmark's serving shape, decided online from the ledger (no trace in memory)."""
    P = bench_fold
    st = led.state
    growing, done, need = state["growing"], state["done"], state["need"]
    for _ in range(steps):
        step = led.open_step
        while len(growing) < P.MAX_GROWING and st.free_count >= P.ADMIT_FREE:
            r = state["next_r"]
            state["next_r"] += 1
            need[r] = rng.randint(*P.REQUEST_PAGES)
            growing.append(r)
        chunks = []
        for r in growing:
            n = min(rng.randint(*P.CHUNK_PAGES), need[r])
            try:
                led.reserve(r, n)
            except OutOfPagesError:
                continue
            chunks.append((r, n))
        for r, n in chunks:
            if rng.random() < P.P_CANCEL_BEFORE_COMMIT:
                led.cancel(r)
                growing.remove(r)
                del need[r]
                continue
            k = rng.randint(1, n - 1) if n >= 2 and rng.random() < P.P_PARTIAL_COMMIT else n
            led.commit(r, step, k)
            if k < n:
                led.return_reservation(r)
            need[r] -= k
            if need[r] == 0:
                growing.remove(r)
                done.append(r)
        snaps = state["snaps"]
        if rng.random() < P.P_ALIAS and st.free_count - 16 >= P.ADMIT_FREE:
            s = state["next_s"]
            state["next_s"] += 1
            led.alias_snapshot(s, rng.randint(*P.ALIAS_PAGES))
            snaps.append(s)
        if snaps and rng.random() < P.P_REUSE:
            t = snaps[rng.randrange(len(snaps))]
            pages = led.snapshot_pages(t)
            s = state["next_s"]
            state["next_s"] += 1
            led.alias_snapshot(s, pages=pages[: rng.randint(1, len(pages))])
            snaps.append(s)
        while snaps and (len(snaps) > P.MAX_SNAPSHOTS or rng.random() < P.P_RELEASE):
            i = rng.randrange(len(snaps))
            snaps[i], s = snaps[-1], snaps[i]
            snaps.pop()
            led.release_snapshot(s)
            if len(snaps) <= P.MAX_SNAPSHOTS:
                break
        if (growing or done) and rng.random() < P.P_CANCEL:
            live = growing + done
            r = live[rng.randrange(len(live))]
            (growing if need[r] else done).remove(r)
            del need[r]
            led.cancel(r)
        while st.free_count < P.LOW_WATER and done:
            r = done.pop(rng.randrange(len(done)))
            del need[r]
            led.finish(r)
        led.seal_step(step)


def _ten_million(directory: str, figures: dict, target: int = 10_000_000) -> dict:
    path = os.path.join(directory, "ten-million.kvlog")
    rng = random.Random(10_000_000)
    state = {"growing": [], "done": [], "need": {}, "snaps": [], "next_r": 0, "next_s": 0}
    t0 = time.perf_counter()
    with open_ledger(path, GEOMETRY, background=True, logger=QUIET) as led:
        while led.seq < target:
            _serve(led, rng, 200, state)
        events = led.seq
    write_s = time.perf_counter() - t0
    size = os.path.getsize(path)
    out = {"ten_million_events": events, "ten_million_log_bytes": size, "ten_million_write_s": write_s}
    gc.collect()
    for inv in ("none", "auto"):
        dt, s = time_call(lambda: replay_log(path, invariants=inv))
        if not s.ok:
            raise RuntimeError("10M replay failed: %s" % (s.error,))
        out["ten_million_replay_%s_s" % inv] = dt
        out["ten_million_replay_%s_events_per_s" % inv] = events / dt
    print_table("log: a %s-event log (%s MB, written in %.0f s with per-step fsync, background writer)"
                % (fmt_count(events), fmt_count(size // 1_000_000), write_s),
                ("replay", "seconds", "events/s", "MB/s"),
                [(inv, "%.1f" % out["ten_million_replay_%s_s" % inv],
                  fmt_rate(out["ten_million_replay_%s_events_per_s" % inv], " ev/s"),
                  "%.0f" % (size / out["ten_million_replay_%s_s" % inv] / 1e6)) for inv in ("none", "auto")])
    return out


if __name__ == "__main__":
    run("--quick" in sys.argv[1:], ten_million="--10m" in sys.argv[1:])
