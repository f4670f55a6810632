"""The ledger's request commands: reserve, allocate, commit, return a reservation, cancel, finish,
release some pages, and the records an engine adds (a request's label, pages a step left unwritten).

A mixin of ``Ledger`` (as ``ledger_prefix.PrefixCommands``): each command checks its
arguments, decides its events against ``self.state`` and hands each to ``self._submit``
(validate -> sink -> apply); ``ledger.py``'s module docstring says where the fast paths
sit in that path. These are the commands a request's pages go through, and the ones a
scheduler calls most (vLLM's ``get_new_blocks`` / ``free_blocks``): their fast paths fold
through the table's own appliers (``fold.allocate_top``, ``reserve_top``, ``commit_pages``,
``release_request``), with the events built only for a sink or a record (``_put``) and
handed to check mode and the observer after the fold (``_watch`` / ``_post``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any

from . import checks
from .errors import InvalidArgumentError, OutOfPagesError, StepOrderError, UnknownRequestError
from .events.events import (
    CommitReads,
    PagesCommitted, PagesEvicted, PagesReleased, PagesReserved, PagesUnwritten, RequestCancelled, RequestFinished,
    RequestLabelled, ReservationReturned,
)
from .state import fold, fold_prefix
from .state import preconditions
from .state.preconditions import same_tenant
from .state.table import HOLDER_FREE, RequestRecord

if TYPE_CHECKING:
    from .state.state import LedgerState

__all__ = ["RequestCommands"]

# An id is an int in [0, 2**63): for an int x, ``x >> 63`` is 0 exactly then (-1 below, >= 1 above),
# so ``(a | b) >> 63`` checks two ints at once. ``checks.ident`` raises the error.
_ID_BITS = 63
_INT_ONLY = {int}


class RequestCommands:
    """Reserve, allocate, commit, return, cancel, finish. Mixed into ``Ledger``, which supplies
    ``state``, ``_submit``, the fast paths' ``_fast`` / ``_plain`` / ``_lean`` / ``_put`` /
    ``_watch`` / ``_post`` and ``reserved_pages``."""

    state: LedgerState
    _submit: Callable[[Any], tuple]
    _fast: bool
    _plain: bool
    _lean: bool
    _put: Callable[[int, Any], None] | None
    _watch: bool
    _post: Callable[[int, Any, tuple], None]
    reserved_pages: Callable[[int], tuple[int, ...]]

    def reserve(self, request: int, n: int, *, tenant: str | None = None) -> tuple[int, ...]:
        """Reserve ``n`` free pages for ``request`` (known or new). Returns the page ids.

        The allocator takes the top of the free stack (LIFO), skipping pages a restore
        is still writing. A known request keeps its tenant (``tenant=None`` means the
        same one). Raises ``OutOfPagesError`` (nothing changed) when fewer than ``n``
        are reservable, ``TenantMismatchError`` when a known request names another tenant.
        """
        st = self.state
        if (self._fast and type(request) is int and type(n) is int and n > 0 and not request >> _ID_BITS
                and not st.stale_entries and n <= len(st.free_stack) + len(st.cached)):
            # fast path: the top of the stack is free and reservable (PagesReserved's precondition)
            rec = st.requests.get(request)
            if tenant is None or (type(tenant) is str and (rec is None or rec.tenant == tenant)):
                if rec is not None:
                    tenant = rec.tenant
                if self._plain:
                    if n > len(st.free_stack):
                        self._evict_plain(n)
                    return fold.reserve_top(st, rec, request, n, tenant)
                if n > len(st.free_stack):  # too few free: the least recently used cached pages go first
                    self._submit(PagesEvicted(page_ids=tuple(islice(st.cached, n - len(st.free_stack)))))
                seq = st.seq
                ev = PagesReserved(request=request, page_ids=tuple(st.free_stack[: -n - 1 : -1]), tenant=tenant)
                if self._put is not None:
                    self._put(seq, ev)
                pages = fold.reserve_top(st, rec, request, n, tenant)
                if self._watch:
                    self._post(seq, ev, ())
                return pages
        if type(request) is not int or request >> _ID_BITS:
            checks.ident(request, "request")
        if type(n) is not int or n < 1:
            checks.count(n, "n")
        if tenant is None:
            rec = st.requests.get(request)
            if rec is not None:
                tenant = rec.tenant
        else:
            if type(tenant) is not str:
                checks.tenant(tenant)
            same_tenant(st, request, tenant)
        picked = st.pick_free(n)
        taken = self._evict_for(n, f"request {request}") if picked is None else picked
        self._submit(PagesReserved(request=request, page_ids=taken, tenant=tenant))
        return taken

    def allocate(self, request: int, step: int, n: int | None = None, *, pages: Iterable[int] | None = None,
                 tenant: str | None = None, reads: CommitReads = "tail") -> tuple[int, ...]:
        """``reserve(request, n)`` then ``commit`` those pages for ``step`` (vLLM's ``get_new_blocks``):
        two events, exactly as the two commands write them, with the same errors; returns the
        pages. If the commit is refused (a sealed step, a bad step id), the reservation stands
        (``return_reservation`` it). ``pages=`` names the pages instead (``_allocate_pages``).
        ``reads``: how the step first reads them (``PagesCommitted.reads``)."""
        if reads != "tail":
            return self._allocate_reading(request, step, n, pages, tenant, reads)
        if pages is not None:
            return self._allocate_pages(request, step, n, pages, tenant)
        st = self.state
        if (self._lean and type(n) is int and n == 1 and type(request) is int and type(step) is int
                and not (request | step) >> _ID_BITS and step >= st.open_step
                and not st.stale_entries and not st.parked):
            # one page, nothing to watch: both preconditions' common case inline (the top of the
            # stack is free, reservable and unmarked; the request has no older reservation)
            rec = st.requests.get(request)
            stack = st.free_stack
            if stack and self._put is None:  # (nothing attached: no event is built)
                p = stack[-1]
                if p not in st.marks:
                    if rec is None:
                        if tenant is None or type(tenant) is str:
                            del stack[-1]
                            st.holder[p] = request
                            st.requests[request] = RequestRecord(request, tenant, [], [p], [step])
                            st.seq += 2
                            return (p,)
                    elif not rec.reserved and (tenant is None or tenant == rec.tenant):
                        del stack[-1]
                        st.holder[p] = request
                        rec.kv.append(p)
                        rec.kv_steps.append(step)
                        st.seq += 2
                        return (p,)
            elif stack or (st.cached and st.policy == "released_aliases"):
                pages = self._allocate_one(rec, request, step, tenant)  # a sink or a record, or evicting
                if pages is not None:
                    return pages
        if (self._fast and type(request) is int and type(step) is int and type(n) is int and n > 0
                and not (request | step) >> _ID_BITS and step >= st.open_step
                and not st.stale_entries and n <= len(st.free_stack) + len(st.cached)):
            # fast path: both preconditions hold (the top of the stack is reservable; the
            # step is not sealed; the request has no older reservation to commit first)
            rec = st.requests.get(request)
            if rec is None:
                if tenant is None or type(tenant) is str:
                    return self._allocate_top(rec, request, step, n, tenant)
            elif not rec.reserved and (tenant is None or tenant == rec.tenant):
                return self._allocate_top(rec, request, step, n, rec.tenant)
        if n is None:
            raise InvalidArgumentError("allocate: give n= or pages=")
        pages = self.reserve(request, n, tenant=tenant)
        if len(st.requests[request].reserved) != n:
            self.commit(request, step, pages=pages)  # older reserved pages stay reserved
        elif type(step) is not int:
            checks.ident(step, "step")
        else:
            self._commit(request, step, pages)  # the reservation is exactly these pages: its head
        return pages

    def _allocate_reading(self, request: int, step: int, n: int | None, pages: Iterable[int] | None,
                          tenant: str | None, reads: CommitReads) -> tuple[int, ...]:
        """``allocate`` of pages a step reads otherwise than its KV tail (``reads="whole"``): no fast
        path, the two events through ``_submit`` (a recurrent state's block, once per request)."""
        checks.commit_reads(reads)
        checks.ident(request, "request")
        checks.ident(step, "step")
        st = self.state
        if step < st.open_step:
            raise StepOrderError(step, st.open_step, "commit into a sealed step")
        preconditions.commit_reads_allowed(st, reads)  # (the commit's, before the reservation: all-or-nothing)
        if pages is None:
            if n is None:
                raise InvalidArgumentError("allocate: give n= or pages=")
            ids = self.reserve(request, n, tenant=tenant)
        else:
            if n is not None:
                raise InvalidArgumentError("allocate: give exactly one of n= or pages=")
            if tenant is not None:
                checks.tenant(tenant)
            ids = checks.page_ids(pages, st.num_pages, allow_empty=False)
            rec = st.requests.get(request)
            if tenant is None and rec is not None:
                tenant = rec.tenant
            self._submit(PagesReserved(request=request, page_ids=ids, tenant=tenant))
        self._submit(PagesCommitted(request=request, step=step, page_ids=ids, reads=reads))
        return ids

    def release(self, request: int, pages: Iterable[int]) -> None:
        """A live request lets go of some of its KV pages (``PagesReleased``): each leaves its block
        table as ``finish`` would take it (still shared: the others keep it; hashed: cached; else
        free, marked as the policy says); the request keeps the rest.

        Raises ``UnknownRequestError``, ``PageNotHeldError`` for a page not in its block table,
        and the page-id errors; nothing changes then."""
        checks.ident(request, "request")
        ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(PagesReleased(request=request, page_ids=ids))

    def label(self, request: int, label: str) -> None:
        """Record the engine's name for ``request`` (``RequestLabelled``: a vLLM request id and cache
        group, say), best before its first event; the audit follows it (``kvledger audit --label``).
        Changes no state."""
        checks.ident(request, "request")
        checks.label(label)
        self._submit(RequestLabelled(request=request, label=label))

    def record_unwritten(self, request: int, step: int, pages: Iterable[int], reason: str = "") -> None:
        """Record that ``request``'s pages committed for ``step`` (sealed) were not written: the step
        ran without it (``PagesUnwritten``; the request may have ended). Changes no state."""
        checks.ident(request, "request")
        checks.ident(step, "step")
        ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        if type(reason) is not str:
            raise InvalidArgumentError(f"reason must be a str, got {reason!r}")
        self._submit(PagesUnwritten(request=request, step=step, page_ids=ids, reason=reason))

    def _allocate_pages(self, request: int, step: int, n: int | None, pages: Iterable[int],
                        tenant: str | None) -> tuple[int, ...]:
        """``allocate(request, step, pages=...)``: the named pages, each free and not restoring, are
        reserved and committed in that order (the same two events; older reserved pages stay
        reserved). Raises what ``PagesReserved`` / ``PagesCommitted`` raise for them
        (``PageNotHeldError`` for a page that is not free, ``RestoringPageError``,
        ``PageOutOfRangeError``, ``DuplicatePageError``, ``TenantMismatchError``), and
        ``StepOrderError`` for a sealed step before anything is reserved: a refused named
        allocation changes nothing. A cached page is not taken: ``evict(pages=...)`` it first.

        The fast path: both preconditions' case checked
        here (int ids, the step not sealed, a new request or one of the same tenant, a tuple of
        distinct free pages in range, none restoring), the two events put and folded as
        ``_allocate_top`` folds them. Otherwise every argument and the step are checked first,
        then the two events go through ``_submit``."""
        st = self.state
        if (self._fast and n is None and type(pages) is tuple and type(request) is int and type(step) is int
                and not (request | step) >> _ID_BITS and step >= st.open_step and self._all_free(pages)):
            rec = st.requests.get(request)
            if tenant is None or (type(tenant) is str and (rec is None or tenant == rec.tenant)):
                if rec is not None:
                    tenant = rec.tenant
                seq, put = st.seq, self._put
                ev = PagesReserved(request=request, page_ids=pages, tenant=tenant)
                if put is not None:
                    put(seq, ev)
                fold.pages_reserved(st, ev)
                return self._commit_reserved(seq, ev, request, step, pages)
        if n is not None:
            raise InvalidArgumentError("allocate: give exactly one of n= or pages=")
        checks.ident(request, "request")
        checks.ident(step, "step")
        if tenant is not None:
            checks.tenant(tenant)
        ids = checks.page_ids(pages, st.num_pages, allow_empty=False)
        if step < st.open_step:
            raise StepOrderError(step, st.open_step, "commit into a sealed step")
        rec = st.requests.get(request)
        if tenant is None and rec is not None:
            tenant = rec.tenant
        self._submit(PagesReserved(request=request, page_ids=ids, tenant=tenant))
        self._submit(PagesCommitted(request=request, step=step, page_ids=ids))
        return ids

    def _all_free(self, pages: tuple) -> bool:
        """``pages`` are distinct int ids in range, each free and not restoring (PagesReserved's
        per-page precondition), checked without raising."""
        st = self.state
        holder = st.holder
        if len(pages) == 1:
            p = pages[0]
            if type(p) is not int or not 0 <= p < st.num_pages or holder[p] != HOLDER_FREE:
                return False
        elif (not pages or set(map(type, pages)) != _INT_ONLY or min(pages) < 0 or max(pages) >= st.num_pages
              or len(set(pages)) != len(pages) or any(holder[p] != HOLDER_FREE for p in pages)):
            return False
        targets = st.restore_targets
        return not targets or targets.keys().isdisjoint(pages)

    def _allocate_one(self, rec: RequestRecord | None, request: int, step: int,
                      tenant: str | None) -> tuple[int, ...] | None:
        """``allocate``'s one-page case with nothing to watch, when a sink or a record is attached
        or the free stack is empty: the top of the stack (unmarked), or else the least recently
        used cached page (evicted: ``PagesEvicted``, its hash dropped; policy ``released_aliases``,
        where a cached page is never marked, pending or restoring: invariants 4), is reserved and
        committed. Each event is put before its fold (``_put``, when set): a put refusing a later
        event leaves the earlier ones standing. None when the common case does not hold."""
        st = self.state
        if rec is None:
            if not (tenant is None or type(tenant) is str):
                return None
        elif rec.reserved or not (tenant is None or tenant == rec.tenant):
            return None
        else:
            tenant = rec.tenant
        put, seq, stack = self._put, st.seq, st.free_stack
        if stack:
            p = stack[-1]
            if p in st.marks or put is None:
                return None
            pages = (p,)
        else:
            cached = st.cached
            p = next(iter(cached))
            pages = (p,)
            if put is not None:
                put(seq, PagesEvicted(page_ids=pages))
            del cached[p]
            del st.hash_page[st.page_hash.pop(p)]
            if put is None:  # (nothing attached: straight from the cache into the request)
                st.holder[p] = request
                if rec is None:
                    st.requests[request] = RequestRecord(request, tenant, [], [p], [step])
                else:
                    rec.kv.append(p)
                    rec.kv_steps.append(step)
                st.seq = seq + 3
                return pages
            st.holder[p] = HOLDER_FREE
            stack.append(p)
            seq += 1
            st.seq = seq
        put(seq, PagesReserved(request=request, page_ids=pages, tenant=tenant))
        del stack[-1]
        st.holder[p] = request
        if rec is None:
            rec = st.requests[request] = RequestRecord(request, tenant, [p], [], [])
        else:
            rec.reserved.append(p)
        st.seq = seq + 1
        put(seq + 1, PagesCommitted(request=request, step=step, page_ids=pages))
        rec.reserved.clear()  # (it held p only)
        rec.kv.append(p)
        rec.kv_steps.append(step)
        st.seq = seq + 2
        return pages

    def _allocate_top(self, rec: RequestRecord | None, request: int, step: int, n: int,
                      tenant: str | None) -> tuple[int, ...]:
        """``allocate``'s fast path, both preconditions checked (``tenant``: the request's): the
        least recently used cached pages make up for too few free ones (``PagesEvicted``), then
        the top ``n`` of the stack are reserved and committed. With nothing attached in one pass
        (``fold.allocate_top``), no event built; otherwise the two events, each through the sink
        before its fold and to the observer after it, exactly as ``reserve`` + ``commit`` write
        them (a sink refusing the commit leaves the reservation standing)."""
        st = self.state
        if self._plain:
            if n > len(st.free_stack):
                self._evict_plain(n)
            pages = fold.allocate_top(st, rec, request, step, n, tenant)
            if pages is None:  # a marked page among them: listed by the commit
                pages = fold.reserve_top(st, rec, request, n, tenant)
                fold.commit_pages(st, st.requests[request], step, pages)
            return pages
        if n > len(st.free_stack):  # too few free: the least recently used cached pages go first
            self._submit(PagesEvicted(page_ids=tuple(islice(st.cached, n - len(st.free_stack)))))
        pages = tuple(st.free_stack[: -n - 1 : -1])
        seq = st.seq
        put = self._put
        ev = PagesReserved(request=request, page_ids=pages, tenant=tenant)
        if put is not None:
            put(seq, ev)
        fold.reserve_top(st, rec, request, n, tenant)
        return self._commit_reserved(seq, ev, request, step, pages)

    def _commit_reserved(self, seq: int, reserved: PagesReserved, request: int, step: int,
                         pages: tuple[int, ...]) -> tuple[int, ...]:
        """The second half of an allocation past the plain path: ``reserved`` (seq ``seq``, put and
        folded) to the observer, then its ``PagesCommitted`` put, folded and posted."""
        st, put = self.state, self._put
        if self._watch:
            self._post(seq, reserved, ())
        ev = PagesCommitted(request=request, step=step, page_ids=pages)
        if put is not None:
            put(seq + 1, ev)
        effects = fold.commit_pages(st, st.requests[request], step, pages)
        if self._watch:
            self._post(seq + 1, ev, effects)
        return pages

    def _evict_plain(self, n: int) -> None:
        """Fast paths (a plain ledger, a stack without stale entries, every check passed):
        evict the least recently used cached pages that make up for too few free ones,
        ``n - free <= cached`` (the ``PagesEvicted`` of ``_evict_for``, folded without
        its event)."""
        st = self.state
        fold_prefix.evict_pages(st, tuple(islice(st.cached, n - len(st.free_stack))))

    def _evict_for(self, n: int, who: str) -> tuple[int, ...]:
        """Too few free pages for ``n``: evict the least recently used cached pages that make
        up the difference (``PagesEvicted``), then return the allocator's ``n`` pages.

        Raises ``OutOfPagesError`` (nothing changed) when free + cached pages are too few.
        The eviction and the allocation are two events: if the log refuses the second,
        the first stays recorded (and the log refuses everything after a failure).
        """
        st = self.state
        short = n - st.free_reservable
        if short > len(st.cached):
            raise OutOfPagesError(n, st.reservable_count, who)
        self._submit(PagesEvicted(page_ids=tuple(st.evictable(short))))
        pages = st.pick_free(n)
        assert pages is not None  # the eviction freed exactly what was short
        return pages

    def return_reservation(self, request: int, pages: Iterable[int] | None = None) -> tuple[int, ...]:
        """Give reserved pages back unused (all of the request's reservation by default)."""
        checks.ident(request, "request")
        if pages is None:
            pages = self.reserved_pages(request)
            if not pages and request not in self.state.requests:
                raise UnknownRequestError(request)
            if not pages:
                return ()
        pages = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(ReservationReturned(request=request, page_ids=pages))
        return pages

    def commit(
        self, request: int, step: int, n: int | None = None, *, pages: Iterable[int] | None = None,
        reads: CommitReads = "tail",
    ) -> tuple[int, ...]:
        """Move reserved pages into the request's KV pages (its block table) for ``step``.

        ``n`` takes the first ``n`` reserved pages; ``pages`` names them. Returns the
        page ids this commit listed for ``step``'s clear list (usually none). That is
        not yet the plan: a listed page whose request lets go of it before the seal
        leaves the list again (and gets its mark back), and an aborted step's pages
        are carried in. ``seal_step(step).clear_list`` is the authority on what every
        rank zeroes. ``reads``: how the step first reads them (``PagesCommitted.reads``).
        """
        st = self.state
        if reads != "tail":
            checks.commit_reads(reads)
            checks.ident(request, "request")
            checks.ident(step, "step")
            if (n is None) == (pages is None):
                raise InvalidArgumentError("commit: give exactly one of n= or pages=")
            if pages is None:
                n = checks.count(n, "n")
                rec = st.requests.get(request)
                if rec is None:
                    raise UnknownRequestError(request)
                if len(rec.reserved) < n:
                    raise InvalidArgumentError(
                        f"request {request} has {len(rec.reserved)} reserved pages, cannot commit {n}")
                ids = tuple(rec.reserved[:n])
            else:
                ids = checks.page_ids(pages, st.num_pages, allow_empty=False)
            effects = self._submit(PagesCommitted(request=request, step=step, page_ids=ids, reads=reads))
            return effects[0].page_ids if effects else ()
        if (self._fast and pages is None and type(request) is int and type(step) is int and type(n) is int
                and n > 0 and not (request | step) >> _ID_BITS and step >= st.open_step):
            rec = st.requests.get(request)
            if rec is not None and n <= len(rec.reserved):
                head = tuple(rec.reserved[:n])
                targets = st.restore_targets
                if not targets or targets.keys().isdisjoint(head):  # fast path: PagesCommitted's precondition holds
                    if self._plain:
                        effects = fold.commit_pages(st, rec, step, head)
                    else:
                        seq, ev = st.seq, PagesCommitted(request=request, step=step, page_ids=head)
                        if self._put is not None:
                            self._put(seq, ev)
                        effects = fold.commit_pages(st, rec, step, head)
                        if self._watch:
                            self._post(seq, ev, effects)
                    return effects[0].page_ids if effects else ()
        if type(request) is not int or type(step) is not int:
            checks.ident(request, "request")
            checks.ident(step, "step")
        if pages is None and type(n) is int and n > 0:
            rec = st.requests.get(request)
            if rec is None:
                checks.ident(request, "request")
                raise UnknownRequestError(request)
            if len(rec.reserved) < n:
                raise InvalidArgumentError(
                    f"request {request} has {len(rec.reserved)} reserved pages, cannot commit {n}"
                )
            return self._commit(request, step, tuple(rec.reserved[:n]))
        if (n is None) == (pages is None):
            raise InvalidArgumentError("commit: give exactly one of n= or pages=")
        if pages is None:
            checks.count(n, "n")  # not a positive int (the branch above took those)
            raise AssertionError("unreachable")
        ids = checks.page_ids(pages, st.num_pages, allow_empty=False)
        if (step | request) >> _ID_BITS:
            checks.ident(request, "request")
            checks.ident(step, "step")
        effects = self._submit(PagesCommitted(request=request, step=step, page_ids=ids))
        return effects[0].page_ids if effects else ()

    def _commit(self, request: int, step: int, head: tuple[int, ...]) -> tuple[int, ...]:
        """Commit ``head``, the head of the request's reservation. The ids are int-typed here;
        their ranges are checked now."""
        if (step | request) >> _ID_BITS:
            checks.ident(request, "request")
            checks.ident(step, "step")
        effects = self._submit(PagesCommitted(request=request, step=step, page_ids=head))
        return effects[0].page_ids if effects else ()

    def cancel(self, request: int) -> None:
        """The request is aborted: its reserved and KV pages go back to the free list."""
        st = self.state
        if self._plain and type(request) is int and request in st.requests:  # nothing watches: the fold alone
            fold.release_request(st, request)
        else:
            self._release(request, RequestCancelled)

    def finish(self, request: int) -> None:
        """The request completed: its reserved and KV pages go back to the free list."""
        st = self.state
        if self._plain and type(request) is int and request in st.requests:  # nothing watches: the fold alone
            fold.release_request(st, request)
        else:
            self._release(request, RequestFinished)

    def _release(self, request: int, event: type[RequestCancelled] | type[RequestFinished]) -> None:
        """``cancel`` and ``finish`` past the plain path: a known request's event built once for
        the sink and the watchers around the fold (fast path), else checked and submitted."""
        st = self.state
        if self._fast and type(request) is int and request in st.requests:  # r known is all it needs
            seq, ev = st.seq, event(request=request)
            if self._put is not None:
                self._put(seq, ev)
            effects = fold.release_request(st, request)
            if self._watch:
                self._post(seq, ev, effects)
            return
        if type(request) is not int or request >> _ID_BITS:
            checks.ident(request, "request")
        self._submit(event(request=request))
