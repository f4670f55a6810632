"""Log benchmark, the long one: ``kvledger replay --trusted`` of 10 million events on 1 Mi pages.

A log of the fold benchmark's serving shape (``bench_fold``: requests of 1-64 pages growing in
chunks, snapshots aliased, reused and released; decided online from the ledger, ``_serve``) on a
1,048,576-page cache is written with the defaults (writer thread, a directory of 64 MiB segments:
about 1.1 GB), then read back four ways, each timed:

* ``kvledger replay --trusted LOG`` run as the console script in a child process: its CPU
  seconds (user + system, from ``getrusage``) are the figure (target < 30 s on the 2-core
  machines), its wall seconds beside them;
* ``kvledger replay LOG`` (checked) the same way;
* the bare trusted fold (``rebuild_state(trusted=True)`` from seq 0) in this process;
* ``audit_log(page=...)`` with its default window (the last segment from its checkpoint).

Baseline, timed in the same run: the CPU seconds the in-memory ledger spent running the same
10 M commands while the log was written (the commands' own cost: the replay is compared with
the run that made the log). ``--log PATH`` reuses a log this module wrote before (the write
takes minutes); ``--events N`` writes a shorter one.

Not part of ``bench/run.py``'s default set unless ``KVLEDGER_BENCH_10M=1`` (it takes minutes);
``python bench/bench_log_10m.py`` runs it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import structlog  # noqa: E402
from _common import fmt_count, fmt_rate, print_table, time_call  # noqa: E402

import bench_fold  # noqa: E402
from kvledger import Geometry, OutOfPagesError  # noqa: E402
from kvledger.options import LogOptions  # noqa: E402
from kvledger.core.log import open_view  # noqa: E402
from kvledger.core.log.fold import rebuild_state  # noqa: E402
from kvledger.durable import open_ledger  # noqa: E402
from kvledger.tools.audit import audit_log  # noqa: E402

TARGETS = {"ten_million_replay_trusted_cpu_s": ("<", 30.0)}
QUIET = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
LARGE = 1 << 20
CLI = os.path.join(os.path.dirname(sys.executable), "kvledger")
CLI = CLI if os.path.exists(CLI) else shutil.which("kvledger") or "kvledger"


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
        _serve_snapshots(led, rng, state)
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


def _serve_snapshots(led, rng: random.Random, state: dict) -> None:
    """One step's snapshots in ``_serve``: alias fresh pages, alias part of a live snapshot, release some."""
    P = bench_fold
    snaps = state["snaps"]
    if rng.random() < P.P_ALIAS and led.state.free_count - 16 >= P.ADMIT_FREE:
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


def write_log(path: str, target: int) -> dict:
    """Write a ``target``-event log of the serving shape at ``path`` (a directory of 64 MiB segments, the
    defaults otherwise); its figures, with the CPU seconds of this thread (the commands: the baseline)."""
    rng = random.Random(10_000_000)
    state = {"growing": [], "done": [], "need": {}, "snaps": [], "next_r": 0, "next_s": 0}
    g = Geometry(num_pages=LARGE, page_tokens=bench_fold.PAGE_TOKENS)
    t0, c0 = time.perf_counter(), time.thread_time()
    with open_ledger(path, g, logger=QUIET, log_options=LogOptions(segment_bytes=64 << 20)) as led:
        while led.seq < target:
            _serve(led, rng, 200, state)
        events, digest = led.seq, led.digest()
    info = {"events": events, "digest": digest, "write_s": time.perf_counter() - t0,
            "commands_cpu_s": time.thread_time() - c0}
    with open(os.path.join(path, "bench-10m.json"), "w") as f:  # (not a segment: readers ignore it)
        json.dump(info, f)
    return info


def _cli(*args: str) -> tuple[dict, float, float]:
    """The console script in a child process: (its JSON summary, CPU seconds, wall seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([CLI, *args, "--json"], capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"kvledger {' '.join(args)} exited {out.returncode}: {out.stdout[-400:]} "
                           f"{out.stderr[-400:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.stdout), cpu, wall


def measure(path: str, info: dict) -> dict:
    """Read the log four ways (module docstring); the figures, printed as a table."""
    events = info["events"]
    segs = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".kvlog")]
    size = sum(os.path.getsize(p) for p in segs)
    out = {"ten_million_events": events, "ten_million_log_bytes": size, "ten_million_write_s": info["write_s"],
           "ten_million_commands_cpu_s": info["commands_cpu_s"], "ten_million_pages": LARGE,
           "ten_million_segments": len(segs)}
    rows = []
    for name, args in (("replay_trusted", ("replay", "--trusted", path)), ("replay_checked", ("replay", path))):
        summary, cpu, wall = _cli(*args)
        if summary["digest"] != info["digest"]:
            raise RuntimeError(f"kvledger {' '.join(args)} reached another digest: {summary['digest']}")
        out[f"ten_million_{name}_cpu_s"], out[f"ten_million_{name}_wall_s"] = cpu, wall
        rows.append((f"kvledger {' '.join(a for a in args if a != path)} (child process)", f"{cpu:.1f}",
                     f"{wall:.1f}", fmt_rate(events / cpu, " ev/s"), f"{info['commands_cpu_s'] / cpu:.2f}"))
    gc.collect()

    def trusted():
        with open_view(path) as v:
            return rebuild_state(v, from_checkpoint=False, trusted=True)[0]

    c0 = time.process_time()
    dt, st = time_call(trusted)
    cpu = time.process_time() - c0
    if st.digest() != info["digest"]:
        raise RuntimeError("the trusted fold reached another digest")
    out["ten_million_trusted_fold_cpu_s"] = cpu
    rows.append(("rebuild_state(trusted=True) from seq 0", f"{cpu:.1f}", f"{dt:.1f}", fmt_rate(events / cpu, " ev/s"),
                 f"{info['commands_cpu_s'] / cpu:.2f}"))
    dt, rep = time_call(lambda: audit_log(path, page=12345))
    if rep.error is not None:
        raise RuntimeError(f"10M audit --page failed: {rep.error}")
    out["ten_million_audit_page_s"] = dt
    rows.append((f"audit_log --page 12,345, default window ({rep.events:,} events)", "-", f"{dt:.2f}", "-", "-"))
    print_table(f"log: a {fmt_count(events)}-event log on {fmt_count(LARGE)} pages ({fmt_count(size // 1_000_000)} MB "
                f"in {len(segs)} segments); baseline: the commands that wrote it, {info['commands_cpu_s']:.1f} s CPU",
                ("read", "CPU s", "wall s", "events/CPU s", "vs commands"), rows)
    return out


def run(quick: bool, *, log: str | None = None, events: int = 10_000_000) -> dict:
    """Write (or reuse) the log and time its reads; skipped by the runner unless KVLEDGER_BENCH_10M=1."""
    if log is None and os.environ.get("KVLEDGER_BENCH_10M") != "1" and __name__ != "__main__":
        return {"skipped": "takes minutes: KVLEDGER_BENCH_10M=1 (or python bench/bench_log_10m.py)"}
    directory = None
    try:
        if log is not None and os.path.exists(os.path.join(log, "bench-10m.json")):
            path = log
            with open(os.path.join(path, "bench-10m.json")) as f:
                info = json.load(f)
        else:
            if log is not None:
                path = log
            else:
                directory = tempfile.mkdtemp(prefix="kvledger-bench-10m-")
                path = os.path.join(directory, "ten-million")
            info = write_log(path, events)
        return measure(path, info)
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", help="reuse (or write once) the log at this path")
    ap.add_argument("--events", type=int, default=10_000_000)
    ns = ap.parse_args()
    figs = run(False, log=ns.log, events=ns.events)
    for k, (op, v) in TARGETS.items():
        print(f"{k} {op} {v}: measured {figs.get(k)}")
