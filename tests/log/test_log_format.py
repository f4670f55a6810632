"""The event log's format and the EventLog writer: golden bytes, scan, policies, failures."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import msgspec
import pytest

from kvledger import CorruptLogError, Geometry, InvalidArgumentError, LogError, TornLogError
from kvledger.core.log.format import (
    HEADER_SIZE,
    KIND_CHECKPOINT,
    KIND_CLOSE,
    KIND_EVENTS,
    max_record_bytes,
)
from kvledger.core.log.scan import scan
from kvledger.core.errors import LogVersionError
from kvledger.core.events.events import (
    CacheConfigured,
    PagesReserved,
    StepAborted,
    StepSealed,
)
from kvledger.core.log import EventLog, open_view
from support.simdisk import FaultInjector, SimulatedDisk
from kvledger.core.errors import (
    LogClosedError,
    LogExistsError,
    LogIOError,
    LogLockedError,
    RecordTooLargeError,
)

G = Geometry(num_pages=4096, page_tokens=16)
LOG_ID = bytes(range(16))
CC = CacheConfigured(geometry=G)

GOLDEN_HEADER = (
    "894b564c4f470d0a01004000000102030405060708090a0b0c0d0e0f0010000000000000100000000000000072656c65617365645f61"
    "6c69617365734edd46b3"
)
GOLDEN_RECORD = (
    "4b5201007e0000000000000000000000020000004000000000000000dd0000000283a474797065b063616368655f636f6e66696775726564"
    "a867656f6d6574727982a96e756d5f7061676573cd1000ab706167655f746f6b656e7310a6706f6c696379b072656c65617365645f616c"
    "696173657383a474797065ab737465705f7365616c6564a47374657000aa636c6561725f6c697374920301eeb5e8cef287d6f04c6cdc07"
)


def _chain(log_id: bytes, data: bytes) -> bytes:
    """The documented chain: BLAKE2b-64 keyed with the log id over every byte before the field."""
    return hashlib.blake2b(data, digest_size=8, key=log_id, person=b"kvledger-log-v1").digest()


def test_golden_bytes_header_and_first_record(tmp_path):
    p = tmp_path / "g.kvlog"
    log = EventLog.create(p, G, log_id=LOG_ID, fsync="per_step")
    log.append(0, CC)
    log.append(1, StepSealed(step=0, clear_list=(3, 1)))  # per_step: this append writes and fsyncs
    assert log.durable_seq == 1
    data = p.read_bytes()
    assert data.hex() == GOLDEN_HEADER + GOLDEN_RECORD
    # The layout, re-derived from the module docstring with struct/zlib/hashlib alone.
    assert data[:8] == b"\x89KVLOG\r\n"
    version, hsize = struct.unpack_from("<HH", data, 8)
    assert (version, hsize) == (1, 64) and data[12:28] == LOG_ID
    assert struct.unpack_from("<QQ", data, 28) == (4096, 16) and data[44:60].rstrip(b"\0") == b"released_aliases"
    assert struct.unpack_from("<I", data, 60)[0] == zlib.crc32(data[:60])
    off = HEADER_SIZE
    magic, kind, flags, n, seq, count, synced = struct.unpack_from("<2sBBIQIQ", data, off)
    assert (magic, kind, flags, seq, count, synced) == (b"KR", KIND_EVENTS, 0, 0, 2, 64)
    payload = data[off + 28 : off + 28 + n]
    assert payload[:5] == b"\xdd" + struct.pack(">I", 2)
    assert msgspec.msgpack.decode(payload) == [
        {"type": "cache_configured", "geometry": {"num_pages": 4096, "page_tokens": 16}, "policy": "released_aliases"},
        {"type": "step_sealed", "step": 0, "clear_list": [3, 1]},
    ]
    cpos = off + 28 + n
    assert data[cpos : cpos + 8] == _chain(LOG_ID, data[:cpos])
    assert struct.unpack_from("<I", data, cpos + 8)[0] == zlib.crc32(data[off : cpos + 8])
    # close appends a close record claiming the whole file synced
    log.close()
    data2 = p.read_bytes()
    end = cpos + 12
    assert data2[:end] == data
    magic, kind, flags, n, seq, count, synced = struct.unpack_from("<2sBBIQIQ", data2, end)
    assert (kind, n, seq, count, synced) == (KIND_CLOSE, 0, 2, 0, end)
    assert data2[end + 28 : end + 36] == _chain(LOG_ID, data2[: end + 28])
    assert len(data2) == end + 40


def test_round_trip_and_scan_of_a_valid_log(tmp_path):
    p = tmp_path / "rt.kvlog"
    events = [CC] + [PagesReserved(request=i, page_ids=(i, i + 100), tenant=f"t{i}") for i in range(50)]
    events += [StepSealed(step=0), StepAborted(step=0, reason="x" * 100)]
    with EventLog.create(p, G) as log:
        for i, ev in enumerate(events):
            log.append(i, ev)
        log.checkpoint(len(events), "d" * 64, b"state bytes")
        assert log.seq == len(events)
    with open_view(p) as v:
        sc = v.scan
        assert sc.error is None and sc.torn_at is None and sc.closed
        assert [r.kind for r in sc.records] == [KIND_EVENTS, KIND_EVENTS, KIND_CHECKPOINT, KIND_CLOSE]
        got = [ev for _, ev, _ in v.iter_events()]
        assert got == events
        cp = v.checkpoint(sc.records[2])
        assert (cp.seq, cp.digest, cp.state) == (len(events), "d" * 64, b"state bytes")
        assert sc.next_seq == len(events) and sc.end == os.path.getsize(p)
        assert [seq for seq, _, _ in v.iter_events(until=10)] == list(range(11))


@pytest.mark.parametrize("fsync,expect_durable", [("per_step", [-1, -1, 2, 2]), ("per_event", [0, 1, 2, 3]),
                                                    ("none", [-1, -1, -1, -1])])
def test_fsync_policies_and_durable_seq(tmp_path, fsync, expect_durable):
    disk = SimulatedDisk()
    log = EventLog.create("a", G, fsync=fsync, layer=disk)
    evs = [CC, PagesReserved(request=1, page_ids=(0,)), StepSealed(step=0), PagesReserved(request=2, page_ids=(1,))]
    got = []
    for i, ev in enumerate(evs):
        log.append(i, ev)
        got.append(log.durable_seq)
    assert got == expect_durable
    # what a crash keeps is exactly what was synced
    synced = scan(disk.durable_bytes("a"), "a")
    assert synced.next_seq == got[-1] + 1
    log.sync()
    assert log.durable_seq == 3 and scan(disk.durable_bytes("a")).next_seq == 4
    stats = log.statistics()
    assert stats.events == 4 and stats.appended == 4 and stats.durable_seq == 3
    log.close()


def test_append_checks_seq_and_type_and_size(tmp_path):
    log = EventLog.create(tmp_path / "c.kvlog", G)
    with pytest.raises(LogError, match="expects seq 0"):
        log.append(1, CC)
    with pytest.raises(InvalidArgumentError):
        log.append(0, "not an event")
    log.append(0, CC)
    with pytest.raises(RecordTooLargeError):
        log.append(1, StepAborted(step=0, reason="x" * (2 << 20)))
    assert log.seq == 1  # nothing changed
    log.append(1, StepSealed(step=0))
    with pytest.raises(LogError, match="checkpoint at seq 5"):
        log.checkpoint(5, "", b"")
    log.close()
    with pytest.raises(LogClosedError):
        log.append(2, StepSealed(step=1))
    with open_view(tmp_path / "c.kvlog") as v:
        assert [ev for _, ev, _ in v.iter_events()] == [CC, StepSealed(step=0)]


def test_create_refuses_an_existing_path_and_a_second_writer(tmp_path):
    p = tmp_path / "x.kvlog"
    log = EventLog.create(p, G)
    with pytest.raises(LogExistsError):
        EventLog.create(p, G)
    with pytest.raises(LogLockedError):
        EventLog.open(p)
    log.close()
    again = EventLog.open(p)  # the lock went with close
    again.close()
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]  # no temp file left behind


def test_header_problems(tmp_path):
    p = tmp_path / "h.kvlog"
    EventLog.create(p, G).close()
    data = bytearray(p.read_bytes())
    for mutate, err in [
        (lambda d: d.__setitem__(0, 0x00), "bad magic"),
        (lambda d: d.__setitem__(30, d[30] ^ 1), "header checksum"),
    ]:
        d = bytearray(data)
        mutate(d)
        with pytest.raises(CorruptLogError, match=err) as ei:
            scan(bytes(d), "h")
        assert ei.value.offset == 0
    d = bytearray(data)
    d[8] = 3  # version 3 (a future format), with a consistent crc
    d[60:64] = struct.pack("<I", zlib.crc32(bytes(d[:60])))
    with pytest.raises(LogVersionError):
        scan(bytes(d))
    with pytest.raises(CorruptLogError, match="shorter than the log header"):
        scan(b"\x89KV")
    with pytest.raises(LogError, match="no such log"):
        open_view(tmp_path / "missing")


def test_torn_tail_repair_and_refusal(tmp_path):
    p = tmp_path / "t.kvlog"
    with EventLog.create(p, G) as log:
        log.append(0, CC)
        log.append(1, StepSealed(step=0))
        log.append(2, StepSealed(step=1))
    whole = p.read_bytes()
    cut = len(whole) - 40 - 7  # inside the last events record (before the close record)
    p.write_bytes(whole[:cut])
    # the log was closed: its sync stamp proves those bytes were synced, so this is loss, not a torn tail
    with pytest.raises(CorruptLogError, match="synced events were lost"):
        EventLog.open(p)
    assert p.read_bytes() == whole[:cut]
    os.unlink(f"{p}.sync")  # as if the writer had crashed before it closed the log
    with pytest.raises(TornLogError) as ei:
        EventLog.open(p, repair=False)
    assert ei.value.nbytes > 0 and p.read_bytes() == whole[:cut]
    log = EventLog.open(p)
    assert log.recovery.torn_at is not None and log.recovery.torn_bytes == cut - log.recovery.torn_at
    assert log.seq == 2  # seq 2 was in the torn record
    log.append(2, StepSealed(step=1))
    log.close()
    with open_view(p) as v:
        assert v.scan.closed and v.scan.next_seq == 3


def test_a_garbage_length_reads_nothing_and_is_tail_damage():
    disk = SimulatedDisk()
    with EventLog.create("a", G, layer=disk) as log:
        log.append(0, CC)
        log.sync()
    data = disk.read("a")
    bogus = struct.pack("<2sBBIQIQ", b"KR", KIND_EVENTS, 0, 0xFFFFFFF0, 1, 1, 64) + b"\0" * 64
    sc = scan(data + bogus)
    assert sc.torn_at == len(data) and sc.error is None
    assert max_record_bytes(G.num_pages) < 0xFFFFFFF0


def test_io_failures_close_the_log_to_appends(tmp_path):
    faults = FaultInjector(fail_sync=2)  # sync 1 is the explicit sync after CacheConfigured
    log = EventLog.create(tmp_path / "f.kvlog", G, layer=faults, fsync="per_step")
    log.append(0, CC)
    log.sync()
    log.append(1, PagesReserved(request=1, page_ids=(0,)))
    with pytest.raises(LogIOError) as ei:
        log.append(2, StepSealed(step=0))
    assert ei.value.op == "fsync" and ei.value.errno is not None
    assert log.durable_seq == 0 and log.failed
    with pytest.raises(LogClosedError, match="reopen"):
        log.append(3, StepSealed(step=1))
    with pytest.raises(LogClosedError):
        log.sync()
    log.close()  # releases the file, writes nothing
    again = EventLog.open(tmp_path / "f.kvlog")
    assert again.seq >= 1  # at least what was durable
    again.close()


def test_background_writer_groups_fsyncs_and_reports_durability(tmp_path):
    p = tmp_path / "b.kvlog"
    log = EventLog.create(p, G, background=True)
    log.append(0, CC)
    seq = 1
    for step in range(200):
        log.append(seq, PagesReserved(request=step, page_ids=(step,)))
        log.append(seq + 1, StepSealed(step=step))
        seq += 2
    assert log.wait_durable(seq - 1, timeout=30)
    assert log.durable_seq == seq - 1
    stats = log.statistics()
    print(f"background writer: {stats.records} records, {stats.syncs} fsyncs for 200 sealed steps")
    assert 1 <= stats.syncs <= 201
    log.close()
    with open_view(p) as v:
        assert v.scan.closed and v.scan.next_seq == seq


def test_background_failures_surface(tmp_path):
    # a failed write happens in the thread too: the next call reports it
    log = EventLog.create(tmp_path / "bw.kvlog", G, background=True, layer=FaultInjector(fail_write=2))
    log.append(0, CC)
    log.sync()  # write 1
    log.append(1, StepSealed(step=0))  # write 2 fails in the thread
    with pytest.raises(LogIOError) as ei:
        log.wait_durable(1, timeout=30)
    assert ei.value.op == "write" and log.durable_seq == 0
    with pytest.raises(LogClosedError):
        log.append(2, StepSealed(step=1))
    log.close()
    # a failed fsync happens in the thread: the next call reports it, nothing after it is durable
    log = EventLog.create(tmp_path / "bs.kvlog", G, background=True, layer=FaultInjector(fail_sync=2))
    log.append(0, CC)
    log.sync()  # fsync 1
    log.append(1, StepSealed(step=0))  # fsync 2 fails in the thread
    with pytest.raises(LogIOError) as ei:
        log.wait_durable(1, timeout=30)
    assert ei.value.op == "fsync" and log.durable_seq == 0
    with pytest.raises(LogClosedError):
        log.append(2, StepSealed(step=1))
    log.close()
    # waiting for an event that is still in an open batch answers False at once
    log = EventLog.create(tmp_path / "bo.kvlog", G, background=True)
    log.append(0, CC)
    assert log.wait_durable(0, timeout=0.01) is False
    log.sync()
    assert log.wait_durable(0) is True
    log.close()
