"""RELIABILITY.md R1-R7, R9, R10 for the event log, on single files and on log directories (quick
profiles; each test prints its counts).

    R1  torn-tail sweep          every offset of the last 4 KiB of a 1,000-event log (a directory: its last segment)
    R2  garbage tails            zero sectors, random bytes, records with bad checksums
    R3  bit flips                one flipped bit in a non-final record: corruption, named (a directory: the segment too)
    R4  SIGKILL crash sweep      real child processes appending; the page cache dropped past their last sync
    R5  simulated power loss     unsynced writes dropped, reordered, torn
    R6  I/O-error injection      the n-th write / fsync / stamp fails, for every n; then unsynced bytes are lost
    R7  decoder fuzzing          hypothesis bytes and mutated logs (see test_log_fuzz.py)
    R9  replay determinism       live fold = replay = checkpoint + tail = other hash seed
    R10 tamper detection         delete, duplicate, reorder, splice, edit + fix checksum

R4 and R5 run in ``support.crashes`` (a function of a kill or seed range: the heavy profile shards them
across processes, ``python tests/support/crashes.py --help``). On directories the quick profile runs a
quarter of the file layout's counts for R1-R3, R9, R10. ``KVLEDGER_HYPOTHESIS=heavy`` scales the counts up
(the heavy profile).
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import time
import zlib

import msgspec
import pytest

from support import HEAVY, QUIET
from kvledger import CLEAR_POLICIES, CorruptLogError, replay
from kvledger.options import LogOptions
from kvledger.core.log.format import HEADER_SIZE, KIND_CLOSE, KIND_EVENTS, PREFIX, SEGMENT_HEADER_SIZE
from kvledger.core.log.segments import list_segments
from kvledger.core.log.scan import scan
from kvledger import LogError
from kvledger.core.log import open_view
from support.simdisk import FaultInjector, SimulatedDisk
from kvledger.core.errors import LogIOError
from kvledger.durable import open_ledger
from kvledger.core.log.fold import rebuild_state, state_from_checkpoint
from kvledger.tools.replay import replay_log

from support.crashes import R4_HEAVY, R4_QUICK, R5_HEAVY, R5_QUICK, r4_kills, r5_seeds
from support.workload import GEOMETRY, drive, make_events
from support.cli import kvledger

SCALE = 10 if HEAVY else 1
# the console script of this interpreter's environment (the worktree's own install), else the one on PATH


def _events_of(view) -> list:
    return [ev for _, ev, _ in view.iter_events()]


def _write_log(disk, path, seed, *, min_events: int, checkpoint_every=100, policy="released_aliases", close=True):
    """A log on ``disk`` with >= min_events events; returns [(durable size, seq, digest)] after every seal."""
    marks = []

    def on_seal(led, plan):
        marks.append((len(disk.durable_bytes(path)), led.seq, led.digest()))

    led = open_ledger(path, GEOMETRY, policy=policy, logger=QUIET,
                      log_options=LogOptions(layer=disk, checkpoint_every=checkpoint_every))
    while led.seq < min_events:
        drive(led, seed, 5, ranks=1, on_seal=on_seal)
    led.sync()
    marks.append((len(disk.durable_bytes(path)), led.seq, led.digest()))
    if close:
        led.close()
    else:
        led.log.abandon()
    return marks


# ---------------------------------------------------------------------- R1


def test_r1_torn_tail_sweep(tmp_path):
    disk = SimulatedDisk()
    marks = _write_log(disk, "r1", "r1", min_events=1000)
    data = disk.read("r1")
    with open_view("r1", layer=disk) as v:
        events = _events_of(v)
    assert len(events) == marks[-1][1] and replay(events).digest() == marks[-1][2]
    # The oracle: record boundaries read with struct alone, and the core's replay of the prefix.
    bounds = [(HEADER_SIZE, 0)]
    for off, end, seq, _kind in _records(data):
        count = PREFIX.unpack_from(data, off)[5]
        bounds.append((end, seq + count))
    digest_of: dict[int, str] = {}
    lo = max(HEADER_SIZE, len(data) - 4096)
    offsets = list(range(lo, len(data) + 1))
    mismatches = real_files = 0
    for i, cut in enumerate(offsets):
        end, expect_seq = max(b for b in bounds if b[0] <= cut)
        if expect_seq not in digest_of:
            digest_of[expect_seq] = replay(events[:expect_seq]).digest()
        if i % 128 == 0:  # some through real files and the OS layer
            p = tmp_path / (f"r1-{cut}.kvlog")
            p.write_bytes(data[:cut])
            led = open_ledger(p, logger=QUIET, log_options=LogOptions(checkpoint_every=None))
            real_files += 1
        else:
            d2 = SimulatedDisk()
            d2.put("r1", data[:cut])
            led = open_ledger("r1", logger=QUIET, log_options=LogOptions(layer=d2, checkpoint_every=None))
        rec = led.recovery
        ok = (led.seq == expect_seq and led.digest() == digest_of[expect_seq] and rec.truncated_bytes == cut - end
              and (rec.truncated_at == end if cut > end else rec.truncated_at is None))
        mismatches += not ok
        led.log.abandon()
    print(f"R1 torn-tail sweep: log of {len(events)} events, {len(data)} bytes; offsets tried {len(offsets)} "
          f"({real_files} through real files); mismatches {mismatches}")
    assert len(offsets) >= 4096 and len(events) >= 1000
    assert mismatches == 0


# ---------------------------------------------------------------------- R2


def _bad_record(rng, seq: int, synced: int) -> bytes:
    """A record that looks right (magic, kind, plausible length and seq) with a bad checksum."""
    events, _ = make_events(rng.randrange(1 << 30), 1)
    enc = msgspec.msgpack.Encoder()
    payload = b"\xdd" + struct.pack(">I", len(events)) + b"".join(enc.encode(e) for e in events)
    head = PREFIX.pack(b"KR", KIND_EVENTS, 0, len(payload), seq, len(events), synced)
    body = head + payload + os.urandom(8)
    crc = zlib.crc32(body) ^ (1 << rng.randrange(32))
    return body + struct.pack("<I", crc)


def test_r2_garbage_tails():
    rng = random.Random(2)
    bases = {}
    for closed in (True, False):
        disk = SimulatedDisk()
        marks = _write_log(disk, "r2", f"r2-{closed}", min_events=200, close=closed)
        bases[closed] = (disk.read("r2"), marks[-1][1], marks[-1][2])
    cases = 1000 * SCALE
    false_accepts = kinds = 0
    per_kind = {"zero sectors": 0, "random bytes": 0, "bad-checksum record": 0, "torn record copy": 0}
    for i in range(cases):
        closed = bool(i & 1)
        data, seq, digest = bases[closed]
        kind = list(per_kind)[i % 4]
        if kind == "zero sectors":
            garbage = bytes(512 * rng.randint(1, 8))
        elif kind == "random bytes":
            garbage = os.urandom(rng.randint(1, 3000))
        elif kind == "bad-checksum record":
            garbage = _bad_record(rng, seq, rng.choice([HEADER_SIZE, len(data)]))
            if rng.random() < 0.5:
                garbage += os.urandom(rng.randint(0, 100))
        else:
            # the start of a copy of a real record: torn
            start = rng.randrange(HEADER_SIZE, len(data) - 100)
            garbage = data[start : start + rng.randint(1, 100)]
        per_kind[kind] += 1
        disk = SimulatedDisk()
        disk.put("r2", data + garbage)
        led = open_ledger("r2", logger=QUIET, log_options=LogOptions(layer=disk, checkpoint_every=None))
        rec = led.recovery
        ok = (led.seq == seq and led.digest() == digest and rec.truncated_at == len(data)
              and rec.truncated_bytes == len(garbage))
        false_accepts += not ok
        led.log.abandon()
        kinds += 1
    print(f"R2 garbage tails: cases {kinds} {per_kind}; false accepts {false_accepts}")
    assert kinds >= 1000 and false_accepts == 0


# ---------------------------------------------------------------------- R3


def test_r3_bit_flips_in_non_final_records(tmp_path):
    disk = SimulatedDisk()
    _write_log(disk, "r3", "r3", min_events=1000)
    data = disk.read("r3")
    sc = scan(data)
    recs = sc.records
    assert sc.closed and recs[-1].kind == KIND_CLOSE
    final = recs[-1].offset  # flips go anywhere before the close record
    starts = [r.offset for r in recs]
    rng = random.Random(3)
    flips = 10_000 * SCALE
    detected = named = 0
    import bisect

    buf = bytearray(data)
    for _ in range(flips):
        pos = rng.randrange(HEADER_SIZE, final)
        bit = 1 << rng.randrange(8)
        buf[pos] ^= bit
        try:
            res = scan(buf, "r3")
        finally:
            buf[pos] ^= bit
        rec = recs[bisect.bisect_right(starts, pos) - 1]
        err = res.error
        if err is not None and res.torn_at is None:
            detected += 1
            named += err.offset == rec.offset and err.seq == rec.seq
    # and through real files: open refuses, names offset and seq, and leaves the file untouched
    files = 0
    for _ in range(100):
        pos = rng.randrange(HEADER_SIZE, final)
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        p = tmp_path / "r3.kvlog"
        p.write_bytes(bad)
        rec = recs[bisect.bisect_right(starts, pos) - 1]
        with pytest.raises(CorruptLogError) as ei:
            open_ledger(p, logger=QUIET)
        assert (ei.value.offset, ei.value.seq) == (rec.offset, rec.seq)
        assert p.read_bytes() == bytes(bad)
        files += 1
    print(f"R3 bit flips: {flips} flips in {len(recs) - 1} non-final records ({final} bytes); detected "
          f"{detected} ({100.0 * detected / flips:.2f} %), named offset+seq {named}; real files {files}")
    assert detected == flips and named == flips


# ---------------------------------------------------------------------- R4


@pytest.mark.parametrize("layout", ["file", "segments"])
def test_r4_sigkill_crash_sweep(tmp_path, layout):
    """Children append with the default (writer-thread) and the inline policy and are SIGKILLed at
    random instants; the page cache is then dropped past the last sync each child reported (per file:
    each segment of a directory), so a missing or late fsync loses acknowledged events. Mutants killed:
    ``os.fdatasync`` made a no-op in ``files._OsHandle.sync`` (acks with no covering sync, lost
    events); durability published before the fsync in ``durability.Durability._round`` (acks ahead of
    every reported sync). The kills run in ``support.crashes.r4_kills``, shardable like R5."""
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    kills = (R4_HEAVY if HEAVY else R4_QUICK) // 2
    t0 = time.perf_counter()
    c = r4_kills(str(tmp_path), layout, range(kills))
    print(f"R4 SIGKILL sweep ({layout}): kills {c.kills} (half with the writer thread, half inline; {c.checked} "
          f"after acknowledged steps, {c.mid_open} before the first); page cache dropped past each child's last "
          f"reported sync ({c.no_sync} kills before any sync of a file); acknowledged events verified "
          f"{c.acked_events} (summed over kills); acknowledgements ahead of a completed sync {c.ahead}; kills "
          f"that lost an acknowledged event {c.lost}; {time.perf_counter() - t0:.1f} s")
    assert c.checked >= kills // 2 and c.mid_open > 0 and c.lost == 0 and c.ahead == 0


# ---------------------------------------------------------------------- R5


@pytest.mark.parametrize("layout", ["file", "segments"])
def test_r5_simulated_power_loss(layout):
    """Mutant killed: the torn tail not truncated on open (``handle.truncate(res.end)`` skipped in
    ``opening._continue``: appends land after garbage, and the next crash-and-reopen refuses the log).
    With ``segments``, logs of 4 KiB segments rotate every few steps and the power goes out around
    rotations too. The seeds run in ``support.crashes.r5_seeds``; the heavy profile's 100,000 seeds per
    layout shard across processes (``python tests/support/crashes.py r5 --help``)."""
    seeds = (R5_HEAVY if HEAVY else R5_QUICK)
    c = r5_seeds(layout, range(seeds))
    print(f"R5 simulated power loss ({layout}): seeds {c.seeds}, crashes {c.crashes} ({c.mid_sync} in the middle "
          f"of an fsync), opens that truncated a torn tail {c.truncations}, opens failed by an injected fsync "
          f"error {c.failed_opens}; violations {c.violations}")
    assert c.violations == 0 and c.crashes >= seeds and c.truncations > seeds // 4


# ---------------------------------------------------------------------- R6


def _r6_run(disk, faults, *, background: bool, steps: int, seg: dict):
    """Drive a ledger on ``faults`` until done or a failure; (highest seq acknowledged durable, surfaced?)."""
    acked = -1
    surfaced = False
    try:
        led = open_ledger("r6", GEOMETRY, logger=QUIET,
                          log_options=LogOptions(layer=faults, checkpoint_every=40, background=background, **seg))
    except LogIOError:
        return None, True

    def on_seal(led, plan):
        nonlocal acked
        acked = max(acked, led.durable_seq)

    try:
        drive(led, "r6", steps, ranks=1, on_seal=on_seal)
        led.flush()
        acked = max(acked, led.durable_seq)
        led.close()
    except LogIOError:
        surfaced = True
        acked = max(acked, led.durable_seq)
        # nothing is acknowledged after the failure, and nothing more is accepted
        before = led.durable_seq
        with pytest.raises(LogError):
            led.reserve(10**9, 1)
        assert led.durable_seq == before
        led.close()
    return acked, surfaced


@pytest.mark.parametrize("layout", ["file", "segments"])
@pytest.mark.parametrize("background", [False, True])
def test_r6_io_error_injection(background, layout):
    """Fail the n-th write (whole or half written), fsync or stamp for every n; then the power goes out
    and every unsynced byte is lost (``SimulatedDisk.crash(keep=0.0)``), so a log that acknowledged more
    than the disk holds is caught. Mutant killed: a failed fsync swallowed in ``durability.Durability._round``
    (``self._fail("fsync", exc)`` replaced by ``pass``): wrong acks."""
    steps = 25
    seg = {"segment_bytes": 4096} if layout == "segments" else {}
    reference, _ = make_events("r6", steps, ranks=1)
    count = FaultInjector(SimulatedDisk())
    acked, surfaced = _r6_run(count.inner, count, background=background, steps=steps, seg=seg)
    assert not surfaced
    writes, syncs, stamps = count.writes, count.syncs, count.stamps
    points = injected = wrong_acks = inconsistent = not_surfaced = dropped = 0
    cases = [("write", n, partial) for n in range(1, writes + 1) for partial in (False, True)]
    cases += [("fsync", n, False) for n in range(1, syncs + 1)] + [("stamp", n, False) for n in range(1, stamps + 1)]
    for op, n, partial in cases:
        disk = SimulatedDisk()
        faults = FaultInjector(disk, fail_write=n if op == "write" else None, fail_sync=n if op == "fsync" else None,
                               fail_stamp=n if op == "stamp" else None, partial=partial)
        acked, surfaced = _r6_run(disk, faults, background=background, steps=steps, seg=seg)
        points += 1
        injected += faults.injected > 0
        not_surfaced += faults.injected > 0 and not surfaced
        before = sum(len(f.data) for f in disk.files.values())
        disk.crash(random.Random(n), keep=0.0)  # power loss right after: every unsynced byte is gone
        if not disk.exists("r6"):
            wrong_acks += acked is not None and acked >= 0
            continue
        dropped += before - sum(len(f.data) for f in disk.files.values())
        try:
            with open_ledger("r6", logger=QUIET, log_options=LogOptions(layer=disk)) as led:  # reopens consistent
                seq = led.seq
                digest = led.digest()
        except CorruptLogError:
            inconsistent += 1
            continue
        if acked is not None and seq < acked + 1:
            wrong_acks += 1
        if reference[:seq] != _reopened_events(disk)[:seq] or replay(reference[:seq]).digest() != digest:
            inconsistent += 1
    mode = f"{'background' if background else 'inline'}, {layout}"
    print(f"R6 I/O errors ({mode}): clean run {writes} writes, {syncs} fsyncs, {stamps} stamps; failure points "
          f"{points} (injected {injected}); not surfaced {not_surfaced}; unsynced bytes dropped by the power cut "
          f"after it {dropped}; wrong acks {wrong_acks}; inconsistent reopens {inconsistent}")
    assert points == 2 * writes + syncs + stamps and not_surfaced == 0 and wrong_acks == 0 and inconsistent == 0
    assert dropped > 0
    if not background:  # inline runs are deterministic: every point is reached
        assert injected == points


def _reopened_events(disk) -> list:
    with open_view("r6", layer=disk) as v:
        return _events_of(v)


# ---------------------------------------------------------------------- R9


_R9_CHILD = r"""
import json, sys
from kvledger.tools.replay import replay_log
out = {}
for path in json.load(sys.stdin):
    s = replay_log(path, invariants="end")
    out[path] = s.digest if s.ok else "error: " + s.error.message
json.dump(out, sys.stdout)
"""


def test_r9_replay_determinism(tmp_path):
    streams = 500 * SCALE
    rng = random.Random(9)
    live: dict[str, str] = {}
    mismatches = checkpoint_tails = 0
    for i in range(streams):
        path = str(tmp_path / (f"s{i}.kvlog"))
        policy = CLEAR_POLICIES[i % 3]
        disk = SimulatedDisk()  # (fsyncs cost milliseconds here; the file gets the same bytes)
        with open_ledger("s", GEOMETRY, policy=policy, logger=QUIET,
                         log_options=LogOptions(layer=disk, checkpoint_every=rng.choice([13, 29, 61]))) as led:
            drive(led, f"r9-{i}", rng.randint(4, 14), ranks=rng.randint(0, 2), tenants=rng.randint(1, 4))
            live[path] = led.digest()
        with open(path, "wb") as f:
            f.write(disk.read("s"))
        with open_view(path) as v:
            full, _, _ = rebuild_state(v, from_checkpoint=False)
            # a checkpoint before the end, then the tail
            i_cp = v.last_checkpoint(v.scan.next_seq - 1)
            if i_cp >= 0:
                rec = v.records[i_cp]
                st = state_from_checkpoint(v.checkpoint(rec), v.header, offset=rec.offset)
                for _, ev, _ in v.iter_events(i_cp + 1):
                    st.fold(ev)
                checkpoint_tails += 1
                mismatches += st.digest() != live[path]
        mismatches += full.digest() != live[path]
    seeds = ("0", "4242")
    for hashseed in seeds:
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        out = subprocess.run([sys.executable, "-c", _R9_CHILD], input=json.dumps(list(live)), env=env,
                             capture_output=True, text=True, timeout=300, check=True)
        got = json.loads(out.stdout)
        mismatches += sum(got[p] != d for p, d in live.items())
    print(f"R9 replay determinism: streams {streams} (3 policies); live vs replay vs {checkpoint_tails} "
          f"checkpoint+tail vs fresh processes with PYTHONHASHSEED={','.join(seeds)}; mismatches {mismatches}")
    assert checkpoint_tails >= streams // 2 and mismatches == 0


# ---------------------------------------------------------------------- R10


def _records(data: bytes) -> list[tuple[int, int, int, int]]:
    """(offset, end, seq, kind) of every record, read with struct alone."""
    out = []
    off = HEADER_SIZE
    while off < len(data):
        _, kind, _, n, seq, count, _ = PREFIX.unpack_from(data, off)
        out.append((off, off + 40 + n, seq, kind))
        off += 40 + n
    return out


def _edit_events_record(data: bytes, rec, rng) -> bytes | None:
    """Change one event inside an events record and fix the record's CRC (not the chain)."""
    off, end, seq, kind = rec
    _, kind, flags, n, seq, count, synced = PREFIX.unpack_from(data, off)
    items = msgspec.msgpack.decode(data[off + 28 : off + 28 + n])
    cands = [i for i, it in enumerate(items) if it.get("page_ids") or "step" in it or "request" in it]
    if not cands:
        return None
    it = items[rng.choice(cands)]
    if it.get("page_ids"):
        it["page_ids"][0] = (it["page_ids"][0] + 1) % GEOMETRY.num_pages
    elif "request" in it:
        it["request"] += 1
    else:
        it["step"] += 1
    enc = msgspec.msgpack.Encoder()
    payload = b"\xdd" + struct.pack(">I", len(items)) + b"".join(enc.encode(x) for x in items)
    body = PREFIX.pack(b"KR", kind, flags, len(payload), seq, count, synced) + payload + data[end - 12 : end - 4]
    return data[:off] + body + struct.pack("<I", zlib.crc32(body)) + data[end:]


def test_r10_tamper_detection(tmp_path):
    per_class = 200 * SCALE
    logs = []
    for i in range(4):
        disk = SimulatedDisk()
        _write_log(disk, "t", f"r10-{i}", min_events=150, checkpoint_every=40)
        logs.append(disk.read("t"))
    rng = random.Random(10)
    stats = {c: [0, 0] for c in ("delete", "duplicate", "reorder", "splice", "edit")}
    samples = []
    for c in stats:
        for k in range(per_class):
            a = rng.randrange(len(logs))
            data = logs[a]
            recs = _records(data)
            if c == "delete":
                i = rng.randrange(len(recs) - 1)  # the last record's deletion is a crash, by definition
                off, end, seq, _ = recs[i]
                bad, want = data[:off] + data[end:], (off, seq)
            elif c == "duplicate":
                i = rng.randrange(len(recs))
                off, end, seq, kind = recs[i]
                nxt = recs[i + 1][2] if i + 1 < len(recs) else None
                bad = data[:end] + data[off:end] + data[end:]
                want = (end, nxt if nxt is not None else _next_seq(data, recs))
            elif c == "reorder":
                i, j = sorted(rng.sample(range(len(recs)), 2))
                oi, ei, si, _ = recs[i]
                oj, ej, sj, _ = recs[j]
                bad = data[:oi] + data[oj:ej] + data[ei:oj] + data[oi:ei] + data[ej:]
                want = (oi, si)
            elif c == "splice":
                other = logs[(a + 1 + rng.randrange(len(logs) - 1)) % len(logs)]
                orecs = _records(other)
                i = rng.randrange(min(len(recs), len(orecs)) - 1)
                off, end, seq, _ = recs[i]
                o_off, o_end, _, _ = orecs[i]
                bad = data[:off] + other[o_off:o_end] + data[end:]
                want = (off, seq)
            else:
                evrecs = [r for r in recs if r[3] == KIND_EVENTS]
                bad = None
                while bad is None:  # (the first record holds only CacheConfigured: nothing to edit)
                    rec = rng.choice(evrecs)
                    bad = _edit_events_record(data, rec, rng)
                want = (rec[0], rec[2])
            disk = SimulatedDisk()
            disk.put("t", bad)
            s = replay_log("t", layer=disk, invariants="none")
            stats[c][0] += 1
            hit = s.error is not None and s.error.kind == "corrupt" and (s.error.offset, s.error.seq) == want
            stats[c][1] += hit
            if not hit:
                print("MISSED", c, want, s.error)
            if k < 1:
                samples.append((c, bad, want))
    # the real console script on one real file per class: non-zero exit naming the first bad record
    for n, (c, bad, want) in enumerate(samples):
        p = tmp_path / (f"tampered-{n}.kvlog")
        p.write_bytes(bad)
        out = kvledger("replay", str(p), "--json")
        rep = json.loads(out.stdout)
        assert out.returncode == 3, (c, out.stdout, out.stderr)
        assert (rep["error"]["offset"], rep["error"]["seq"]) == want
    print("R10 tamper detection: " + ", ".join(f"{c} {d}/{t}" for c, (t, d) in stats.items())
          + f" detected naming the first bad record; CLI sample {len(samples)} runs, all exit 3")
    assert all(t >= 200 and d == t for t, d in stats.values())


def _next_seq(data: bytes, recs) -> int:
    _, kind, _, n, seq, count, _ = PREFIX.unpack_from(data, recs[-1][0])
    return seq + count


# ---------------------------------------------------------------------- R1-R3, R9, R10 on log directories


SEG = 4096
SEG_SHARE = 1 if HEAVY else 4  # quick: a quarter of the file layout's counts on directories


def _segmented_log(seed: str, min_events: int, checkpoint_every=100, close: bool = True) -> tuple[SimulatedDisk, str]:
    """A closed (or synced and abandoned) log directory "d" of 4 KiB segments; (disk, digest)."""
    disk = SimulatedDisk()
    led = open_ledger("d", GEOMETRY, logger=QUIET,
                      log_options=LogOptions(layer=disk, checkpoint_every=checkpoint_every, segment_bytes=SEG))
    while led.seq < min_events:
        drive(led, seed, 5, ranks=1)
    digest = led.digest()
    if close:
        led.close()
    else:
        led.sync()
        led.log.abandon()
    return disk, digest


def _copy(disk: SimulatedDisk, replace: dict[str, bytes], drop_stamps: bool = True) -> SimulatedDisk:
    """A disk holding ``disk``'s files durably, some replaced; stamps dropped (a crash before any was written)."""
    out = SimulatedDisk()
    out.dirs = set(disk.dirs)
    for path in disk.listdir("d"):
        full = f"d/{path}"
        if drop_stamps and path.endswith(".sync"):
            continue
        out.put(full, replace.get(full, disk.read(full) if not path.endswith(".sync") else disk.read_stamp(full[:-5])))
    return out


def test_r1_r2_torn_and_garbage_tails_of_a_directorys_last_segment():
    """R1 and R2 on a log directory: the last segment cut at every offset after its opening checkpoint,
    or garbage appended to it (the writer crashed: no stamps); open recovers exactly the longest valid
    prefix, truncates the rest and reports it."""
    disk, _ = _segmented_log("r1-seg", 1000)
    segs = list_segments(disk, "d")
    last = segs[-1]
    data = disk.read(last)
    with open_view("d", layer=disk) as v:
        events = _events_of(v)
        recs = [r for r in v.records if r.segment == len(v.paths) - 1]
    bounds = [(r.end, r.seq + r.count) for r in recs]
    digest_of: dict[int, str] = {}
    start = recs[0].end  # (the checkpoint: a segment is created with it, atomically)
    offsets = list(range(start, len(data) + 1, SEG_SHARE))
    mismatches = 0
    for cut in offsets:
        end, expect = max(b for b in bounds if b[0] <= cut)
        if expect not in digest_of:
            digest_of[expect] = replay(events[:expect]).digest()
        led = open_ledger("d", logger=QUIET,
                          log_options=LogOptions(layer=_copy(disk, {last: data[:cut]}), checkpoint_every=None))
        rec = led.recovery
        mismatches += not (led.seq == expect and led.digest() == digest_of[expect]
                           and rec.truncated_bytes == cut - end)
        led.log.abandon()
    rng = random.Random(22)
    cases = 1000 // SEG_SHARE
    false_accepts = 0
    seq, digest = len(events), replay(events).digest()
    for i in range(cases):
        garbage = (bytes(512 * rng.randint(1, 4)) if i % 3 == 0 else os.urandom(rng.randint(1, 2000)) if i % 3 == 1
                   else _bad_record(rng, seq, rng.choice([SEGMENT_HEADER_SIZE, len(data)])))
        led = open_ledger("d", logger=QUIET,
                          log_options=LogOptions(layer=_copy(disk, {last: data + garbage}), checkpoint_every=None))
        rec = led.recovery
        false_accepts += not (led.seq == seq and led.digest() == digest and rec.truncated_at == len(data)
                              and rec.truncated_bytes == len(garbage))
        led.log.abandon()
    print(f"R1/R2 on a directory ({len(segs)} segments, {len(events)} events): last segment cut at {len(offsets)} "
          f"offsets (every {SEG_SHARE}), mismatches {mismatches}; garbage tails {cases}, false accepts "
          f"{false_accepts}")
    assert len(offsets) * SEG_SHARE >= len(data) - start and mismatches == 0 and false_accepts == 0


def test_r3_r10_damage_and_tampering_inside_a_directory():
    """R3 and R10 on a log directory: a bit flipped in any record but the very last, a record deleted,
    duplicated, swapped with the next or edited with its CRC fixed, in any segment: the scan reports
    corruption naming the segment, the offset and the seq of the first bad record (a segment with a
    successor is complete, so damage in it is never a torn tail)."""
    disk, _ = _segmented_log("r3-seg", 600, checkpoint_every=40)
    segs = list_segments(disk, "d")
    with open_view("d", layer=disk) as v:
        recs = list(v.records)
        paths = list(v.paths)
    rng = random.Random(310)
    flips = 10_000 // (SEG_SHARE * 4)
    per_class = 200 // SEG_SHARE
    named = 0
    for _ in range(flips):
        rec = rng.choice(recs[:-1])
        path = paths[rec.segment]
        data = bytearray(disk.read(path))
        data[rng.randrange(rec.offset, rec.end)] ^= 1 << rng.randrange(8)
        with open_view("d", layer=_copy(disk, {path: bytes(data)}, drop_stamps=False)) as v:
            err = v.scan.error
        named += err is not None and (err.path, err.offset, err.seq) == (path, rec.offset, rec.seq)
    tampered = {c: 0 for c in ("delete", "duplicate", "reorder", "edit")}
    for c in tampered:
        done = 0
        while done < per_class:
            i = rng.randrange(len(recs) - 1)
            rec = recs[i]
            path = paths[rec.segment]
            data = disk.read(path)
            nxt = recs[i + 1] if recs[i + 1].segment == rec.segment else None
            if c == "delete":
                bad = data[: rec.offset] + data[rec.end :]
            elif c == "duplicate":
                bad = data[: rec.end] + data[rec.offset : rec.end] + data[rec.end :]
            elif c == "reorder" and nxt is not None:
                bad = data[: rec.offset] + data[nxt.offset : nxt.end] + data[rec.offset : rec.end] + data[nxt.end :]
            elif c == "edit" and rec.kind == KIND_EVENTS and rec.seq:
                edited = _edit_events_record(data, (rec.offset, rec.end, rec.seq, rec.kind), rng)
                if edited is None:
                    continue
                bad = edited
            else:
                continue  # (no record of that class here: pick another)
            done += 1
            s = replay_log("d", layer=_copy(disk, {path: bad}, drop_stamps=False), invariants="none")
            at = rec.end if c == "duplicate" else rec.offset
            tampered[c] += s.error is not None and s.error.kind == "corrupt" and s.error.offset == at \
                and s.error.file == path
    print(f"R3/R10 on a directory ({len(segs)} segments, {len(recs)} records): bit flips {flips}, named segment+"
          f"offset+seq {named}; tampering detected per class {tampered} of {per_class}")
    assert named == flips and all(v == per_class for v in tampered.values())


def test_r9_replay_of_directories_in_fresh_processes(tmp_path):
    """R9 on log directories: live digest = replay from seq 0 = replay from each segment's checkpoint =
    replay in fresh processes with another hash seed."""
    streams = 120 // SEG_SHARE * (10 if HEAVY else 1)
    live: dict[str, str] = {}
    starts = mismatches = 0
    for i in range(streams):
        disk, digest = _segmented_log(f"r9-seg-{i}", 150 + 40 * (i % 5), checkpoint_every=rng_every(i))
        out = tmp_path / f"d{i}"
        out.mkdir()
        for name in disk.listdir("d"):
            if not name.endswith(".sync"):
                (out / name).write_bytes(disk.read(f"d/{name}"))
        live[str(out)] = digest
        with open_view(out) as v:
            mismatches += rebuild_state(v, from_checkpoint=False)[0].digest() != digest
        for seg in list_segments(disk, "d")[1:]:
            with open_view(out / os.path.basename(seg)) as v:
                st, start, _ = start_state_of(v)
                starts += 1
                mismatches += st.digest() != digest
    for hashseed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=hashseed)
        res = subprocess.run([sys.executable, "-c", _R9_CHILD], input=json.dumps(list(live)), env=env,
                             capture_output=True, text=True, timeout=300, check=True)
        got = json.loads(res.stdout)
        mismatches += sum(got[p] != d for p, d in live.items())
    print(f"R9 on directories: streams {streams}; replays from a later segment's checkpoint {starts}; fresh "
          f"processes x2 hash seeds; mismatches {mismatches}")
    assert starts >= streams and mismatches == 0


def rng_every(i: int) -> int:
    return (13, 29, 61)[i % 3]


def start_state_of(view):
    from kvledger.core.log.fold import fold_records, start_state

    st, start, ck = start_state(view, at=view.first_seq)
    fold_records(view, st, start)
    return st, start, ck
