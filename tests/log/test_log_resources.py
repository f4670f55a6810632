"""What a log holds: memory bounded by bytes buffered whatever the step pattern (F4), no eternal
stall in any configuration (F4), and nothing leaked by a ledger dropped without ``close()`` (F7).

    no step sealed     a writer that never seals a step, with checkpoints ("auto") and without
                       (None): appends keep going, the disk catches up (durable_seq moves with no
                       seal and no sync), and the memory the process traces stays under a bound
    dropped ledgers    ledgers dropped without close(): a ResourceWarning each, and their writer
                       threads, file descriptors and locks are given back (reopening works)
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import threading
import time
import tracemalloc
import warnings

import pytest

from support import QUIET
from kvledger import Geometry
from kvledger.options import LogOptions
from kvledger.durable import open_ledger

from support.workload import GEOMETRY, drive

WRITER = "kvledger-log-fsync"


def _writers() -> int:
    return sum(t.name == WRITER for t in threading.enumerate())


def _fds(under: pathlib.Path | None = None) -> int:
    """Open file descriptors of this process; with ``under``, only those on files below it (the
    process-wide count moves with whatever else the test process runs meanwhile)."""
    if not os.path.isdir("/proc/self/fd"):
        return 0
    if under is None:
        return len(os.listdir("/proc/self/fd"))
    prefix = str(under.resolve()) + os.sep
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (closed since listed)
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(prefix)
    return n


@pytest.mark.parametrize("checkpoint_every", ["auto", None])
def test_f4_no_step_ever_sealed(tmp_path, checkpoint_every):
    """F4: with no step sealed, nothing was fsynced (durable_seq stayed 0 while memory grew), and
    with ``checkpoint_every=None`` the append stalled for ever once the lag passed its bound. Here
    the bound is small (256 KiB) so that a few hundred thousand events reach it many times."""
    g = Geometry(num_pages=64, page_tokens=16)
    led = open_ledger(tmp_path / "n.kvlog", g, logger=QUIET,
                      log_options=LogOptions(checkpoint_every=checkpoint_every, max_lag_bytes=256 << 10))
    pairs = 60_000
    done = threading.Event()
    box: list = []

    def append() -> None:
        try:
            for r in range(pairs):
                led.reserve(r, 1)
                led.cancel(r)
        except BaseException as exc:  # (reported below)
            box.append(exc)
        done.set()

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    th = threading.Thread(target=append, daemon=True)
    t0 = time.monotonic()
    th.start()
    finished = done.wait(120)
    elapsed = time.monotonic() - t0
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    assert finished, f"the appends stalled: seq {led.seq}, durable_seq {led.durable_seq} after {elapsed:.0f} s"
    assert not box, box
    events = led.seq
    durable_without_a_seal = led.log.wait_durable(events // 2, timeout=30)
    stats = led.log.statistics()
    print(f"F4 no step sealed (checkpoint_every={checkpoint_every}): {events:,} events in {elapsed:.1f} s; "
          f"durable_seq {led.durable_seq:,} with no seal and no sync; {stats.syncs} fsyncs, {stats.stalls} "
          f"appends waited for the disk; traced memory peak {peak / 2**20:.1f} MiB above the start")
    assert durable_without_a_seal
    assert peak < 24 << 20  # (a few batches of event objects; unbounded growth would pass it many times)
    led.close()


@pytest.mark.parametrize("fsync", ["background", "per_step"])
def test_f7_a_ledger_dropped_without_close_gives_everything_back(tmp_path, fsync):
    """F7: a DurableLedger dropped without close() kept its writer thread, file descriptor and lock
    for ever (and an in-process reopen got LogLockedError). Now a finalizer warns (ResourceWarning, as
    files do) and gives them back; what the writer thread was handed is written."""
    gc.collect()
    threads0, fds0 = _writers(), _fds(tmp_path)
    drops = 20
    sealed = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(drops):
            led = open_ledger(tmp_path / f"d{i}.kvlog", GEOMETRY, logger=QUIET, log_options=LogOptions(fsync=fsync))
            drive(led, f"f7-{i}", 3, ranks=1, on_seal=lambda led, plan, i=i: sealed.__setitem__(i, led.seq))
            del led
        gc.collect()  # (once for all twenty: a full collection costs tens of ms in a big test process)
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning) and "never closed" in str(w.message)]
    deadline = time.monotonic() + 30
    while (_writers() > threads0 or _fds(tmp_path) > fds0) and time.monotonic() < deadline:
        time.sleep(0.01)
    threads, fds = _writers() - threads0, _fds(tmp_path) - fds0
    reopened = 0
    for i in range(drops):
        with open_ledger(tmp_path / f"d{i}.kvlog", logger=QUIET) as again:  # the lock was given back
            reopened += again.seq >= sealed[i]  # (events after the last seal were never handed off)
    print(f"F7 dropped ledgers ({fsync}): {drops} dropped without close; ResourceWarnings {len(unclosed)}; "
          f"writer threads left {threads}, file descriptors left {fds}; reopened in-process {reopened}")
    assert len(unclosed) == drops and threads <= 0 and fds <= 0 and reopened == drops
