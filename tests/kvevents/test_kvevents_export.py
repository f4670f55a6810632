"""``kvledger events`` on log directories: retained ones, any segment, and while retention runs.

Pins: the export of a log directory whose first segments retention deleted, and of
any later segment, starts at the checkpoint that segment opens with (as ``kvledger
replay`` does) and yields exactly the KV events the live run published after it,
tenants' extra keys included (seeded from the checkpoint's requests); the CLI exits
0 on both (cc956ad: "corrupt", exit 3, on every one); exports keep succeeding while
a writer rotates segments and retention deletes them; an ``until`` before the
view's first event is refused, naming it.
"""

from __future__ import annotations

import random
import threading

import msgspec
import pytest

from support import HEAVY, QUIET
from kvledger import Geometry, InvalidArgumentError
from kvledger.options import LogOptions
from kvledger.core.hashing import block_hashes
from kvledger.core.log import OsFileLayer
from kvledger.core.log.segments import list_segments
from kvledger.durable import open_ledger
from kvledger.kvevents import KVEventBatcher, export_log
from kvledger.kvevents.cli import main as events_main

G = Geometry(num_pages=32, page_tokens=4)
SEG = 4096


class LiveEvents:
    """A ledger observer recording the KV events each folded event produced, by seq (a batcher
    flushed after every event: what a live publisher sends, one event at a time)."""

    def __init__(self) -> None:
        self.by_seq: dict[int, tuple] = {}
        self._b = KVEventBatcher(self._keep, auto_flush=False, clock=lambda: 0.0)
        self._seq = -1

    def _keep(self, batch) -> None:
        self.by_seq[self._seq] = batch.events

    def __call__(self, seq: int, event, effects) -> None:
        self._seq = seq
        self._b.observe(seq, event, effects)
        self._b.flush()

    def after(self, first_seq: int) -> list:
        return [e for seq in sorted(self.by_seq) if seq >= first_seq for e in self.by_seq[seq]]


def drive(led, rounds: int, rng: random.Random, state: dict) -> None:
    """Requests of two tenants over a few prompts: publish, share, finish, evict (and evictions
    inside reserve)."""
    T = G.page_tokens
    docs = state.setdefault("docs", [[rng.randrange(50_000) for _ in range(T * rng.randint(2, 4))] for _ in range(4)])
    for _ in range(rounds):
        step = state["step"] = state.get("step", -1) + 1
        r = state["req"] = state.get("req", 0) + 1
        tenant = rng.choice(("acme", "globex"))
        tokens = rng.choice(docs)
        hashes = block_hashes(tokens, T, extra_keys=(tenant,))
        fresh = False
        if led.lookup(hashes, tenant=tenant) == len(hashes):
            led.share(r, hashes, tenant=tenant)
        else:
            try:
                led.reserve(r, len(hashes), tenant=tenant)
            except Exception:  # out of pages: skip this one
                led.seal_step(step)
                led.complete_step(step, 0)
                continue
            led.commit(r, step, len(hashes))
            fresh = True
        led.seal_step(step)
        led.complete_step(step, 0)
        if fresh and all(led.lookup([h]) == 0 for h in hashes):
            led.publish(r, hashes, tokens)
        for q in list(led.state.requests):
            if q != r and rng.random() < 0.5:
                led.finish(q)
        if rng.random() < 0.15 and led.cached_count:
            led.evict(1)


def plain(events) -> list:
    return msgspec.json.decode(msgspec.json.encode(list(events)))


def test_events_reads_a_retained_directory_and_any_of_its_segments(tmp_path, capsys):
    path = str(tmp_path / "live")
    live = LiveEvents()
    rng = random.Random(7)
    state: dict = {}
    with open_ledger(path, G, logger=QUIET, observer=live,
                     log_options=LogOptions(segment_bytes=SEG, retain_segments=3)) as led:
        drive(led, 300, rng, state)
        led.flush()  # rotations and retention run on the writer thread, in order with its rounds
        deleted = led.log.segments_deleted
    segments = list_segments(OsFileLayer(), path)
    assert deleted > 0 and len(segments) >= 2
    for target in (path, segments[1]):  # the directory (from its first kept segment), a later one
        got: list = []
        s = export_log(target, got.append, clock=lambda: 0.0)
        assert s.from_checkpoint is not None and s.first_seq == s.from_checkpoint > 0
        exported = [e for b in got for e in b.events]
        assert plain(exported) == plain(live.after(s.first_seq)) and exported
        keys = {k for e in exported if type(e).__name__ == "BlockStoredMap" and e.extra_keys for k in e.extra_keys}
        assert keys <= {("acme",), ("globex",)} and keys
        assert events_main([target, "-o", str(tmp_path / "out.jsonl")]) == 0
        assert "from the checkpoint at seq" in capsys.readouterr().err
    with pytest.raises(InvalidArgumentError, match="before the first event"):
        export_log(path, lambda b: None, until=0)


def test_exports_keep_succeeding_while_retention_deletes_segments(tmp_path):
    """The probe of issue #19: exports of a directory while the writer rotates and retention runs
    (cc956ad: every one "corrupt")."""
    path = str(tmp_path / "live")
    rng = random.Random(9)
    state: dict = {}
    led = open_ledger(path, G, logger=QUIET,
                      log_options=LogOptions(segment_bytes=SEG, retain_segments=2, fsync="per_step"))
    drive(led, 40, rng, state)
    stop = threading.Event()
    reads, errors = [0], []

    def reader() -> None:
        while not stop.is_set():
            try:
                export_log(path, lambda b: None)
                reads[0] += 1
            except Exception as exc:  # noqa: BLE001  (any failure is what this probe counts)
                errors.append(repr(exc))

    t = threading.Thread(target=reader)
    t.start()
    try:
        drive(led, 600 if HEAVY else 150, rng, state)
        while reads[0] < 3 and not errors and t.is_alive():
            drive(led, 5, rng, state)
    finally:
        stop.set()
        t.join(60)
        led.close()
    print(f"exports while retention ran: {reads[0]} reads, {len(errors)} errors; "
          f"{led.log.segments_deleted} segments deleted")
    assert not errors and reads[0] >= 3 and led.log.segments_deleted > 0
