"""The fold of pages, requests and snapshot rows: one applier per event, ``(state, event) -> effects``.

The fold has three modules, one per seam of the state: this one (the page table,
the allocator's free stack, requests and snapshot rows, marks), ``fold_steps.py``
(the step book: the open step, clear lists, plans in flight, completions, aborts)
and ``fold_prefix.py`` (the prefix index: hashes, sharers, the cache).

An applier assumes its event passed its precondition (``preconditions.py``) and
never raises for one. It advances ``state.seq`` and returns the event's effects:
``(ClearPages,)`` for a commit that listed marked pages, ``(StepPlan,)`` for a
seal, ``()`` otherwise. Pure: no I/O, no logging, no clock, no object per page.
The fold modules (this one and ``fold_prefix.py``) are the only code that writes
a ``LedgerState`` (``tests/core/test_fold_writes.py`` reads every other module's
source and fails on a write).

The table's appliers (one per event, ``transitions.py``) serve replay and every
command outside its common case. The commands' fast paths (``core/ledger.py``)
decide their events in the common case of the precondition and fold them
through the appliers of that case, each named for its events and taking them
(plus the request's record the command already looked up), never a hand copy:

    reserved_top(st, rec, reserved)                the top of a clean free stack
    allocated_one(st, rec, reserved, committed)    one page: the top, unmarked
    allocated_top(st, rec, reserved, committed)    the top n, none marked
    pages_committed(st, committed, rec)            the head of r's reservation (the table's
                                                   applier, given the record the command has)
(``fold_steps.py``: ``sealed``, the seal with its clear list derived once, and
``completed``; ``fold_prefix.py``: ``published``, ``shared``, ``shared_cached``,
``evicted``, ``taken_from_cache``.) Each equals the table's applier (or two of them, in
order) on the same events in that case: R8 drives ledgers of every mode and a
ledger whose state has its own table through the same commands and compares them.

Every applier that sets marks returns ``PagesMarked`` with those pages (the
sanitizer poisons them before the next plan's clear).

Marks and clear lists (the seed's rule, policy ``released_aliases``):
    SnapshotReleased   sets the mark on every page whose last alias went away
    PagesCommitted     takes the mark off each marked page and lists it for ``step``
    RestoreStarted     into a request: takes the mark off (the restore overwrites
                       the whole page), never lists it
    StepSealed         the plan: the step's listed pages still held as KV, once each,
                       in the order they were (last) listed
    a listed page that leaves KV before its step is sealed gets its mark back:
    nothing has zeroed it yet.
The other policies also mark pages when a request lets go of bytes it wrote
(``cross_tenant``: marked for other tenants only; ``all_reused``: for everyone).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import filterfalse
from typing import TYPE_CHECKING

from ..events.events import (
    CacheConfigured, ClearPages, PagesCommitted, PagesMarked, PagesReleased, PagesReserved, ReservationReturned,
    RestoreCompleted, RestoreStarted, SnapshotAliased, SnapshotReleased,
)
from .table import (
    HOLDER_ALIAS, HOLDER_CACHED, HOLDER_FREE, MARK_ALL, MARK_TENANT, SHARERS_ORDERED, RequestRecord,
)

if TYPE_CHECKING:
    from .state import LedgerState

__all__ = [
    "NO_EFFECTS", "allocated_one", "allocated_top", "cache_configured", "free_pages", "marked_effect",
    "pages_committed", "pages_released", "pages_reserved", "record", "request_gone",
    "reservation_returned", "reserved_top", "restore_completed", "restore_started", "snapshot_aliased",
    "snapshot_released", "take_from_stack",
]

NO_EFFECTS: tuple = ()
_NOBODY = object()  # a tenant no residue names (a commit that reads the whole page lists every mark)


# ---------------------------------------------------------------------- shared pieces (fold_prefix uses them too)


def take_from_stack(st: LedgerState, pages) -> None:
    """Pages that were free (their holder already changed) leave the free stack.

    The top is deleted in place. Pages deeper down leave stale entries (O(1) each);
    stale entries on the top are then popped so the top stays live, and the stack is
    compacted when more than half is stale. Parked runs above the new top sink onto it.
    """
    stack, holder = st.free_stack, st.holder
    k = len(pages)
    if not st.stale_entries and tuple(stack[: -k - 1 : -1]) == tuple(pages):
        del stack[-k:]  # the allocator's choice: the top
        if st.parked:
            st.clamp_parked()
        return
    st.stale_entries += k
    targets = st.restore_targets
    while stack and (holder[stack[-1]] != HOLDER_FREE or stack[-1] in targets):
        stack.pop()  # (an entry of a parked page is stale too)
        st.stale_entries -= 1
    if st.parked:
        st.clamp_parked()
    if st.stale_entries > 64 and 2 * st.stale_entries > len(stack):
        st.compact_free_stack()


def _remove(seq: list[int], pages) -> None:
    """Remove ``pages`` from ``seq`` keeping order; fast when they are its prefix."""
    k = len(pages)
    if tuple(seq[:k]) == tuple(pages):
        del seq[:k]
        return
    gone = set(pages)
    seq[:] = [p for p in seq if p not in gone]


def free_pages(st: LedgerState, pages, tenant: str | None, dirty) -> list[int] | tuple:
    """Pages leave a request for the free stack; marks follow the policy. Returns the pages
    it marked (a listed page that never got its clear, and the policy's marks).

    ``dirty``: the pages among them that hold bytes the request wrote (its KV
    pages, reserved pages a restore wrote); only the non-default policies mark them.
    """
    holder, free = st.holder, HOLDER_FREE
    for p in pages:
        holder[p] = free
    marked: list[int] | tuple = NO_EFFECTS
    pend = st.pending
    if pend and not pend.keys().isdisjoint(pages):
        marks, residue = st.marks, st.residue
        marked = []
        for p in pages:
            if p in pend:
                # Listed for a step that has not been sealed: nothing zeroed it yet.
                del pend[p]
                marks[p] = MARK_ALL
                residue.pop(p, None)
                marked.append(p)
    ow = st.overwritten
    if ow and not ow.keys().isdisjoint(pages):
        marks, residue, open_step = st.marks, st.residue, st.open_step
        marked = list(marked)
        for p in pages:
            s = ow.get(p)
            if s is not None and s >= open_step:
                # Committed to be written whole by a step that has not been sealed: nothing wrote it.
                del ow[p]
                marks[p] = MARK_ALL
                residue.pop(p, None)
                marked.append(p)
    st.push_free(pages)
    if dirty and st.policy != "released_aliases":
        marks = st.marks
        if st.policy == "all_reused":
            for p in dirty:
                marks[p] = MARK_ALL
        else:
            residue = st.residue
            for p in dirty:
                if marks.get(p) != MARK_ALL:
                    marks[p] = MARK_TENANT
                    residue[p] = tenant
        marked = list(dict.fromkeys([*marked, *dirty]))
    return marked


def marked_effect(pages) -> tuple:
    """The effect for pages that just got a mark (nothing when there are none)."""
    return (PagesMarked(page_ids=tuple(pages)),) if pages else NO_EFFECTS


# ---------------------------------------------------------------------- one per event


def cache_configured(st: LedgerState, e: CacheConfigured) -> tuple:
    n = e.geometry.num_pages
    st.geometry = e.geometry
    st.policy = e.policy
    st.num_pages = n
    st.holder = [HOLDER_FREE] * n
    st.alias_count = [0] * n
    # Lowest ids on top: the first reservation of a fresh cache takes pages 0, 1, ...
    st.free_stack = list(range(n - 1, -1, -1))
    st.seq += 1
    return NO_EFFECTS


def pages_reserved(st: LedgerState, e: PagesReserved) -> tuple:
    pages = e.page_ids
    r = e.request
    rec = st.requests.get(r)
    if rec is None:
        st.requests[r] = RequestRecord(r, e.tenant, list(pages), [], [])
    else:
        rec.reserved += pages
    holder = st.holder
    for p in pages:
        holder[p] = r
    take_from_stack(st, pages)
    st.seq += 1
    return NO_EFFECTS


def reserved_top(st: LedgerState, rec: RequestRecord | None, e: PagesReserved) -> tuple:
    """PagesReserved of the top ``len(e.page_ids)`` entries of a free stack without stale entries,
    top first (the allocator's pick: ``pick_free``), into ``rec``'s request (None: a new one, made
    with ``e.tenant``)."""
    pages = e.page_ids
    stack = st.free_stack
    del stack[-len(pages):]
    if st.parked and st.parked[-1][0] > len(stack):
        st.clamp_parked()
    holder, r = st.holder, e.request
    for p in pages:
        holder[p] = r
    if rec is None:
        st.requests[r] = RequestRecord(r, e.tenant, list(pages), [], [])
    else:
        rec.reserved += pages
    st.seq += 1
    return NO_EFFECTS


def allocated_top(st: LedgerState, rec: RequestRecord | None, r: PagesReserved, c: PagesCommitted) -> tuple:
    """PagesReserved then PagesCommitted of the same pages in one pass: the top of a free stack
    without stale entries, none marked (so nothing is listed: no effects), for a request without
    reserved pages (``rec``; None: a new one, made with ``r.tenant``)."""
    pages = r.page_ids
    n = len(pages)
    stack = st.free_stack
    del stack[-n:]
    if st.parked and st.parked[-1][0] > len(stack):
        st.clamp_parked()
    holder, request = st.holder, r.request
    for p in pages:
        holder[p] = request
    if rec is None:
        st.requests[request] = RequestRecord(request, r.tenant, [], list(pages), [c.step] * n)
    else:
        rec.kv += pages
        rec.kv_steps += [c.step] * n
    st.seq += 2
    return NO_EFFECTS


def allocated_one(st: LedgerState, rec: RequestRecord | None, r: PagesReserved, c: PagesCommitted) -> None:
    """``allocated_top`` of one page (vLLM's ``get_new_blocks(1)``, the commonest allocation)."""
    del st.free_stack[-1]
    request = r.request
    p = r.page_ids[0]
    st.holder[p] = request
    if rec is None:
        st.requests[request] = RequestRecord(request, r.tenant, [], [p], [c.step])
    else:
        rec.kv.append(p)
        rec.kv_steps.append(c.step)
    if st.parked and st.parked[-1][0] > len(st.free_stack):
        st.clamp_parked()
    st.seq += 2


def reservation_returned(st: LedgerState, e: ReservationReturned) -> tuple:
    rec = st.requests[e.request]
    pages = e.page_ids
    _remove(rec.reserved, pages)
    dirty: tuple | list = ()
    if rec.restored:
        dirty = [p for p in pages if p in rec.restored]
        rec.restored.difference_update(pages)
    marked = free_pages(st, pages, rec.tenant, dirty)
    st.seq += 1
    return marked_effect(marked)


def pages_committed(st: LedgerState, e: PagesCommitted, rec: RequestRecord | None = None) -> tuple:
    """``e.page_ids`` (reserved by the request, none restoring, ``e.step`` not sealed) join its block
    table; marked ones are listed for the step (``e.reads == "tail"``: except those marked for
    other tenants only and left by its own; ``"whole"``: all of them). Returns ``(ClearPages,)`` or
    ``()``. ``rec``: the request's record, when the caller (a command's fast path) has it."""
    if rec is None:
        rec = st.requests[e.request]
    pages, step = e.page_ids, e.step
    marks = st.marks
    listed = None
    if marks and not marks.keys().isdisjoint(pages):
        residue, pend = st.residue, st.pending
        listed = []
        own = rec.tenant if e.reads == "tail" else _NOBODY
        for p in pages:
            m = marks.pop(p, 0)
            if m:
                if e.reads == "none":  # written whole before it is read: the mark comes off, unlisted
                    residue.pop(p, None)
                    st.overwritten[p] = step
                    continue
                if m == MARK_TENANT and residue.pop(p) == own:
                    continue  # the committing tenant's own bytes, read under a mask
                if p not in pend:
                    pend[p] = step
                    listed.append(p)
    reserved, k = rec.reserved, len(pages)
    if tuple(reserved[:k]) == pages:  # the usual commit: the head
        del reserved[:k]
    else:
        _remove(reserved, pages)
    if rec.restored:
        rec.restored.difference_update(pages)
    rec.kv += pages
    rec.kv_steps += [step] * k
    st.seq += 1
    if not listed:
        return NO_EFFECTS
    cl = st.clear_lists.get(step)
    if cl is None:
        st.clear_lists[step] = listed
    else:
        cl.extend(listed)
    return (ClearPages(step=step, page_ids=tuple(listed)),)


def request_gone(st: LedgerState, e) -> tuple:
    """RequestCancelled / RequestFinished: the request (known) goes: reserved pages go free; each
    KV page loses r as a holder: still held by others, it stays kv(R - {r}); hashed, it goes
    cached(h) (the request's last block first in line for eviction); otherwise free. Returns
    the effects (``PagesMarked`` when the policy or a pending clear marked pages)."""
    rec = st.requests.pop(e.request)
    kv, reserved = rec.kv, rec.reserved
    if st.page_hash:  # (prefix caching in use: a shared page is hashed, so this covers them too)
        kv = _release_shares(st, rec)
    pages = reserved + kv if reserved else kv
    if (st.policy == "released_aliases" and not (st.pending and not st.pending.keys().isdisjoint(pages))
            and not st.overwritten):
        holder, free = st.holder, HOLDER_FREE  # (the usual case: _free_pages without marks, inline)
        for p in pages:
            holder[p] = free
        st.push_free(pages)
        st.seq += 1
        return NO_EFFECTS
    dirty: tuple | list = ()
    if st.policy != "released_aliases":
        dirty = kv + [p for p in reserved if rec.restored and p in rec.restored]
    marked = free_pages(st, pages, rec.tenant, dirty)
    st.seq += 1
    return (PagesMarked(page_ids=tuple(marked)),) if marked else NO_EFFECTS


def pages_released(st: LedgerState, e: PagesReleased) -> tuple:
    """Request ``e.request`` (live) lets go of ``e.page_ids``, some of its KV pages: they leave its
    block table, and each goes where ``request_gone`` sends a page of a request that ends (still
    shared: the others keep it; hashed: cached, the last released first in line for eviction;
    else free, marked as the policy marks a request's bytes). Returns ``PagesMarked`` or ``()``."""
    rec = st.requests[e.request]
    pages = e.page_ids
    r, gone = rec.request, set(pages)
    kv, steps = rec.kv, rec.kv_steps
    if tuple(kv[-len(pages):]) == pages:  # (the commonest: the tail, in order)
        del kv[-len(pages):], steps[-len(pages):]
    else:
        keep = [i for i, p in enumerate(kv) if p not in gone]
        rec.kv = [kv[i] for i in keep]
        rec.kv_steps = [steps[i] for i in keep]
    holder, sharers, hashed = st.holder, st.sharers, st.page_hash
    freed: list[int] = []
    to_cache: list[int] = []
    for p in pages:
        holders = sharers.get(p) if sharers else None
        if holders is not None:
            del holders[r]  # (an ordered set: table.py)
            if holder[p] == r:
                if len(holders) >= SHARERS_ORDERED and type(holders) is dict:
                    holders = sharers[p] = OrderedDict.fromkeys(holders)
                holder[p] = next(iter(holders))
            if len(holders) == 1:
                del sharers[p]
        elif p in hashed:
            holder[p] = HOLDER_CACHED
            to_cache.append(p)
        else:
            freed.append(p)
    cache = st.cached
    for p in reversed(to_cache):
        cache[p] = None
    marked: list[int] | tuple = ()
    if freed:
        marked = free_pages(st, freed, rec.tenant, freed if st.policy != "released_aliases" else ())
    st.seq += 1
    return marked_effect(marked)


def record(st: LedgerState, e) -> tuple:
    """A record-only event (``RequestLabelled``): the fold counts it, nothing more."""
    st.seq += 1
    return NO_EFFECTS


def _release_shares(st: LedgerState, rec: RequestRecord) -> list[int]:
    """r leaves its shared and hashed KV pages; returns the KV pages that go free."""
    r, holder, sharers, hashed, cached = rec.request, st.holder, st.sharers, st.page_hash, HOLDER_CACHED
    freed: list[int] = []
    to_cache: list[int] = []
    if sharers:
        for p in rec.kv:  # one pass: shared pages lose r, hashed ones go cached, the rest free
            holders = sharers.get(p)
            if holders is not None:
                del holders[r]  # (an ordered set: table.py)
                if holder[p] == r:  # the first left: the next in joining order comes first
                    if len(holders) >= SHARERS_ORDERED and type(holders) is dict:
                        holders = sharers[p] = OrderedDict.fromkeys(holders)  # (a long set: its first O(1) now)
                    holder[p] = next(iter(holders))
                if len(holders) == 1:
                    del sharers[p]
            elif p in hashed:
                holder[p] = cached
                to_cache.append(p)
            else:
                freed.append(p)
    else:  # nothing shared: hashed pages go cached, the rest free (C-level passes)
        to_cache = list(filter(hashed.__contains__, rec.kv))
        if len(to_cache) < len(rec.kv):
            freed = list(filterfalse(hashed.__contains__, rec.kv))
        for p in to_cache:
            holder[p] = cached
    cache = st.cached
    for p in reversed(to_cache):  # the last block first: the first to be evicted (a loop: an
        cache[p] = None           # OrderedDict's update() of many keys costs twice as much)
    return freed


def snapshot_aliased(st: LedgerState, e: SnapshotAliased) -> tuple:
    pages = e.page_ids
    holder, count = st.holder, st.alias_count
    newly = []
    for p in pages:
        if holder[p] == HOLDER_FREE:
            holder[p] = HOLDER_ALIAS
            count[p] = 1
            newly.append(p)
        else:
            count[p] += 1
    if newly:
        take_from_stack(st, newly)
    mine = st.snapshots.get(e.snapshot)
    if mine is None:
        st.snapshots[e.snapshot] = list(pages)
    else:
        mine.extend(pages)
    st.seq += 1
    return NO_EFFECTS


def snapshot_released(st: LedgerState, e: SnapshotReleased) -> tuple:
    pages = st.snapshots.pop(e.snapshot)
    holder, count, marks, residue = st.holder, st.alias_count, st.marks, st.residue
    marked = []
    for p in pages:
        c = count[p] - 1
        count[p] = c
        if c == 0:
            holder[p] = HOLDER_FREE
            marks[p] = MARK_ALL
            residue.pop(p, None)
            marked.append(p)
    st.push_free(marked)  # (the pages that went free are the ones marked)
    st.seq += 1
    return marked_effect(marked)


def restore_started(st: LedgerState, e: RestoreStarted) -> tuple:
    pages = e.page_ids
    targets = st.restore_targets
    t = (e.into, e.target)
    for p in pages:
        targets[p] = t
    if e.into == "request":
        marks, residue = st.marks, st.residue
        for p in pages:
            marks.pop(p, None)  # overwritten whole: the restore removes the mark
            residue.pop(p, None)
        st.restored_since.update(dict.fromkeys(pages, st.open_step))
        if st.policy != "released_aliases":
            rec = st.requests[e.target]
            if rec.restored is None:
                rec.restored = set()
            rec.restored.update(pages)
    st.seq += 1
    return NO_EFFECTS


def restore_completed(st: LedgerState, e: RestoreCompleted) -> tuple:
    targets = st.restore_targets
    for p in e.page_ids:
        del targets[p]
    if st.parked:
        st.unpark(e.page_ids)  # free pages it was writing go back into the stack where they sit
    st.seq += 1
    return NO_EFFECTS
