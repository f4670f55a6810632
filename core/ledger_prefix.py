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
    _pre: Callable[[int, Any], None]  # Ledger's: a fast path's event before its fold (sink, record)
    _post: Callable[[int, Any, tuple], None]  # and after it (check mode, observer)

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
                and type(token_ids) is tuple and parent_hash is None and lora_id is None and lora_name is None
                and start >= 0 and st.policy == "released_aliases"):
            rec = st.requests.get(request)
            k = len(hashes)
            if (rec is not None and 0 < k <= len(rec.kv) - start
                    and len(token_ids) == k * st.geometry.page_tokens  # type: ignore[union-attr]
                    and (k == 1 or len(set(hashes)) == k) and checks.all_ints(token_ids)):
                # fast path: PagesPublished's precondition for a run of the block table, as a slice
                pages = tuple(rec.kv[start : start + k])
                steps = rec.kv_steps[start : start + k]
                if (min(steps) >= 0 and max(steps) <= st.completed_step
                        and (not st.aborted_steps or st.aborted_steps.isdisjoint(steps))
                        and st.page_hash.keys().isdisjoint(pages)
                        and checks.block_hash_list(hashes, "publish") is hashes
                        and st.hash_page.keys().isdisjoint(hashes)):
                    if self._plain:
                        fold_prefix.publish_pages(st, request, pages, hashes)
                    else:
                        seq = st.seq
                        ev = PagesPublished(request=request, page_ids=pages, hashes=hashes,
                                            parent_hash=st.page_hash.get(rec.kv[start - 1]) if start else None,
                                            token_ids=token_ids)
                        self._pre(seq, ev)
                        self._post(seq, ev, fold_prefix.pages_published(st, ev))
                    return pages
        return self._publish(request, hashes, token_ids, start, parent_hash, lora_id, lora_name)

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
        if (self._fast and type(request) is int and type(hashes) is tuple and tenant is None and hashes
                and not request >> 63 and st.policy == "released_aliases"):
            # fast path: PagesShared's precondition page by page (a hashed page is kv or cached,
            # never marked or restoring; it must not be r's already), then distinct pages
            hp, holder = st.hash_page, st.holder
            if len(hashes) == 1:  # (one cached block into a known request: vLLM's touch, inline)
                h = hashes[0]
                p = hp.get(h) if type(h) is bytes or type(h) is int else None
                if p is not None and holder[p] == HOLDER_CACHED and self._plain:
                    rec = st.requests.get(request)
                    if rec is not None:
                        del st.cached[p]
                        holder[p] = request
                        rec.kv.append(p)
                        rec.kv_steps.append(SHARED_IN)
                        st.seq += 1
                        return (p,)
            sharers = st.sharers if request in st.requests else {}  # (a new request holds nothing)
            pages = []
            for h in hashes:
                if type(h) is not bytes and type(h) is not int:
                    break
                p = hp.get(h)
                if p is None:
                    break
                x = holder[p]
                if x == request or (x >= 0 and p in sharers and request in sharers[p]):
                    break
                pages.append(p)
            else:
                if len(pages) == 1 or len(set(pages)) == len(pages):
                    ids = tuple(pages)
                    if self._plain:
                        fold_prefix.share_pages(st, request, ids, None)
                    else:
                        seq, ev = st.seq, PagesShared(request=request, page_ids=ids, tenant=None)
                        self._pre(seq, ev)
                        fold_prefix.share_pages(st, request, ids, None)
                        self._post(seq, ev, ())
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

    def evict(self, n: int | None = None, *, pages: Iterable[int] | None = None) -> tuple[int, ...]:
        """Evict cached pages: the ``n`` least recently used (fewer if fewer are cached), or the
        named ones, or all of them by default.

        Returns the page ids evicted; the fold's effect is a ``BlocksRemoved`` KV event.
        """
        st = self.state
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
