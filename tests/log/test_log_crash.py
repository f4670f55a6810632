"""Crashes around a log directory's own operations: a segment roll (F1), a lost last segment (F9),
creating the directory (F10).

    roll         the power goes out at every file operation of a run that rolls segments
                 (the simulated disk keeps any subset of the unsynced writes), then the log
                 is reopened twice (appending, closing cleanly in between): no reopen may
                 refuse the log, and no acknowledged event may be lost
    lost tail    the last segment deleted: open, readers and replay report the loss, with
                 the seq range the orphaned sync stamp names, instead of rolling back
    creating     the power goes out at every file operation of creating a log directory:
                 ``open_ledger`` with the geometry then creates (or opens) the log there

``KVLEDGER_HYPOTHESIS=heavy`` tries more crash images per cut point.
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest

from support import HEAVY, QUIET
from kvledger import ConfigurationError, CorruptLogError, replay
from kvledger.options import LogOptions
from kvledger.core.errors import LogIOError
from kvledger.core.log import list_segments, open_view
from kvledger.core.log.files import default_layer
from kvledger.durable import open_ledger
from support.simdisk import FaultInjector, SimulatedDisk

from support.workload import GEOMETRY, drive
from support.cli import kvledger

IMAGES = 8 if HEAVY else 2  # crash images per cut point
SEG = {"segment_bytes": 4096}


class _PowerCut(Exception):
    def __init__(self, op: str = "", n: int = 0) -> None:
        super().__init__(op, n)


def _run(layer, fsync: str, steps: int, acked: list) -> None:
    """Append ``steps`` steps to a new log directory; ``acked`` gets (durable_seq, digest) after each
    seal whose events the log reported durable."""
    digests: dict[int, str] = {}

    def on_seal(led, plan):
        digests[led.seq - 1] = led.digest()
        d = led.durable_seq
        if d in digests:
            acked.append((d, digests[d]))

    led = open_ledger("d", GEOMETRY, logger=QUIET,
                      log_options=LogOptions(layer=layer, fsync=fsync, checkpoint_every=None, **SEG))
    try:
        drive(led, f"roll-{fsync}", steps, ranks=1, on_seal=on_seal)
        led.flush()
        acked.append((led.durable_seq, led.digest()))
    finally:
        led.log.abandon()


def _roll_windows(ops: list[tuple[str, str]]) -> set[int]:
    """1-based indices of the operations that belong to a roll: from the fsync before a segment k > 0
    is created to the first stamp written for it."""
    inside: set[int] = set()
    for i, (op, path) in enumerate(ops):
        if op == "create" and os.path.basename(path).startswith("seg-") and not path.endswith("0" * 20 + ".kvlog"):
            start = max(j for j in range(i) if ops[j][0] == "fsync")
            end = next((j for j in range(i, len(ops)) if ops[j][0] == "stamp" and ops[j][1] == path), len(ops) - 1)
            inside.update(range(start + 1, end + 2))
    return inside


def _acked_prefix_ok(disk, acked) -> bool:
    if not acked:
        return True
    seq, digest = acked[-1]
    with open_view("d", layer=disk) as v:
        events = [ev for _, ev, _ in v.iter_events(until=seq)]
    return len(events) == seq + 1 and replay(events).digest() == digest


@pytest.mark.parametrize("fsync", ["per_step", "background"])
def test_f1_power_cut_at_every_file_operation_of_a_roll(fsync):
    """F1: a crash anywhere in a roll (after the new segment's header, before its checkpoint was
    synced, ...) left a segment that reopen repaired to its header and appended into, and the next
    clean close bricked the log ("a segment must open with a checkpoint"). Now the new segment is
    created with its checkpoint in one atomic step. Every file operation of a run with several rolls
    is cut (with ``per_step`` the run is deterministic: every operation is reached)."""
    steps = 30
    clean = FaultInjector(SimulatedDisk())
    _run(clean, fsync, steps, [])
    total = len(clean.ops)
    rolls = _roll_windows(clean.ops)
    refused, lost, reopened, in_roll = [], 0, 0, 0
    for n in range(1, total + 1):
        for image in range(IMAGES):
            disk = SimulatedDisk(sector=512)
            acked: list = []
            with contextlib.suppress(_PowerCut, LogIOError):
                _run(FaultInjector(disk, fail_op=n, error=_PowerCut), fsync, steps, acked)
            disk.crash(random.Random(n * 100 + image))
            if not disk.exists("d") or not list_segments(disk, "d"):
                continue  # (cut before segment 0 existed: nothing to reopen)
            in_roll += n in rolls
            try:
                for again in range(2):  # reopen, append a little, close cleanly; twice
                    with open_ledger("d", logger=QUIET, log_options=LogOptions(layer=disk, **SEG)) as led:
                        if again == 0 and not _acked_prefix_ok(disk, acked):
                            lost += 1
                        drive(led, f"after-{n}-{image}-{again}", 3, ranks=1)
                    reopened += 1
            except CorruptLogError as exc:
                refused.append((n, clean.ops[n - 1], str(exc)[:160]))
    print(f"F1 roll power cuts ({fsync}): {total} file operations in the run ({len(rolls)} of them in "
          f"{sum(1 for op, p in clean.ops if op == 'create') - 1} rolls) x {IMAGES} crash images; cuts inside "
          f"a roll {in_roll}; reopens {reopened}; refused logs {len(refused)}; runs that lost an acknowledged "
          f"event {lost}")
    assert in_roll > 0 and not refused and lost == 0, refused[:3]


def test_f9_a_lost_last_segment_is_reported_not_rolled_back(tmp_path):
    """F9: deleting the last segment silently rolled the log back (its orphaned sync stamp was
    ignored). Open, a view and replay report it as corruption naming the lost seq range."""
    path = tmp_path / "d"
    with open_ledger(path, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=None, **SEG)) as led:
        drive(led, "f9", 60, ranks=1)
        events = led.seq
    segs = list_segments(default_layer, str(path))
    assert len(segs) >= 3
    first_lost = int(os.path.basename(segs[-1])[4:24])
    os.unlink(segs[-1])
    with pytest.raises(CorruptLogError, match="missing") as ei:
        open_ledger(path, logger=QUIET)
    assert ei.value.seq == first_lost and str(events - 1) in str(ei.value)
    with open_view(path) as v:
        assert isinstance(v.scan.error, CorruptLogError) and "missing" in str(v.scan.error)
    out = kvledger("replay", str(path))
    assert out.returncode == 3, out.stdout + out.stderr
    print(f"F9 lost last segment: {len(segs)} segments, {events} events; open, view and replay (exit "
          f"{out.returncode}) report seq {first_lost}-{events - 1} lost")


def test_f9_after_a_crash_following_a_roll(tmp_path):
    """The same when the writer crashed (no close): the roll stamped the new segment."""
    disk = SimulatedDisk()
    led = open_ledger("d", GEOMETRY, logger=QUIET,
                      log_options=LogOptions(layer=disk, fsync="per_step", checkpoint_every=None, **SEG))
    drive(led, "f9c", 40, ranks=1)
    led.log.abandon()
    segs = list_segments(disk, "d")
    assert len(segs) >= 2
    disk.remove(segs[-1])
    with pytest.raises(CorruptLogError, match="missing"):
        open_ledger("d", logger=QUIET, log_options=LogOptions(layer=disk))


def test_f10_power_cut_while_creating_a_log_directory(tmp_path):
    """F10: a crash while a log directory was being created left a path that could be neither opened
    nor created. Every operation of the create is cut; ``open_ledger`` with the geometry then works,
    without it says what to do; on real files an empty directory or one holding only ``LOCK``
    is finished the same way."""
    clean = FaultInjector(SimulatedDisk())
    open_ledger("d", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=clean, **SEG)).close()
    create_ops = next(i for i, (op, _) in enumerate(clean.ops) if op == "write")  # up to the first append
    opened = 0
    for n in range(1, create_ops + 1):
        disk = SimulatedDisk()
        with pytest.raises((_PowerCut, LogIOError)):
            failing = FaultInjector(disk, fail_op=n, error=_PowerCut)
            open_ledger("d", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=failing, **SEG))
        disk.crash(random.Random(n))
        if disk.exists("d") and not list_segments(disk, "d"):
            with pytest.raises(ConfigurationError, match="interrupted create"):
                open_ledger("d", logger=QUIET, log_options=LogOptions(layer=disk))
        with open_ledger("d", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=disk, **SEG)) as led:
            led.reserve(1, 2)
            led.seal_step(0)
            seq = led.seq
        with open_ledger("d", logger=QUIET, log_options=LogOptions(layer=disk)) as led:
            assert led.seq == seq
        opened += 1
    for name, files in (("empty", []), ("lock-only", ["LOCK"])):
        p = tmp_path / name
        p.mkdir(mode=0o700)
        for f in files:
            (p / f).write_bytes(b"")
        with open_ledger(p, GEOMETRY, logger=QUIET, log_options=LogOptions(**SEG)) as led:
            led.reserve(1, 1)
        with open_ledger(p, logger=QUIET) as led:
            assert led.seq == 2
        opened += 1
    print(f"F10 directory create cut at each of its {create_ops} file operations, plus 2 real directories: "
          f"{opened} created or opened afterwards")
    assert opened == create_ops + 2
