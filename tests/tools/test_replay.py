"""replay_log: the fold of a log file with every check, compared with what the live run recorded."""

from __future__ import annotations


import pytest

from support import QUIET
from kvledger import Geometry, InvalidArgumentError, replay
from kvledger.options import LogOptions
from kvledger.core.log.format import KIND_CHECKPOINT
from kvledger.core.events.events import (
    CacheConfigured,
    PagesCommitted,
    PagesReserved,
    RequestFinished,
    SnapshotAliased,
    SnapshotReleased,
    StepSealed,
)
from kvledger.core.log import EventLog, open_view
from support.simdisk import SimulatedDisk
from kvledger.durable import open_ledger
from kvledger.tools.replay import exit_code, render, replay_log

from support.workload import GEOMETRY, drive



@pytest.fixture(scope="module")
def logfile(tmp_path_factory):
    p = tmp_path_factory.mktemp("replay") / "w.kvlog"
    with open_ledger(p, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=60)) as led:
        drive(led, "replay", 40, ranks=2)
        digest, seq = led.digest(), led.seq
    with open_view(p) as v:
        events = [ev for _, ev, _ in v.iter_events()]
        checkpoints = [r for r in v.records if r.kind == KIND_CHECKPOINT]
    return p, events, digest, seq, checkpoints


def test_full_replay_summary(logfile):
    p, events, digest, seq, checkpoints = logfile
    s = replay_log(p)
    assert s.ok and exit_code(s) == 0 and s.error is None
    assert s.digest == digest and s.events == seq == len(events) and s.last_seq == seq - 1
    assert s.closed_cleanly and s.torn_at is None
    assert s.checkpoints_compared == len(checkpoints) >= 2
    assert s.invariant_checks >= 1  # 64 pages: every 1,024 events, and at the end
    # the counts, recomputed from the events
    seals = [e for e in events if type(e) is StepSealed]
    assert s.steps_sealed == len(seals)
    assert s.pages_cleared == sum(len(e.clear_list) for e in seals)
    assert s.plans_with_clears == sum(1 for e in seals if e.clear_list)
    assert s.commits == sum(1 for e in events if type(e) is PagesCommitted)
    assert s.snapshots_released == sum(1 for e in events if type(e) is SnapshotReleased)
    assert s.requests_finished == sum(1 for e in events if type(e) is RequestFinished)
    assert s.ranks == 2
    text = render(s)
    assert "result" in text and "OK" in text and digest in text


def test_until_and_from_checkpoint(logfile):
    p, events, digest, seq, checkpoints = logfile
    for until in (0, 5, checkpoints[0].seq - 1, checkpoints[0].seq, seq // 2, seq - 2):
        want = replay(events[: until + 1]).digest()
        a = replay_log(p, until=until)
        b = replay_log(p, until=until, from_checkpoint=True)
        assert a.ok and b.ok and a.digest == want == b.digest, until
        assert a.last_seq == until == b.last_seq
        cp = [c.seq for c in checkpoints if c.seq <= until + 1]
        assert b.from_checkpoint == (cp[-1] if cp else None)
        assert b.events == until + 1 - (cp[-1] if cp else 0)


def test_invariant_modes(logfile):
    p = logfile[0]
    every = replay_log(p, invariants="steps")
    end = replay_log(p, invariants="end")
    none = replay_log(p, invariants="none")
    assert every.invariant_checks == every.steps_sealed + 1
    assert end.invariant_checks == 1 and none.invariant_checks == 0
    assert every.digest == end.digest == none.digest
    with pytest.raises(InvalidArgumentError):
        replay_log(p, invariants="sometimes")


def _hand_written(events, *, checkpoint=None) -> tuple[SimulatedDisk, str]:
    """A log whose events were never validated (EventLog takes whatever it is given)."""
    disk = SimulatedDisk()
    log = EventLog.create("h", G, layer=disk)
    for i, ev in enumerate(events):
        if checkpoint is not None and i == checkpoint[0]:
            log.checkpoint(i, checkpoint[1], b"")
        log.append(i, ev)
    log.close()
    return disk, "h"


G = Geometry(num_pages=8, page_tokens=4)
SCENARIO = [
    CacheConfigured(geometry=G),
    SnapshotAliased(snapshot=1, page_ids=(0, 1)),
    SnapshotReleased(snapshot=1),
    PagesReserved(request=5, page_ids=(0, 1)),
    PagesCommitted(request=5, step=0, page_ids=(0, 1)),
]


def test_a_recorded_plan_that_differs_is_a_mismatch():
    disk, path = _hand_written(SCENARIO + [StepSealed(step=0, clear_list=(1,))])
    s = replay_log(path, layer=disk)
    assert s.error is not None
    assert not s.ok and s.error.kind == "mismatch" and s.error.seq == 5 and exit_code(s) == 1
    assert "recorded clear list [1]" in s.error.message
    ok, path2 = _hand_written(SCENARIO + [StepSealed(step=0, clear_list=(0, 1))])
    assert replay_log(path2, layer=ok).ok


def test_an_event_the_fold_rejects_is_reported():
    disk, path = _hand_written(SCENARIO + [RequestFinished(request=6)])
    s = replay_log(path, layer=disk)
    assert s.error is not None
    assert s.error.kind == "rejected" and s.error.seq == 5 and s.error.error == "UnknownRequestError"
    assert s.events == 5 and exit_code(s) == 1


def test_a_checkpoint_whose_digest_differs_is_a_mismatch():
    disk, path = _hand_written(SCENARIO + [StepSealed(step=0, clear_list=(0, 1))], checkpoint=(3, "0" * 64))
    s = replay_log(path, layer=disk)
    assert s.error is not None
    assert s.error.kind == "mismatch" and s.error.seq == 3 and "checkpoint" in s.error.message


def test_torn_tail_is_reported_not_failed_and_corruption_is(logfile, tmp_path):
    p, events, digest, seq, _ = logfile
    data = p.read_bytes()
    torn = tmp_path / "torn.kvlog"
    torn.write_bytes(data + b"\x00" * 100)
    s = replay_log(torn)
    assert s.ok and s.torn_at == len(data) and s.torn_bytes == 100 and s.digest == digest
    bad = bytearray(data)
    bad[200] ^= 0x10
    (tmp_path / "bad.kvlog").write_bytes(bytes(bad))
    s = replay_log(tmp_path / "bad.kvlog")
    assert s.error is not None
    assert s.error.kind == "corrupt" and exit_code(s) == 3 and s.error.offset is not None
    assert "FAILED (corrupt" in render(s)
