"""The ledger's prefix-caching commands (SPEC, "Prefix-shared pages"): publish, lookup, share, evict.

A mixin of ``Ledger``: each command checks its arguments, decides one event
against ``self.state`` and hands it to ``self._submit`` (validate -> sink -> apply),
exactly as the ledger's other commands; nothing changes when one raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from . import checks
from .errors import InvalidArgumentError, UnknownBlockHashError, UnknownRequestError
from .events.events import PagesEvicted, PagesPublished, PagesShared, typed
from .state import fold_prefix
from .state.table import HOLDER_CACHED, SHARED_IN

_HASH_MIN, _HASH_MAX = -(1 << 63), (1 << 63) - 1  # an int block hash is a signed 64-bit value
_HASH_TYPES = frozenset((bytes, int))  # (a published hash is valid: only its exact type is left to check)
_INT_ONLY = {int}


def _plain(h: object) -> bool:
    """``h`` is a valid block hash: 1-64 bytes, or an int in the signed 64-bit range (not a bool)."""
    if type(h) is bytes:
        return 0 < len(h) <= 64
    return type(h) is int and _HASH_MIN <= h <= _HASH_MAX


if TYPE_CHECKING:
    from .state.state import LedgerState

__all__ = ["PrefixCommands"]


class PrefixCommands:
    """Publish full pages under block hashes, look hashes up, share cached or held pages,
    evict cached ones. Mixed into ``Ledger``, which supplies ``state`` and ``_submit``."""

    state: LedgerState
    _submit: Callable[[Any], tuple]  # Ledger's one submit path
    _fast: bool  # Ledger's: the standard table (the commands' fast paths may be taken)
    _plain: bool  # Ledger's: and no sink, observer, record or check (they may skip the events)
    _lean: bool  # Ledger's: the standard table, no check mode, no observer (only _put around the fold)
    _prefix_fast: bool  # Ledger's: _fast under policy released_aliases (any request may share any block)
    _touch: bool  # Ledger's: _prefix_fast and _lean (share's one-block case inline)
    _put: Callable[[int, Any], None] | None  # Ledger's: a fast path's event before its fold (sink, record)
    _watch: bool  # Ledger's: check mode or an observer, called after the fold through _post
    _post: Callable[[int, Any, tuple], None]

    def publish(
        self,
        request: int,
        hashes: Sequence[int | bytes],
        token_ids: Sequence[int],
        *,
        start: int | None = None,
        parent_hash: int | bytes | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> tuple[int, ...]:
        """Publish full KV pages of ``request`` under block hashes, so other requests can share them.

        The pages are ``len(hashes)`` pages of the request's block table from index
        ``start`` (default: the first page not yet published); ``token_ids`` are their
        tokens (``page_tokens`` per page); ``parent_hash`` the hash of the block before
        ``start`` (default: that page's published hash, None at index 0). The request
        must have written them in a step that completed (``complete_step``). Returns
        the page ids; the fold's effect is a ``BlocksStored`` KV event. Raises what the
        precondition raises (``PageNotHeldError``, ``StepOrderError``, ...); nothing
        changes then.
        """
        st = self.state
        if (self._fast and type(request) is int and type(start) is int and type(hashes) is tuple
                and type(token_ids) is tuple and lora_id is None and lora_name is None
                and start >= 0 and st.policy == "released_aliases" and (parent_hash is None or _plain(parent_hash))):
            rec = st.requests.get(request)
            k = len(hashes)
            if (rec is not None and 0 < k <= len(rec.kv) - start
                    and len(token_ids) == k * st.geometry.page_tokens):  # type: ignore[union-attr]
                # fast path: PagesPublished's precondition for a run of the block table, as a slice
                if k == 1:  # (one block: vLLM's cache_full_blocks of a step's new full block)
                    h = hashes[0]
                    p = rec.kv[start]
                    step = rec.kv_steps[start]
                    ok = (_plain(h) and 0 <= step <= st.completed_step and p not in st.page_hash
                          and h not in st.hash_page and step not in st.aborted_steps and checks.all_ints(token_ids))
                    pages: tuple = (p,)
                else:
                    pages = tuple(rec.kv[start : start + k])
                    ok = self._publishable(pages, rec.kv_steps[start : start + k], hashes, token_ids)
                if ok:
                    if self._plain:
                        fold_prefix.publish_pages(st, request, pages, hashes)
                        return pages
                    seq = st.seq
                    if parent_hash is None and start:
                        parent_hash = st.page_hash.get(rec.kv[start - 1])
                    ev = PagesPublished(request=request, page_ids=pages, hashes=hashes, parent_hash=parent_hash,
                                        token_ids=token_ids)
                    if self._put is not None:
                        self._put(seq, ev)
                    if self._watch:
                        self._post(seq, ev, fold_prefix.pages_published(st, ev))
                    else:
                        fold_prefix.publish_pages(st, request, pages, hashes)
                    return pages
        return self._publish(request, hashes, token_ids, start, parent_hash, lora_id, lora_name)

    def _publishable(self, pages: tuple, steps: list, hashes: tuple, token_ids: tuple) -> bool:
        """``publish``'s fast path for a run of ``k`` > 1 blocks (``pages`` of the block table,
        ``steps`` their commit steps): PagesPublished's precondition holds. Raises what
        ``checks.block_hash_list`` raises for a bad hash."""
        st = self.state
        steps_ = set(steps)  # (a step or a few)
        return (min(steps_) >= 0 and max(steps_) <= st.completed_step
                and (not st.aborted_steps or st.aborted_steps.isdisjoint(steps_))
                and st.page_hash.keys().isdisjoint(pages)
                and checks.block_hash_list(hashes, "publish") is hashes
                and st.hash_page.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes)
                and checks.all_ints(token_ids))

    def _publish(self, request, hashes, token_ids, start, parent_hash, lora_id, lora_name) -> tuple[int, ...]:
        """``publish`` through the table's path: every argument checked, the event decided and
        submitted (its precondition raises the specific error)."""
        st = self.state
        checks.ident(request, "request")
        rec = st.requests.get(request)
        if rec is None:
            raise UnknownRequestError(request)
        hashes = checks.block_hash_list(hashes, "publish")
        if start is None:
            start = 0
            while start < len(rec.kv) and rec.kv[start] in st.page_hash:
                start += 1
        elif type(start) is not int or start < 0:
            raise InvalidArgumentError(f"start must be a block index >= 0, got {start!r}")
        pages = tuple(rec.kv[start : start + len(hashes)])
        if len(pages) != len(hashes) or not hashes:
            raise InvalidArgumentError(f"request {request} has {len(rec.kv)} KV pages; cannot publish "
                                       f"{len(hashes)} from index {start}")
        if parent_hash is None and start > 0:
            parent_hash = st.page_hash.get(rec.kv[start - 1])
        ev = PagesPublished(request=request, page_ids=pages, hashes=hashes, parent_hash=parent_hash,
                            token_ids=tuple(token_ids), lora_id=lora_id, lora_name=lora_name)
        if (not checks.all_ints(ev.token_ids) or not (parent_hash is None or checks.plain_block_hashes((parent_hash,)))
                or not (lora_id is None or type(lora_id) is int) or not (lora_name is None or type(lora_name) is str)):
            ev = typed(ev)  # names the ill-typed field (the common case skips the msgpack round trip)
        self._submit(ev)
        return pages

    def lookup(self, hashes: Iterable[int | bytes], *, tenant: str | None = None) -> int:
        """How many leading blocks of ``hashes`` are cached or held, ready to ``share``.

        Under ``cross_tenant`` / ``all_reused`` only blocks ``tenant`` itself wrote count
        (``share`` refuses the others).
        """
        st = self.state
        if type(hashes) is tuple and st.policy == "released_aliases":
            # fast path: every published hash counts (a hashed page is never marked or restoring)
            hp = st.hash_page
            n = 0
            for h in hashes:
                if (type(h) is not bytes and type(h) is not int) or h not in hp:
                    break  # (an int or bytes key equal to a published one is that hash: checked when published)
                n += 1
            else:
                return n
            checks.block_hash_list(hashes[n:], "lookup")  # the rest must still be block hashes
            return n
        return st.lookup(checks.block_hash_list(hashes, "lookup"), tenant)

    def share(self, request: int, hashes: Sequence[int | bytes], *, tenant: str | None = None) -> tuple[int, ...]:
        """Share the pages that hold ``hashes`` into ``request``'s block table, in order.

        ``request`` may be new (created with ``tenant``). Use ``lookup`` first: every
        hash must be held (``UnknownBlockHashError`` otherwise). Cached pages leave
        the cache; held pages become shared and read-only. Shared pages are never
        listed for a clear: they hold the KV the request wants. Returns the page ids.
        """
        st = self.state
        if self._touch and type(hashes) is tuple and len(hashes) == 1 and type(request) is int and tenant is None:
            h = hashes[0]  # one cached block into a known request (vLLM's touch): PagesShared's
            if type(h) is bytes or type(h) is int:  # precondition holds for a cached page, inline
                p = st.hash_page.get(h)
                rec = st.requests.get(request)
                if p is not None and rec is not None and st.holder[p] == HOLDER_CACHED:
                    if self._put is not None:
                        self._put(st.seq, PagesShared(request=request, page_ids=(p,), tenant=None))
                    del st.cached[p]
                    st.holder[p] = request
                    rec.kv.append(p)
                    rec.kv_steps.append(SHARED_IN)
                    st.seq += 1
                    return (p,)
        if (self._prefix_fast and type(request) is int and type(hashes) is tuple and tenant is None and hashes
                and not request >> 63):
            # fast path: PagesShared's precondition page by page (a hashed page is kv or cached,
            # never marked or restoring; it must not be r's already), then distinct pages
            ids = self._share_pages(request, hashes)
            if ids is not None:
                return ids
        checks.ident(request, "request")
        checks.tenant(tenant)
        hashes = checks.block_hash_list(hashes, "share")
        found = list(map(st.hash_page.get, hashes))
        if None in found:
            h = hashes[found.index(None)]
            raise UnknownBlockHashError(h, f"request {request} cannot share it")
        pages_: tuple[int, ...] = tuple(found)  # type: ignore[arg-type]
        ev = PagesShared(request=request, page_ids=pages_, tenant=tenant)
        self._submit(ev)
        return ev.page_ids

    def _share_pages(self, request: int, hashes: tuple) -> tuple[int, ...] | None:
        """``share``'s fast path for any number of hashes (policy ``released_aliases``, no
        tenant): the pages, shared, or None when a hash is not published or not a plain block
        hash, a page is the request's already, or pages repeat (the table's path raises)."""
        st = self.state
        hp, holder, sharers = st.hash_page, st.holder, st.sharers
        pages: list  # (of ints once the Nones are ruled out)
        if request not in st.requests:  # a new request holds nothing: every published block will do
            pages = list(map(hp.get, hashes))
            if None in pages or not _HASH_TYPES.issuperset(map(type, hashes)):
                return None
        else:
            pages = []
            for h in hashes:
                if type(h) is not bytes and type(h) is not int:
                    return None
                p = hp.get(h)
                if p is None:
                    return None
                x = holder[p]
                if x == request or (x >= 0 and p in sharers and request in sharers[p]):
                    return None
                pages.append(p)
        if len(pages) > 1 and len(set(pages)) != len(pages):
            return None
        ids = tuple(pages)
        if self._plain:
            fold_prefix.share_pages(st, request, ids, None)
            return ids
        seq, ev = st.seq, PagesShared(request=request, page_ids=ids, tenant=None)
        if self._put is not None:
            self._put(seq, ev)
        fold_prefix.share_pages(st, request, ids, None)
        if self._watch:
            self._post(seq, ev, ())
        return ids

    def evict(self, n: int | None = None, *, pages: Iterable[int] | None = None) -> tuple[int, ...]:
        """Evict cached pages: the ``n`` least recently used (fewer if fewer are cached), or the
        named ones, or all of them by default.

        Returns the page ids evicted; the fold's effect is a ``BlocksRemoved`` KV event.
        """
        st = self.state
        if n is None and self._lean and (type(pages) is list or type(pages) is tuple):
            # fast path (vLLM's pool evicting the cached blocks its free queue picked): named,
            # distinct int pages, each cached (so in range), nothing watched (the effects unread)
            ids = tuple(pages)
            cached = st.cached
            if len(ids) == 1:
                ok = type(ids[0]) is int and ids[0] in cached
            else:
                ok = (bool(ids) and set(map(type, ids)) == _INT_ONLY and len(set(ids)) == len(ids)
                      and cached.keys() >= set(ids))
            if ok:
                if self._put is not None:
                    self._put(st.seq, PagesEvicted(page_ids=ids))
                fold_prefix.evict_pages(st, ids)
                return ids
        if n is not None and pages is not None:
            raise InvalidArgumentError("evict: give n= or pages=, not both")
        if pages is None:
            k = len(st.cached) if n is None else checks.count(n, "n")
            ids = tuple(st.evictable(k))
            if not ids:
                return ()
        else:
            ids = checks.page_ids(pages, st.num_pages, allow_empty=False)
        self._submit(PagesEvicted(page_ids=ids))
        return ids
