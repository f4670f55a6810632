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
import os
import random

import pytest

from support import HEAVY, QUIET
from kvledger import CorruptLogError, KVLedgerError
from kvledger.options import LogOptions
from kvledger.core.log import open_view
from support.simdisk import SimulatedDisk
from kvledger.durable import open_ledger

from support.workload import GEOMETRY, drive
from support.cli import kvledger

CASES = 1000 * (10 if HEAVY else 1)
# the console script of this interpreter's environment (the worktree's own install), else the one on PATH


def _base(closed: bool) -> tuple[SimulatedDisk, bytes, bytes, int]:
    """A log on a simulated disk, closed or synced; (disk, log bytes, stamp bytes, events)."""
    disk = SimulatedDisk()
    led = open_ledger("s", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=disk, checkpoint_every=40))
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
            open_ledger("s", logger=QUIET, log_options=LogOptions(layer=disk)).log.abandon()
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
    out = kvledger("replay", str(p), "--json")
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


# ---------------------------------------------------------------------- stale copies past the end (F13)


def _crashed_per_step(seed: str, steps: int) -> tuple[bytes, list, int]:
    """A writer with ``fsync="per_step"`` that crashed (no close, no stamp past open): every record
    but the first few claims the ones before it synced. (log bytes, record offsets, events)."""
    disk = SimulatedDisk()
    led = open_ledger("c", GEOMETRY, logger=QUIET,
                      log_options=LogOptions(layer=disk, fsync="per_step", checkpoint_every=None))
    drive(led, seed, steps)
    events = led.seq
    led.log.abandon()
    disk.remove_stamp("c")  # (the crash came before any sync() / close(): only the records prove anything)
    data = disk.read("c")
    with open_view("c", layer=disk) as v:
        offsets = [(r.offset, r.end, r.synced) for r in v.records]
    return data, offsets, events


def test_r20_stale_copies_of_earlier_records_past_the_end_hide_nothing():
    """F13: a damaged record is a torn tail only when no intact record after it proves it synced. Stale
    bytes past the end can hold an intact copy of an earlier record (its ``synced`` claim is small); the
    rule takes the largest claim of any intact record after the damage, never just the last one. Each
    case: one bit flipped in a record that later records prove synced, then copies of earlier records
    appended; open, replay and audit must report corruption, never truncate the synced events."""
    from kvledger.tools.replay import replay_log

    rng = random.Random(13)
    cases = 200 * (10 if HEAVY else 1)
    accepted = lost_events = 0
    bases = [_crashed_per_step(f"f13-{i}", 30) for i in range(4)]
    for k in range(cases):
        data, recs, events = bases[k % len(bases)]
        # a record that a later record's claim covers
        proved = [i for i, (off, end, _) in enumerate(recs) if any(s >= end for _, _, s in recs[i + 1 :])]
        i = rng.choice(proved)
        off, end, _ = recs[i]
        bad = bytearray(data)
        pos = rng.randrange(off, end)
        bad[pos] ^= 1 << rng.randrange(8)
        for _ in range(rng.randint(1, 3)):  # stale copies of earlier records, intact
            o, e, _ = recs[rng.randrange(0, max(1, i))]
            bad += data[o:e]
        disk = SimulatedDisk()
        disk.put("c", bytes(bad))
        try:
            led = open_ledger("c", logger=QUIET, log_options=LogOptions(layer=disk, checkpoint_every=None))
        except CorruptLogError:
            s = replay_log("c", layer=disk)
            assert s.error is not None and s.error.kind == "corrupt", s.error
            continue
        accepted += 1
        lost_events += events - led.seq
        led.log.abandon()
    print(f"F13 stale record copies past a damaged, synced record: {cases} cases; accepted (synced events "
          f"truncated as a torn tail) {accepted}, synced events lost in them {lost_events}")
    assert accepted == 0


def test_r20_the_issues_stale_copy_case_through_the_cli(tmp_path):
    """The issue's case: fsync per_step, a crashed writer, one flipped bit, a stale copy of record 1
    appended. Without the copy it is CorruptLogError; with it, it must be too (replay exit 3)."""
    data, recs, _ = _crashed_per_step("f13-cli", 12)
    off, end, _ = recs[len(recs) // 2]
    bad = bytearray(data)
    bad[off + 30] ^= 0x10
    o, e, _ = recs[1]
    for name, blob in (("plain", bytes(bad)), ("stale-copy", bytes(bad) + data[o:e])):
        p = tmp_path / f"{name}.kvlog"
        p.write_bytes(blob)
        with pytest.raises(CorruptLogError):
            open_ledger(p, logger=QUIET)
        out = kvledger("replay", str(p), "--json")
        assert out.returncode == 3, (name, out.stdout, out.stderr)
        assert p.read_bytes() == blob  # untouched


def test_r20_on_a_directorys_last_segment():
    """R20 on a log directory: the last segment of a closed (or synced) directory cut or zeroed to its
    end is loss of synced data, refused with the files untouched; the segments before it are proved
    complete by their successors (test_log_segments)."""
    from kvledger.core.log import list_segments

    rng = random.Random(202)
    cases = CASES // (1 if HEAVY else 4)
    silent = refused = total = 0
    for closed in (True, False):
        disk = SimulatedDisk()
        led = open_ledger("d", GEOMETRY, logger=QUIET,
                          log_options=LogOptions(layer=disk, checkpoint_every=40, segment_bytes=4096))
        drive(led, f"r20-seg-{closed}", 40)
        events = led.seq
        if closed:
            led.close()
        else:
            led.sync()
            led.log.abandon()
        last = list_segments(disk, "d")[-1]
        data = disk.read(last)
        for _ in range(cases // 2):
            kind, bad = _damage(rng, data)
            if bad == data or len(bad) < 200:
                continue
            total += 1
            copy = SimulatedDisk()
            copy.dirs = set(disk.dirs)
            for name in disk.listdir("d"):
                full = f"d/{name}"
                if name.endswith(".sync"):
                    copy.write_stamp(full[:-5], disk.read_stamp(full[:-5]))
                else:
                    copy.put(full, bad if full == last else disk.read(full))
            try:
                with open_view("d", layer=copy) as v:
                    silent += v.scan.error is None and v.scan.next_seq < events
            except CorruptLogError:
                pass  # (the cut reached the segment's header: refused before any record)
            try:
                open_ledger("d", logger=QUIET, log_options=LogOptions(layer=copy)).log.abandon()
            except CorruptLogError:
                refused += copy.read(last) == bad
    print(f"R20 on a directory's last segment: cases {total} (closed and synced); silent drops {silent}; "
          f"refused with the files untouched {refused}")
    assert total >= cases * 3 // 4 and silent == 0 and refused == total
