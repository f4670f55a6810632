"""RELIABILITY.md R19: durability tested at the system-call level, over real files.

``support.syscalls.SyscallRecorder`` records every write, fsync, fdatasync,
link, rename and unlink the log makes and keeps a simulated page cache: what a
power cut would leave is only what a completed sync covered, under directory
entries a completed directory fsync made durable. The tests count and order the
calls a commit makes, check at every acknowledgement (and inside every sync,
before the real call) that nothing is acknowledged ahead of the disk, fail
syncs and directory syncs, and reopen the crash images.

Mutants these tests kill (a one-line change each; see each test's docstring):
fdatasync made a no-op, durability reported before the fsync (inline), the
fsync moved after the acknowledgement (writer thread), a directory fsync error
swallowed.
"""

from __future__ import annotations

import os

import pytest
from support import QUIET
from support.syscalls import SyscallRecorder, norm

from kvledger.core.errors import LogIOError
from kvledger.options import LogOptions
from kvledger.core.log import EventLog, open_view
from support.simdisk import SimulatedDisk
from kvledger.durable import open_ledger

from support.workload import GEOMETRY, drive



def _image_events(rec: SyscallRecorder, path: str) -> tuple[int, object]:
    """(events a power cut now would keep at ``path``, the scan error or None)."""
    data = rec.crash_image(path)
    if data is None:
        return 0, None
    disk = SimulatedDisk()
    disk.put("x", data)
    stamp = rec.crash_image(f"{path}.sync")
    if stamp is not None:
        disk.write_stamp("x", stamp)
    with open_view("x", layer=disk) as v:
        return v.scan.next_seq, v.scan.error


class _Watch:
    """Checks, inside every file sync (before the real call), that the ledger has not already
    acknowledged events the disk does not hold yet."""

    def __init__(self, rec: SyscallRecorder, path: str) -> None:
        self.rec, self.path = rec, norm(path)
        self.led = None
        self.checked = self.early = 0
        rec.before_sync = self

    def __call__(self, synced_path: str) -> None:
        if self.led is None or norm(synced_path) != self.path:
            return
        acked = self.led.durable_seq
        kept, _ = _image_events(self.rec, self.path)
        self.checked += 1
        self.early += acked + 1 > kept


def test_r19_a_commit_is_one_write_then_one_fdatasync_then_the_ack(tmp_path, monkeypatch):
    """Mutants killed: ``os.fdatasync`` in ``files._OsHandle.sync`` made a no-op (no fdatasync is
    counted, and the crash image lacks acknowledged events); ``self._publish(last_seq)`` moved before
    ``live.sync()`` in ``durability.Durability._round`` (durability reported before the fsync: caught
    inside the fdatasync)."""
    path = str(tmp_path / "c.kvlog")
    rec = SyscallRecorder(monkeypatch)
    watch = _Watch(rec, path)
    led = open_ledger(path, GEOMETRY, logger=QUIET, log_options=LogOptions(fsync="per_step", checkpoint_every=None))
    watch.led = led
    commits = bad_commits = lost = 0
    for step in range(40):
        led.reserve(step, 2)
        led.commit(step, step, 2)
        before = len(rec.calls)
        led.seal_step(step)
        calls = [c for c, p in rec.calls[before:] if norm(p) == norm(path)]
        commits += 1
        bad_commits += calls != ["write", "fdatasync"]
        kept, err = _image_events(rec, path)
        lost += err is not None or kept < led.durable_seq + 1 or led.durable_seq != led.seq - 1
        led.finish(step)
    led.close()
    print(f"R19 inline commits: {commits} seals, each expected as [write, fdatasync] on the log: "
          f"{commits - bad_commits} were; syncs checked before the call {watch.checked}, acknowledged early "
          f"{watch.early}; seals whose crash image lacked an acknowledged event {lost}; calls {rec.counts}")
    assert bad_commits == 0 and watch.early == 0 and lost == 0 and watch.checked >= commits


@pytest.mark.parametrize("fsync", ["background", "per_event"])
def test_r19_acknowledged_events_survive_every_crash_image(tmp_path, monkeypatch, fsync):
    """Mutants killed: as above, in the writer thread's rounds too (background: the publish before the
    fsync means ``durable_seq`` already covers events the disk does not hold when the fdatasync starts)."""
    path = str(tmp_path / "a.kvlog")
    rec = SyscallRecorder(monkeypatch)
    watch = _Watch(rec, path)
    acks = violations = 0

    def on_seal(led, plan):
        nonlocal acks, violations
        acked = led.durable_seq
        kept, err = _image_events(rec, path)
        acks += 1
        violations += err is not None or kept < acked + 1

    led = open_ledger(path, GEOMETRY, logger=QUIET, log_options=LogOptions(fsync=fsync, checkpoint_every=30))
    watch.led = led
    drive(led, f"r19-{fsync}", 40, on_seal=on_seal)
    led.flush()
    kept, err = _image_events(rec, path)
    violations += err is not None or kept != led.seq
    led.close()
    print(f"R19 {fsync}: acknowledgements checked against the crash image {acks + 1}, violations {violations}; "
          f"syncs checked before the call {watch.checked}, acknowledged early {watch.early}; calls {rec.counts}")
    assert violations == 0 and watch.early == 0 and rec.counts.get("fdatasync", 0) > 0


@pytest.mark.parametrize("fsync", ["per_step", "background"])
def test_r19_a_failed_fdatasync_surfaces_and_acknowledges_nothing_after_it(tmp_path, monkeypatch, fsync):
    """Mutant killed: a failed fdatasync swallowed in ``durability.Durability._round`` (the log acknowledges
    events that the crash image does not hold)."""
    results = []
    for n in range(1, 7):
        path = str(tmp_path / f"f{n}-{fsync}.kvlog")
        rec = SyscallRecorder(monkeypatch)
        led = open_ledger(path, GEOMETRY, logger=QUIET, log_options=LogOptions(fsync=fsync, checkpoint_every=None))
        target = rec.counts.get("fdatasync", 0) + n
        rec.fail = {"fdatasync": target}
        surfaced = False
        acked = -1
        try:
            drive(led, f"f{n}", 12)
            led.flush()
            acked = led.durable_seq
            led.close()  # (the writer thread groups syncs: the failing one may be the close's)
        except LogIOError as exc:
            surfaced = exc.op == "fsync"
        acked = max(acked, led.durable_seq)
        led.close()
        kept, err = _image_events(rec, path)
        injected = rec.counts.get("fdatasync", 0) >= target  # (the writer thread groups syncs: fewer of them)
        results.append((surfaced == injected, err is None and kept >= acked + 1, injected))
        monkeypatch.undo()
    print(f"R19 failed fdatasync ({fsync}): failure points {len(results)}, injected {sum(i for *_, i in results)}, "
          f"surfaced when injected {sum(s for s, _, _ in results)}, crash images holding every acknowledged "
          f"event {sum(k for _, k, _ in results)}")
    assert all(s and k for s, k, _ in results) and sum(i for *_, i in results) >= 2


def test_r19_directory_fsync_errors_surface(tmp_path, monkeypatch):
    """Mutant killed: the ``raise`` in ``files.fsync_dir`` dropped (a directory fsync error swallowed:
    create, recovery and stamps would report success for entries that may not survive)."""
    rec = SyscallRecorder(monkeypatch)
    outcomes = {}
    rec.fail = {"dir_fsync": 1}
    with pytest.raises(LogIOError) as ei:
        EventLog.create(tmp_path / "new.kvlog", GEOMETRY)
    outcomes["create"] = ei.value.op
    assert not (tmp_path / "new.kvlog").exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    log = EventLog.create(tmp_path / "s.kvlog", GEOMETRY)
    rec.fail = {"dir_fsync": rec.counts["dir_fsync"] + 1}
    with pytest.raises(LogIOError) as ei:
        log.close()  # the close record is synced; the stamp's directory entry is not
    outcomes["close (stamp)"] = ei.value.op
    with open(tmp_path / "s.kvlog", "ab") as f:
        f.write(b"KR" + bytes(100))  # a torn tail: recovery replaces the file
    os.unlink(tmp_path / "s.kvlog.sync")
    rec.fail = {"dir_fsync": rec.counts["dir_fsync"] + 1}
    with pytest.raises(LogIOError) as ei:
        EventLog.open(tmp_path / "s.kvlog")
    outcomes["open (torn-tail repair)"] = ei.value.op
    print(f"R19 directory fsync failures: {outcomes}; calls {rec.counts}")
    assert outcomes == {"create": "create", "close (stamp)": "stamp", "open (torn-tail repair)": "truncate"}


def test_r19_create_orders_its_calls(tmp_path, monkeypatch):
    """The header is synced before the file gets its name, and the name before create returns."""
    rec = SyscallRecorder(monkeypatch)
    p = str(tmp_path / "o.kvlog")
    EventLog.create(p, GEOMETRY, fsync="per_step").close()
    order = [c for c, _ in rec.calls]
    first_sync = order.index("fsync")
    link = order.index("link")
    assert order.index("write") < first_sync < link < order.index("dir_fsync", link)
    with open_view(p) as v:
        assert v.scan.closed


def _directory_image_events(rec: SyscallRecorder, directory: str) -> tuple[int, object]:
    """(events a power cut now would keep in the log directory, the scan error or None)."""
    from kvledger.core.log.segments import is_segment_name

    disk = SimulatedDisk()
    disk.dirs.add("d")
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if is_segment_name(name):
            data = rec.crash_image(path)
            if data is not None:
                disk.put(f"d/{name}", data)
        elif name.endswith(".sync") and is_segment_name(name[:-5]):
            stamp = rec.crash_image(path)
            if stamp is not None:
                disk.write_stamp(f"d/{name[:-5]}", stamp)
    if not disk.listdir("d"):
        return 0, None
    with open_view("d", layer=disk) as v:
        return v.scan.next_seq, v.scan.error


@pytest.mark.parametrize("fsync", ["per_step", "background"])
def test_r19_a_directory_survives_every_crash_image_across_rolls(tmp_path, monkeypatch, fsync):
    """R19 on a log directory of 4 KiB segments: at every acknowledgement, the crash image of the
    whole directory (each segment and stamp as its last completed sync and directory fsync left it)
    holds every acknowledged event and opens without error, rolls included. Mutants killed: as
    above (fdatasync a no-op, durability published before the fsync), and a roll that creates the
    next segment before its checkpoint is durable."""
    path = str(tmp_path / "d")
    rec = SyscallRecorder(monkeypatch)
    acks = violations = 0

    def on_seal(led, plan):
        nonlocal acks, violations
        acked = led.durable_seq
        kept, err = _directory_image_events(rec, path)
        acks += 1
        violations += err is not None or kept < acked + 1

    led = open_ledger(path, GEOMETRY, logger=QUIET,
                      log_options=LogOptions(fsync=fsync, checkpoint_every=None, segment_bytes=4096))
    drive(led, f"r19-dir-{fsync}", 60, on_seal=on_seal)
    led.flush()
    kept, err = _directory_image_events(rec, path)
    violations += err is not None or kept != led.seq
    led.close()
    segments = len([n for n in os.listdir(path) if n.endswith(".kvlog")])
    print(f"R19 directory ({fsync}): {segments} segments; acknowledgements checked against the crash image "
          f"{acks + 1}, violations {violations}; calls {rec.counts}")
    assert violations == 0 and segments >= 3 and rec.counts.get("fdatasync", 0) > 0
