"""A seeded serving workload that uses every event and every holder, for the replay and audit tests.

``serve(ledger, seed, steps)`` issues only commands valid for the ledger's state:
requests of two tenants reserve, commit (sometimes partially, returning the
rest), finish or are cancelled; a new request first shares the longest cached or
held prefix of an earlier request's published blocks (``lookup`` + ``share``);
requests publish the pages of their completed steps; cached pages are evicted
explicitly and by reservations under pressure; snapshots alias pages and are
released; inbound restores write into reserved pages and complete later; two
steps are in flight at a time: the older one completes on every rank, or
(sometimes) is aborted and takes the younger one with it (a cascade), sometimes
after rank 0 completed it; sometimes the sanitizer's violation on a listed page
is recorded before the abort. Deterministic given the seed.

``build(path, ...)`` writes it through ``open_ledger`` into a log directory of
small segments. The replay and audit tests import both
(``from test_audit_workload import build, serve``). Kills: nothing by itself;
``test_the_workload_uses_every_event_and_holder`` pins that the other tests'
logs cover what they claim to cover (a driver that stopped sharing, evicting,
cascading or recording violations fails it).
"""

from __future__ import annotations

import os
import random

import pytest

from support import QUIET
from kvledger import CLEAR_POLICIES, Geometry, Ledger, LedgerState, OutOfPagesError, check_invariants
from kvledger.core.events.events import EVENT_TYPES, SanitizerViolation, StepAborted
from kvledger.durable import open_ledger

__all__ = ["GEOMETRY", "QUIET", "build", "serve"]

GEOMETRY = Geometry(num_pages=48, page_tokens=4)
RANKS = 2


class _Serving:
    """The driver's memory: published block chains (for later shares), the steps in flight."""

    def __init__(self, led, seed) -> None:
        self.led, self.st = led, led.state
        self.rng = random.Random(f"{seed}")
        self.chains: dict[int, list[int]] = {}  # request -> hashes of its published blocks, from block 0
        self.old_chains: list[list[int]] = []  # chains of requests that ended (their blocks may be cached)
        self.in_flight: list[int] = []
        self.next_r = 1
        self.next_s = 1
        self.next_hash = 1

    def step(self) -> None:
        led, st, rng = self.led, self.st, self.rng
        step = led.open_step
        self._complete_restores()
        self._snapshots()
        self._admit()
        self._commit(step)
        self._end_requests()
        plan = led.seal_step(step)
        self._unwritten(step)
        self.in_flight.append(step)
        if plan.clear_list and rng.random() < 0.15:  # the sanitizer caught a page: the engine aborts the step
            led.record_violation(step, 1, rng.randrange(3), plan.clear_list[0], rng.choice(["not_zero", "poison"]))
            led.abort_step(self.in_flight[0], "sanitizer violation on rank 1")
            self.in_flight = []
        else:
            self._resolve()
        self._publish()
        if st.cached and rng.random() < 0.2:
            led.evict(1)
        self._start_restore()

    def _complete_restores(self) -> None:
        st = self.st
        by: dict = {}
        for p, t in sorted(st.restore_targets.items()):
            by.setdefault(t, []).append(p)
        for (into, target), ps in sorted(by.items()):
            self.led.complete_restore(ps, **{into: target})

    def _snapshots(self) -> None:
        led, st, rng = self.led, self.st, self.rng
        if rng.random() < 0.35:
            try:
                if st.snapshots and rng.random() < 0.3:
                    other = st.snapshots[rng.choice(sorted(st.snapshots))]
                    led.alias_snapshot(self.next_s, pages=other[: rng.randint(1, len(other))])
                else:
                    led.alias_snapshot(self.next_s, rng.randint(1, 4))
                self.next_s += 1
            except OutOfPagesError:
                pass
        while st.snapshots and rng.random() < 0.35:
            led.release_snapshot(rng.choice(sorted(st.snapshots)))

    def _admit(self) -> None:
        led, st, rng = self.led, self.st, self.rng
        for _ in range(rng.randint(1, 2)):
            r, tenant = self.next_r, rng.choice(["a", "b"])
            self.next_r += 1
            if rng.random() < 0.5:
                led.label(r, f"req-{r}")  # (an engine's name for it, before its first event)
            chains = [c for c in (*self.chains.values(), *self.old_chains) if c]
            if chains and rng.random() < 0.6:
                chain = rng.choice(chains)
                k = led.lookup(chain, tenant=tenant)
                if k:
                    led.share(r, chain[:k], tenant=tenant)
            try:
                led.reserve(r, rng.randint(1, 4), tenant=tenant)
            except OutOfPagesError:
                if r in st.requests:
                    led.finish(r)
                self._relieve()

    def _relieve(self) -> None:
        """Pressure: the oldest request finishes (its published pages go cached)."""
        if self.st.requests:
            r = min(self.st.requests)
            self.led.finish(r)
            self._ended(r)

    def _ended(self, r: int) -> None:
        chain = self.chains.pop(r, None)
        if chain:
            self.old_chains = [*self.old_chains[-7:], chain]

    def _commit(self, step: int) -> None:
        led, st, rng = self.led, self.st, self.rng
        for r, rec in sorted(st.requests.items()):
            ready = [p for p in rec.reserved if p not in st.restore_targets]
            if not ready or rng.random() < 0.15:
                continue
            x = rng.random()  # (a recurrent state's page read whole; a page the step writes whole first)
            reads = "whole" if x < 0.1 and st.policy != "released_aliases" else "none" if x < 0.2 else "tail"
            led.commit(r, step, pages=ready[: rng.randint(1, len(ready))], reads=reads)
            if rng.random() < 0.1:
                rest = [p for p in rec.reserved if p not in st.restore_targets]
                if rest:
                    led.return_reservation(r, rest)

    def _unwritten(self, step: int) -> None:
        """Now and then a request is aborted and its share of the step just sealed dropped."""
        led, st, rng = self.led, self.st, self.rng
        if rng.random() < 0.1:
            for r, rec in sorted(st.requests.items()):
                mine = [p for p, s in zip(rec.kv, rec.kv_steps, strict=True) if s == step]
                if mine:
                    led.cancel(r)
                    self._ended(r)
                    led.record_unwritten(r, step, mine, "aborted before its step ran")
                    return

    def _end_requests(self) -> None:
        led, st, rng = self.led, self.st, self.rng
        for r in sorted(st.requests):
            rec = st.requests[r]
            if len(rec.kv) > 1 and rng.random() < 0.15:  # a window moved on: some pages go, the rest stay
                led.release(r, rng.sample(rec.kv, rng.randint(1, len(rec.kv) - 1)))
            x = rng.random()
            if x < 0.12 or len(st.requests) > 10:
                led.finish(r)
                self._ended(r)
            elif x < 0.15:
                led.cancel(r)
                self._ended(r)

    def _resolve(self) -> None:
        """At most two steps in flight: the older completes everywhere, or aborts (taking the younger)."""
        led, rng = self.led, self.rng
        if len(self.in_flight) < 2 and rng.random() < 0.6:
            return  # the step stays in flight while the next one is sealed
        oldest = self.in_flight[0]
        if rng.random() < 0.2:
            if rng.random() < 0.5 and RANKS - 1 in self.st.completed:  # (a rank counts once it reported)
                led.complete_step(oldest, 0)  # rank 0 ran it, rank 1 failed
            led.abort_step(oldest, "rank 1 failed")
            self.in_flight = []
            return
        for step in self.in_flight[: 1 if len(self.in_flight) == 2 and rng.random() < 0.5 else 2]:
            for rank in range(RANKS):
                led.complete_step(step, rank)
            self.in_flight.remove(step)

    def _publish(self) -> None:
        """Each request publishes its next written, completed, unpublished pages (a prefix of its table)."""
        led, st = self.led, self.st
        done, aborted = st.completed_step, st.aborted_steps
        for r, rec in sorted(st.requests.items()):
            chain = self.chains.setdefault(r, [])
            i = len(chain)
            if any(p not in st.page_hash for p in rec.kv[:i]):
                continue  # its chain was cut short by an eviction of a block it shared
            j = i
            while j < len(rec.kv) and 0 <= rec.kv_steps[j] <= done and rec.kv_steps[j] not in aborted \
                    and rec.kv[j] not in st.page_hash:
                j += 1
            if j > i and self.rng.random() < 0.7:
                hashes = list(range(self.next_hash, self.next_hash + j - i))
                self.next_hash += j - i
                led.publish(r, hashes, [h % 1000 for h in range(4 * (j - i))], start=i)
                chain.extend(hashes)

    def _start_restore(self) -> None:
        led, st, rng = self.led, self.st, self.rng
        if rng.random() < 0.25:
            cands = [(r, [p for p in rec.reserved if p not in st.restore_targets])
                     for r, rec in sorted(st.requests.items())]
            cands = [(r, ps) for r, ps in cands if ps]
            if cands:
                r, ps = rng.choice(cands)
                led.start_restore(ps[: rng.randint(1, len(ps))], request=r)
        if st.snapshots and rng.random() < 0.15:
            s = rng.choice(sorted(st.snapshots))
            ps = [p for p in st.snapshots[s] if p not in st.restore_targets]
            if ps:
                led.start_restore(ps[:1], snapshot=s)


def serve(led, seed, steps: int) -> None:
    """Run ``steps`` steps of the workload (module docstring) on ``led``; leaves steps in flight
    completed on every rank and restores completed, so a closed log owes nothing."""
    s = _Serving(led, seed)
    for _ in range(steps):
        s.step()
    s._complete_restores()
    for step in s.in_flight:
        for rank in range(RANKS):
            led.complete_step(step, rank)


def build(path, *, policy: str = "released_aliases", seed="audit", steps: int = 120,
          segment_bytes: int | None = 4096, checkpoint_every=None) -> dict:
    """Write the workload into ``path`` (a log directory of small segments; ``segment_bytes=None``: one
    file); returns the live run's digest, event count, and the log's files."""
    with open_ledger(path, GEOMETRY, policy=policy, segment_bytes=segment_bytes,
                     checkpoint_every=checkpoint_every, logger=QUIET) as led:
        serve(led, seed, steps)
        digest, seq = led.digest(), led.seq
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".kvlog")) \
        if segment_bytes is not None else [str(path)]
    return {"path": str(path), "digest": digest, "seq": seq, "files": files}


@pytest.mark.parametrize("policy", CLEAR_POLICIES)
def test_the_workload_uses_every_event_and_holder(policy):
    led = Ledger(GEOMETRY, policy=policy, record=True, check=True)
    serve(led, "sanity", 150)
    check_invariants(led.state)
    events = led.events
    assert events is not None
    kinds = {type(e) for e in events}
    assert kinds == set(EVENT_TYPES), sorted(t.__name__ for t in set(EVENT_TYPES) - kinds)
    st, holders, cascades, violations_then_abort = LedgerState(), set(), 0, 0
    for i, ev in enumerate(events):
        before = len(st.aborted_steps)
        st.fold(ev)
        if type(ev) is StepAborted:
            cascades += len(st.aborted_steps) - before - 1
            violations_then_abort += type(events[i - 1]) is SanitizerViolation
        holders |= {"shared" if h.startswith("kv({") else h.split("(")[0]
                    for h in map(st.holder_of, range(GEOMETRY.num_pages))}
    assert holders == {"free", "reserved", "kv", "shared", "alias", "cached"}, holders
    assert cascades >= 1 and violations_then_abort >= 1
    print(f"workload {policy}: {led.seq} events, {cascades} steps aborted in a cascade")
