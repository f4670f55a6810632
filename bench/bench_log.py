"""Log benchmark: appending through the durable log, and replaying it from disk.

The serving trace of the fold benchmark (``bench_fold.make_trace``: 10,000 pages,
requests of 1-64 pages growing in chunks of 1-16, lifo and random finish order,
snapshots aliased, reused and released) is run four ways in the same process:

* baseline A, the in-memory fold: a plain ``Ledger`` running the trace's commands;
* append, inline: ``LogOptions(fsync="per_step")``, the same commands; every
  ``seal_step`` writes its step's record and fsyncs before it returns;
* append, background: ``LogOptions(fsync="per_step", background=True)``: the
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

The 10-million-event log (``replay --trusted`` on 1 Mi pages) is ``bench_log_10m.py``.
"""

from __future__ import annotations

import logging
import os
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
from kvledger import Geometry, Ledger, replay  # noqa: E402
from kvledger.options import LogOptions  # noqa: E402
from kvledger.durable import open_ledger  # noqa: E402
from kvledger.core.log import open_view  # noqa: E402
from kvledger.core.log.fold import rebuild_state  # noqa: E402
from kvledger.tools.replay import replay_log  # noqa: E402

TARGETS = {"append_ratio": (">=", 0.9), "replay_checked_vs_commands": (">=", 0.7),
           "replay_trusted_vs_commands": (">=", 0.7), "pages_ratio": ("<=", 1.3)}
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
        p = os.path.join(self.directory, f"{self.variant}-{name}-{self.n}.kvlog")
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
        # background: the defaults (writer thread, group commit); inline: fsync="per_step" (opt-in)
        led = open_ledger(path, GEOMETRY, logger=QUIET) if background else \
            open_ledger(path, GEOMETRY, logger=QUIET, log_options=LogOptions(fsync="per_step"))
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

    def from_disk(invariants: str, trusted: bool = False):
        def case() -> float:
            dt, s = time_call(lambda: replay_log(run.log, invariants=invariants, trusted=trusted))
            if not s.ok:
                raise RuntimeError(f"replay failed: {s.error}")
            run.digests["replay_" + invariants + ("_trusted" if trusted else "")] = s.digest
            return dt

        return case

    def trusted() -> float:
        def work():
            with open_view(run.log) as v:
                st, _, _ = rebuild_state(v, from_checkpoint=False, trusted=True)
            return st

        dt, st = time_call(work)
        run.digests["replay_trusted"] = st.digest()
        return dt

    return {"fold_events": fold_events, "replay": from_disk("none"), "replay_auto": from_disk("auto"),
            "trusted": trusted, "replay_trusted": from_disk("auto", trusted=True)}


RATIOS = ("append_ratio", "append_inline_ratio", "replay_ratio", "replay_auto_ratio", "replay_trusted_vs_commands",
          "replay_checked_vs_commands")


def run(quick: bool) -> dict:
    """Time append and replay against the in-memory fold on the serving trace; print a table."""
    steps = 800 if quick else 2400
    repeats = 3 if quick else 5
    directory = tempfile.mkdtemp(prefix="kvledger-bench-log-")
    figures: dict = {"pages": GEOMETRY.num_pages, "steps": steps, "repeats": repeats, "segments": SEGMENTS,
                     "gc": "disabled while timed", "fsync": "per_step"}
    rows: list = []
    try:
        figures["fsync_latency_ms"] = _fsync_latency(directory) * 1e3
        for variant in bench_fold.VARIANTS:
            figs, variant_rows = _variant(variant, steps, repeats, directory)
            figures.update(figs)
            rows += variant_rows
        for k in RATIOS:
            figures[k] = min(figures[f"{variant}_{k}"] for variant in bench_fold.VARIANTS)
        _print_variants(figures, rows, steps, repeats)
        figures.update(_pages_scaling(directory, quick))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return figures


def _variant(variant: str, steps: int, repeats: int, directory: str) -> tuple[dict, list]:
    """One trace order: append (background and inline) and every replay case, timed; its figures and rows."""
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
        raise RuntimeError(f"the runs of {variant} disagree on the final state digest: {run_.digests}")
    n_ev, n_tr = len(events), trace.transitions
    size = os.path.getsize(run_.log)
    t = {"mem": ta["memory"].best, "bg": ta["background"].best, "mem_i": ti["memory"].best,
         "inl": ti["inline"].best, **{k: tr[k].best for k in ("fold_events", "replay", "replay_auto", "trusted",
                                                               "replay_trusted")}}
    spread = {"memory": ta["memory"].runs.spread, "background": ta["background"].runs.spread,
              **{k: tr[k].spread for k in tr}}
    figures = _variant_figures(variant, n_ev, n_tr, size, t, spread, run_)
    figures[variant + "_append_ratio_run_min"] = min(
        m / b for m, b in zip(ta["memory"].runs.samples, ta["background"].runs.samples, strict=True))
    rows = _variant_rows(variant, n_ev, n_tr, t, spread, run_)
    if run_.log and os.path.exists(run_.log):
        os.unlink(run_.log)
    return figures, rows


def _variant_figures(variant: str, n_ev: int, n_tr: int, size: int, t: dict, spread: dict, run_: _Run) -> dict:
    """The figures of one trace order from its best times ``t`` (seconds)."""
    mem, bg, fe, rp, ra, tt, rt = (t[k] for k in ("mem", "bg", "fold_events", "replay", "replay_auto", "trusted",
                                                    "replay_trusted"))
    v = variant + "_"
    return {
        v + "events": n_ev, v + "transitions": n_tr, v + "log_bytes": size, v + "bytes_per_event": size / n_ev,
        v + "memory_events_per_s": n_ev / mem, v + "memory_transitions_per_s": n_tr / mem,
        v + "append_events_per_s": n_ev / bg, v + "append_transitions_per_s": n_tr / bg,
        v + "append_ratio": mem / bg, v + "append_fsyncs": run_.syncs["background"],
        v + "append_inline_events_per_s": n_ev / t["inl"], v + "append_inline_ratio": t["mem_i"] / t["inl"],
        v + "append_inline_fsyncs": run_.syncs["inline"],
        v + "fold_events_per_s": n_ev / fe, v + "replay_events_per_s": n_ev / rp,
        v + "replay_transitions_per_s": n_tr / rp, v + "replay_mb_per_s": size / rp / 1e6,
        v + "replay_ratio": fe / rp,
        v + "replay_trusted_events_per_s": n_ev / tt, v + "replay_trusted_vs_commands": mem / tt,
        v + "replay_checked_vs_commands": mem / rp,
        v + "replay_log_trusted_events_per_s": n_ev / rt, v + "replay_log_trusted_vs_commands": mem / rt,
        v + "replay_auto_ratio": fe / ra,
        v + "memory_spread": spread["memory"], v + "append_spread": spread["background"],
        v + "replay_spread": spread["replay"],
    }


def _variant_rows(variant: str, n_ev: int, n_tr: int, t: dict, spread: dict, run_: _Run) -> list:
    """The table rows of one trace order: (case, seconds key, baseline key, fsyncs, spread key) each."""
    cases = [("in-memory fold (commands)", "mem", "mem", "-", "memory"),
             ("append, per_step, background", "bg", "mem", fmt_count(run_.syncs["background"]), "background"),
             ("append, per_step, inline (1 run)", "inl", "mem_i", fmt_count(run_.syncs["inline"]), None),
             ("in-memory fold (event objects)", "fold_events", "fold_events", "-", "fold_events"),
             ("replay from disk", "replay", "fold_events", "-", "replay"),
             ("replay, invariants auto", "replay_auto", "fold_events", "-", "replay_auto"),
             ("trusted fold from disk (vs commands)", "trusted", "mem", "-", "trusted"),
             ("checked replay from disk (vs commands)", "replay", "mem", "-", "replay"),
             ("replay --trusted, summary counted (vs commands)", "replay_trusted", "mem", "-", "replay_trusted")]
    return [(variant, case, fmt_rate(n_ev / t[k], " ev/s"), fmt_rate(n_tr / t[k], " tr/s"), f"{t[base] / t[k]:.3f}",
             fsyncs, f"{100 * spread[sk]:.0f}%" if sk else "-") for case, k, base, fsyncs, sk in cases]


def _print_variants(figures: dict, rows: list, steps: int, repeats: int) -> None:
    print_table(
        f"log: append and replay vs the in-memory fold, {fmt_count(GEOMETRY.num_pages)} pages, {steps} steps per "
        f"variant; append: {repeats} repeats x {SEGMENTS} segments (sum of per-segment bests), replay: best of "
        f"{repeats + 2}; fsync (4 KiB append + fdatasync) {figures['fsync_latency_ms']:.2f} ms now",
        ("order", "case", "events/s", "transitions/s", "ratio", "fsyncs", "spread"), rows)
    print("append ratio = in-memory command time / append time with the defaults (writer thread; target\n"
          ">= 0.9; the inline per-step run pays every fsync on the critical path); replay ratios: the fold of\n"
          "the event objects / checked replay from the file, and the command time / the trusted fold from disk\n"
          f"(target >= 0.7). Worse variant: append {figures['append_ratio']:.3f} (inline "
          f"{figures['append_inline_ratio']:.3f}), checked replay {figures['replay_ratio']:.3f} (auto invariants "
          f"{figures['replay_auto_ratio']:.3f}), trusted fold vs commands "
          f"{figures['replay_trusted_vs_commands']:.3f}. spread: (worst - best) / best.")


# ---------------------------------------------------------------------- 1 k pages vs 1 M pages

SMALL, LARGE = 1 << 10, 1 << 20


def _scaling_side(ops_segments: list, run: _Run, num_pages: int, every):
    last = len(ops_segments) - 1

    def build():
        path = run.path(f"pages{num_pages}")
        g = Geometry(num_pages=num_pages, page_tokens=bench_fold.PAGE_TOKENS)
        led = open_ledger(path, g, logger=QUIET, log_options=LogOptions(checkpoint_every=every))
        calls = bench_fold.ledger_calls(led)

        def segment(i: int) -> None:
            bench_fold.drive(calls, ops_segments[i])
            if i == last:
                led.flush()

        def check() -> None:
            run.digests[num_pages] = led.log.statistics().checkpoints
            led.log.abandon()
            os.unlink(path)

        return segment, check

    return build


def _checkpoint_seconds(num_pages: int, trace_ops: list) -> float:
    """One checkpoint of the state the trace leaves on a ``num_pages`` cache (best of 3)."""
    led = Ledger(Geometry(num_pages=num_pages, page_tokens=bench_fold.PAGE_TOKENS))
    bench_fold.drive(bench_fold.ledger_calls(led), trace_ops)
    import hashlib

    def one():
        cb = led.state.canonical_bytes()
        return hashlib.blake2b(cb, digest_size=32).hexdigest()

    return min(time_call(one)[0] for _ in range(3))


def _pages_scaling(directory: str, quick: bool) -> dict:
    """Durable append, default settings, of one command stream on a 1 Ki-page and a 1 Mi-page cache."""
    from kvledger.durable import auto_checkpoint_every

    steps = 1500 if quick else 6000
    trace = bench_fold.make_trace("lifo", steps=steps, num_pages=SMALL)
    segs = _segments(trace.ops, SEGMENTS)
    run_ = _Run(directory, "pages")
    out: dict = {}
    rows = []
    for label, every in (("auto", "auto"), ("every 10,000", 10_000)):
        t = interleaved_segments({"small": _scaling_side(segs, run_, SMALL, every),
                                  "large": _scaling_side(segs, run_, LARGE, every)}, SEGMENTS, 2 if quick else 3)
        n = len(trace.ops)
        small, large = t["small"].best / n * 1e6, t["large"].best / n * 1e6
        key = "pages" if every == "auto" else "pages_every_10k"
        out.update({f"{key}_small_us_per_command": small, f"{key}_large_us_per_command": large,
                    f"{key}_ratio": large / small, f"{key}_large_checkpoints": run_.digests[LARGE]})
        rows.append((label, f"{small:.2f}", f"{large:.2f}", f"{large / small:.3f}", str(run_.digests[LARGE])))
    cp = _checkpoint_seconds(LARGE, trace.ops)
    every_large = auto_checkpoint_every(LARGE)
    events_per_command = 1.0  # (each command appends one event)
    amortized = cp / every_large * events_per_command * 1e6
    out.update({"pages_commands": len(trace.ops), "checkpoint_1m_pages_s": cp,
                "checkpoint_auto_every_1m": every_large, "pages_amortized_checkpoint_us": amortized,
                "pages_ratio_with_amortized_checkpoint": (out["pages_large_us_per_command"] + amortized)
                / out["pages_small_us_per_command"]})
    print_table(f"log: durable append (defaults: writer thread) of {fmt_count(len(trace.ops))} commands on "
                f"{fmt_count(SMALL)} vs {fmt_count(LARGE)} pages; one checkpoint at 1 Mi pages {cp * 1e3:.0f} ms",
                ("checkpoints", "µs/command 1 Ki", "µs/command 1 Mi", "ratio", "checkpoints at 1 Mi"), rows)
    print(f"auto checkpoints: every max(10,000, 4 x num_pages) events = {fmt_count(every_large)} at 1 Mi pages, "
          f"so the checkpoint costs {amortized:.3f} µs per command amortized; ratio with it added "
          f"{out['pages_ratio_with_amortized_checkpoint']:.3f} (target <= 1.3)")
    return out


if __name__ == "__main__":
    run("--quick" in sys.argv[1:])
