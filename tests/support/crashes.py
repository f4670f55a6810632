"""RELIABILITY.md R4 and R5 as functions of a seed (or kill) range, so the heavy profile can shard them.

    r5_seeds(layout, seeds)       simulated power loss: append through a FaultInjector that cuts the
                                  power in a random fsync, crash the SimulatedDisk (any subset of the
                                  unsynced sectors kept, torn or reordered), reopen, repeat; every event
                                  reported durable must be in the reopened log, as it was appended
    r4_kills(directory, kills)    real child processes SIGKILLed while appending (``test_reliability_log``
                                  holds the child, the kill and the page-cache drop)

Sharding the heavy profile (R5: 100,000 seeds per layout; a 16-core host runs 16 at once)::

    for i in $(seq 0 15); do
      python tests/support/crashes.py r5 --layout segments --start $((i*6250)) --stop $(((i+1)*6250)) &
    done; wait

Each shard prints one JSON line of counts; a shard exits 1 if it saw a violation. The sum over shards
is the figure (``--layout file`` the same). ``KVLEDGER_HYPOTHESIS`` plays no part here: the range does.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from typing import NamedTuple

import structlog

if __package__ in (None, ""):  # run as a script: the tests directory on the path, as pytest puts it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvledger.core.errors import LogIOError
from kvledger.core.log import open_view
from kvledger.durable import open_ledger
from support.simdisk import FaultInjector, SimulatedDisk
from test_log_workload import GEOMETRY, drive

__all__ = ["R5_HEAVY", "R5_QUICK", "R5Counts", "r5_seeds"]

R5_QUICK, R5_HEAVY = 1000, 100_000
QUIET = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


class PowerCut(Exception):
    """The power goes out during an fsync: written, not yet synced."""

    def __init__(self, op: str = "", n: int = 0) -> None:
        super().__init__(op, n)


class R5Counts(NamedTuple):
    seeds: int = 0
    crashes: int = 0
    mid_sync: int = 0  # crashes in the middle of an fsync
    truncations: int = 0  # opens that truncated a torn tail
    failed_opens: int = 0  # opens failed by an injected fsync error (then a crash)
    checked: int = 0  # reopens checked against the events acknowledged before
    violations: int = 0  # reopens missing an acknowledged event, or holding another one in its place

    def __add__(self, other) -> R5Counts:  # type: ignore[override]
        return R5Counts(*(a + b for a, b in zip(self, other, strict=True)))


class _Seed:
    """One seed: the events appended so far (the oracle) and the highest seq acknowledged durable."""

    def __init__(self, seed: int, layout: str) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.fsync = "background" if seed % 2 else "per_step"
        self.seg = {"segment_bytes": 4096} if layout == "segments" else {}
        self.disk = SimulatedDisk(sector=self.rng.choice([64, 512, 4096]))
        self.every = self.rng.choice([None, 17, 50])
        self.history: dict = {}  # seq -> the event the live ledgers folded there (seq 0 configures the cache)
        self.acked = -1  # highest seq reported durable
        self.counts = {f: 0 for f in R5Counts._fields}

    def record(self, seq: int, event, effects) -> None:
        self.history[seq] = event

    def check(self, led) -> None:
        """The reopened log holds every acknowledged event, each as it was appended; then what it holds
        is the history (an event whose append failed may have reached the disk or not: either is right)."""
        with open_view("r5", layer=self.disk) as v:
            events = [ev for _, ev, _ in v.iter_events()]
        if self.acked >= 0:
            self.counts["checked"] += 1
            want = [self.history.get(seq) for seq in range(1, self.acked + 1)]
            self.counts["violations"] += led.seq < self.acked + 1 or events[1 : self.acked + 1] != want
        self.history = dict(enumerate(events))

    def round(self, round_: int) -> None:
        c, disk, rng = self.counts, self.disk, self.rng
        layer = FaultInjector(disk, fail_sync=1) if round_ and rng.random() < 0.1 else disk  # open's own fsync
        try:
            led = open_ledger("r5", GEOMETRY, layer=layer, checkpoint_every=self.every, logger=QUIET, **self.seg)
        except LogIOError:
            c["failed_opens"] += 1
            disk.crash(rng)
            return
        c["truncations"] += led.recovery.truncated_at is not None
        self.check(led)
        led.log.abandon()
        # append until the power goes out in the middle of a random fsync
        cut = FaultInjector(disk, fail_sync=rng.randint(1, 10), error=PowerCut)

        def on_seal(led, plan) -> None:
            self.acked = max(self.acked, led.durable_seq)  # (the writer thread acknowledges some time later)

        try:
            led = open_ledger("r5", GEOMETRY, layer=cut, checkpoint_every=self.every, fsync=self.fsync,
                              logger=QUIET, observer=self.record, **self.seg)
            drive(led, f"r5-{self.seed}-{round_}", 10, on_seal=on_seal)
            if self.fsync == "background":
                led.flush()
                self.acked = max(self.acked, led.durable_seq)
        except (PowerCut, LogIOError):  # (the writer thread reports the cut as a failure)
            c["mid_sync"] += 1
        led.log.abandon()  # no close and no more writes; its writer thread (background) ends
        disk.crash(rng)  # unsynced writes keep or lose any subset of their sectors
        c["crashes"] += 1

    def run(self) -> R5Counts:
        for round_ in range(self.rng.randint(1, 3) + 1):
            self.round(round_)
        led = open_ledger("r5", GEOMETRY, layer=self.disk, logger=QUIET, **self.seg)
        self.counts["truncations"] += led.recovery.truncated_at is not None
        self.check(led)
        led.close()
        self.counts["seeds"] = 1
        return R5Counts(**self.counts)


def r5_seeds(layout: str, seeds: range) -> R5Counts:
    """R5 for every seed in ``seeds`` (``layout``: "file" or "segments", 4 KiB segments that roll
    every few steps, so the power also goes out around rolls). Returns the summed counts."""
    total = R5Counts()
    for seed in seeds:
        total = total + _Seed(seed, layout).run()
    return total


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="one shard of R5 (simulated power loss)")
    ap.add_argument("what", choices=["r5"])
    ap.add_argument("--layout", choices=["file", "segments"], default="file")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stop", type=int, default=R5_QUICK)
    ns = ap.parse_args(argv)
    c = r5_seeds(ns.layout, range(ns.start, ns.stop))
    print(json.dumps({"layout": ns.layout, "start": ns.start, "stop": ns.stop, **c._asdict()}))
    return 1 if c.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
