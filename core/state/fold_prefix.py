"""The fold's prefix-caching appliers (SPEC, "Prefix-shared pages"): publish, share, evict.

As ``fold.py``: ``(state, event) -> effects``, for an event that passed its
precondition; pure, no object per page. A publish returns the ``BlocksStored`` KV
event, an eviction ``BlocksRemoved`` (and ``PagesMarked`` under the isolating
policies). A request letting go of its shared and hashed pages is
``fold.request_gone``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..events.events import BlocksRemoved, BlocksStored, PagesEvicted, PagesPublished, PagesShared
from .fold import _NO_EFFECTS, _free_pages, _marked
from .table import HOLDER_CACHED, SHARED_IN, RequestRecord

if TYPE_CHECKING:
    from .state import LedgerState

__all__ = ["pages_evicted", "pages_published", "pages_shared", "evict_pages", "publish_pages", "share_pages"]


def pages_published(st: LedgerState, e: PagesPublished) -> tuple:
    geometry = st.geometry
    assert geometry is not None  # configured before any request
    publish_pages(st, e.request, e.page_ids, e.hashes)
    return (BlocksStored(hashes=e.hashes, parent_hash=e.parent_hash, token_ids=e.token_ids,
                         page_tokens=geometry.page_tokens,
                         lora_id=e.lora_id, lora_name=e.lora_name),)


def publish_pages(st: LedgerState, request: int, pages: tuple, hashes: tuple) -> None:
    """``pages`` of ``request`` gain ``hashes`` (the state's part of PagesPublished)."""
    if len(pages) == 1:
        st.page_hash[pages[0]] = hashes[0]
        st.hash_page[hashes[0]] = pages[0]
    else:  # (as many hashes as pages: the precondition)
        st.page_hash.update(zip(pages, hashes, strict=True))
        st.hash_page.update(zip(hashes, pages, strict=True))
    if st.policy != "released_aliases":  # the writer's tenant decides sharing and eviction marks
        st.hash_tenant.update(dict.fromkeys(pages, st.requests[request].tenant))
    st.seq += 1


def pages_shared(st: LedgerState, e: PagesShared) -> tuple:
    share_pages(st, e.request, e.page_ids, e.tenant)
    return _NO_EFFECTS


def share_pages(st: LedgerState, r: int, pages: tuple, tenant: str | None) -> None:
    """Hashed ``pages`` (cached, or held by others) join ``r``'s block table (a new request
    is created with ``tenant``): the state's part of PagesShared."""
    rec = st.requests.get(r)
    if rec is None:
        rec = st.requests[r] = RequestRecord(r, tenant, [], [], [])
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


def pages_evicted(st: LedgerState, e: PagesEvicted) -> tuple:
    hashes, marked = evict_pages(st, e.page_ids)
    return (BlocksRemoved(hashes=hashes), *_marked(marked))


def evict_pages(st: LedgerState, pages: tuple) -> tuple[tuple, list[int] | tuple]:
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
        marked: list[int] | tuple = _free_pages(st, pages, None, ())
    elif st.policy == "cross_tenant":
        # each evicted page carries its own writer's tenant
        hash_tenant = st.hash_tenant
        marked = []
        for p in pages:
            marked.extend(_free_pages(st, (p,), hash_tenant.pop(p), (p,)))
    else:
        for p in pages:
            st.hash_tenant.pop(p, None)
        marked = list(_free_pages(st, pages, None, pages))
    st.seq += 1
    return hashes, marked
