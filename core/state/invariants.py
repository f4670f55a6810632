"""SPEC invariants 1-4, checked from scratch over the whole state (check mode, property tests).

Invariant 5 (replay reproduces digest and effects) is a property of the log and
is checked by replay, not here.
"""

from __future__ import annotations

from collections import Counter

from ..errors import InvariantViolation
from .state import LedgerState
from .table import ALIAS, CACHED, FREE, HOLDER_ALIAS, HOLDER_CACHED, HOLDER_FREE, KV, MARK_ALL, MARK_TENANT, RESERVED

__all__ = ["check_invariants", "check_page_ids"]


def check_invariants(st: LedgerState) -> None:
    """Raise ``InvariantViolation`` naming the first broken invariant and page. Pure, and total: a
    state built from forged bytes gets the same error, never an IndexError."""
    if st.geometry is None:
        return
    check_page_ids(st)
    h = st.holder_codes()  # derived from the holder list and the request lists
    _holders_partition(st, h)
    _free_stack_agrees(st, h)
    _marks_and_pending(st, h)
    _clear_lists_and_restores(st, h)
    _prefix_cache(st, h)


def check_page_ids(st: LedgerState) -> None:
    """Every page id the state names lies in ``[0, num_pages)``, else ``InvariantViolation`` naming
    the collection and the id (O(ids named); the page table's own length is the caller's check)."""
    n = st.num_pages
    reqs = st.requests.values()
    named = [("a request's reserved pages", [p for rec in reqs for p in rec.reserved]),
             ("a request's KV pages", [p for rec in reqs for p in rec.kv]),
             ("a request's restored pages", [p for rec in reqs for p in rec.restored or ()]),
             ("a snapshot", [p for pages in st.snapshots.values() for p in pages]),
             ("a clear list", [p for pages in st.clear_lists.values() for p in pages]),
             ("a step in flight", [p for plan in st.in_flight for p in plan.clear_list]),
             ("the marks", st.marks), ("the residue", st.residue), ("the restore targets", st.restore_targets),
             ("the pending clears", st.pending), ("the restored pages", st.restored_since),
             ("the page hashes", st.page_hash), ("the sharers", st.sharers), ("the cached pages", st.cached)]
    for what, ids in named:
        for p in ids:
            if type(p) is not int or not 0 <= p < n:
                raise InvariantViolation(1, f"{what} names page {p!r}, outside the geometry's [0, {n})")


def _request_index(st: LedgerState) -> dict[int, tuple[int, int]]:
    """page -> (RESERVED or KV, its first holder) from the request tables. A page in two
    tables is a violation unless it is a shared KV page and ``sharers`` names exactly them."""
    where: dict[int, tuple[int, int]] = {}
    held_by: dict[int, list[int]] = {}
    for r, rec in st.requests.items():
        if len(rec.kv_steps) != len(rec.kv):
            raise InvariantViolation(1, f"request {r} has {len(rec.kv)} kv pages but {len(rec.kv_steps)} commit steps")
        for kind, pages in ((RESERVED, rec.reserved), (KV, rec.kv)):
            for p in pages:
                if p in where:
                    if kind != KV or where[p][0] != KV or p not in st.sharers:
                        raise InvariantViolation(1, f"page {p} listed twice in request tables")
                    held_by[p].append(r)
                    continue
                where[p] = (kind, r)
                if kind == KV:
                    held_by[p] = [r]
    for p, rs in st.sharers.items():
        first = next(iter(rs), None)
        if len(rs) < 2 or sorted(rs) != sorted(held_by.get(p, ())) or st.holder[p] != first:
            raise InvariantViolation(1, f"shared page {p}: sharers {list(rs)} != the requests holding it "
                                     f"{held_by.get(p)}")
        where[p] = (KV, first)
    for p, holders in held_by.items():
        if len(holders) > 1 and p not in st.sharers:
            raise InvariantViolation(1, f"page {p} is in the KV of {holders} but not recorded as shared")
    return where


def _holders_partition(st: LedgerState, h: bytearray) -> None:
    """1. The holders partition the pages, and every index agrees with the arrays."""
    o, an = st.holder, st.alias_count
    where = _request_index(st)
    alias_counts = Counter(p for pages in st.snapshots.values() for p in pages)
    for s, pages in st.snapshots.items():
        if len(set(pages)) != len(pages):
            raise InvariantViolation(1, f"snapshot {s} lists a page twice")
        if not pages:
            raise InvariantViolation(1, f"snapshot {s} is live with no pages")
    for p in range(st.num_pages):
        kind = h[p]
        if kind == FREE:
            if o[p] != HOLDER_FREE or an[p] or p in where:
                raise InvariantViolation(1, f"free page {p} still has a holder or alias")
        elif kind in (RESERVED, KV):
            if where.get(p) != (kind, o[p]):
                raise InvariantViolation(1, f"page {p} holder {st.holder_of(p)} disagrees with request tables")
            if an[p]:
                raise InvariantViolation(1, f"page {p} is both {st.holder_of(p)} and aliased")
        elif kind == ALIAS:
            if o[p] != HOLDER_ALIAS or an[p] < 1 or an[p] != alias_counts.get(p, 0) or p in where:
                raise InvariantViolation(1, f"alias page {p} count {an[p]} != snapshots {alias_counts.get(p, 0)}")
        elif kind == CACHED:
            if o[p] != HOLDER_CACHED or an[p] or p in where:
                raise InvariantViolation(1, f"cached page {p} is also held or aliased")
        else:
            raise InvariantViolation(1, f"page {p} has unknown holder code {kind}")
        if kind != ALIAS and alias_counts.get(p):
            raise InvariantViolation(1, f"page {p} is in a snapshot but held as {st.holder_of(p)}")


def _free_stack_agrees(st: LedgerState, h: bytearray) -> None:
    """1. The free stack holds exactly the free pages, each once."""
    free = h.count(FREE)
    live = st.live_free_stack()
    parked = [p for _, pages in st.parked for p in pages]
    if free != len(live) or len(st.free_stack) - st.stale_entries + len(parked) != free:
        raise InvariantViolation(1, f"free stack holds {len(live)} live pages ({len(st.free_stack)} entries, "
                                 f"{st.stale_entries} counted stale, {len(parked)} parked), {free} are free")
    if st.free_stack and (h[st.free_stack[-1]] != FREE or st.free_stack[-1] in st.restore_targets):
        raise InvariantViolation(1, f"the top of the free stack, page {st.free_stack[-1]}, is not free and reservable")
    markers = [m for m, _ in st.parked]
    restoring_free = {p for p in st.restore_targets if h[p] == FREE}
    if (len(parked) != st.parked_count or set(parked) != restoring_free or markers != sorted(set(markers))
            or (markers and markers[-1] > len(st.free_stack)) or not all(pages for _, pages in st.parked)):
        raise InvariantViolation(1, f"parked runs {st.parked[:4]} do not hold exactly the free pages a restore is "
                                 f"writing {sorted(restoring_free)[:8]}, in order below the top of the stack")
    stack_counts = Counter(live)
    for p in range(st.num_pages):
        c = stack_counts.get(p, 0)
        if c != (h[p] == FREE):
            raise InvariantViolation(1, f"free stack holds page {p} {c} times, holder {st.holder_of(p)}")


def _marks_and_pending(st: LedgerState, h: bytearray) -> None:
    """2. No KV page carries a mark. 3. A mark is either set or pending, never both."""
    n, o = st.num_pages, st.holder
    marks, pend = st.marks, st.pending
    for step in st.clear_lists:
        if step < st.open_step:
            raise InvariantViolation(3, f"clear list of sealed step {step} was never planned")
    for p, m in marks.items():
        if not 0 <= p < n or m not in (MARK_ALL, MARK_TENANT):
            raise InvariantViolation(3, f"bad mark {m!r} on page {p}")
        if h[p] == KV:
            raise InvariantViolation(2, f"page {p} is in kv({o[p]}) and still marked")
        if p in pend:
            raise InvariantViolation(3, f"page {p} is both marked and pending a clear")
        if (m == MARK_TENANT) != (p in st.residue):
            raise InvariantViolation(3, f"page {p} mark {m} disagrees with its residue tenant")
    if len(st.residue) != sum(1 for m in marks.values() if m == MARK_TENANT):
        raise InvariantViolation(3, "residue tenants recorded for unmarked pages")
    for p, step in pend.items():
        if h[p] != KV:
            raise InvariantViolation(3, f"page {p} pending a clear but held as {st.holder_of(p)}")
        if p not in st.clear_lists.get(step, ()):
            raise InvariantViolation(3, f"page {p} pending a clear in step {step} but not in its clear list")


def _clear_lists_and_restores(st: LedgerState, h: bytearray) -> None:
    """4. Clear lists hold valid ids; the last plan's ids are distinct and none restoring."""
    n = st.num_pages
    for pages in st.clear_lists.values():
        for p in pages:
            if not 0 <= p < n:
                raise InvariantViolation(4, f"clear list holds out-of-range page {p}")
    steps = [plan.step for plan in st.in_flight]
    if steps != sorted(set(steps)) or (steps and steps[-1] >= st.open_step):
        raise InvariantViolation(4, f"plans in flight for steps {steps} with step {st.open_step} open")
    for plan in st.in_flight:
        cl = plan.clear_list
        if len(set(cl)) != len(cl):
            raise InvariantViolation(4, f"plan of step {plan.step} lists a page twice")
    for p in st.restore_targets:
        if not 0 <= p < n:
            raise InvariantViolation(4, f"restoring page {p} out of range")
        if h[p] == KV or p in st.pending:
            raise InvariantViolation(4, f"restoring page {p} is {st.holder_of(p)} / pending a clear")


def _prefix_cache(st: LedgerState, h: bytearray) -> None:
    """Hashes and pages agree both ways; a hashed page is kv or cached, never marked, pending or
    restoring; a cached page is hashed and in the LRU; a page with the cached holder code is cached."""
    tenants = st.page_hash.keys() if st.policy != "released_aliases" else set()  # kept for the isolating policies
    if len(st.page_hash) != len(st.hash_page) or st.hash_tenant.keys() != tenants:
        raise InvariantViolation(1, "page -> hash, hash -> page and page -> tenant maps disagree")
    for p, hsh in st.page_hash.items():
        if st.hash_page.get(hsh) != p:
            raise InvariantViolation(1, f"page {p} has hash {hsh!r}, which names page {st.hash_page.get(hsh)}")
        if h[p] not in (KV, CACHED):
            raise InvariantViolation(1, f"hashed page {p} is {st.holder_of(p)}")
        if p in st.marks:
            raise InvariantViolation(2, f"hashed page {p} ({st.holder_of(p)}) is marked stale")
        if p in st.pending:
            raise InvariantViolation(3, f"hashed page {p} is pending a clear")
        if p in st.restore_targets:
            raise InvariantViolation(4, f"hashed page {p} is restoring")
    for p in st.cached:
        if h[p] != CACHED or p not in st.page_hash:
            raise InvariantViolation(1, f"page {p} is in the cache LRU but is {st.holder_of(p)}")
    if h.count(CACHED) != len(st.cached):
        raise InvariantViolation(1, f"{h.count(CACHED)} pages are cached, the LRU holds {len(st.cached)}")
    for p in st.sharers:
        if p not in st.page_hash:
            raise InvariantViolation(1, f"shared page {p} has no hash")
