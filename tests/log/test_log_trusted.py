"""The trusted fold (``fold_records(..., trusted=True)``): the same states as the checked fold, faster,
still refusing events out of bounds (page ids, step numbers, recorded plans) and logs whose recorded
checkpoints or invariants disagree with what it folded; and forged logs against every reader (F2, F3).

``KVLEDGER_HYPOTHESIS=heavy`` forges 3,000 logs instead of 1,000."""

from __future__ import annotations

import hashlib
import random
import struct
import zlib

import msgspec
import pytest

from support import HEAVY, QUIET
from kvledger import CLEAR_POLICIES, CorruptLogError, KVLedgerError, replay
from kvledger.options import LogOptions
from kvledger.core.log import open_view
from support.simdisk import SimulatedDisk
from kvledger.core.log.fold import fold_records, rebuild_state, start_state
from kvledger.core.log.format import HEADER_SIZE, KIND_CHECKPOINT, KIND_EVENTS, PREFIX
from kvledger.core.state import LedgerState
from kvledger.durable import open_ledger

from support.workload import GEOMETRY, drive



def _log(seed: str, policy: str = "released_aliases", steps: int = 20, every: int = 37) -> tuple[bytes, str, int]:
    disk = SimulatedDisk()
    with open_ledger("t", GEOMETRY, policy=policy, logger=QUIET,
                     log_options=LogOptions(layer=disk, checkpoint_every=every)) as led:
        drive(led, seed, steps, ranks=2, tenants=3)
        digest, seq = led.digest(), led.seq
    return disk.read("t"), digest, seq


def _view(data: bytes):
    disk = SimulatedDisk()
    disk.put("t", data)
    return open_view("t", layer=disk)


def test_trusted_and_checked_folds_agree():
    streams = 0
    for i in range(60):
        data, digest, seq = _log(f"tr-{i}", CLEAR_POLICIES[i % 3], steps=5 + i % 17)
        for from_checkpoint in (False, True):
            with _view(data) as v:
                st, start, _ = start_state(v) if from_checkpoint else (LedgerState(), 0, None)
                seen: list[int] = []
                n = fold_records(v, st, start, trusted=True, verify_gap=0, on_event=lambda q, ev, s=seen: s.append(q))
                assert seen == list(range(st.seq - n, st.seq))
                assert st.digest() == digest and st.seq == seq and n == seq - (start and v.records[start - 1].seq)
                st2, _, _ = rebuild_state(v, from_checkpoint=from_checkpoint, trusted=False)
                assert st2.digest() == digest
        streams += 1
    print(f"trusted fold: {streams} streams x (from seq 0, from the last checkpoint) agree with the checked fold")


def _rechain(data: bytes) -> bytes:
    """Recompute every record's chain and CRC (whoever can rewrite the whole file can do this)."""
    log_id = data[12:28]
    out = bytearray(data[:HEADER_SIZE])
    off = HEADER_SIZE
    while off < len(data):
        n = PREFIX.unpack_from(data, off)[3]
        body = data[off : off + 28 + n]
        chain = hashlib.blake2b(bytes(out) + body, digest_size=8, key=log_id, person=b"kvledger-log-v1").digest()
        out += body + chain + struct.pack("<I", zlib.crc32(body + chain))
        off += 40 + n
    return bytes(out)


def _edit_one_event(data: bytes, rng: random.Random, what: str) -> tuple[bytes, int]:
    """Change a page id (or the tenant: a consistent state, only the digest differs) of one
    reservation before the last checkpoint; chain and CRCs forged."""
    recs = []
    off = HEADER_SIZE
    while off < len(data):
        _, kind, _, n, seq, count, _ = PREFIX.unpack_from(data, off)
        recs.append((off, kind, n, seq, count))
        off += 40 + n
    last_cp = max(r[3] for r in recs if r[1] == KIND_CHECKPOINT)
    first: set[tuple[int, int]] = set()  # (seq of the record, index): a request's first reservation
    known: set[int] = set()
    for off, kind, n, seq, _ in recs:
        if kind == KIND_EVENTS:
            for j, it in enumerate(msgspec.msgpack.decode(data[off + 28 : off + 28 + n])):
                if it["type"] == "pages_reserved" and it["request"] not in known:
                    first.add((seq, j))
                known.update([it["request"]] if "request" in it else [])
    for off, kind, n, seq, count in rng.sample(recs, len(recs)):
        if kind != KIND_EVENTS or seq + count > last_cp or seq == 0:
            continue
        items = msgspec.msgpack.decode(data[off + 28 : off + 28 + n])
        for j, it in enumerate(items):
            if it["type"] == "pages_reserved" and (what == "page" or (seq, j) in first):
                if what == "page":
                    it["page_ids"][0] = (it["page_ids"][0] + 1) % GEOMETRY.num_pages
                else:
                    it["tenant"] = f"{it['tenant']}-forged"
                enc = msgspec.msgpack.Encoder()
                payload = b"\xdd" + struct.pack(">I", len(items)) + b"".join(enc.encode(x) for x in items)
                head = bytearray(data[off : off + 28])
                struct.pack_into("<I", head, 4, len(payload))
                bad = data[:off] + bytes(head) + payload + bytes(12) + data[off + 40 + n :]
                return _rechain(bad), seq + j
    raise AssertionError("no reservation to edit")


def test_trusted_fold_refuses_a_forged_log_it_cannot_apply_or_whose_checkpoint_disagrees():
    """Mutant killed: the digest comparison in ``fold._Verifier`` skipped (forged logs fold silently)."""
    rng = random.Random(12)
    cases = refused = neutral = silent = 0
    for i in range(40):
        data, digest, _ = _log(f"forge-{i}", steps=25, every=23)
        bad, seq = _edit_one_event(data, rng, "page" if i % 2 else "tenant")
        with _view(bad) as v:
            assert v.scan.error is None  # the chain was forged: only the fold can tell
            cases += 1
            st = LedgerState()
            try:
                fold_records(v, st, 0, trusted=True, verify_gap=0)
            except CorruptLogError:
                refused += 1
                continue
        # not refused: only an edit that left no trace in any state the log recorded (a tenant of a
        # request that finished before the next checkpoint) may pass, and the result is the recorded state
        if st.digest() == digest:
            neutral += 1
        else:
            silent += 1
    print(f"trusted fold on forged logs (a page id or a tenant edited, chain and CRCs recomputed): {cases} cases, "
          f"{refused} refused, {neutral} edits that changed no recorded state, {silent} silently different states")
    assert silent == 0 and refused >= cases * 3 // 4


def test_reopen_folds_the_tail_checked_to_the_same_digest(tmp_path):
    p = tmp_path / "r.kvlog"
    with open_ledger(p, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=None)) as led:
        drive(led, "re", 30)
        digest = led.digest()
    with open_view(p) as v:
        events = [ev for _, ev, _ in v.iter_events()]
    assert replay(events).digest() == digest
    with open_ledger(p, logger=QUIET) as again:
        assert again.digest() == digest and again.recovery.folded == len(events)


# ---------------------------------------------------------------------- F2: forged impossible events


FORGED = 3000 if HEAVY else 1000


def _records_of(data: bytes) -> list[tuple[int, int, int, int, int]]:
    out, off = [], HEADER_SIZE
    while off < len(data):
        _, kind, _, n, seq, count, _ = PREFIX.unpack_from(data, off)
        out.append((off, kind, n, seq, count))
        off += 40 + n
    return out


def _mutate_event(items: list, j: int, rng: random.Random, ids: dict) -> str | None:
    """Change event ``j`` of a decoded events record one way; the name of the way (None: none applies)."""
    it = items[j]
    ways = [w for w, ok in (("page", bool(it.get("page_ids"))), ("step", "step" in it), ("rank", "rank" in it),
                            ("request", "request" in it), ("snapshot", "snapshot" in it), ("target", "target" in it),
                            ("clear_list", it.get("type") == "step_sealed"), ("drop", True), ("duplicate", True),
                            ("swap", j + 1 < len(items)), ("type", it.get("type") in _RETYPE)) if ok]
    way = rng.choice(ways)
    n = GEOMETRY.num_pages
    if way == "page":
        k = rng.randrange(len(it["page_ids"]))
        it["page_ids"][k] = rng.choice([-2, -1, n, n + 7, rng.randrange(n), it["page_ids"][0], it["page_ids"][-1]])
    elif way in ("step", "rank"):
        it[way] = max(0, it[way] + rng.choice([-2, -1, 1, 2, 1000]))
    elif way in ("request", "snapshot", "target"):
        pool = ids["snapshot" if way == "snapshot" or it.get("into") == "snapshot" else "request"]
        it[way] = rng.choice(sorted(pool)) if pool and rng.random() < 0.7 else it[way] + 1
    elif way == "clear_list":
        cl = it.setdefault("clear_list", [])
        if cl and rng.random() < 0.5:
            cl.pop(rng.randrange(len(cl)))
        else:
            cl.append(rng.randrange(-2, n + 2))
    elif way == "drop":
        del items[j]
    elif way == "duplicate":
        items.insert(j, dict(it))
    elif way == "swap":
        items[j], items[j + 1] = items[j + 1], items[j]
    else:
        it["type"] = _RETYPE[it["type"]]
    return way


_RETYPE = {"request_finished": "request_cancelled", "request_cancelled": "request_finished",
           "restore_started": "restore_completed", "restore_completed": "restore_started",
           "reservation_returned": "pages_reserved"}


def _forge(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One event after the last checkpoint changed (what reopen folds), the record's length and
    count fixed, every chain value and CRC recomputed: only the fold can tell."""
    recs = _records_of(data)
    cps = [r[3] for r in recs if r[1] == KIND_CHECKPOINT]
    after = max(cps) if cps else 1
    ids: dict[str, set] = {"request": set(), "snapshot": set()}
    for off, kind, n, _, _ in recs:
        if kind == KIND_EVENTS:
            for it in msgspec.msgpack.decode(data[off + 28 : off + 28 + n]):
                for f in ("request", "snapshot"):
                    if f in it:
                        ids[f].add(it[f])
    cands = [r for r in recs if r[1] == KIND_EVENTS and r[3] >= after]
    off, _, n, seq, count = rng.choice(cands)
    items = msgspec.msgpack.decode(data[off + 28 : off + 28 + n])
    way = _mutate_event(items, rng.randrange(len(items)), rng, ids)
    if not items:
        return data, ""
    enc = msgspec.msgpack.Encoder()
    payload = b"\xdd" + struct.pack(">I", len(items)) + b"".join(enc.encode(x) for x in items)
    synced = PREFIX.unpack_from(data, off)[6]
    head = PREFIX.pack(b"KR", KIND_EVENTS, 0, len(payload), seq, len(items), synced)
    tail = data[off + 40 + n :]
    # later records move with it: their seqs by the events added or dropped, and their claims of bytes
    # synced past this record by its change in size (else a claim could pass its own record's offset,
    # a forgery that depended on how far the writer thread had synced when the base log was written)
    tail = _shift(tail, len(items) - count, len(payload) - n, past=off)
    return _rechain(data[:off] + head + payload + bytes(12) + tail), way


def _shift(data: bytes, seqs: int, size: int, past: int) -> bytes:
    out, off = bytearray(data), 0
    while off < len(out):
        magic, kind, flags, n, seq, count, synced = PREFIX.unpack_from(out, off)
        synced += size if synced > past else 0
        PREFIX.pack_into(out, off, magic, kind, flags, n, seq + seqs, count, synced)
        if kind == KIND_CHECKPOINT:  # (its payload names the seq too: left as it is, the checkpoint is refused)
            pass
        off += 40 + n
    return bytes(out)


def _refused_by(fn, *args, **kw) -> bool:
    try:
        res = fn(*args, **kw)
    except KVLedgerError:
        return True
    return res.error is not None


def test_f2_f3_forged_events_are_refused():
    """F2: a trusted reopen applied events without their preconditions and accepted impossible states
    (a page id of -2 indexing the page table from its end, a completion of a step never sealed). F3:
    ``replay --trusted`` and ``audit --page`` exited 0 on them. One event of a verified log is forged
    (chain and CRCs recomputed) after its last checkpoint; the checked fold from that checkpoint is the
    oracle, and the class of what it rejects decides what each reader owes:

        every rejection        reopen refuses it (it validates the events after the checkpoint)
        impossible states      page ids outside the geometry, step numbers against the open step and
        (PageOutOfRange,       the steps in flight: replay --trusted and audit --page refuse them too
        StepOrder)             (the trusted fold's bounds checks)
        plans that differ      replay --trusted refuses them (it compares every recorded plan); audit
        (ReplayMismatch)       --page compares its own page's place in each plan (counted)
        the rest               (a page not held, an unknown request: preconditions of the state) replay
                               --trusted skips them by design; counted, with what caught them anyway

    Logs the checked fold accepts reopen to the same digest."""
    from kvledger.core.errors import PageOutOfRangeError, ReplayMismatchError, StepOrderError
    from kvledger.tools.audit import audit_log
    from kvledger.tools.replay import replay_log

    impossible = (PageOutOfRangeError, StepOrderError)
    rng = random.Random(2)
    bases = []
    for i in range(6):
        disk = SimulatedDisk()
        every = None if i % 2 else 60
        led = open_ledger("t", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=disk, checkpoint_every=every))
        drive(led, f"f2-{i}", 30, ranks=2, tenants=3)
        led.sync()
        led.log.abandon()  # (no closing checkpoint: reopen folds the events after the last one)
        disk.remove_stamp("t")
        bases.append(disk.read("t"))
    cases = rejected = reopen_missed = agree = 0
    owed = {"impossible": [0, 0, 0], "plan": [0, 0, 0], "precondition": [0, 0, 0]}  # cases, replay, audit refused
    ways: dict[str, list[int]] = {}
    for k in range(FORGED):
        bad, way = _forge(bases[k % len(bases)], rng)
        if not way:
            continue
        cases += 1
        disk = SimulatedDisk()
        disk.put("t", bad)
        with open_view("t", layer=disk) as v:
            assert v.scan.error is None  # forged: every CRC and chain value matches
            try:
                checked = rebuild_state(v, trusted=False, check=True)[0]
                why = None
            except KVLedgerError as exc:
                checked, why = None, exc.__cause__ or exc
        try:
            led = open_ledger("t", logger=QUIET, log_options=LogOptions(layer=disk, checkpoint_every=None))
        except CorruptLogError:
            reopened = None
        else:
            reopened = led.digest()
            led.log.abandon()
        w = ways.setdefault(way, [0, 0])
        w[0] += 1
        if checked is None:
            rejected += 1
            w[1] += 1
            reopen_missed += reopened is not None
            cls = owed["impossible" if isinstance(why, impossible) else "plan" if isinstance(why, ReplayMismatchError)
                       else "precondition"]
            cls[0] += 1
            cls[1] += _refused_by(replay_log, "t", layer=disk, trusted=True, invariants="none")
            cls[2] += _refused_by(audit_log, "t", layer=disk, page=k % GEOMETRY.num_pages)
        elif reopened == checked.digest():
            agree += 1
    imp, plan, pre = owed["impossible"], owed["plan"], owed["precondition"]
    print(f"F2/F3 forged logs: {cases} (one event changed after the last checkpoint, chain and CRCs forged; "
          + ", ".join(f"{w} {r}/{c}" for w, (c, r) in sorted(ways.items()))
          + f" rejected by the checked fold); rejected {rejected}: reopen accepted {reopen_missed} of them; "
          f"impossible states {imp[0]}: replay --trusted refused {imp[1]}, audit --page refused {imp[2]}; "
          f"recorded plans that differ {plan[0]}: replay --trusted refused {plan[1]}, audit --page (its own page "
          f"only) {plan[2]}; "
          f"broken preconditions {pre[0]}: replay --trusted (invariants none) refused {pre[1]}, audit --page "
          f"{pre[2]} (by design not owed); accepted by both folds with the same digest {agree} of {cases - rejected}")
    assert cases >= FORGED * 9 // 10 and rejected >= cases // 2 and imp[0] >= cases // 10
    assert reopen_missed == 0 and imp[1] == imp[0] and imp[2] == imp[0] and plan[1] == plan[0]
    assert agree == cases - rejected


# ---------------------------------------------------------------------- a forged checkpoint's page ids


def _forge_checkpoint(data: bytes, edit) -> bytes:
    """The log with its last checkpoint's state edited by ``edit(canonical dict)``, its digest made
    right for the new bytes, and every chain and CRC recomputed: only the reader's checks of what the
    state says can refuse it."""
    from kvledger.core.log.format import Checkpoint
    from kvledger.core.state.canonical import digest_of

    off, _, n, _, _ = [r for r in _records_of(data) if r[1] == KIND_CHECKPOINT][-1]
    cp = msgspec.msgpack.decode(data[off + 28 : off + 28 + n], type=Checkpoint)
    canon = msgspec.msgpack.decode(cp.state)
    edit(canon)
    state = msgspec.msgpack.encode(canon)
    payload = msgspec.msgpack.encode(Checkpoint(seq=cp.seq, digest=digest_of(state), state=state))
    head = bytearray(data[off : off + 28])
    struct.pack_into("<I", head, 4, len(payload))
    return _rechain(data[:off] + bytes(head) + payload + bytes(12) + data[off + 40 + n :])


@pytest.mark.parametrize("bad", [GEOMETRY.num_pages, GEOMETRY.num_pages + 1000, -1])
def test_a_checkpoint_naming_a_page_outside_the_geometry_is_corruption_for_every_fold(bad):
    """Found by the heavy profile's log fuzzer (2026-12-02, 883,708th execution of one process): a
    checkpoint whose request listed a page past num_pages passed the trusted start (it skips the
    O(num_pages) invariants), and the fold's final invariant check raised IndexError out of
    ``rebuild_state``. Negative ids indexed from the table's end, silently."""
    disk = SimulatedDisk()  # a log left open (synced, not closed): its last checkpoint is not at its end
    led = open_ledger("t", GEOMETRY, logger=QUIET, log_options=LogOptions(layer=disk, checkpoint_every=23))
    drive(led, "cp-range", 25, ranks=2, tenants=3)
    led.sync()
    led.log.abandon()
    data = disk.read("t")
    with _view(data) as v:
        final = rebuild_state(v, from_checkpoint=False)[0]

    def edit(canon: dict) -> None:
        # a request that finishes after the checkpoint: the fold would release the forged page
        live = [r for r in canon["requests"] if r[3] and r[0] not in final.requests]
        assert live, "no request with KV pages at the last checkpoint that ends after it"
        live[0][3].append(bad)
        for r in canon["kv_steps"]:
            if r[0] == live[0][0]:
                r[1].append(r[1][-1])

    forged = _forge_checkpoint(data, edit)
    for trusted in (True, False):  # a fold that starts at the checkpoint
        with _view(forged) as v:
            assert v.scan.error is None
            with pytest.raises(CorruptLogError, match="outside the geometry"):
                rebuild_state(v, from_checkpoint=True, trusted=trusted)
    # a trusted fold from seq 0 that verifies every checkpoint it passes: its own digest differs
    with _view(forged) as v, pytest.raises(CorruptLogError, match="checkpoint recorded"):
        fold_records(v, LedgerState(), 0, trusted=True, verify_gap=0)
    disk = SimulatedDisk()
    disk.put("t", forged)
    with pytest.raises(CorruptLogError, match="outside the geometry"):
        open_ledger("t", logger=QUIET, log_options=LogOptions(layer=disk))
