"""R8: a hypothesis state machine over every ledger command, against a reference model.

The reference model (``Model``) is written from SPEC's event table with plain
dicts, lists and sets: no flat arrays, no free stack, no pending flags. It
predicts every page's holder, mark and restoring flag, each commit's clear list
and each step's plan. The machine drives two ledgers with the same commands: one
that records its events (replayed at the end of every run) and one on the hot
path (no check, no record, no sink); both must agree with each other and with
the model after every step, and ``check_invariants`` must pass.

On top of the model, a second, semantic oracle (``Bytes``) follows what every
page physically holds: zeros, snapshot-row bytes, or KV data of a request.
At each sealed step it executes the plan (zero the listed pages), then lets
every request read the pages committed for that step or earlier, then writes
them. It asserts the two promises of RELIABILITY.md:
  * zero before first read: no request reads bytes its policy forbids;
  * exactly once: a plan never zeroes a page that already holds zeros
    (released_aliases) nor a page holding its reader's own KV data (any policy),
and, restated as the issue asks, every page that entered a request's KV while
marked appears in exactly one (non-aborted) sealed plan, in the step it was
committed for (or the step an abort carried it to).

Invalid commands are tried too: each must raise the error class the model
predicts and leave digest, seq and the recorded events unchanged.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvledger import (
    DuplicatePageError,
    Geometry,
    InvalidArgumentError,
    KVLedgerError,
    Ledger,
    OutOfPagesError,
    PageNotHeldError,
    PageOutOfRangeError,
    RestoringPageError,
    StepOrderError,
    TenantMismatchError,
    UnknownRequestError,
    UnknownSnapshotError,
    check_invariants,
    replay,
)
from kvledger.core.events import PagesReserved

NUM_PAGES = 16
GEOMETRY = Geometry(num_pages=NUM_PAGES, page_tokens=16)
REQUEST_IDS = (0, 1, 2, 3)
SNAPSHOT_IDS = (0, 1, 2)
TENANTS = ("a", "b", None)
ALL = "all"

STATS: dict[str, Counter] = {}


# --------------------------------------------------------------------------- the model

class Req:
    """One request incarnation (an id may be reused after cancel/finish)."""

    def __init__(self, rid, tenant, inc):
        self.rid, self.tenant, self.inc = rid, tenant, inc
        self.reserved: list[int] = []
        self.kv: list[tuple[int, int]] = []  # (page, step it was committed for), in order
        self.restored: set[int] = set()

    def kv_pages(self):
        return [p for p, _ in self.kv]


class Model:
    """SPEC's event table, slowly and obviously."""

    def __init__(self, n, policy):
        self.n, self.policy = n, policy
        self.where: list[Req | None] = [None] * n  # request holding the page
        self.aliases: list[set] = [set() for _ in range(n)]
        self.mark: list = [None] * n  # None | ALL | ("tenant", t)
        self.restoring: dict[int, tuple[str, int]] = {}
        self.requests: dict[int, Req] = {}
        self.snapshots: dict[int, list[int]] = {}
        self.open_step = 0
        self.listings: list[list] = []  # live [step, page, inc], in listing order
        self.last_plan = None  # (step, [pages])
        self.restored_since_seal: dict[int, int] = {}  # page -> inc of the request that restored it
        self.incs = 0

    # queries
    def kind(self, p):
        r = self.where[p]
        if r is not None:
            return "reserved" if p in r.reserved else "kv"
        return "alias" if self.aliases[p] else "free"

    def holder(self, p):
        k = self.kind(p)
        if k in ("reserved", "kv"):
            return "%s(%d)" % (k, self.where[p].rid)
        if k == "alias":
            return "alias({" + ",".join(str(s) for s in sorted(self.aliases[p])) + "})"
        return "free"

    def free(self):
        return [p for p in range(self.n) if self.kind(p) == "free"]

    def reservable(self):
        return [p for p in self.free() if p not in self.restoring]

    def listed(self, p):
        return any(x[1] == p for x in self.listings)

    # transitions
    def reserve(self, rid, pages, tenant):
        r = self.requests.get(rid)
        if r is None:
            self.incs += 1
            r = self.requests[rid] = Req(rid, tenant, self.incs)
        for p in pages:
            self.where[p] = r
        r.reserved.extend(pages)

    def _dirty(self, pages, tenant):
        if self.policy == "all_reused":
            for p in pages:
                self.mark[p] = ALL
        elif self.policy == "cross_tenant":
            for p in pages:
                if self.mark[p] != ALL:
                    self.mark[p] = ("tenant", tenant)

    def return_(self, rid, pages):
        r = self.requests[rid]
        for p in pages:
            r.reserved.remove(p)
            self.where[p] = None
        dirty = [p for p in pages if p in r.restored]
        r.restored.difference_update(pages)
        if self.policy != "released_aliases":
            self._dirty(dirty, r.tenant)

    def commit(self, rid, step, pages):
        r = self.requests[rid]
        listed = []
        for p in pages:
            m = self.mark[p]
            self.mark[p] = None
            if m is None or m == ("tenant", r.tenant):
                continue
            listed.append(p)
            self.listings.append([step, p, r.inc])
        for p in pages:
            r.reserved.remove(p)
            r.kv.append((p, step))
        r.restored.difference_update(pages)
        return listed

    def gone(self, rid):
        r = self.requests.pop(rid)
        kv = r.kv_pages()
        for p in kv:
            if any(x[1] == p and x[2] == r.inc for x in self.listings):
                # listed, never zeroed: the mark comes back
                self.listings = [x for x in self.listings if x[1] != p]
                self.mark[p] = ALL
        for p in r.reserved + kv:
            self.where[p] = None
        if self.policy != "released_aliases":
            self._dirty(kv + [p for p in r.reserved if p in r.restored], r.tenant)
        return r

    def alias(self, sid, pages):
        for p in pages:
            self.aliases[p].add(sid)
        self.snapshots.setdefault(sid, []).extend(pages)

    def release(self, sid):
        for p in self.snapshots.pop(sid):
            self.aliases[p].discard(sid)
            if not self.aliases[p]:
                self.mark[p] = ALL

    def start_restore(self, into, target, pages):
        for p in pages:
            self.restoring[p] = (into, target)
        if into == "request":
            r = self.requests[target]
            r.restored.update(pages)
            for p in pages:
                self.mark[p] = None
                self.restored_since_seal[p] = r.inc

    def complete_restore(self, pages):
        for p in pages:
            del self.restoring[p]

    def seal(self, step):
        plan = []
        keep = []
        for x in self.listings:
            if x[0] == step:
                if x[1] not in plan:
                    plan.append(x[1])
            else:
                keep.append(x)
        self.listings = keep
        self.open_step = step + 1
        self.last_plan = (step, plan)
        self.restored_since_seal = {}
        return plan

    def abort(self, step):
        _, plan = self.last_plan
        self.last_plan = None
        carry = []
        for p in plan:
            r = self.where[p]
            if r is not None and self.restored_since_seal.get(p) == r.inc:
                continue  # its holder's restore overwrote it whole since the seal
            if p in self.restoring and self.restoring[p][0] == "request":
                continue  # a restore is overwriting it whole right now
            if self.kind(p) == "kv":
                if not self.listed(p):
                    carry.append([self.open_step, p, r.inc])
            else:
                self.mark[p] = ALL
        self.listings = carry + self.listings


# --------------------------------------------------------------------------- the bytes oracle

ZERO, ROW = "zero", "row"


class Bytes:
    """What each page physically holds; checks the promises at every sealed step."""

    def __init__(self, model: Model):
        self.m = model
        self.content = [ZERO] * model.n
        self.sealed_prev: dict[int, object] = {}  # page -> content before the last seal touched it
        self.touched: set[int] = set()  # pages written by anything since the last seal
        self.owed: dict[int, list] = {}  # page -> [step, inc, times zeroed]
        self.retired: dict[int, tuple] = {}  # owed entries settled by the last seal

    def own(self, r):
        return ("kv", r.tenant, r.inc)

    def acceptable(self, c, r):
        pol = self.m.policy
        if pol == "released_aliases":
            return c != ROW
        if pol == "cross_tenant":
            return c == ZERO or (c[0] == "kv" and c[1] == r.tenant)
        return c == ZERO or c == self.own(r)

    def write(self, p, c):
        self.content[p] = c
        self.touched.add(p)

    def aliased(self, pages):
        for p in pages:
            self.write(p, ROW)

    def restored_into_request(self, pages, r):
        for p in pages:
            self.write(p, self.own(r))

    def let_go(self, pages, r):
        """``r`` gave the pages back: what it wrote there is no longer data it will read
        (a later reservation by the same request starts over), only its tenant's bytes."""
        for p in pages:
            if self.content[p] == self.own(r):
                self.content[p] = ("kv", r.tenant, -r.inc)

    def committed(self, listed, step, r):
        for p in listed:
            self.owed[p] = [step, r.inc, 0]

    def left_kv(self, pages):
        for p in pages:
            self.owed.pop(p, None)

    def seal(self, step, plan):
        m = self.m
        self.sealed_prev = {}
        self.touched = set()
        for p in plan:
            r = m.where[p]
            c = self.content[p]
            assert r is not None and m.kind(p) == "kv", ("plan lists a page no request holds", p)
            assert c != self.own(r), ("plan zeroes its reader's own KV data", step, p)
            if m.policy == "released_aliases":
                assert c != ZERO, ("plan zeroes a page that already holds zeros", step, p)
            self.sealed_prev.setdefault(p, c)
            self.content[p] = ZERO
            if p in self.owed:
                self.owed[p][2] += 1
        # the step's graph reads every page committed for this step or earlier, then writes it
        for r in m.requests.values():
            for p, s in r.kv:
                if s <= step:
                    assert self.acceptable(self.content[p], r), (
                        "request %d reads page %d holding %r in step %d" % (r.rid, p, self.content[p], step))
                    if self.content[p] != self.own(r):
                        self.sealed_prev.setdefault(p, self.content[p])
                        self.content[p] = self.own(r)
        # every marked page that entered a KV list appears in exactly one plan by its step
        self.retired = {}
        for p, (s, inc, times) in list(self.owed.items()):
            if s <= step:
                assert times == 1, ("page listed at commit was zeroed %d times by step %d" % (times, step), p)
                self.retired[p] = (s, inc)
                del self.owed[p]

    def abort(self, step, plan):
        for p, prev in self.sealed_prev.items():
            if p not in self.touched:
                self.content[p] = prev  # nothing of the aborted step can be assumed done
        m = self.m
        for p, (s, inc) in self.retired.items():
            r = m.where[p]
            if r is not None and r.inc == inc and m.kind(p) == "kv" and m.listed(p):
                self.owed[p] = [m.open_step, inc, 0]
        for p in plan:
            if p in self.owed and p not in self.retired:
                self.owed[p][2] -= 1  # zeroed early by the aborted plan: not done after all
        self.sealed_prev = {}
        self.retired = {}


# --------------------------------------------------------------------------- the machine

class LedgerMachine(RuleBasedStateMachine):
    policy = "released_aliases"

    def __init__(self):
        super().__init__()
        self.L = Ledger(GEOMETRY, policy=self.policy, record=True)
        self.hot = Ledger(GEOMETRY, policy=self.policy)  # the plain hot path
        self.m = Model(NUM_PAGES, self.policy)
        self.b = Bytes(self.m)
        self.ok = True
        self.stats = STATS.setdefault(self.policy, Counter())
        self.stats["runs"] += 1

    # -- plumbing

    def both(self, call):
        """Run ``call`` on both ledgers; they must return the same or raise the same."""
        self.ok = False
        self.stats["commands"] += 1
        try:
            got = call(self.L)
        except KVLedgerError as e:
            with pytest.raises(type(e)):
                call(self.hot)
            raise
        assert call(self.hot) == got
        return got

    def rejected(self, call, exc):
        """``call`` must raise ``exc`` and change nothing, on both ledgers."""
        digest, seq, n_events = self.L.digest(), self.L.seq, len(self.L.events)
        hot_digest = self.hot.digest()
        with pytest.raises(exc) as ei:
            self.both(call)
        assert type(ei.value) is exc, (type(ei.value), exc)
        assert (self.L.digest(), self.L.seq, len(self.L.events)) == (digest, seq, n_events)
        assert self.hot.digest() == hot_digest
        self.stats["rejected"] += 1

    def draw_subset(self, data, pool, max_size=None):
        return data.draw(st.lists(st.sampled_from(sorted(pool)), min_size=1, max_size=max_size, unique=True))

    # -- reserve / return

    @rule(data=st.data(), rid=st.sampled_from(REQUEST_IDS), n=st.integers(1, 3))
    def reserve(self, data, rid, n):
        self._reserve(data, rid, n)

    def _reserve(self, data, rid, n):
        r = self.m.requests.get(rid)
        tenant = data.draw(st.sampled_from(TENANTS if r is None else (None, r.tenant)))
        if n > len(self.m.reservable()):
            self.rejected(lambda L: L.reserve(rid, n, tenant=tenant), OutOfPagesError)
            return None
        pages = self.both(lambda L: L.reserve(rid, n, tenant=tenant))
        assert len(pages) == n and len(set(pages)) == n
        assert all(self.m.kind(p) == "free" and p not in self.m.restoring for p in pages)
        self.m.reserve(rid, pages, tenant if r is None else r.tenant)
        return pages

    @rule(data=st.data(), rid=st.sampled_from(REQUEST_IDS), n=st.integers(1, 3), ahead=st.integers(0, 1))
    def reserve_then_commit(self, data, rid, n, ahead):
        """The common lifecycle step, as two commands: reserve n pages, commit them."""
        pages = self._reserve(data, rid, n)
        if pages is not None:
            step = self.m.open_step + ahead
            self._commit(self.m.requests[rid], step, list(pages), lambda L: L.commit(rid, step, pages=pages))

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
    def commit_pages(self, data, ahead):
        r = data.draw(st.sampled_from(self._with_reserved()))
        pages = self.draw_subset(data, r.reserved)
        step = self.m.open_step + ahead
        self._commit(r, step, pages, lambda L: L.commit(r.rid, step, pages=list(pages)))

    # -- cancel / finish

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data(), finished=st.booleans())
    def request_gone(self, data, finished):
        rid = data.draw(st.sampled_from(sorted(self.m.requests)))
        self.both(lambda L: L.finish(rid) if finished else L.cancel(rid))
        r = self.m.gone(rid)
        self.b.left_kv(r.kv_pages())
        self.b.let_go(r.reserved + r.kv_pages(), r)
        self.stats["finished" if finished else "cancelled"] += 1

    # -- snapshots

    @rule(sid=st.sampled_from(SNAPSHOT_IDS), n=st.integers(1, 3))
    def alias_n(self, sid, n):
        self._alias_n(sid, n)

    def _alias_n(self, sid, n):
        if n > len(self.m.reservable()):
            self.rejected(lambda L: L.alias_snapshot(sid, n), OutOfPagesError)
            return False
        pages = self.both(lambda L: L.alias_snapshot(sid, n))
        assert len(set(pages)) == n
        assert all(self.m.kind(p) == "free" and p not in self.m.restoring for p in pages)
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

    # -- steps

    @rule()
    def seal(self):
        step = self.m.open_step
        plan = self.both(lambda L: L.seal_step(step))
        expect = self.m.seal(step)
        assert plan.step == step
        assert len(set(plan.clear_list)) == len(plan.clear_list)
        assert set(plan.clear_list) == set(expect), (step, plan.clear_list, expect)
        self.b.seal(step, list(plan.clear_list))
        self.stats["steps sealed"] += 1
        self.stats["pages cleared"] += len(plan.clear_list)

    @precondition(lambda self: self.m.open_step > 0)
    @rule(data=st.data(), rank=st.integers(0, 2))
    def complete_step(self, data, rank):
        step = data.draw(st.integers(0, self.m.open_step - 1))
        self.both(lambda L: L.complete_step(step, rank))

    @precondition(lambda self: self.m.last_plan is not None)
    @rule()
    def abort_step(self):
        step, plan = self.m.last_plan
        self.both(lambda L: L.abort_step(step, "rank failed"))
        self.m.abort(step)
        self.b.abort(step, plan)
        self.stats["steps aborted"] += 1

    # -- invalid commands

    def _invalid_candidates(self):
        m = self.m
        out = []
        kinds = {p: m.kind(p) for p in range(NUM_PAGES)}
        known = sorted(m.requests)
        unknown = [r for r in REQUEST_IDS if r not in m.requests]
        for p, k in kinds.items():
            if k != "free":
                rid = known[0] if known else 0
                tenant = m.requests[rid].tenant if known else None
                ev = PagesReserved(request=rid, page_ids=(p,), tenant=tenant)
                out.append((lambda L, ev=ev: L.submit(ev), PageNotHeldError))
            elif p in m.restoring:
                out.append((lambda L, p=p: L.submit(PagesReserved(request=99, page_ids=(p,))), RestoringPageError))
            if k in ("reserved", "kv"):
                out.append((lambda L, p=p: L.alias_snapshot(0, pages=[p]), PageNotHeldError))
            elif p in m.restoring:
                out.append((lambda L, p=p: L.alias_snapshot(0, pages=[p]), RestoringPageError))
            if p not in m.restoring:
                out.append((lambda L, p=p: L.complete_restore([p], request=0), PageNotHeldError))
        for rid in known:
            r = m.requests[rid]
            mine = set(r.reserved)
            for p in range(NUM_PAGES):
                if p not in mine:
                    out.append((lambda L, rid=rid, p=p: L.commit(rid, m.open_step, pages=[p]), PageNotHeldError))
                    out.append((lambda L, rid=rid, p=p: L.return_reservation(rid, [p]), PageNotHeldError))
                    out.append((lambda L, rid=rid, p=p: L.start_restore([p], request=rid), PageNotHeldError))
            for p in r.reserved:
                if p in m.restoring:
                    out.append((lambda L, rid=rid, p=p: L.commit(rid, m.open_step, pages=[p]), RestoringPageError))
                    out.append((lambda L, rid=rid, p=p: L.start_restore([p], request=rid), RestoringPageError))
                elif m.open_step > 0:
                    out.append((lambda L, rid=rid, p=p: L.commit(rid, m.open_step - 1, pages=[p]), StepOrderError))
            other = [t for t in TENANTS if t is not None and t != r.tenant]
            out.append((lambda L, rid=rid, t=other[0]: L.reserve(rid, 1, tenant=t), TenantMismatchError))
            out.append((lambda L, rid=rid: L.commit(rid, m.open_step, pages=[]), InvalidArgumentError))
        for rid in unknown:
            out.append((lambda L, rid=rid: L.cancel(rid), UnknownRequestError))
            out.append((lambda L, rid=rid: L.finish(rid), UnknownRequestError))
            out.append((lambda L, rid=rid: L.commit(rid, m.open_step, pages=[0]), UnknownRequestError))
            out.append((lambda L, rid=rid: L.start_restore([0], request=rid), UnknownRequestError))
        for sid in SNAPSHOT_IDS:
            if sid not in m.snapshots:
                out.append((lambda L, sid=sid: L.release_snapshot(sid), UnknownSnapshotError))
                out.append((lambda L, sid=sid: L.start_restore([0], snapshot=sid), UnknownSnapshotError))
            else:
                mine = m.snapshots[sid]
                for p in mine:
                    if p not in m.restoring:
                        out.append((lambda L, sid=sid, p=p: L.alias_snapshot(sid, pages=[p]), DuplicatePageError))
                for p in range(NUM_PAGES):
                    if p not in mine:
                        out.append((lambda L, sid=sid, p=p: L.start_restore([p], snapshot=sid), PageNotHeldError))
        out.append((lambda L: L.reserve(98, len(m.reservable()) + 1), OutOfPagesError))
        out.append((lambda L: L.alias_snapshot(0, len(m.reservable()) + 1), OutOfPagesError))
        out.append((lambda L: L.seal_step(m.open_step + 1), StepOrderError))
        out.append((lambda L: L.complete_step(m.open_step, 0), StepOrderError))
        last = m.last_plan[0] if m.last_plan else None
        out.append((lambda L: L.abort_step(m.open_step), StepOrderError))
        if m.open_step > 0:
            out.append((lambda L: L.seal_step(m.open_step - 1), StepOrderError))
            if last != m.open_step - 1:
                out.append((lambda L: L.abort_step(m.open_step - 1), StepOrderError))
        out.append((lambda L: L.alias_snapshot(0, pages=[NUM_PAGES]), PageOutOfRangeError))
        out.append((lambda L: L.alias_snapshot(0, pages=[-1]), PageOutOfRangeError))
        out.append((lambda L: L.alias_snapshot(0, pages=[1, 1]), DuplicatePageError))
        return out

    @rule(data=st.data())
    def invalid_command(self, data):
        call, exc = data.draw(st.sampled_from(self._invalid_candidates()))
        self.rejected(call, exc)

    # -- checks after every step

    @invariant()
    def agrees_with_the_model(self):
        try:
            self._agrees_with_the_model()
        except BaseException:
            self.stats["violations"] += 1  # counted where it is seen, then reported by hypothesis
            raise

    def _agrees_with_the_model(self):
        L, m = self.L, self.m
        check_invariants(L.state)
        check_invariants(self.hot.state)
        assert self.hot.digest() == L.digest()
        for p in range(NUM_PAGES):
            assert L.holder_of(p) == m.holder(p), (p, L.holder_of(p), m.holder(p))
            # (a tenant mark vs a mark for everyone shows in which commits list the page)
            assert L.is_marked(p) == (m.mark[p] is not None), (p, L.is_marked(p), m.mark[p])
            assert L.is_restoring(p) == (p in m.restoring), p
        assert L.free_count == len(m.free())
        assert L.reservable_count == len(m.reservable())
        assert L.open_step == m.open_step
        assert sorted(L.state.requests) == sorted(m.requests)
        for rid, r in m.requests.items():
            assert L.reserved_pages(rid) == tuple(r.reserved)
            assert L.kv_pages(rid) == tuple(r.kv_pages())
        assert sorted(L.state.snapshots) == sorted(m.snapshots)
        for sid, pages in m.snapshots.items():
            assert L.snapshot_pages(sid) == tuple(pages)
        self.stats["steps checked"] += 1
        self.ok = True

    def teardown(self):
        if not self.ok:
            return  # a rule failed: let hypothesis report that
        L = self.L
        assert replay(L.events, check=True).digest() == L.digest()
        # drain: every restore completes, every request and snapshot goes; all pages come back
        for (into, target) in sorted(set(self.m.restoring.values())):
            pages = [p for p, t in self.m.restoring.items() if t == (into, target)]
            L.complete_restore(pages, **{into: target})
            self.m.complete_restore(pages)
        for rid in sorted(self.m.requests):
            L.cancel(rid)
        for sid in sorted(self.m.snapshots):
            L.release_snapshot(sid)
        assert L.free_count == NUM_PAGES and L.reservable_count == NUM_PAGES
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


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    for policy, c in sorted(STATS.items()):
        print(
            "\nR8 state machine [%s]: runs=%d steps=%d commands=%d rejected=%d listed=%d cleared=%d "
            "sealed=%d aborted=%d cancelled=%d finished=%d released=%d restores(req/snap)=%d/%d "
            "alias-reuse=%d replays=%d violations=%d"
            % (policy, c["runs"], c["steps checked"], c["commands"], c["rejected"], c["listed"],
               c["pages cleared"], c["steps sealed"], c["steps aborted"], c["cancelled"], c["finished"],
               c["released"], c["restores into requests"], c["restores into snapshots"],
               c["alias pages reused"], c["replays"], c["violations"])
        )
