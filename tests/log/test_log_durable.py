"""DurableLedger: write-through, reopen to the same digest, recovery reports, failures, logging."""

from __future__ import annotations

import msgspec
import pytest
import structlog

from support import QUIET
from kvledger import (
    ConfigurationError,
    CorruptLogError,
    Geometry,
    Ledger,
    LedgerState,
    PageNotHeldError,
    replay,
)
from kvledger.options import LogOptions
from kvledger.core.log.format import KIND_CHECKPOINT, Checkpoint
from kvledger.core.log import open_view
from support.simdisk import FaultInjector, SimulatedDisk
from kvledger.core.errors import LogClosedError, LogIOError, LogLockedError
from kvledger.durable import DurableLedger, open_ledger
from kvledger.core.log.fold import state_from_checkpoint

from support.workload import GEOMETRY, drive

import logging



def test_create_write_through_reopen_same_digest(tmp_path):
    p = tmp_path / "d.kvlog"
    with open_ledger(p, GEOMETRY, check=True, logger=QUIET, log_options=LogOptions(checkpoint_every=100)) as led:
        assert isinstance(led, DurableLedger) and isinstance(led, Ledger)
        assert led.recovery.created and led.durable_seq == 0
        drive(led, "w", 30, ranks=2)
        digest, seq = led.digest(), led.seq
        led.flush()  # the default writer thread catches up; flush waits for it
        assert led.durable_seq == seq - 1
    assert led.log.closed
    with open_view(p) as v:
        events = [ev for _, ev, _ in v.iter_events()]
    assert len(events) == seq and replay(events).digest() == digest
    with open_ledger(p, logger=QUIET) as again:
        rec = again.recovery
        print(f"reopen: {rec.events} events, checkpoint at {rec.checkpoint_seq}, folded {rec.folded}")
        assert again.digest() == digest and again.seq == seq
        assert not rec.created and rec.closed_cleanly and rec.truncated_at is None
        assert rec.checkpoint_seq == seq and rec.folded == 0  # close wrote a final checkpoint
        drive(again, "w", 10, ranks=2)  # and it continues
        d2, s2 = again.digest(), again.seq
    with open_ledger(p, logger=QUIET, log_options=LogOptions(checkpoint_every=None)) as third:
        assert third.digest() == d2 and third.seq == s2


def test_reopen_without_checkpoints_folds_everything(tmp_path):
    p = tmp_path / "nc.kvlog"
    led = open_ledger(p, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=None))
    drive(led, "nc", 20)
    digest, seq = led.digest(), led.seq
    led.sync()
    led.log.abandon()  # like a crash after the last sync: no close record, no checkpoint
    again = open_ledger(p, logger=QUIET)
    assert again.recovery.checkpoint_seq is None and again.recovery.folded == seq
    assert not again.recovery.closed_cleanly and again.digest() == digest
    again.close()


def test_checkpoints_are_taken_on_the_hot_command_paths(tmp_path):
    p = tmp_path / "cp.kvlog"
    with open_ledger(p, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=25)) as led:
        for step in range(40):  # only reserve / commit / finish / seal: the fast command paths
            led.reserve(step, 2)
            led.commit(step, step, 2)
            led.finish(step)
            led.seal_step(step)
        n_events = led.seq
    with open_view(p) as v:
        cps = [r for r in v.records if r.kind == KIND_CHECKPOINT]
        for r in cps:
            st = state_from_checkpoint(v.checkpoint(r), v.header, path=str(p), offset=r.offset)
            events = [ev for seq, ev, _ in v.iter_events(until=r.seq - 1)]
            assert st.digest() == replay(events).digest()
    print(f"checkpoints: {len(cps)} for {n_events} events (every 25 + one at close)")
    assert len(cps) == n_events // 25 + 1


def test_a_rejected_command_writes_nothing(tmp_path):
    p = tmp_path / "r.kvlog"
    with open_ledger(p, GEOMETRY, logger=QUIET) as led:
        led.reserve(1, 2)
        before = (led.seq, led.log.seq, led.digest())
        with pytest.raises(PageNotHeldError):
            led.commit(1, 0, pages=[40])
        assert (led.seq, led.log.seq, led.digest()) == before


def _events(caplog) -> list[dict]:
    """kvledger's events as stdlib logging captured them (each record's msg is the event dict)."""
    return [{**r.msg, "log_level": r.levelname.lower()} for r in caplog.records if r.name.startswith("kvledger")]


def test_a_failed_write_fails_the_command_and_leaves_state_unchanged(tmp_path, caplog):
    faults = FaultInjector(fail_sync=3)  # 1: create's sync, 2: first seal, 3: second seal
    led = open_ledger(tmp_path / "w.kvlog", GEOMETRY, log_options=LogOptions(layer=faults, fsync="per_step"))
    led.reserve(1, 2)
    led.commit(1, 0, 2)
    led.seal_step(0)
    led.reserve(2, 1)
    before = led.digest()
    seq = led.seq
    with caplog.at_level(logging.DEBUG, logger="kvledger"), pytest.raises(LogIOError):
        led.seal_step(1)
    logs = _events(caplog)
    assert led.digest() == before and led.seq == seq and led.open_step == 1
    assert any(e["event"] == "log_write_failed" and e["op"] == "fsync" for e in logs)
    with pytest.raises(LogClosedError):
        led.reserve(3, 1)  # the log takes nothing more
    assert led.digest() == before
    led.close()
    again = open_ledger(tmp_path / "w.kvlog")
    assert again.seq >= 4 + 1  # everything durable before the failure is there
    again.close()


def test_open_refuses_mismatches_and_missing_geometry(tmp_path):
    p = tmp_path / "m.kvlog"
    with pytest.raises(ConfigurationError, match="give a geometry"):
        open_ledger(p)
    open_ledger(p, GEOMETRY, policy="cross_tenant").close()
    with pytest.raises(ConfigurationError, match="geometry"):
        open_ledger(p, Geometry(num_pages=65, page_tokens=16))
    with pytest.raises(ConfigurationError, match="cross_tenant"):
        open_ledger(p, policy="all_reused")
    with open_ledger(p, GEOMETRY, policy="cross_tenant") as led:
        assert led.state.policy == "cross_tenant"
        with pytest.raises(LogLockedError):
            open_ledger(p)


def test_log_truncated_is_reported_and_logged(tmp_path, caplog):
    p = tmp_path / "tt.kvlog"
    with open_ledger(p, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=None)) as led:
        drive(led, "tt", 5)
    data = p.read_bytes()
    p.write_bytes(data + b"\x00" * 700)  # a crash left zeroed sectors at the end
    with caplog.at_level(logging.INFO, logger="kvledger"):
        led = open_ledger(p)
    logs = _events(caplog)
    rec = led.recovery
    assert rec.truncated_at == len(data) and rec.truncated_bytes == 700
    trunc = [e for e in logs if e["event"] == "log_truncated"]
    assert trunc and trunc[0]["offset"] == len(data) and trunc[0]["bytes"] == 700 and trunc[0]["log_level"] == "warning"
    assert [e["event"] for e in logs][-1] == "log_opened"
    led.close()
    assert p.stat().st_size > len(data)  # appended after the truncation point


def test_debug_events_follow_the_logger_level(tmp_path, caplog):
    p = tmp_path / "dbg.kvlog"
    with caplog.at_level(logging.DEBUG, logger="kvledger"), \
            open_ledger(p, GEOMETRY, log_options=LogOptions(fsync="per_step")) as led:
        pages = led.alias_snapshot(1, 2)
        led.release_snapshot(1)
        led.reserve(1, 2)
        led.commit(1, 0, 2)
        led.seal_step(0)
    logs = _events(caplog)
    names = [e["event"] for e in logs]
    assert names[0] == "log_created" and names[-1] == "log_closed"
    committed = [e for e in logs if e["event"] == "pages_committed"]
    assert committed and sorted(committed[0]["listed"]) == sorted(pages)
    sealed = [e for e in logs if e["event"] == "step_sealed"]
    assert sealed and sealed[0]["cleared"] == 2 and sealed[0]["durable_seq"] == sealed[0]["seq"]
    quiet = structlog.wrap_logger(structlog.testing.CapturingLogger(),
                                  wrapper_class=structlog.make_filtering_bound_logger(30))
    with open_ledger(tmp_path / "q.kvlog", GEOMETRY, logger=quiet) as led:
        assert led._debug is False
    with open_ledger(tmp_path / "u.kvlog", GEOMETRY) as led:  # the kvledger logger left unconfigured
        assert led._debug is False


def test_corrupt_checkpoint_is_refused(tmp_path):
    p = tmp_path / "c.kvlog"
    with open_ledger(p, GEOMETRY, logger=QUIET) as led:
        drive(led, "c", 5)
    with open_view(p) as v:
        rec = [r for r in v.records if r.kind == KIND_CHECKPOINT][-1]
        cp = v.checkpoint(rec)
        header = v.header
    good = state_from_checkpoint(cp, header)
    assert isinstance(good, LedgerState)
    canon = msgspec.msgpack.decode(cp.state)
    bad_cases = [
        Checkpoint(seq=cp.seq, digest="0" * 64, state=cp.state),  # digest mismatch
        Checkpoint(seq=cp.seq, digest=cp.digest, state=b"\xc1"),  # not msgpack
        Checkpoint(seq=cp.seq, digest=cp.digest, state=msgspec.msgpack.encode([1, 2])),
        Checkpoint(seq=cp.seq, digest=cp.digest, state=msgspec.msgpack.encode({**canon, "geometry": [1 << 40, 16]})),
        Checkpoint(seq=cp.seq, digest=cp.digest, state=msgspec.msgpack.encode({**canon, "owner": "abc"})),
        Checkpoint(seq=cp.seq, digest=cp.digest, state=msgspec.msgpack.encode({**canon, "free_stack": [10 ** 6]})),
        Checkpoint(seq=cp.seq, digest=cp.digest,
                   state=msgspec.msgpack.encode({k: v for k, v in canon.items() if k != "owner"})),
    ]
    for bad in bad_cases:
        with pytest.raises(CorruptLogError) as ei:
            state_from_checkpoint(bad, header, offset=rec.offset)
        assert ei.value.offset == rec.offset and ei.value.seq == cp.seq


def test_simulated_disk_layer_round_trip():
    disk = SimulatedDisk()
    with open_ledger("x", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=disk)) as led:
        drive(led, "sim", 10)
        digest = led.digest()
    with open_ledger("x", logger=QUIET, log_options=LogOptions(layer=disk)) as again:
        assert again.digest() == digest


def test_check_mode_runs_every_invariant_and_changes_no_digest(tmp_path):
    with open_ledger(tmp_path / "plain.kvlog", GEOMETRY, logger=QUIET) as plain:
        drive(plain, "chk", 6)
        want = (plain.seq, plain.digest())
    with open_ledger(tmp_path / "chk.kvlog", GEOMETRY, check=True, logger=QUIET) as led:
        assert led.check
        drive(led, "chk", 6)  # every invariant after every command
        assert (led.seq, led.digest()) == want
    with open_ledger(tmp_path / "chk.kvlog", logger=QUIET) as again:
        assert (again.seq, again.digest()) == want
        assert not again.check


def test_checkpoint_digest_is_the_state_digest(tmp_path):
    led = open_ledger(tmp_path / "cd.kvlog", GEOMETRY, logger=QUIET)
    drive(led, "cd", 8)
    seq, digest, state = led._checkpoint_state()
    assert seq == led.seq and digest == led.digest() and state == led.state.canonical_bytes()
    led.close()
