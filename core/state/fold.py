"""The fold: one applier per event, ``(state, event) -> effects``.

An applier assumes its event passed its precondition (``preconditions.py``) and
never raises for one. It advances ``state.seq`` and returns the event's effects:
``(ClearPages,)`` for a commit that listed marked pages, ``(StepPlan,)`` for a
seal, ``()`` otherwise. Pure: no I/O, no logging, no clock, no object per page.

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
    RestoreCompleted, RestoreStarted, SanitizerViolation, SnapshotAliased, SnapshotReleased, StepAborted,
    StepCompleted, StepPlan, StepSealed,
)
from .table import (
    HOLDER_ALIAS, HOLDER_CACHED, HOLDER_FREE, MARK_ALL, MARK_TENANT, MAX_IN_FLIGHT, SHARERS_ORDERED, RequestRecord,
)

if TYPE_CHECKING:
    from .state import LedgerState

__all__ = [
    "allocate_top", "cache_configured", "commit_pages", "complete", "pages_unwritten", "release_pages",
    "release_request", "record",
    "reserve_top", "seal", "pages_committed", "pages_released", "pages_reserved", "request_gone",
    "reservation_returned",
    "restore_completed", "restore_started", "sanitizer_violation", "snapshot_aliased", "snapshot_released",
    "step_aborted", "step_completed", "step_sealed",
]

_NO_EFFECTS: tuple = ()
_NOBODY = object()  # a tenant no residue names (a commit that reads the whole page lists every mark)


# ---------------------------------------------------------------------- shared pieces


def _take_from_stack(st: LedgerState, pages) -> None:
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


def _free_pages(st: LedgerState, pages, tenant: str | None, dirty) -> list[int] | tuple:
    """Pages leave a request for the free stack; marks follow the policy. Returns the pages
    it marked (a listed page that never got its clear, and the policy's marks).

    ``dirty``: the pages among them that hold bytes the request wrote (its KV
    pages, reserved pages a restore wrote); only the non-default policies mark them.
    """
    holder, free = st.holder, HOLDER_FREE
    for p in pages:
        holder[p] = free
    marked: list[int] | tuple = _NO_EFFECTS
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


def _marked(pages) -> tuple:
    """The effect for pages that just got a mark (nothing when there are none)."""
    return (PagesMarked(page_ids=tuple(pages)),) if pages else _NO_EFFECTS


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
    return _NO_EFFECTS


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
    _take_from_stack(st, pages)
    st.seq += 1
    return _NO_EFFECTS


def reserve_top(st: LedgerState, rec: RequestRecord | None, request: int, n: int, tenant: str | None) -> tuple:
    """The allocator's pick and its PagesReserved in one: the top ``n`` entries of a free
    stack without stale entries and with no page restoring become ``reserved(request)``
    (``rec``: the request's record, None for a new request, created with ``tenant``).
    Returns the pages, top of the stack first (what ``pick_free(n)`` gives)."""
    stack = st.free_stack
    pages = stack[-n:]
    del stack[-n:]
    if st.parked and st.parked[-1][0] > len(stack):
        st.clamp_parked()
    pages.reverse()
    holder = st.holder
    for p in pages:
        holder[p] = request
    if rec is None:
        st.requests[request] = RequestRecord(request, tenant, pages, [], [])
    else:
        rec.reserved += pages
    st.seq += 1
    return tuple(pages)


def allocate_top(st: LedgerState, rec: RequestRecord | None, request: int, step: int, n: int,
                 tenant: str | None) -> tuple | None:
    """``reserve_top`` then ``commit_pages`` in one pass, for a request without reserved pages
    (``rec``; None: a new one, with ``tenant``), when none of the top ``n`` pages is marked (no
    clear list, no effects). Returns the pages, or None (nothing changed) when one is marked."""
    stack = st.free_stack
    pages = stack[-n:]
    marks = st.marks
    if marks and not marks.keys().isdisjoint(pages):
        return None
    del stack[-n:]  # (reserve_top's pop, written out: a call here cost the lifecycle bench ~5 %)
    if st.parked and st.parked[-1][0] > len(stack):
        st.clamp_parked()
    pages.reverse()
    holder = st.holder
    for p in pages:
        holder[p] = request
    if rec is None:
        st.requests[request] = RequestRecord(request, tenant, [], pages, [step] * n)
    else:
        rec.kv += pages
        rec.kv_steps += [step] * n
    st.seq += 2
    return tuple(pages)


def reservation_returned(st: LedgerState, e: ReservationReturned) -> tuple:
    rec = st.requests[e.request]
    pages = e.page_ids
    _remove(rec.reserved, pages)
    dirty: tuple | list = ()
    if rec.restored:
        dirty = [p for p in pages if p in rec.restored]
        rec.restored.difference_update(pages)
    marked = _free_pages(st, pages, rec.tenant, dirty)
    st.seq += 1
    return _marked(marked)


def pages_committed(st: LedgerState, e: PagesCommitted) -> tuple:
    return commit_pages(st, st.requests[e.request], e.step, e.page_ids, e.reads)


def commit_pages(st: LedgerState, rec: RequestRecord, step: int, pages: tuple, reads: str = "tail") -> tuple:
    """``pages`` (reserved by ``rec``'s request, none restoring, ``step`` not sealed) join its
    block table; marked ones are listed for ``step`` (``reads="tail"``: except those marked for
    other tenants only and left by its own; ``"whole"``: all of them). Returns
    ``(ClearPages,)`` or ``()``."""
    marks = st.marks
    listed = None
    if marks and not marks.keys().isdisjoint(pages):
        residue, pend = st.residue, st.pending
        listed = []
        own = rec.tenant if reads == "tail" else _NOBODY
        for p in pages:
            m = marks.pop(p, 0)
            if m:
                if reads == "none":  # written whole before it is read: the mark comes off, unlisted
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
        return _NO_EFFECTS
    cl = st.clear_lists.get(step)
    if cl is None:
        st.clear_lists[step] = listed
    else:
        cl.extend(listed)
    return (ClearPages(step=step, page_ids=tuple(listed)),)


def request_gone(st: LedgerState, e) -> tuple:  # RequestCancelled / RequestFinished
    return release_request(st, e.request)


def release_request(st: LedgerState, request: int) -> tuple:
    """Request ``request`` (known) goes: reserved pages go free; each KV page loses r as a
    holder: still held by others, it stays kv(R - {r}); hashed, it goes cached(h) (the
    request's last block first in line for eviction); otherwise free. Returns the effects
    (``PagesMarked`` when the policy or a pending clear marked pages)."""
    rec = st.requests.pop(request)
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
        return _NO_EFFECTS
    dirty: tuple | list = ()
    if st.policy != "released_aliases":
        dirty = kv + [p for p in reserved if rec.restored and p in rec.restored]
    marked = _free_pages(st, pages, rec.tenant, dirty)
    st.seq += 1
    return (PagesMarked(page_ids=tuple(marked)),) if marked else _NO_EFFECTS


def pages_released(st: LedgerState, e: PagesReleased) -> tuple:
    return release_pages(st, st.requests[e.request], e.page_ids)


def release_pages(st: LedgerState, rec: RequestRecord, pages: tuple) -> tuple:
    """Request ``rec`` (live) lets go of ``pages``, some of its KV pages: they leave its block
    table, and each goes where ``release_request`` sends a page of a request that ends (still
    shared: the others keep it; hashed: cached, the last released first in line for eviction;
    else free, marked as the policy marks a request's bytes). Returns ``PagesMarked`` or ``()``."""
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
    if to_cache:
        to_cache.reverse()
        st.cached.update(dict.fromkeys(to_cache))
    marked: list[int] | tuple = ()
    if freed:
        marked = _free_pages(st, freed, rec.tenant, freed if st.policy != "released_aliases" else ())
    st.seq += 1
    return _marked(marked)


def record(st: LedgerState, e) -> tuple:
    """A record-only event (``RequestLabelled``): the fold counts it, nothing more."""
    st.seq += 1
    return _NO_EFFECTS


def _back_in_kv(st: LedgerState, p: int, kv_of: dict[int, set[int]]) -> bool:
    """Is page ``p`` in some request's KV pages (``kv_of``: request -> its KV pages, built once)?"""
    r = st.holder[p]
    if r < 0:
        return False
    kv = kv_of.get(r)
    if kv is None:
        kv = kv_of[r] = set(st.requests[r].kv)
    return p in kv


def pages_unwritten(st: LedgerState, e) -> tuple:
    """The step ran without the request: pages a ``reads="none"`` commit of it took a mark off for
    that step get it back when they are free or reserved (marked for everyone). A page another
    request committed since is left to that commit (an engine that reuses a page before it
    learns of a dropped share commits it reading whole). Returns ``PagesMarked``."""
    ow = st.overwritten
    marked: list[int] = []
    if ow:
        kv_of: dict[int, set[int]] = {}
        holder = st.holder
        for p in e.page_ids:
            if ow.get(p) != e.step:
                continue
            del ow[p]
            if holder[p] == HOLDER_FREE or (holder[p] >= 0 and not _back_in_kv(st, p, kv_of)):
                st.marks[p] = MARK_ALL
                st.residue.pop(p, None)
                marked.append(p)
    st.seq += 1
    return _marked(marked)


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
    to_cache.reverse()  # the last block first: the first to be evicted
    st.cached.update(dict.fromkeys(to_cache))
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
        _take_from_stack(st, newly)
    mine = st.snapshots.get(e.snapshot)
    if mine is None:
        st.snapshots[e.snapshot] = list(pages)
    else:
        mine.extend(pages)
    st.seq += 1
    return _NO_EFFECTS


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
    return _marked(marked)


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
    return _NO_EFFECTS


def restore_completed(st: LedgerState, e: RestoreCompleted) -> tuple:
    targets = st.restore_targets
    for p in e.page_ids:
        del targets[p]
    if st.parked:
        st.unpark(e.page_ids)  # free pages it was writing go back into the stack where they sit
    st.seq += 1
    return _NO_EFFECTS


def step_sealed(st: LedgerState, e: StepSealed) -> tuple:
    return (seal(st, e.step),)


def seal(st: LedgerState, step: int) -> StepPlan:
    """Seal ``step`` (the open step): its plan joins the steps in flight (the last
    ``MAX_IN_FLIGHT`` sealed and not aborted)."""
    if step in st.clear_lists:
        clear_list = st.derive_clear_list(step)
        del st.clear_lists[step]
        pend = st.pending
        for p in clear_list:
            del pend[p]
    else:
        clear_list = ()
    st.open_step = step + 1
    plan = StepPlan(step=step, clear_list=clear_list)
    in_flight = st.in_flight
    in_flight.append(plan)
    if len(in_flight) > MAX_IN_FLIGHT:
        del in_flight[0]  # too old to abort: its restore records go too
        oldest = in_flight[0].step
        if st.restored_since:
            st.restored_since = {p: s for p, s in st.restored_since.items() if s > oldest}
        if st.overwritten:
            st.overwritten = {p: s for p, s in st.overwritten.items() if s >= oldest}
    st.seq += 1
    return plan


def step_completed(st: LedgerState, e: StepCompleted) -> tuple:
    complete(st, e.step, e.rank)
    return _NO_EFFECTS


def complete(st: LedgerState, step: int, rank: int) -> None:
    """A rank ran the step. Once every rank that reports completions has completed a step,
    its plan leaves the steps in flight: it can no longer be aborted (its pages may be
    published from now on)."""
    if step > st.completed.get(rank, -1):
        st.completed[rank] = step
        in_flight = st.in_flight
        if in_flight and in_flight[0].step <= step:
            done = st.completed_step
            while in_flight and in_flight[0].step <= done:
                del in_flight[0]
            if not in_flight:
                if st.restored_since:
                    st.restored_since.clear()
            elif st.restored_since:  # a restore matters only to a plan sealed before it: the oldest bounds them
                oldest = in_flight[0].step
                st.restored_since = {p: s for p, s in st.restored_since.items() if s > oldest}
        if st.overwritten:  # (a step that ran everywhere wrote its pages: nothing can give their marks back)
            done = st.completed_step
            st.overwritten = {p: s for p, s in st.overwritten.items() if s > done}
    st.seq += 1


def sanitizer_violation(st: LedgerState, e: SanitizerViolation) -> tuple:
    """A record only: the step it names is aborted by its own event."""
    st.seq += 1
    return _NO_EFFECTS


def step_aborted(st: LedgerState, e: StepAborted) -> tuple:
    """Step ``e.step`` and every later step in flight did not run everywhere: nothing of them
    can be assumed zeroed. Their pages still in KV are listed again for the open step
    (first in its clear list, the oldest plan's first), the others get their mark back,
    except pages a restore into a request rewrote whole after the plan was sealed."""
    aborted = [plan for plan in st.in_flight if plan.step >= e.step]
    st.in_flight = [plan for plan in st.in_flight if plan.step < e.step]
    marks, residue, pend = st.marks, st.residue, st.pending
    carry: list[int] = []
    step = st.open_step
    restored = st.restored_since
    kv_of: dict[int, set[int]] = {}  # request -> its KV pages, built once per request
    holder, requests = st.holder, st.requests
    marked: list[int] = []
    seen: set[int] = set()  # a page in two aborted plans is named once
    for plan in aborted:
        for p in plan.clear_list:
            if restored.get(p, -1) > plan.step:
                continue  # a restore into a request rewrote it whole after this plan was sealed
            r = holder[p]
            if r >= 0:
                kv = kv_of.get(r)
                if kv is None:
                    kv = kv_of[r] = set(requests[r].kv)
                if p in kv:
                    if p not in pend:
                        pend[p] = step
                        carry.append(p)
                    continue
            if p not in seen:
                seen.add(p)
                marked.append(p)
            marks[p] = MARK_ALL
            residue.pop(p, None)
        st.aborted_steps.add(plan.step)
    if st.overwritten:  # pages a commit of an aborted step was to write whole: nothing wrote them
        gone = {plan.step for plan in aborted}
        for p in [q for q, s in st.overwritten.items() if s in gone]:
            del st.overwritten[p]
            if _back_in_kv(st, p, kv_of):
                if p not in pend:
                    pend[p] = step
                    carry.append(p)
            else:
                if p not in seen:
                    seen.add(p)
                    marked.append(p)
                marks[p] = MARK_ALL
                residue.pop(p, None)
    if carry:
        listed = st.clear_lists.get(step)
        if listed:  # entries of a carried page there are stale (it was not pending): carried is its last listing
            moved = set(carry)
            listed = [q for q in listed if q not in moved]
        st.clear_lists[step] = carry + listed if listed else carry
    if not st.in_flight:
        st.restored_since.clear()
    st.seq += 1
    return _marked(marked)
