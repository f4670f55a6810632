"""RELIABILITY.md R17 and R21: untrusted logs and files that are not logs.

    R17  headers, records and checkpoints that claim huge geometry, counts or
         lengths, checksums and chain forged to match: the library's own error,
         within a memory bound set by ``max_pages`` and the file's size
    R21  a FIFO, a directory, a device, a symlink, another program's file, a log
         owned by someone else: refused at once, nothing written through a link,
         new logs (and their sync stamps) created 0600

``KVLEDGER_HYPOTHESIS=heavy`` multiplies the R17 count by ten.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
from support import HEAVY, QUIET, craft

from kvledger import CorruptLogError, Geometry, KVLedgerError, LogError
from kvledger.core.log import DEFAULT_MAX_PAGES, EventLog, open_view
from kvledger.core.log.fold import rebuild_state
from kvledger.durable import open_ledger
from kvledger.tools.replay import replay_log

SCALE = 10 if HEAVY else 1
MEMORY_BOUND = 32 << 20  # what one crafted file may make the readers allocate (tracemalloc peak)


def _huge_header_log(rng: random.Random, header=craft.header) -> bytes:
    """The issue's 238-byte log: a forged header claiming more than max_pages, and seq 0 configuring it."""
    # (just past the limit: a mutant without the check allocates a few hundred MB here, not 100 GiB;
    # the 2**32 claim runs in a child with an address-space limit below)
    n = rng.randrange(DEFAULT_MAX_PAGES + 1, DEFAULT_MAX_PAGES + 4096)
    log = header(n, rng.randint(1, 1 << 20))
    if rng.random() < 0.3:
        return log  # header only: open_ledger would append seq 0 itself
    return craft.record(log, craft.EVENTS, 0, 1, craft.events_payload([craft.configured(n)]))


def _huge_length_log(rng: random.Random, header=craft.header) -> bytes:
    log = craft.record(header(64), craft.EVENTS, 0, 1, craft.events_payload([craft.configured(64)]))
    payload = os.urandom(rng.randint(0, 64))
    return craft.record(log, rng.choice([1, 2, 3]), 1, rng.randint(0, 3), payload,
                        length=rng.choice([0xFFFF_FFFF, 1 << 31, rng.getrandbits(32)]))


def _huge_count_log(rng: random.Random, header=craft.header) -> bytes:
    log = header(64)
    count = rng.choice([0xFFFF_FFFF, 1 << 30, rng.getrandbits(32)])
    items = [craft.configured(64)]
    return craft.record(log, craft.EVENTS, 0, count, craft.events_payload(items, count=count))


def _huge_checkpoint_log(rng: random.Random, header=craft.header) -> bytes:
    log = craft.record(header(64), craft.EVENTS, 0, 1, craft.events_payload([craft.configured(64)]))
    claim = rng.choice([0xFFFF_FFFF, 1 << 28, rng.getrandbits(32)])
    state = b"\x8a" + b"\xa5owner\xdd" + claim.to_bytes(4, "big") + os.urandom(rng.randint(0, 32))
    if rng.random() < 0.5:  # a well-formed state whose geometry claims more pages than the header
        import msgspec

        state = msgspec.msgpack.encode({"v": 1, "geometry": [1 << 32, 16], "policy": "released_aliases", "seq": 1,
                                        "owner": [], "alias_n": []})
    return craft.record(log, craft.CHECKPOINT, 1, 0, craft.checkpoint_payload(1, "0" * 64, state))


CLASSES = {"header geometry": _huge_header_log, "record length": _huge_length_log,
           "event count": _huge_count_log, "checkpoint lists": _huge_checkpoint_log}


def _read_everything(path: str) -> str:
    """Every reader on one file: open_view + the fold, replay, open_ledger. Returns how it ended."""
    outcome = "accepted"
    try:
        with open_view(path) as v:
            rebuild_state(v)
            v.scan.raise_error()
    except KVLedgerError as exc:
        outcome = type(exc).__name__
    try:
        s = replay_log(path)
        if not s.ok:
            outcome = s.error.error
    except KVLedgerError as exc:
        outcome = type(exc).__name__
    try:
        open_ledger(path, logger=QUIET).close()
    except KVLedgerError as exc:
        outcome = type(exc).__name__
    return outcome


def _read_traced(path: str) -> tuple[str, int]:
    """``_read_everything`` under tracemalloc: (how it ended, the peak traced allocation)."""
    tracemalloc.start()
    try:
        try:
            outcome = _read_everything(path)
        except Exception as exc:  # anything but the library's own error is an escape
            outcome = f"escape {type(exc).__name__}"
        return outcome, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_r17_crafted_logs_are_refused_within_a_memory_bound(tmp_path):
    """Mutant killed: the ``max_pages`` check in ``format.decode_header`` removed (every reader would
    allocate page tables for 2**32 pages: the tracemalloc bound, or the child's address-space limit, fails)."""
    rng = random.Random(17)
    per_class = 250 * SCALE
    counts = {c: 0 for c in CLASSES}
    outcomes: dict[str, int] = {}
    escapes = 0
    peak = 0
    for i in range(per_class * len(CLASSES)):
        cls = list(CLASSES)[i % len(CLASSES)]
        data = CLASSES[cls](rng)
        path = str(tmp_path / f"c{i % 8}.kvlog")
        for leftover in (path, f"{path}.sync"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        with open(path, "wb") as f:
            f.write(data)
        outcome, used = _read_traced(path)
        escapes += outcome.startswith("escape")
        peak = max(peak, used)
        counts[cls] += 1
        key = f"{cls}: {outcome}"
        outcomes[key] = outcomes.get(key, 0) + 1
        if peak >= MEMORY_BOUND or escapes:
            break  # (fail fast: a reader without the bound allocates per file)
    total = sum(counts.values())
    print(f"R17 crafted logs: {total} files {counts}; outcomes {outcomes}; escapes {escapes}; "
          f"peak traced allocation {peak / 1e6:.2f} MB (bound {MEMORY_BOUND / 1e6:.0f} MB, max_pages "
          f"{DEFAULT_MAX_PAGES:,})")
    assert total >= 1000 and escapes == 0 and peak < MEMORY_BOUND
    # a garbage length at the end is tail damage (cut off, nothing read); every other claim is refused
    assert not [k for k in outcomes if k.endswith(": accepted") and not k.startswith("record length")]


def test_r17_crafted_segments_of_a_directory(tmp_path):
    """R17 on a log directory: the same crafted claims as segment 0 of a directory (a version-2 header,
    CRCs and chain forged): refused, or a tail cut off, within the same memory bound; never an escape."""
    rng = random.Random(171)
    per_class = 63 * SCALE
    escapes = total = 0
    peak = 0
    outcomes: dict[str, int] = {}
    for i in range(per_class * len(CLASSES)):
        cls = list(CLASSES)[i % len(CLASSES)]
        d = tmp_path / f"d{i % 4}"
        if d.exists():
            for f in d.iterdir():
                f.unlink()
        else:
            d.mkdir()
        (d / ("seg-" + "0" * 20 + ".kvlog")).write_bytes(CLASSES[cls](rng, header=craft.segment_header))
        outcome, used = _read_traced(str(d))
        escapes += outcome.startswith("escape")
        peak = max(peak, used)
        total += 1
        outcomes[f"{cls}: {outcome}"] = outcomes.get(f"{cls}: {outcome}", 0) + 1
        if peak >= MEMORY_BOUND or escapes:
            break
    print(f"R17 crafted segments: {total} directories; outcomes {outcomes}; escapes {escapes}; peak traced "
          f"allocation {peak / 1e6:.2f} MB (bound {MEMORY_BOUND / 1e6:.0f} MB)")
    assert total >= 250 and escapes == 0 and peak < MEMORY_BOUND
    assert not [k for k in outcomes if k.endswith(": accepted") and not k.startswith("record length")]


_CHILD = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from kvledger import KVLedgerError
from kvledger.durable import open_ledger
from kvledger.tools.replay import replay_log
for f in (lambda: replay_log(sys.argv[1]), lambda: open_ledger(sys.argv[1]).close()):
    try:
        f()
        print("accepted")
    except KVLedgerError as exc:
        print(type(exc).__name__)
"""


def test_r17_the_issues_238_byte_log_under_an_address_space_limit(tmp_path):
    """Mutant killed: as above; a child limited to 1 GiB of address space would die of MemoryError."""
    n = 1 << 32
    data = craft.record(craft.header(n), craft.EVENTS, 0, 1, craft.events_payload([craft.configured(n)]))
    p = tmp_path / "big.kvlog"
    p.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(p)], capture_output=True, text=True, timeout=120)
    print(f"R17 {len(data)}-byte log claiming {n:,} pages, child with RLIMIT_AS 1 GiB: rc {out.returncode}, "
          f"answers {out.stdout.split()}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LogError", "LogError"]


def test_r17_a_larger_limit_is_a_deliberate_choice(tmp_path):
    g = Geometry(num_pages=DEFAULT_MAX_PAGES + 1, page_tokens=16)
    with pytest.raises(LogError, match="max_pages"):
        EventLog.create(tmp_path / "big.kvlog", g)
    assert not (tmp_path / "big.kvlog").exists()
    small = Geometry(num_pages=64, page_tokens=16)
    EventLog.create(tmp_path / "s.kvlog", small).close()
    with pytest.raises(LogError, match="max_pages"):
        open_view(tmp_path / "s.kvlog", max_pages=32)


# ---------------------------------------------------------------------- R21


def _within(seconds: float, fn) -> tuple[str, float]:
    """Run fn in a thread; (outcome, seconds). A call still blocked after ``seconds`` is a hang."""
    box: list = []

    def run():
        try:
            fn()
            box.append("accepted")
        except KVLedgerError as exc:
            box.append(f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            box.append(f"escape {type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    return (box[0] if box else "hang"), time.perf_counter() - t0


def test_r21_files_that_are_not_logs(tmp_path):
    """Mutants killed: ``O_NOFOLLOW`` dropped in ``files.open_regular`` (the link is followed; only the
    inode check stops the write, for the wrong reason), the ``fstat`` regular-file check removed (a FIFO or
    a device is mapped or locked before anything notices), ``LOG_MODE`` widened from 0600."""
    g = Geometry(num_pages=64, page_tokens=16)
    real = tmp_path / "real.kvlog"
    with open_ledger(real, g, logger=QUIET) as led:
        led.reserve(1, 2)
        led.seal_step(0)
    real_bytes = real.read_bytes()
    fifo = tmp_path / "fifo.kvlog"
    os.mkfifo(fifo)
    link = tmp_path / "link.kvlog"
    link.symlink_to(real)
    dangling = tmp_path / "dangling.kvlog"
    dangling.symlink_to(tmp_path / "target-that-does-not-exist.kvlog")
    other = tmp_path / "other.txt"
    other.write_bytes(b"#!/bin/sh\necho another program's file\n" * 10)
    foreign = tmp_path / "foreign.kvlog"
    foreign.write_bytes(real_bytes)
    os.chown(foreign, 12345, 12345) if os.geteuid() == 0 else None
    cases = {
        "fifo/open_ledger": lambda: open_ledger(fifo, logger=QUIET),
        "fifo/open_view": lambda: open_view(fifo),
        "fifo/replay": lambda: replay_log(fifo),
        "directory/open_ledger": lambda: open_ledger(tmp_path, logger=QUIET),
        "directory/open_view": lambda: open_view(tmp_path),
        "device/open_view": lambda: open_view("/dev/zero"),
        "device/open_ledger": lambda: open_ledger("/dev/null", logger=QUIET),
        "symlink/open_ledger": lambda: open_ledger(link, logger=QUIET),
        "symlink/create": lambda: open_ledger(dangling, g, logger=QUIET),
        "other program's file/open_ledger": lambda: open_ledger(other, logger=QUIET),
        "other program's file/open_view": lambda: open_view(other),
    }
    if os.geteuid() == 0:
        cases["log of another user/open_ledger"] = lambda: open_ledger(foreign, logger=QUIET)
    before = sorted(os.listdir(tmp_path))
    results = {name: _within(5.0, fn) for name, fn in cases.items()}
    assert sorted(os.listdir(tmp_path)) == before  # nothing was created anywhere (no lock file in a directory)
    hangs = [n for n, (o, _) in results.items() if o == "hang"]
    accepted = [n for n, (o, _) in results.items() if "Error" not in o or o.startswith("escape")]
    # each refused for the right reason, named: not a file, a link, not a log, not ours
    why = {"fifo": "FIFO", "directory": "directory", "device": "device", "symlink": "symbolic link",
           "other program's file": "not a kvledger log", "log of another user": "belongs to uid"}
    wrong_reason = [n for n, (o, _) in results.items() if why[n.split("/")[0]] not in o]
    slowest = max(t for _, t in results.values())
    writes_through_links = (real.read_bytes() != real_bytes) + (tmp_path / "target-that-does-not-exist.kvlog").exists()
    with open_view(link) as v:  # reading through a link is fine
        assert v.scan.error is None and v.scan.closed
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (real, tmp_path / "real.kvlog.sync")}
    print(f"R21 not-a-log files: cases {len(results)} "
          + ", ".join(f"{n}: {o.split(':')[0]}" for n, (o, _) in results.items())
          + f"; refused for another reason {wrong_reason}; hangs {len(hangs)}; slowest answer "
          f"{slowest * 1e3:.1f} ms; writes through links "
          f"{writes_through_links}; modes {', '.join(f'{n} {m:o}' for n, m in modes.items())}")
    assert not hangs and not accepted and not wrong_reason and slowest < 1.0 and writes_through_links == 0
    assert all(m == 0o600 for m in modes.values())
    assert isinstance(_first_error(lambda: open_ledger(other, logger=QUIET)), CorruptLogError)
    assert other.read_bytes().startswith(b"#!/bin/sh")


def _first_error(fn):
    try:
        fn()
    except KVLedgerError as exc:
        return exc
    return None


def test_r21_files_that_are_not_segments_inside_a_log_directory(tmp_path):
    """R21 on a log directory: a last segment that is a symbolic link (the writer refuses it and never
    writes its target; readers may read through it, as for a file), a FIFO or a directory named like a
    segment: refused with a clear error within a second, nothing written or deleted (an older open
    removed anything that small as a header-only segment, and its stamp with it); a new directory is
    created 0700, its segments and stamps 0600."""
    from kvledger.core.log import list_segments
    from kvledger.core.log.files import default_layer

    g = Geometry(num_pages=64, page_tokens=16)
    real = tmp_path / "real"
    with open_ledger(real, g, segment_bytes=4096, logger=QUIET) as led:
        for step in range(40):
            led.reserve(step, 1)
            led.seal_step(step)
    segs = list_segments(default_layer, str(real))
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in [str(real), *segs, f"{segs[-1]}.sync",
                                                             str(real / "HEAD.sync")]}
    outcomes = {}
    for kind in ("symlink", "fifo", "directory"):
        d = tmp_path / kind
        shutil.copytree(real, d)
        last = d / os.path.basename(segs[-1])
        target = tmp_path / f"{kind}-target.kvlog"
        target.write_bytes(last.read_bytes())
        last.unlink()
        if kind == "symlink":
            last.symlink_to(target)
        elif kind == "fifo":
            os.mkfifo(last)
        else:
            last.mkdir()
        before = target.read_bytes()
        for reader in ("open_ledger", "open_view"):
            fn = (lambda d=d: open_ledger(d, logger=QUIET).close()) if reader == "open_ledger" else \
                (lambda d=d: open_view(d).close())
            outcome, seconds = _within(5.0, fn)
            outcomes[f"{kind}/{reader}"] = (outcome.split(":")[0], round(seconds, 3))
        assert target.read_bytes() == before and os.path.lexists(last)  # nothing written through, nothing removed
    shown = ", ".join(f"{os.path.basename(p)} {m:o}" for p, m in modes.items())
    print(f"R21 inside a log directory: {outcomes}; modes {shown}")
    owed = {k for k in outcomes if k != "symlink/open_view"}  # (reading through a link is fine)
    refused = {k for k, (o, s) in outcomes.items() if "Error" in o and not o.startswith("escape") and s < 1.0}
    assert refused == owed and outcomes["symlink/open_view"][0] == "accepted"
    assert modes[str(real)] == 0o700 and all(m == 0o600 for p, m in modes.items() if p != str(real))
