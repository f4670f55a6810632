"""``python -m kvledger.integrations.vllm.probe``: the table, per rule, config and scheduling mode.

Run from the folder that holds vLLM's ``tests/`` (the conformance work folder), with the
conformance environment's python; ``scripts/vllm-conformance --probe`` does both. Prints,
per run: stale reads, unwritten-state hits, masked same-group reads, emulator errors
(WRONG: 0 in a sound run), blocks and bytes zeroed and the bytes against vLLM's rule on
the same config and mode; then the sanitizer's first stale read, named. Exit status 1 when
kvledger's default rule shows a stale read, an unwritten hit, a WRONG, or zeroes more than
half of vLLM's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from . import CONFIGS, RULES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvledger.integrations.vllm.probe",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--modes", default="sync,async", help="sync, async or both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=240)
    ap.add_argument("--json", default=None, help="write every run's counts here")
    ap.add_argument("--log-dir", default=None, help="keep each kvledger run's log here (audit it)")
    opts = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    from tests.v1.core import utils  # type: ignore[import-not-found]  # vLLM's own test utilities

    from .driver import run_probe

    rows = []
    for config in opts.configs.split(","):
        for mode in opts.modes.split(","):
            for rule in opts.rules.split(","):
                log_dir = None
                if rule != "vllm":
                    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="kvledger-probe-")
                    os.makedirs(log_dir, exist_ok=True)
                t0 = time.perf_counter()
                stats = run_probe(utils, config, rule, steps=opts.steps, async_scheduling=mode == "async",
                                  seed=opts.seed, num_blocks=opts.blocks, log_dir=log_dir)
                rows.append((stats, time.perf_counter() - t0))
                print(f"[probe] {config:6s} {mode:5s} {rule:10s} stale {stats.stale:6d} unwritten "
                      f"{stats.unwritten:4d} wrong {stats.wrong} zeroed {stats.zeroed_blocks:6d} "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    status = _table(rows)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump([dict(vars(s), seconds=t) for s, t in rows], f, indent=1)
    return status


def _table(rows: list) -> int:
    base = {(s.config, s.async_scheduling): s.zeroed_bytes for s, _ in rows if s.rule == "vllm"}
    head = (f"{'config':7s}{'sched':6s}{'rule':11s}{'stale':>8s}{'unwritten':>10s}{'masked same':>12s}"
            f"{'wrong':>6s}{'blocks zeroed':>14s}{'MiB zeroed':>11s}{'vs vLLM':>9s}")
    print(head)
    print("-" * len(head))
    status = 0
    for s, _ in rows:
        b = base.get((s.config, s.async_scheduling))
        ratio = f"{s.zeroed_bytes / b:.2f}" if b else "-"
        print(f"{s.config:7s}{'async' if s.async_scheduling else 'sync':6s}{s.rule:11s}{s.stale:8d}{s.unwritten:10d}"
              f"{s.masked_same:12d}{s.wrong:6d}{s.zeroed_blocks:14d}{s.zeroed_bytes / 2**20:11.1f}{ratio:>9s}")
        if s.wrong:
            status = 1
        if s.rule == "groups" and (s.stale or s.unwritten or (b and s.zeroed_bytes > 0.5 * b)):
            status = 1
    firsts = [(s, s.first_stale) for s, _ in rows if s.rule == "sanitizer" and s.first_stale]
    if firsts:
        print("\nthe sanitizer's first stale read (kvledger recording, nothing zeroed, released blocks poisoned):")
        for s, first in firsts:
            print(f"  {s.config} {'async' if s.async_scheduling else 'sync'}: {first}  (log: {s.log})")
    for s, _ in rows:
        for ex in s.wrong_examples:
            print(f"  WRONG {s.config} {s.rule}: step {ex[0]} request {ex[1]} group {ex[2]} block {ex[3]} "
                  f"position {ex[4]} holds {ex[5]}")
    return status


if __name__ == "__main__":
    sys.exit(main())
