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

and R4 (10,000 kills: 5,000 per layout) the same way with ``r4`` (``--start``/``--stop`` number kills).

Each shard prints one JSON line of counts; a shard exits 1 if it saw a violation. The sum over shards
is the figure (``--layout file`` the same). ``KVLEDGER_HYPOTHESIS`` plays no part here: the range does.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import struct
import sys
import time
from typing import NamedTuple


if __package__ in (None, ""):  # run as a script: the tests directory on the path, as pytest puts it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import QUIET
from kvledger.core.errors import LogIOError
from kvledger.options import LogOptions
from kvledger import replay
from kvledger.core.log import open_view
from kvledger.core.log.format import KIND_EVENTS
from kvledger.core.log.segments import is_segment_name
from kvledger.durable import open_ledger
from support.simdisk import FaultInjector, SimulatedDisk
from support.workload import GEOMETRY, drive

__all__ = ["R4_HEAVY", "R4_QUICK", "R5_HEAVY", "R5_QUICK", "R4Counts", "R5Counts", "r4_kills", "r5_seeds"]

R4_QUICK, R4_HEAVY = 200, 10_000  # kills in all: half on a file, half on a directory (the test's layouts)
R5_QUICK, R5_HEAVY = 500, 100_000  # seeds per layout (quick: 1,000 over the two layouts, RELIABILITY's floor)


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
            led = open_ledger("r5", GEOMETRY, logger=QUIET,
                              log_options=LogOptions(layer=layer, checkpoint_every=self.every, **self.seg))
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
            led = open_ledger("r5", GEOMETRY, logger=QUIET, observer=self.record,
                              log_options=LogOptions(layer=cut, checkpoint_every=self.every, fsync=self.fsync,
                                                     **self.seg))
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
        led = open_ledger("r5", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=self.disk, **self.seg))
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

# ---------------------------------------------------------------------- R4


_MSG = struct.Struct("<qqq32s")  # (kind, a, b, digest): ack (durable_seq, seq, digest at seq) | sync (inode, size)
_ACK, _SYNC, _OPENED = 0, 1, 2


def _child(path: str, seed: str, wfd: int, fsync: str, seg: dict) -> None:
    """Append until killed. Every completed file sync is reported (inode, size) right after the real
    call returns, every acknowledgement (durable_seq) at each seal: the pipe holds them in true order."""
    real = {name: getattr(os, name) for name in ("fsync", "fdatasync")}

    def hook(name):
        def synced(fd):
            real[name](fd)
            st = os.fstat(fd)
            os.write(wfd, _MSG.pack(_SYNC, st.st_ino, st.st_size, bytes(32)))
        return synced

    os.fsync, os.fdatasync = hook("fsync"), hook("fdatasync")
    led = open_ledger(path, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=150, fsync=fsync, **seg))
    os.write(wfd, _MSG.pack(_OPENED, led.seq, 0, bytes(32)))  # (what it holds was synced before or at open)

    def on_seal(led, plan):
        os.write(wfd, _MSG.pack(_ACK, led.durable_seq, led.seq, bytes.fromhex(led.digest())))

    drive(led, seed, 1 << 30, ranks=1, on_seal=on_seal)


def _kill_child(path: str, k: int, fsync: str, rng: random.Random, seg: dict) -> list[tuple]:
    """Fork a child appending to ``path``, SIGKILL it at a random instant; its messages in order."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _child(path, f"r4-{k}", w, fsync, seg)
        finally:
            os._exit(0)
    os.close(w)
    chunks: list[bytes] = []
    if rng.random() < 0.8:  # mostly while appending: after the first acknowledgements, at a random instant
        deadline = time.monotonic() + 10
        while sum(map(len, chunks)) < 20 * _MSG.size and time.monotonic() < deadline:
            if select.select([r], [], [], 0.5)[0]:
                b = os.read(r, 1 << 16)
                if not b:
                    break
                chunks.append(b)
        time.sleep(rng.uniform(0.0, 0.02))
    else:
        time.sleep(rng.uniform(0.0, 0.01))  # during start-up, open and recovery
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    raw = b"".join(chunks)
    return [_MSG.unpack_from(raw, i) for i in range(0, len(raw) - len(raw) % _MSG.size, _MSG.size)]


def _power_cut(path: str, msgs: list, rng: random.Random) -> tuple[int, bool]:
    """Drop what the page cache held: cut the file to its last reported sync (plus, half the time, a
    random part of the unsynced rest). Returns (synced size, whether a sync of this file was seen)."""
    ino = os.stat(path).st_ino
    sizes = [m[2] for m in msgs if m[0] == _SYNC and m[1] == ino]
    with open(path, "rb") as f:
        data = f.read()
    if not sizes:
        return len(data), False
    synced = sizes[-1]
    keep = synced if rng.random() < 0.5 else rng.randint(synced, len(data))
    with open(path, "r+b") as f:
        f.truncate(keep)
    return synced, True


def _acks_ahead_of_the_disk(msgs: list, ends: list[tuple[int, int, int]]) -> int:
    """Acknowledgements whose event was not covered by a completed sync of its file reported before them
    (``ends``: (last seq, inode, end offset) of each events record)."""
    import bisect

    synced: dict[int, int] = {}
    ahead = opened = 0
    last_seqs = [s for s, _, _ in ends]
    for kind, a, b, _ in msgs:
        if kind == _SYNC:
            synced[a] = max(synced.get(a, 0), b)
        elif kind == _OPENED:
            opened = a  # events before it were in the log the child opened (synced by then)
        elif kind == _ACK and a >= opened:
            i = bisect.bisect_left(last_seqs, a)  # the record holding event a
            ahead += i >= len(ends) or ends[i][2] > synced.get(ends[i][1], 0)
    return ahead




class R4Counts(NamedTuple):
    kills: int = 0
    checked: int = 0  # kills after acknowledged steps
    mid_open: int = 0  # kills before the first acknowledgement
    no_sync: int = 0  # kills before any sync of a file
    acked_events: int = 0
    ahead: int = 0  # acknowledgements ahead of a completed sync
    lost: int = 0  # kills that lost an acknowledged event

    def __add__(self, other) -> R4Counts:  # type: ignore[override]
        return R4Counts(*(a + b for a, b in zip(self, other, strict=True)))


def _files(path: str) -> list[str]:
    """The data files of a log: the file, or the segments of a directory."""
    if os.path.isdir(path):
        return [os.path.join(path, n) for n in sorted(os.listdir(path)) if is_segment_name(n)]
    return [path] if os.path.exists(path) else []


def r4_kills(directory: str, layout: str, kills: range) -> R4Counts:
    """R4 for every kill number in ``kills`` (a new log every 5 kills, under ``directory``; ``layout``:
    "file" or "segments", 16 KiB segments). Returns the summed counts."""
    rng = random.Random(f"r4-{layout}-{kills.start}")
    seg = {"segment_bytes": 16384} if layout == "segments" else {}
    c = dict.fromkeys(R4Counts._fields, 0)
    path = ""
    for k in kills:
        if k % 5 == 0 or not path:
            path = os.path.join(directory, f"r4-{layout}-{k}" + ("" if seg else ".kvlog"))
        fsync = "background" if k % 2 == 0 else "per_step"
        msgs = _kill_child(path, k, fsync, rng, seg)
        c["kills"] += 1
        acks = [m for m in msgs if m[0] == _ACK and m[1] >= 0]
        files = _files(path)
        if not files:
            assert not acks
            continue
        with open_view(path) as v:  # before the power cut: where each record ends, in which file
            inode = [os.stat(p).st_ino for p in v.paths]
            ends = [(rec.seq + rec.count - 1, inode[rec.segment], rec.end) for rec in v.records
                    if rec.kind == KIND_EVENTS]
        c["ahead"] += _acks_ahead_of_the_disk(msgs, ends)
        for f in files:
            _, seen = _power_cut(f, msgs, rng)
            c["no_sync"] += not seen
            if os.path.exists(f"{f}.sync") and not seen:
                os.unlink(f"{f}.sync")
        with open_view(path) as v:
            assert v.scan.error is None, v.scan.error  # a crash never looks like corruption
            if not acks:
                c["mid_open"] += 1
                continue
            durable_seq = max(a[1] for a in acks)
            events = [ev for seq, ev, _ in v.iter_events(until=durable_seq)]
            first = v.first_seq
        c["checked"] += 1
        c["acked_events"] += durable_seq + 1
        full = [a for a in acks if a[1] == a[2] - 1]  # inline acks: the digest at durable_seq is known
        c["lost"] += len(events) != durable_seq + 1 - first
        if full and len(events) == durable_seq + 1 and not first:
            c["lost"] += replay(events[: full[-1][1] + 1]).digest() != full[-1][3].hex()
    return R4Counts(**c)


def main(argv: list[str]) -> int:
    import argparse

    import tempfile

    ap = argparse.ArgumentParser(description="one shard of R4 (SIGKILLed children) or R5 (simulated power loss)")
    ap.add_argument("what", choices=["r4", "r5"])
    ap.add_argument("--layout", choices=["file", "segments"], default="file")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stop", type=int, default=None, help="default: the quick profile's count")
    ns = ap.parse_args(argv)
    stop = ns.stop if ns.stop is not None else (R4_QUICK // 2 if ns.what == "r4" else R5_QUICK)
    if ns.what == "r5":
        c5 = r5_seeds(ns.layout, range(ns.start, stop))
        print(json.dumps({"what": "r5", "layout": ns.layout, "start": ns.start, "stop": stop, **c5._asdict()}))
        return 1 if c5.violations else 0
    with tempfile.TemporaryDirectory(prefix="kvledger-r4-") as d:
        c4 = r4_kills(d, ns.layout, range(ns.start, stop))
    print(json.dumps({"what": "r4", "layout": ns.layout, "start": ns.start, "stop": stop, **c4._asdict()}))
    return 1 if c4.lost or c4.ahead else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
