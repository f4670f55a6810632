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

if TYPE_CHECKING:
    from .state.state import LedgerState

__all__ = ["PrefixCommands"]


class PrefixCommands:
    """Publish full pages under block hashes, look hashes up, share cached or held pages,
    evict cached ones. Mixed into ``Ledger``, which supplies ``state`` and ``_submit``."""

    state: LedgerState
    _submit: Callable[[Any], tuple]  # Ledger's one submit path

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
        checks.ident(request, "request")
        st = self.state
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
        return self.state.lookup(checks.block_hash_list(hashes, "lookup"), tenant)

    def share(self, request: int, hashes: Sequence[int | bytes], *, tenant: str | None = None) -> tuple[int, ...]:
        """Share the pages that hold ``hashes`` into ``request``'s block table, in order.

        ``request`` may be new (created with ``tenant``). Use ``lookup`` first: every
        hash must be held (``UnknownBlockHashError`` otherwise). Cached pages leave
        the cache; held pages become shared and read-only. Shared pages are never
        listed for a clear: they hold the KV the request wants. Returns the page ids.
        """
        checks.ident(request, "request")
        checks.tenant(tenant)
        hashes = checks.block_hash_list(hashes, "share")
        found = list(map(self.state.hash_page.get, hashes))
        if None in found:
            h = hashes[found.index(None)]
            raise UnknownBlockHashError(h, f"request {request} cannot share it")
        pages: tuple[int, ...] = tuple(found)  # type: ignore[arg-type]
        ev = PagesShared(request=request, page_ids=pages, tenant=tenant)
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
