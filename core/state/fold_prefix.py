"""The fold's prefix-caching appliers (SPEC, "Prefix-shared pages"): publish, share, evict.

As ``fold.py``: ``(state, event) -> effects``, for an event that passed its
precondition; pure, no object per page. A publish returns the ``BlocksStored`` KV
event, an eviction ``BlocksRemoved`` (and ``PagesMarked`` under the isolating
policies). A request letting go of its shared and hashed pages is
``fold.request_gone``'s.

The fast cases' appliers (``fold.py``'s docstring says what they are):

    published(st, published)          the state's part of a publish (no effect built)
    shared(st, shared)                hashed pages into a request (no effect to build)
    shared_cached(st, rec, shared)    one cached page into a known request (vLLM's touch)
    evicted(st, evicted)              cached pages go free (the effects unread)
    taken_from_cache(st, rec, evicted, reserved, committed)
                                      the least recently used cached page, evicted,
                                      reserved and committed in one pass (policy
                                      released_aliases: nothing marked, nothing listed)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..events.events import (
    BlocksRemoved, BlocksStored, PagesCommitted, PagesEvicted, PagesPublished, PagesReserved, PagesShared,
)
from .fold import NO_EFFECTS, free_pages, marked_effect
from .table import HOLDER_CACHED, SHARED_IN, RequestRecord

if TYPE_CHECKING:
    from .state import LedgerState

__all__ = ["evicted", "pages_evicted", "pages_published", "pages_shared", "published", "shared", "shared_cached",
           "taken_from_cache"]


def pages_published(st: LedgerState, e: PagesPublished) -> tuple:
    geometry = st.geometry
    assert geometry is not None  # configured before any request
    published(st, e)
    return (BlocksStored(hashes=e.hashes, parent_hash=e.parent_hash, token_ids=e.token_ids,
                         page_tokens=geometry.page_tokens,
                         lora_id=e.lora_id, lora_name=e.lora_name),)


def published(st: LedgerState, e: PagesPublished) -> None:
    """``e.page_ids`` of ``e.request`` gain ``e.hashes`` (the state's part of PagesPublished)."""
    pages, hashes = e.page_ids, e.hashes
    if len(pages) == 1:
        st.page_hash[pages[0]] = hashes[0]
        st.hash_page[hashes[0]] = pages[0]
    else:  # (as many hashes as pages: the precondition)
        st.page_hash.update(zip(pages, hashes, strict=True))
        st.hash_page.update(zip(hashes, pages, strict=True))
    if st.policy != "released_aliases":  # the writer's tenant decides sharing and eviction marks
        st.hash_tenant.update(dict.fromkeys(pages, st.requests[e.request].tenant))
    st.seq += 1


def pages_shared(st: LedgerState, e: PagesShared) -> tuple:
    shared(st, e)
    return NO_EFFECTS


def shared(st: LedgerState, e: PagesShared) -> None:
    """Hashed ``e.page_ids`` (cached, or held by others) join ``e.request``'s block table (a new
    request is created with ``e.tenant``): the state's part of PagesShared."""
    r, pages = e.request, e.page_ids
    rec = st.requests.get(r)
    if rec is None:
        rec = st.requests[r] = RequestRecord(r, e.tenant, [], [], [])
    holder, sharers, cached = st.holder, st.sharers, st.cached
    for p in pages:
        x = holder[p]
        if x == HOLDER_CACHED:
            del cached[p]
            holder[p] = r
        else:
            holders = sharers.get(p)
            if holders is None:
                sharers[p] = {x: None, r: None}
            else:
                holders[r] = None
    rec.kv += pages
    rec.kv_steps += [SHARED_IN] * len(pages)
    st.seq += 1


def shared_cached(st: LedgerState, rec: RequestRecord, e: PagesShared) -> None:
    """``shared`` of one cached page into a known request (``rec``): vLLM's ``touch``."""
    p = e.page_ids[0]
    del st.cached[p]
    st.holder[p] = e.request
    rec.kv.append(p)
    rec.kv_steps.append(SHARED_IN)
    st.seq += 1


def pages_evicted(st: LedgerState, e: PagesEvicted) -> tuple:
    hashes, marked = _evict(st, e.page_ids)
    return (BlocksRemoved(hashes=hashes), *marked_effect(marked))


def evicted(st: LedgerState, e: PagesEvicted) -> None:
    """``pages_evicted`` for a caller that reads no effects."""
    _evict(st, e.page_ids)


def _evict(st: LedgerState, pages: tuple) -> tuple[tuple, list[int] | tuple]:
    """Cached pages go free and lose their hashes; under the isolating policies they are
    marked for the writer's tenant (cross_tenant) or for everyone (all_reused). Returns
    (their hashes, the pages marked)."""
    page_hash, hash_page, cached = st.page_hash, st.hash_page, st.cached
    hashes = tuple(map(page_hash.pop, pages))
    for h in hashes:
        del hash_page[h]
    for p in pages:
        del cached[p]
    if st.policy == "released_aliases":  # no marks of its own, no writer tenants kept
        marked: list[int] | tuple = free_pages(st, pages, None, ())
    elif st.policy == "cross_tenant":
        # each evicted page carries its own writer's tenant
        hash_tenant = st.hash_tenant
        marked = []
        for p in pages:
            marked.extend(free_pages(st, (p,), hash_tenant.pop(p), (p,)))
    else:
        for p in pages:
            st.hash_tenant.pop(p, None)
        marked = list(free_pages(st, pages, None, pages))
    st.seq += 1
    return hashes, marked


def taken_from_cache(st: LedgerState, rec: RequestRecord | None, e: PagesEvicted, r: PagesReserved,
                     c: PagesCommitted) -> None:
    """PagesEvicted, PagesReserved and PagesCommitted in one pass, for an allocation that takes
    every free page and ``e.page_ids``, the least recently used cached pages (policy
    ``released_aliases``: a cached page is never marked, pending or restoring; no free page
    marked; a free stack without stale entries). The evicted pages would be pushed onto the
    stack and taken at once: ``r.page_ids`` is them, last evicted first, then the stack, top
    first. They lose their hashes and join the request (``rec``; None: a new one, made with
    ``r.tenant``); the stack is left empty."""
    page_hash, hash_page, cached = st.page_hash, st.hash_page, st.cached
    for p in e.page_ids:
        del hash_page[page_hash.pop(p)]
        del cached[p]
    st.free_stack.clear()
    if st.parked and st.parked[-1][0] > 0:
        st.clamp_parked()
    pages, request = r.page_ids, r.request
    holder = st.holder
    for p in pages:
        holder[p] = request
    if rec is None:
        st.requests[request] = RequestRecord(request, r.tenant, [], list(pages), [c.step] * len(pages))
    else:
        rec.kv += pages
        rec.kv_steps += [c.step] * len(pages)
    st.seq += 3
