"""R8: a hypothesis state machine over every ledger command, against a reference model.

The reference model (``support.r8.model.Model``) is written from SPEC's event tables
with plain dicts, lists and sets. It predicts every page's holder, mark,
restoring flag and block hash, the cache's least-recently-used order, each
commit's clear list and each step's plan (in order), the steps in flight (sealed
without completing, several at once, at most ``MAX_IN_FLIGHT``), what an abort
of an older step in flight does to it and every later one, which completions
retire plans, which pages ``reserve`` / ``alias_snapshot`` evict, every
``BlocksStored`` / ``BlocksRemoved`` effect and every page a ``PagesMarked``
effect names. It never reads the ledger's state to decide anything. The machine
drives five ledgers with the same commands: one that records its events and
has an observer (replayed at the end of every run; its commands' events each
put, folded by the table's appliers and observed), one on the hot path (no
check, no record, no sink, no observer: the lean path, every event built and
kept in the quiet journal), one with a callable sink (every event through it),
one with a journal sink that gates as the durable log does (the durable log's
case: the lean path between its gates, ``put`` at them) and one whose state has
its own copy of the transition table (every command through ``_submit``:
validate, apply); all must agree with each other (digests, events, errors) and
with the model after every step, and ``check_invariants`` must pass.

On top of the model, a second, semantic oracle (``support.r8.bytes_oracle.Bytes``) follows
what every page physically holds and asserts RELIABILITY.md's promises at every
sealed step (zero before first read, exactly once), undoing aborted steps.
Invalid commands are tried too (``support.r8.invalid``): each must raise the error class
the model predicts and leave digest, seq and the recorded events unchanged.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.r8.bytes_oracle import Bytes
from support.r8.invalid import invalid_commands
from support.r8.model import MAX_IN_FLIGHT, Model
from support.r8.prefix import PrefixRules
from support.journals import GatedJournal

from kvledger import (
    ConfigurationError,
    Geometry,
    KVLedgerError,
    Ledger,
    OutOfPagesError,
    PageNotHeldError,
    RestoringPageError,
    check_invariants,
    replay,
)
from kvledger.core.events import BlocksRemoved, CacheConfigured, PagesEvicted, PagesMarked, StepAborted
from kvledger.core.state import TRANSITIONS, LedgerState

NUM_PAGES = 16
PAGE_TOKENS = 16
GEOMETRY = Geometry(num_pages=NUM_PAGES, page_tokens=PAGE_TOKENS)
REQUEST_IDS = (0, 1, 2, 3)
SNAPSHOT_IDS = (0, 1, 2)
TENANTS = ("a", "b", None)
RANKS = (0, 1, 2)

STATS: dict[str, Counter] = {}


class TableOnly(LedgerState):
    """A state whose table is a copy of the standard one: a ledger over it takes no fast path."""

    transitions = dict(TRANSITIONS)


class LedgerMachine(PrefixRules, RuleBasedStateMachine):
    policy = "released_aliases"
    page_tokens = PAGE_TOKENS
    tenants = TENANTS

    def __init__(self):
        super().__init__()
        self.seen: list[tuple] = []  # (event, effects) of every event L folded
        self.L = Ledger(GEOMETRY, policy=self.policy, record=True,
                        observer=lambda seq, ev, eff: self.seen.append((ev, eff)))
        self.hot = Ledger(GEOMETRY, policy=self.policy)  # the plain hot path
        self.sunk_events: list = []  # what a ledger with only a sink gets (the durable log's case)
        self.sunk = Ledger(GEOMETRY, policy=self.policy, sink=self._sunk_put)
        self.journal = GatedJournal()  # the durable log's case: lean between gates, put at them
        self.gated = Ledger(GEOMETRY, policy=self.policy, sink=self.journal)
        self.journal.ledger_seq = lambda: self.gated.seq
        table = TableOnly()  # a state with its own copy of the table: every command through _submit
        table.fold(CacheConfigured(geometry=GEOMETRY, policy=self.policy))
        self.table = Ledger(GEOMETRY, state=table, record=True)
        self.m = Model(NUM_PAGES, self.policy)
        self.b = Bytes(self.m)
        self.ok = True
        self.hashes_made = 0
        self.marks_checked = 0  # len(self.seen) when the PagesMarked effects were last checked
        self.stats = STATS.setdefault(self.policy, Counter())
        self.stats["runs"] += 1

    # -- plumbing

    def _sunk_put(self, seq, event):
        assert seq == len(self.sunk_events)  # one seq each, in order, none skipped
        if seq:
            assert self.sunk.seq == seq  # everything before it folded, nothing after
        self.sunk_events.append(event)

    def both(self, call):
        """Run ``call`` on every ledger; they must return the same or raise the same."""
        self.ok = False
        self.stats["commands"] += 1
        try:
            got = call(self.L)
        except KVLedgerError as e:
            with pytest.raises(type(e)):
                call(self.hot)
            with pytest.raises(type(e)):
                call(self.table)
            with pytest.raises(type(e)):
                call(self.sunk)
            with pytest.raises(type(e)):
                call(self.gated)
            raise
        assert call(self.hot) == got
        assert call(self.table) == got
        assert call(self.sunk) == got
        assert call(self.gated) == got
        return got

    def rejected(self, call, exc):
        """``call`` must raise ``exc`` and change nothing, on every ledger."""
        digest, seq, n_events, n_seen = self.L.digest(), self.L.seq, len(self.L.events), len(self.seen)
        hot_digest, table_digest, sunk = self.hot.digest(), self.table.digest(), len(self.sunk_events)
        gated = len(self.journal.events)
        with pytest.raises(exc) as ei:
            self.both(call)
        assert type(ei.value) is exc, (type(ei.value), exc)
        assert (self.L.digest(), self.L.seq, len(self.L.events), len(self.seen)) == (digest, seq, n_events, n_seen)
        assert self.hot.digest() == hot_digest and self.table.digest() == table_digest
        assert self.sunk.digest() == hot_digest and len(self.sunk_events) == sunk
        assert self.gated.digest() == hot_digest and len(self.journal.events) == gated
        self.stats["rejected"] += 1

    def draw_subset(self, data, pool, max_size=None):
        return data.draw(st.lists(st.sampled_from(sorted(pool)), min_size=1, max_size=max_size, unique=True))

    def new_hash(self):
        """A block hash never used before in this run: ints of both signs and 16-byte strings."""
        self.hashes_made += 1
        k = self.hashes_made
        if k % 3 == 0:
            return hashlib.blake2b(k.to_bytes(4, "little"), digest_size=16).digest()
        return k if k % 3 == 1 else -k

    def expect_folded(self, since, expected):
        """The events folded since ``len(self.seen) == since`` are ``expected`` [(event, effects)]."""
        assert self.seen[since:] == expected, (self.seen[since:], expected)
        self.stats["kv events checked"] += sum(1 for _, eff in expected if eff)

    def _evicted(self, pages, hashes):
        """The eviction event and its effects: BlocksRemoved, and under the isolating policies the
        pages marked (for their writer's tenant, or for everyone)."""
        marked = () if self.policy == "released_aliases" else (PagesMarked(page_ids=tuple(pages)),)
        return (PagesEvicted(page_ids=tuple(pages)), (BlocksRemoved(hashes=tuple(hashes)), *marked))

    def _allocate(self, n, call, who):
        """Run an allocation of ``n`` pages (``call``) with the eviction the model predicts.
        Returns the pages, or None after checking an ``OutOfPagesError``."""
        evict = self.m.to_evict(n)
        if evict is None:
            self.rejected(call, OutOfPagesError)
            return None
        reservable = set(self.m.reservable())
        since = len(self.seen)
        pages = self.both(call)
        assert len(pages) == n and len(set(pages)) == n
        if evict:
            hashes = self.m.evict(evict)
            self.b.evicted(evict)
            self.expect_folded(since, [self._evicted(evict, hashes), (self.seen[-1][0], ())])
            assert set(pages) == reservable | set(evict), (pages, reservable, evict)  # everything free, then these
            self.stats[f"evicted by {who}"] += len(evict)
        else:
            assert len(self.seen) == since + 1 and set(pages) <= reservable
        return pages

    # -- reserve / return

    @rule(data=st.data(), rid=st.sampled_from(REQUEST_IDS), n=st.integers(1, 3))
    def reserve(self, data, rid, n):
        self._reserve(data, rid, n)

    def _reserve(self, data, rid, n):
        r = self.m.requests.get(rid)
        tenant = data.draw(st.sampled_from(TENANTS if r is None else (None, r.tenant)))
        pages = self._allocate(n, lambda L: L.reserve(rid, n, tenant=tenant), "reserve")
        if pages is not None:
            self.m.reserve(rid, pages, tenant if r is None else r.tenant)
        return pages

    @rule(data=st.data(), rid=st.sampled_from(REQUEST_IDS), n=st.integers(1, 3), ahead=st.integers(0, 1))
    def reserve_then_commit(self, data, rid, n, ahead):
        """The common lifecycle step, as two commands: reserve n pages, commit them."""
        pages = self._reserve(data, rid, n)
        if pages is not None:
            self._commit_pages(rid, self.m.open_step + ahead, pages)

    @rule(data=st.data(), rid=st.sampled_from(REQUEST_IDS), n=st.integers(1, 3), ahead=st.integers(0, 1))
    def allocate(self, data, rid, n, ahead):
        """reserve + commit as one command (vLLM's ``get_new_blocks``): the two events the two
        commands write, the eviction the model predicts first; the hot ledger takes its fast path."""
        r = self.m.requests.get(rid)
        tenant = data.draw(st.sampled_from(TENANTS if r is None else (None, r.tenant)))
        step = self.m.open_step + ahead
        call = lambda L: L.allocate(rid, step, n, tenant=tenant)  # noqa: E731
        evict = self.m.to_evict(n)
        if evict is None:
            self.rejected(call, OutOfPagesError)
            return
        reservable = set(self.m.reservable())
        since = len(self.seen)
        pages = self.both(call)
        assert len(pages) == n and len(set(pages)) == n
        if evict:
            hashes = self.m.evict(evict)
            self.b.evicted(evict)
            assert self.seen[since] == self._evicted(evict, hashes)
            assert set(pages) == reservable | set(evict), (pages, reservable, evict)
            self.stats["evicted by allocate"] += len(evict)
        else:
            assert set(pages) <= reservable
        assert [type(ev).__name__ for ev, _ in self.seen[since + bool(evict):]] == ["PagesReserved", "PagesCommitted"]
        self.m.reserve(rid, pages, tenant if r is None else r.tenant)
        expect = self.m.commit(rid, step, list(pages))
        self.b.committed(expect, step, self.m.requests[rid])
        self.stats["allocated"] += n
        self.stats["listed"] += len(expect)

    @precondition(lambda self: self.m.reservable())
    @rule(data=st.data(), rid=st.sampled_from(REQUEST_IDS), ahead=st.integers(0, 1))
    def allocate_named(self, data, rid, ahead):
        """reserve + commit of pages the caller names (vLLM's free queue picks them): any free
        pages, deep in the free stack or on top, in any order; the same two events."""
        r = self.m.requests.get(rid)
        tenant = data.draw(st.sampled_from(TENANTS if r is None else (None, r.tenant)))
        pages = tuple(data.draw(st.permutations(self.draw_subset(data, self.m.reservable(), 3))))
        step = self.m.open_step + ahead
        since = len(self.seen)
        assert self.both(lambda L: L.allocate(rid, step, pages=pages, tenant=tenant)) == pages
        assert [type(ev).__name__ for ev, _ in self.seen[since:]] == ["PagesReserved", "PagesCommitted"]
        self.m.reserve(rid, pages, tenant if r is None else r.tenant)
        expect = self.m.commit(rid, step, list(pages))
        assert list(self.seen[-1][1][0].page_ids if self.seen[-1][1] else ()) == expect
        self.b.committed(expect, step, self.m.requests[rid])
        self.stats["allocated by name"] += len(pages)
        self.stats["listed"] += len(expect)

    def _with_reserved(self):
        return [r for r in self.m.requests.values() if r.reserved]

    @precondition(lambda self: self._with_reserved())
    @rule(data=st.data(), everything=st.booleans())
    def return_reservation(self, data, everything):
        r = data.draw(st.sampled_from(self._with_reserved()))
        pages = tuple(r.reserved) if everything else tuple(self.draw_subset(data, r.reserved))
        got = self.both(lambda L: L.return_reservation(r.rid, None if everything else list(pages)))
        assert got == pages
        self.m.return_(r.rid, pages)
        self.b.let_go(pages, r)

    # -- commit

    def _commit_pages(self, rid, step, pages):
        self._commit(self.m.requests[rid], step, list(pages), lambda L: L.commit(rid, step, pages=pages))

    def _commit(self, r, step, pages, call):
        if any(p in self.m.restoring for p in pages):
            self.rejected(call, RestoringPageError)
            return
        listed = self.both(call)
        expect = self.m.commit(r.rid, step, pages)
        assert list(listed) == expect
        self.b.committed(expect, step, r)
        self.stats["listed"] += len(listed)

    @precondition(lambda self: self._with_reserved())
    @rule(data=st.data(), ahead=st.integers(0, 2))
    def commit_n(self, data, ahead):
        r = data.draw(st.sampled_from(self._with_reserved()))
        n = data.draw(st.integers(1, len(r.reserved)))
        step = self.m.open_step + ahead
        self._commit(r, step, list(r.reserved[:n]), lambda L: L.commit(r.rid, step, n))

    @precondition(lambda self: self._with_reserved())
    @rule(data=st.data(), ahead=st.integers(0, 2))
    def commit_whole(self, data, ahead):
        """A commit whose step reads the pages whole before writing them (a recurrent state): every
        mark listed, whatever tenant left it; refused under released_aliases, which marks no KV."""
        r = data.draw(st.sampled_from(self._with_reserved()))
        pages = self.draw_subset(data, r.reserved)
        step = self.m.open_step + ahead
        call = lambda L: L.commit(r.rid, step, pages=list(pages), reads="whole")  # noqa: E731
        if self.policy == "released_aliases":
            self.rejected(call, ConfigurationError)
            return
        if any(p in self.m.restoring for p in pages):
            self.rejected(call, RestoringPageError)
            return
        listed = self.both(call)
        expect = self.m.commit(r.rid, step, list(pages), whole=True)
        assert list(listed) == expect
        self.b.committed(expect, step, r, whole=pages)
        self.stats["listed"] += len(listed)
        self.stats["committed whole"] += len(pages)

    @precondition(lambda self: self._with_reserved())
    @rule(data=st.data(), ahead=st.integers(0, 2))
    def commit_none(self, data, ahead):
        """A commit whose step writes the pages whole before reading them (a chunk filling them, a
        state copied in): marks come off unlisted; an abort, or a release before the seal, gives
        them back."""
        r = data.draw(st.sampled_from(self._with_reserved()))
        pages = self.draw_subset(data, r.reserved)
        step = self.m.open_step + ahead
        call = lambda L: L.commit(r.rid, step, pages=list(pages), reads="none")  # noqa: E731
        if any(p in self.m.restoring for p in pages):
            self.rejected(call, RestoringPageError)
            return
        assert self.both(call) == ()
        assert self.m.commit(r.rid, step, list(pages), none=True) == []
        self.b.committed([], step, r, none=pages)
        self.stats["committed none"] += len(pages)

    def _with_kv(self):
        return [r for r in self.m.requests.values() if len(r.kv) > 1]

    @precondition(lambda self: self._with_kv())
    @rule(data=st.data())
    def release_some(self, data):
        """A live request lets go of some of its KV pages (a sliding window moved on)."""
        r = data.draw(st.sampled_from(self._with_kv()))
        pages = self.draw_subset(data, r.kv_pages(), len(r.kv) - 1)
        if data.draw(st.booleans()) and self.m.free():
            stranger = [p for p in self.m.free() if p not in pages][:1]  # a page it does not hold
            if stranger:
                self.rejected(lambda L: L.release(r.rid, [*pages, *stranger]), PageNotHeldError)
        self.both(lambda L: L.release(r.rid, pages))
        freed = self.m.release_pages(r.rid, pages)
        self.b.left_kv(freed, r)
        self.b.released(pages, r)
        self.stats["released"] += len(pages)

    @precondition(lambda self: self._with_reserved())
    @rule(data=st.data(), ahead=st.integers(0, 2))
    def commit_pages(self, data, ahead):
        r = data.draw(st.sampled_from(self._with_reserved()))
        pages = self.draw_subset(data, r.reserved)
        step = self.m.open_step + ahead
        self._commit(r, step, pages, lambda L: L.commit(r.rid, step, pages=list(pages)))

    # -- cancel / finish

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data(), finished=st.booleans())
    def request_gone(self, data, finished):
        self._gone(data.draw(st.sampled_from(sorted(self.m.requests))), finished)

    def _gone(self, rid, finished):
        self.both(lambda L: L.finish(rid) if finished else L.cancel(rid))
        r, freed = self.m.gone(rid)
        self.b.left_kv(freed, r)
        self.b.let_go(r.reserved + freed, r)
        self.stats["finished" if finished else "cancelled"] += 1

    # -- snapshots

    @rule(sid=st.sampled_from(SNAPSHOT_IDS), n=st.integers(1, 3))
    def alias_n(self, sid, n):
        self._alias_n(sid, n)

    def _alias_n(self, sid, n):
        pages = self._allocate(n, lambda L: L.alias_snapshot(sid, n), "alias")
        if pages is None:
            return False
        self.m.alias(sid, pages)
        self.b.aliased(pages)
        return True

    @rule(sid=st.sampled_from(SNAPSHOT_IDS), n=st.integers(1, 3))
    def alias_then_release(self, sid, n):
        """A snapshot row comes and goes: its pages return to the free list marked."""
        if self._alias_n(sid, n):
            self._release(sid)

    def _aliasable(self, sid):
        mine = set(self.m.snapshots.get(sid, ()))
        return [p for p in range(NUM_PAGES)
                if self.m.kind(p) in ("free", "alias") and p not in self.m.restoring and p not in mine]

    @rule(data=st.data(), sid=st.sampled_from(SNAPSHOT_IDS))
    def alias_pages(self, data, sid):
        pool = self._aliasable(sid)
        if not pool:
            return
        pages = self.draw_subset(data, pool)
        reused = sum(1 for p in pages if self.m.kind(p) == "alias")
        got = self.both(lambda L: L.alias_snapshot(sid, pages=pages))
        assert got == tuple(pages)
        self.m.alias(sid, pages)
        self.b.aliased(pages)
        self.stats["alias pages reused"] += reused

    @precondition(lambda self: self.m.snapshots)
    @rule(data=st.data())
    def release(self, data):
        self._release(data.draw(st.sampled_from(sorted(self.m.snapshots))))

    def _release(self, sid):
        self.both(lambda L: L.release_snapshot(sid))
        self.m.release(sid)
        self.stats["released"] += 1

    # -- restores

    def _restorable_requests(self):
        return [r for r in self.m.requests.values() if any(p not in self.m.restoring for p in r.reserved)]

    @precondition(lambda self: self._restorable_requests())
    @rule(data=st.data())
    def restore_into_request(self, data):
        r = data.draw(st.sampled_from(self._restorable_requests()))
        pages = self.draw_subset(data, [p for p in r.reserved if p not in self.m.restoring])
        self.both(lambda L: L.start_restore(pages, request=r.rid))
        self.m.start_restore("request", r.rid, pages)
        self.b.restored_into_request(pages, r)
        self.stats["restores into requests"] += 1

    def _restorable_snapshots(self):
        return [s for s, ps in sorted(self.m.snapshots.items()) if any(p not in self.m.restoring for p in ps)]

    @precondition(lambda self: self._restorable_snapshots())
    @rule(data=st.data())
    def restore_into_snapshot(self, data):
        sid = data.draw(st.sampled_from(self._restorable_snapshots()))
        pages = self.draw_subset(data, [p for p in self.m.snapshots[sid] if p not in self.m.restoring])
        self.both(lambda L: L.start_restore(pages, snapshot=sid))
        self.m.start_restore("snapshot", sid, pages)
        self.b.aliased(pages)
        self.stats["restores into snapshots"] += 1

    @precondition(lambda self: self.m.restoring)
    @rule(data=st.data())
    def complete_restore(self, data):
        into, target = data.draw(st.sampled_from(sorted(set(self.m.restoring.values()))))
        pages = self.draw_subset(data, [p for p, t in self.m.restoring.items() if t == (into, target)])
        self.both(lambda L: L.complete_restore(pages, **{into: target}))
        self.m.complete_restore(pages)

    # -- steps: sealed, in flight, completed (retired) or aborted

    @rule()
    def seal(self):
        self._seal()

    @rule(k=st.sampled_from((2, 3, MAX_IN_FLIGHT + 1)))
    def seal_several(self, k):
        """Steps sealed back to back, none completed: several in flight, now and then past the cap."""
        for _ in range(k):
            self._seal()

    def _seal(self):
        step = self.m.open_step
        plan = self.both(lambda L: L.seal_step(step))
        expect, dropped = self.m.seal(step)
        assert plan.step == step
        assert plan.clear_list == tuple(expect), (step, plan.clear_list, expect)
        self.b.seal(step, expect)
        if dropped is not None:
            self.b.retire([dropped])
            self.stats["plans past the cap"] += 1
        self.stats["steps sealed"] += 1
        self.stats["pages cleared"] += len(plan.clear_list)
        self.stats["most in flight"] = max(self.stats["most in flight"], len(self.m.in_flight))
        return step

    def _complete(self, step, rank):
        self.both(lambda L: L.complete_step(step, rank))
        retired = self.m.complete(step, rank)
        self.b.retire(retired)
        self.stats["steps retired"] += len(retired)

    @precondition(lambda self: self.m.open_step > 0)
    @rule(data=st.data(), rank=st.sampled_from(RANKS))
    def complete_step(self, data, rank):
        """One rank reports a step (any sealed one: late, repeated or out of order)."""
        self._complete(data.draw(st.integers(max(0, self.m.open_step - 4), self.m.open_step - 1)), rank)

    @rule()
    def seal_and_complete(self):
        """The step runs everywhere: sealed, then completed on every rank (so its pages can be published)."""
        step = self._seal()
        for rank in RANKS:
            self._complete(step, rank)

    @precondition(lambda self: self.m.in_flight)
    @rule(data=st.data())
    def abort_step(self, data):
        """A step in flight fails: it and every later step in flight abort."""
        self._abort(data.draw(st.sampled_from(self.m.in_flight_steps())))

    @rule(data=st.data(), rid=st.sampled_from(REQUEST_IDS), k=st.integers(1, 3), n=st.integers(1, 3),
          which=st.integers(0, 2), leave=st.booleans())
    def listed_steps_then_abort(self, data, rid, k, n, which, leave):
        """k steps in flight, each committing pages a released snapshot row left (listed for its
        plan); then (``leave``) the request may go, and one of those steps fails."""
        sealed = []
        for _ in range(k):
            self.alias_then_release(data.draw(st.sampled_from(SNAPSHOT_IDS)), n)
            pages = self._reserve(data, rid, n)
            if pages is not None:
                self._commit_pages(rid, self.m.open_step, pages)
            sealed.append(self._seal())
        if leave and rid in self.m.requests:
            self._gone(rid, data.draw(st.booleans()))
        flying = [s for s in sealed if s in self.m.in_flight_steps()]
        if flying:
            self._abort(flying[min(which, len(flying) - 1)])

    def _abort(self, step):
        self.both(lambda L: L.abort_step(step, "rank failed"))
        steps, carried = self.m.abort(step)
        self.b.abort(steps, carried)
        self.stats["aborts"] += 1
        self.stats["plans aborted"] += len(steps)
        self.stats["aborts of several plans"] += len(steps) > 1
        self.stats["pages carried"] += len(carried)

    # -- invalid commands

    @rule(data=st.data())
    def invalid_command(self, data):
        out = invalid_commands(self.m, NUM_PAGES, REQUEST_IDS, SNAPSHOT_IDS, TENANTS, PAGE_TOKENS)
        call, exc = data.draw(st.sampled_from(out))
        self.rejected(call, exc)

    # -- checks after every step

    @invariant()
    def agrees_with_the_model(self):
        try:
            self._agrees_with_the_model()
            self._marks_agree()
        except BaseException:
            self.stats["violations"] += 1  # counted where it is seen, then reported by hypothesis
            raise
        self.stats["steps checked"] += 1
        self.ok = True

    def _agrees_with_the_model(self):
        L, m = self.L, self.m
        check_invariants(L.state)
        check_invariants(self.hot.state)
        assert self.hot.digest() == L.digest() == self.table.digest()
        assert self.table.events == L.events[1:]  # (the table ledger's state was configured before it)
        assert self.sunk_events == L.events and self.sunk.digest() == L.digest()
        assert self.journal.events == L.events and self.gated.digest() == L.digest()
        for p in range(NUM_PAGES):
            assert L.holder_of(p) == m.holder(p), (p, L.holder_of(p), m.holder(p))
            # (a tenant mark vs a mark for everyone shows in which commits list the page)
            assert L.is_marked(p) == (m.mark[p] is not None), (p, L.is_marked(p), m.mark[p])
            assert L.is_restoring(p) == (p in m.restoring), p
            assert L.block_hash(p) == m.hashes.get(p), (p, L.block_hash(p), m.hashes.get(p))
            holders = tuple(r.rid for r in m.held[p]) if m.kind(p) == "kv" else ()
            assert L.holders_of(p) == holders, (p, L.holders_of(p), holders)
        assert list(L.state.cached) == m.lru, (list(L.state.cached), m.lru)  # the LRU order
        assert L.cached_count == len(m.lru)
        assert L.free_count == len(m.free())
        assert L.reservable_count == len(m.reservable()) + len(m.lru)
        assert L.open_step == m.open_step
        flying = [(plan.step, list(plan.clear_list)) for plan in L.state.in_flight]
        assert flying == m.in_flight, (flying, m.in_flight)
        assert L.state.completed_step == m.done() and L.state.aborted_steps == m.aborted
        assert sorted(L.state.requests) == sorted(m.requests)
        for rid, r in m.requests.items():
            assert L.reserved_pages(rid) == tuple(r.reserved)
            assert L.kv_pages(rid) == tuple(r.kv_pages())
        assert sorted(L.state.snapshots) == sorted(m.snapshots)
        for sid, pages in m.snapshots.items():
            assert L.snapshot_pages(sid) == tuple(pages)

    def _marks_agree(self):
        """The pages the PagesMarked effects named since the last check are the ones the model marked."""
        got = [p for _, effects in self.seen[self.marks_checked:] for eff in effects
               if type(eff) is PagesMarked for p in eff.page_ids]
        self.marks_checked = len(self.seen)
        want = self.m.take_marked()
        assert set(got) == set(want), ("PagesMarked effects", sorted(set(got)), sorted(set(want)))
        self.stats["marked"] += len(set(got))

    def teardown(self):
        self.stats["shared reads"] += self.b.shared_reads
        if not self.ok:
            return  # a rule failed: let hypothesis report that
        L = self.L
        assert replay(L.events, check=True).digest() == L.digest()
        # drain: every restore completes, every request and snapshot goes; all pages come back,
        # free or cached, and evicting the cache frees them all
        for (into, target) in sorted(set(self.m.restoring.values())):
            pages = [p for p, t in self.m.restoring.items() if t == (into, target)]
            L.complete_restore(pages, **{into: target})
            self.m.complete_restore(pages)
        for rid in sorted(self.m.requests):
            L.cancel(rid)
        for sid in sorted(self.m.snapshots):
            L.release_snapshot(sid)
        assert L.free_count + L.cached_count == NUM_PAGES and L.reservable_count == NUM_PAGES
        assert L.cached_count == len(L.state.page_hash)  # every hashed page is cached now
        L.evict()
        assert L.free_count == NUM_PAGES and L.cached_count == 0 and L.lookup(list(self.m.pages_of)) == 0
        check_invariants(L.state)
        assert replay(L.events, check=True).digest() == L.digest()
        self.stats["replays"] += 2


class CrossTenantMachine(LedgerMachine):
    policy = "cross_tenant"


class AllReusedMachine(LedgerMachine):
    policy = "all_reused"


TestReleasedAliases = LedgerMachine.TestCase
TestCrossTenant = CrossTenantMachine.TestCase
TestAllReused = AllReusedMachine.TestCase

def test_an_abort_names_each_marked_page_once():
    L = Ledger(Geometry(num_pages=8, page_tokens=4), policy="all_reused", check=True)
    L.alias_snapshot(9, 1)
    L.release_snapshot(9)
    (p,) = L.reserve(1, 1)
    L.commit(1, 0, 1)
    assert L.seal_step(0).clear_list == (p,)
    L.finish(1)  # marked for everyone again (all_reused): the next commit lists it again
    assert L.reserve(2, 1) == (p,)
    L.commit(2, 1, 1)
    assert L.seal_step(1).clear_list == (p,)
    L.finish(2)  # out of KV: the abort marks it instead of carrying it
    (marked,) = L.submit(StepAborted(step=0))
    assert type(marked) is PagesMarked and marked.page_ids == (p,)


REPORTED = [
    # (label, counter)
    ("runs", "runs"), ("steps", "steps checked"), ("commands", "commands"), ("rejected", "rejected"),
    ("listed", "listed"), ("cleared", "pages cleared"), ("marked", "marked"), ("sealed", "steps sealed"),
    ("retired", "steps retired"), ("most-in-flight", "most in flight"), ("past-cap", "plans past the cap"),
    ("aborts", "aborts"), ("plans-aborted", "plans aborted"), ("multi-aborts", "aborts of several plans"),
    ("carried", "pages carried"), ("named", "allocated by name"), ("cancelled", "cancelled"), ("finished", "finished"),
    ("released", "released"),
    ("restores-req", "restores into requests"), ("restores-snap", "restores into snapshots"),
    ("alias-reuse", "alias pages reused"), ("published", "pages published"), ("lookups", "lookups"),
    ("lookups-cut-by-tenant", "lookups cut by the tenant"),
    ("shared", "pages shared"), ("shared-from-cache", "pages shared from the cache"),
    ("shared-reads", "shared reads"), ("evicted-by-evict", "evicted by evict"),
    ("evicted-by-reserve", "evicted by reserve"), ("evicted-by-alias", "evicted by alias"),
    ("kv-events", "kv events checked"), ("replays", "replays"), ("violations", "violations"),
]


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    for policy, c in sorted(STATS.items()):
        figures = " ".join(f"{label}={c[key]}" for label, key in REPORTED)
        refused = " ".join(f"{k}={v}" for k, v in sorted(c.items()) if k.endswith(")"))
        print(f"\nR8 state machine [{policy}]: {figures}\n  refusals predicted: {refused}")
