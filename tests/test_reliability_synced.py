"""RELIABILITY.md R20: damage that reaches records already synced is corruption, never a torn tail.

A torn tail can only be the last unsynced write. A log closed cleanly, or
synced with ``sync()``, carries a sync stamp (``<log>.sync``: how many bytes
were synced, the seq and the chain value there), so zeroing or cutting a range
that ends at its tail is reported as loss of synced data (``CorruptLogError``,
replay exit 3), never truncated away as a torn tail with a warning.

``KVLEDGER_HYPOTHESIS=heavy`` runs ten times as many cases.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys

import structlog

from kvledger import CorruptLogError, KVLedgerError
from kvledger.core.log import open_view
from support.simdisk import SimulatedDisk
from kvledger.durable import open_ledger

from test_log_workload import GEOMETRY, drive

HEAVY = os.environ.get("KVLEDGER_HYPOTHESIS") == "heavy"
CASES = 1000 * (10 if HEAVY else 1)
# the console script of this interpreter's environment (the worktree's own install), else the one on PATH
CLI = os.path.join(os.path.dirname(sys.executable), "kvledger")
CLI = CLI if os.path.exists(CLI) else shutil.which("kvledger") or "kvledger"
QUIET = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def _base(closed: bool) -> tuple[SimulatedDisk, bytes, bytes, int]:
    """A log on a simulated disk, closed or synced; (disk, log bytes, stamp bytes, events)."""
    disk = SimulatedDisk()
    led = open_ledger("s", GEOMETRY, layer=disk, checkpoint_every=40, logger=QUIET)
    drive(led, f"r20-{closed}", 25)
    events = led.seq
    if closed:
        led.close()
    else:
        led.sync()
        led.log.abandon()  # then the process died: no close record, but everything was synced
    return disk, disk.read("s"), disk.read_stamp("s"), events


def _damage(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    start = rng.randrange(64, len(data))
    if rng.random() < 0.5:
        return "cut", data[:start]
    keep = rng.randint(0, 24)  # a zeroed range ending at the tail (or a few bytes before it)
    end = max(start, len(data) - keep)
    return "zeroed", data[:start] + bytes(end - start) + data[end:]


def test_r20_damage_to_synced_records_is_never_a_torn_tail():
    """Mutant killed: the sync stamp ignored (``format.decode_stamp`` returning None): every case
    becomes a silent drop of synced events behind a torn-tail warning."""
    rng = random.Random(20)
    bases = {closed: _base(closed) for closed in (True, False)}
    counts = {"cut": 0, "zeroed": 0}
    silent_drops = no_change = refused_by_open = 0
    for i in range(CASES):
        closed = bool(i & 1)
        _, data, stamp, events = bases[closed]
        kind, bad = _damage(rng, data)
        if bad == data:
            no_change += 1  # zeroing bytes that were zero already
            continue
        counts[kind] += 1
        disk = SimulatedDisk()
        disk.put("s", bad)
        disk.write_stamp("s", stamp)
        with open_view("s", layer=disk) as v:
            sc = v.scan
            silent = sc.error is None and sc.next_seq < events
        silent_drops += silent
        try:
            open_ledger("s", layer=disk, logger=QUIET).log.abandon()
        except CorruptLogError:
            refused_by_open += disk.read("s") == bad  # refused, and the file left as it was
    total = sum(counts.values())
    print(f"R20 damage to synced records: cases {total} {counts} on a closed and a synced log "
          f"({no_change} no-op zeroings skipped); silent drops of synced events {silent_drops}; "
          f"refused by open_ledger with the file untouched {refused_by_open}")
    assert total >= CASES * 9 // 10 and silent_drops == 0 and refused_by_open == total


def test_r20_the_issues_case_through_the_cli(tmp_path):
    """The issue's case on real files: zero from offset 2401 to 10 bytes before the end of a closed log."""
    p = tmp_path / "demo.kvlog"
    with open_ledger(p, GEOMETRY, logger=QUIET) as led:
        drive(led, "demo", 12)
        events = led.seq
    data = bytearray(p.read_bytes())
    assert len(data) > 2500
    data[2401 : len(data) - 10] = bytes(len(data) - 10 - 2401)
    p.write_bytes(bytes(data))
    out = subprocess.run([CLI, "replay", str(p), "--json"], capture_output=True, text=True, timeout=120)
    rep = json.loads(out.stdout)
    print(f"R20 the issue's case: {events} events, zeroed [2401, {len(data) - 10}): replay exit {out.returncode}, "
          f"{rep['error']['message'][:120]}")
    assert out.returncode == 3 and rep["error"]["kind"] == "corrupt"
    try:
        open_ledger(p, logger=QUIET).close()
        refused = False
    except KVLedgerError:
        refused = True
    assert refused and p.read_bytes() == bytes(data)
    # the torn tail a crash leaves after the stamp is still repaired
    p2 = tmp_path / "crash.kvlog"
    with open_ledger(p2, GEOMETRY, logger=QUIET) as led:
        drive(led, "demo", 3)
    with open(p2, "ab") as f:
        f.write(b"KR" + os.urandom(300))
    with open_ledger(p2, logger=QUIET) as again:
        assert again.recovery.truncated_bytes == 302
