"""R7: fuzz the log decoder. Only the library's own errors escape; memory stays bounded;
a valid log round-trips to the same events.

Quick profile: 2 x 1,000 + 600 hypothesis examples + 8,000 seeded mutations (>= 10^4 executions);
``KVLEDGER_HYPOTHESIS=heavy`` runs 2 x 25,000 + 15,000 examples and 100,000 mutations; the coverage-guided
heavy profile is atheris (tests/fuzz/fuzz_log.py, run by scripts/heavy).
"""

from __future__ import annotations

import contextlib
import os
import random
import struct
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import HEAVY, QUIET
from kvledger import CLEAR_POLICIES, KVLedgerError, replay
from kvledger.options import LogOptions
from kvledger.core.log.format import HEADER_SIZE, KIND_CHECKPOINT, KIND_EVENTS, PREFIX
from kvledger.core.log.scan import scan
from kvledger.core.log import EventLog, LogView, open_view
from support.simdisk import SimulatedDisk
from kvledger.core.log.fold import rebuild_state

from support.workload import GEOMETRY, drive, make_events

EXAMPLES = 25_000 if HEAVY else 1_000
MUTATIONS = 100_000 if HEAVY else 8_000
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _valid_log(seed: str = "fuzz", steps: int = 12, every: int = 20) -> bytes:
    from kvledger.durable import open_ledger
    disk = SimulatedDisk()
    with open_ledger("v", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=disk, checkpoint_every=every)) as led:
        drive(led, seed, steps)
    return disk.read("v")


BASE = _valid_log()
HEADER = BASE[:HEADER_SIZE]
COUNTS = {"bytes": 0, "tails": 0, "mutants": 0, "loop": 0, "round_trip": 0}


def _consume(data: bytes) -> None:
    """Everything a reader does with untrusted bytes: scan, decode every record, fold, load checkpoints."""
    try:
        res = scan(data, "fuzz")
    except KVLedgerError:
        return
    view = LogView(data, res, "fuzz")
    for rec in res.records:
        try:
            if rec.kind == KIND_EVENTS:
                view.events(rec)
            elif rec.kind == KIND_CHECKPOINT:
                view.checkpoint(rec)
        except KVLedgerError:
            pass
    for from_checkpoint in (True, False):
        with contextlib.suppress(KVLedgerError):
            rebuild_state(view, from_checkpoint=from_checkpoint)


@FUZZ
@given(st.binary(max_size=4096))
def test_r7_arbitrary_bytes_only_raise_library_errors(data):
    COUNTS["bytes"] += 1
    _consume(data)


@FUZZ
@given(st.binary(max_size=4096))
def test_r7_valid_header_and_arbitrary_records(tail):
    COUNTS["tails"] += 1
    _consume(HEADER + tail)


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(BASE) - 1), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, len(BASE) - 1), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, len(BASE)), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("delete"), st.integers(0, len(BASE) - 1), st.integers(1, 256)),
    st.tuples(st.just("truncate"), st.integers(0, len(BASE)), st.just(0)),
    st.tuples(st.just("length"), st.integers(0, 200), st.integers(0, 0xFFFFFFFF)),
    st.tuples(st.just("dup"), st.integers(0, len(BASE) - 1), st.integers(1, 512)),
)


def _records(data: bytes) -> list[int]:
    out, off = [], HEADER_SIZE
    while off + 28 <= len(data):
        n = PREFIX.unpack_from(data, off)[3]
        out.append(off)
        off += 40 + n
    return out


STARTS = _records(BASE)


def _mutate(data: bytes, muts) -> bytes:
    b = bytearray(data)
    for kind, pos, arg in muts:
        if not b:
            break
        pos = min(pos, len(b) - 1)
        if kind == "flip":
            b[pos] ^= 1 << arg
        elif kind == "set":
            b[pos] = arg
        elif kind == "insert":
            b[pos:pos] = arg
        elif kind == "delete":
            del b[pos : pos + arg]
        elif kind == "truncate":
            del b[pos:]
        elif kind == "length":  # a record's length field set to anything
            off = STARTS[pos % len(STARTS)]
            if off + 8 <= len(b):
                struct.pack_into("<I", b, off + 4, arg)
        elif kind == "dup":
            b[pos:pos] = b[pos : pos + arg]
    return bytes(b)


@settings(FUZZ, max_examples=EXAMPLES * 3 // 5)
@given(st.lists(_mutation, min_size=1, max_size=4))
def test_r7_mutated_valid_logs_only_raise_library_errors(muts):
    COUNTS["mutants"] += 1
    _consume(_mutate(BASE, muts))


def test_r7_seeded_mutation_loop_and_memory_bound():
    rng = random.Random(7)
    kinds = ("flip", "set", "insert", "delete", "truncate", "length", "dup")
    peak_ratio = 0.0  # over inputs of 1 KiB or more (a 2-byte input's ratio is all fixed cost)
    excess = 0  # the most one pass allocated beyond 400 bytes per input byte
    for i in range(MUTATIONS):
        muts = []
        for _ in range(rng.randint(1, 3)):
            k = rng.choice(kinds)
            if k == "insert":
                muts.append((k, rng.randrange(len(BASE)), os.urandom(rng.randint(1, 32))))
            elif k == "length":
                muts.append((k, rng.randrange(200), rng.choice([0, 1, 27, 0xFFFFFFFF, rng.getrandbits(32)])))
            elif k == "flip":
                muts.append((k, rng.randrange(len(BASE)), rng.randrange(8)))
            else:
                muts.append((k, rng.randrange(len(BASE)), rng.randint(0, 255)))
        data = _mutate(BASE, muts)
        if i % 50 == 0:  # measure what one pass allocates, against the input's size
            tracemalloc.start()
            try:
                _consume(data)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            if len(data) >= 1024:
                peak_ratio = max(peak_ratio, peak / len(data))
            excess = max(excess, peak - 400 * len(data))
        else:
            _consume(data)
        COUNTS["loop"] += 1
    total = sum(COUNTS[k] for k in ("bytes", "tails", "mutants", "loop"))
    print(f"R7 decoder fuzzing: executions {total} (hypothesis bytes {COUNTS['bytes']}, header+tail "
          f"{COUNTS['tails']}, mutated logs {COUNTS['mutants']}; seeded mutations {COUNTS['loop']}); "
          f"crashes 0 (only KVLedgerError escaped); peak allocation {peak_ratio:.0f} x the input size (inputs of "
          f">= 1 KiB); at most {max(excess, 0)} bytes beyond 400 x the input")
    assert COUNTS["loop"] == MUTATIONS
    # A garbage length can never make the reader allocate for it: what one pass allocates is a
    # small multiple of the input (decoded events and states), never the claimed length.
    # (the heavy profile once met a 2-byte input whose 1.3 KB of fixed cost was 642 x its size: hence the
    # allowance of 64 KiB, and the ratio taken over inputs of 1 KiB or more)
    assert peak_ratio < 400 and excess < 64 * 1024


@settings(max_examples=200 if not HEAVY else 2000, deadline=None)
@given(seed=st.integers(0, 1 << 30), steps=st.integers(1, 25), policy=st.sampled_from(CLEAR_POLICIES),
       fsync=st.sampled_from(["per_step", "per_event", "none"]))
def test_r7_round_trip_is_identity(seed, steps, policy, fsync):
    COUNTS["round_trip"] += 1
    events, led = make_events(seed, steps, policy=policy)
    disk = SimulatedDisk()
    log = EventLog.create("rt", GEOMETRY, policy=policy, fsync=fsync, layer=disk)
    for i, ev in enumerate(events):
        log.append(i, ev)
    log.close()
    with open_view("rt", layer=disk) as v:
        assert v.scan.closed and v.scan.error is None
        back = [ev for _, ev, _ in v.iter_events()]
    assert back == events
    assert replay(back).digest() == led.digest()


def test_r7_garbage_length_is_not_read():
    """A length field of 4 GiB in a 200-byte file: classified as tail damage from the header alone."""
    bad = bytearray(BASE[:HEADER_SIZE]) + PREFIX.pack(b"KR", KIND_EVENTS, 0, 0xFFFFFF00, 0, 1, HEADER_SIZE) + bytes(200)
    tracemalloc.start()
    try:
        res = scan(bytes(bad))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert res.torn_at == HEADER_SIZE and peak < 64 * 1024


def test_r7_mutated_segments_of_a_directory_only_raise_library_errors():
    """R7 on a log directory: one segment (its header included) mutated the seeded loop's ways; the
    directory read as a view from its first segment and from the mutated one, folded both ways, and
    reopened: only the library's errors escape."""
    from kvledger.core.log import list_segments
    from kvledger.durable import open_ledger
    disk = SimulatedDisk()
    with open_ledger("d", GEOMETRY, logger=QUIET,
                     log_options=LogOptions(layer=disk, checkpoint_every=20, segment_bytes=4096)) as led:
        drive(led, "fuzz-seg", 40)
    segs = list_segments(disk, "d")
    files = {name: disk.read(f"d/{name}") for name in disk.listdir("d") if not name.endswith(".sync")}
    rng = random.Random(77)
    cases = MUTATIONS // 20
    kinds = ("flip", "set", "insert", "delete", "truncate", "length", "dup")
    escapes = 0
    for _ in range(cases):
        target = rng.choice(segs)
        base = files[target[2:]]
        k = rng.choice(kinds)
        arg = (os.urandom(rng.randint(1, 32)) if k == "insert" else rng.randrange(8) if k == "flip"
               else rng.choice([0, 27, 0xFFFFFFFF]) if k == "length" else rng.randint(0, 255))
        bad = _mutate(base, [(k, rng.randrange(len(base)), arg)])
        copy = SimulatedDisk()
        copy.dirs.add("d")
        for name, data in files.items():
            copy.put(f"d/{name}", bad if f"d/{name}" == target else data)
        try:
            for start in ("d", target):
                try:
                    with open_view(start, layer=copy) as v:
                        for from_checkpoint in (True, False):
                            with contextlib.suppress(KVLedgerError):
                                rebuild_state(v, from_checkpoint=from_checkpoint)
                except KVLedgerError:
                    pass
            with contextlib.suppress(KVLedgerError):
                open_ledger("d", logger=QUIET, log_options=LogOptions(layer=copy)).log.abandon()
        except Exception:  # (anything but the library's own error is an escape)
            escapes += 1
    print(f"R7 on a directory ({len(segs)} segments): {cases} mutated segments read from the first and "
          f"from the mutated segment, folded and reopened; escapes {escapes}")
    assert escapes == 0
