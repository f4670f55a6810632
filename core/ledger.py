"""The command side: decide a command against the state into events, record them, fold them.

One piece: ``Ledger`` is one class in one module (as ``EventLog`` is, core/log/writer.py).
Its commands share one plumbing and one vocabulary, and a split along the commands
(requests, prefix caching, snapshots, steps) would be a split of that plumbing, not
of the state: the state's seams (the page table and allocator, the prefix index, the
step book) live in ``core/state`` with the fold, which is the only writer of the
state. The ledger writes nothing; it decides.

    command ─► check argument types ─► decide the events (the allocator's pages, the
            head of a reservation, the derived clear list)
            ─► the journal (core/journal.py): every event, before its fold
            ─► the fold: one applier per event (core/state/fold*.py) ─► effects

Two roads through that path, one decision per command:

    lean       the command checked its events' precondition in its common case as it
               decided them (the top of a free stack without stale entries, named pages
               that are free, the head of a reservation, the open step, a known request,
               published hashes) and the journal's ``due`` is past them: it appends them
               to ``journal.events`` and folds them through the appliers of that case
               (``fold.allocated_one``, ``reserved_top``, ``pages_committed``, ``sealed``, ...),
               each taking the events it folds
    decided    the same events, one at a time, when the journal must see each (a callable
               sink, an observer, check mode, a log's checkpoint or roll due, a seal):
               ``journal.put`` ─► the table's applier ─► ``journal.post``

Anything outside the common case goes through ``_submit``: the event's precondition
(``core/state/preconditions.py``, which raises the specific error) ─► put ─► the
table's applier ─► post. A ledger whose state has another table than ``TRANSITIONS``
takes that path for every event (its journal is ``Watched``: due -1, and decided
events are submitted): R8 drives ledgers of every mode and that one with the same
commands and compares them.

Every command is all-or-nothing: argument errors, precondition failures and a
refusing sink (the durable log, when one is attached) all raise before the fold of
the event they concern, so state and effects are exactly as before it (a command of
two events whose second is refused keeps its first: allocate's reservation, an
eviction before the allocation it made room for). Running out of pages is an
ordinary ``OutOfPagesError``: cheap, nothing changed. Synchronous and I/O-free by
itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Literal

from . import checks
from .errors import (
    ConfigurationError, InvalidArgumentError, OutOfPagesError, StepOrderError, UnknownBlockHashError,
    UnknownRequestError,
)
from .events.events import (
    CacheConfigured, CommitReads, Geometry, PagesCommitted, PagesEvicted, PagesPublished, PagesReleased, PagesReserved,
    PagesShared, PagesUnwritten, RequestCancelled, RequestFinished, RequestLabelled, ReservationReturned,
    RestoreCompleted, RestoreStarted, SanitizerViolation, SnapshotAliased, SnapshotReleased, StepAborted,
    StepCompleted, StepPlan, StepSealed, typed,
)
from .journal import CallSink, EventList, Journal, Ring, Watched
from .state import fold, fold_prefix, fold_steps
from .state.invariants import check_invariants
from .state.preconditions import commit_reads_allowed, same_tenant
from .state.state import LedgerState
from .state.table import HOLDER_CACHED, HOLDER_FREE, MARK_ALL
from .state.transitions import TRANSITIONS

__all__ = ["EventObserver", "EventSink", "Journal", "Ledger", "replay"]

# A sink receives every accepted event with its sequence number before it is folded.
# Raising refuses the event (the command fails, nothing of that event changes).
EventSink = Callable[[int, object], None]
# An observer receives every folded event with its sequence number and its effects.
EventObserver = Callable[[int, object, tuple], None]

# An id is an int in [0, 2**63): for an int x, ``x >> 63`` is 0 exactly then (-1 below, >= 1 above),
# so ``(a | b) >> 63`` checks two ints at once. ``checks.ident`` raises the error.
_ID_BITS = 63
assert checks.MAX_ID == (1 << _ID_BITS) - 1
_MAX_TENANT = checks.MAX_TENANT_CHARS
_INT_ONLY = {int}
_HASH_TYPES = frozenset((bytes, int))  # (a published hash is valid: only its exact type is left to check)


class Ledger:
    """The KV-page ledger of one cache. Commands mirror SPEC's event table.

    ``allocate(request, step, n)`` reserves and commits the allocator's next ``n``
    pages; ``allocate(request, step, pages=ids)`` the named ones, for a scheduler
    whose own free queue picks its blocks (vLLM's ``BlockPool``): the same two
    events, each page checked free (a refusal changes nothing).

    Every event of every command is built and recorded (the module docstring says
    how): ``sink`` (optional) is a ``Journal`` (the durable log, a recording
    ``EventList``) or a callable ``sink(seq, event)``; either sees each accepted
    event before the fold, and raising refuses it (nothing of it changes).
    ``observer(seq, event, effects)`` (optional) sees it after the fold (metrics,
    debug logs, KV-event publishers); it must not raise. ``record=True`` keeps the
    events in ``self.events`` (tests, small tools). ``check=True`` runs every
    invariant after every fold (O(num_pages) each: for tests and debugging). All
    are fixed when the ledger is made: they choose its journal.
    """

    def __init__(
        self,
        geometry: Geometry,
        *,
        policy: str = "released_aliases",
        check: bool = False,
        sink: EventSink | Journal | None = None,
        record: bool = False,
        state: LedgerState | None = None,
        observer: EventObserver | None = None,
    ) -> None:
        self.events: list | None = [] if record else None
        self._observer = observer
        self._check = bool(check)
        self._sink = sink
        if state is not None:
            if state.geometry != geometry:
                raise ConfigurationError(f"state geometry {state.geometry} != {geometry}")
            self.state = state
        else:
            if not isinstance(geometry, Geometry):
                raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
            checks.geometry(geometry)
            self.state = LedgerState()
        standard = state is None or state.transitions is TRANSITIONS
        self._journal = self._choose_journal(sink, standard)
        self._events = self._journal.events  # (the lean path appends here: one list for the journal's life)
        # an event a command decided in its common case: put, fold, post; with another table, submitted
        self._decided: Callable[..., tuple] = self._put_and_fold if standard else self._submit
        if state is None:
            first = CacheConfigured(geometry=geometry, policy=policy)
            self.state.validate(first)
            self._submit(first)
        # any request may share any published block (the isolating policies check tenants)
        self._open_sharing = self.state.policy == "released_aliases"

    def _choose_journal(self, sink, standard: bool) -> Journal:
        """The one object the ledger's mode is (core/journal.py)."""
        if sink is not None and not isinstance(sink, Journal):
            if not callable(sink):
                raise InvalidArgumentError(f"a sink must be a Journal or callable(seq, event), got {sink!r}")
            sink = CallSink(sink)
        watched = self._check or self._observer is not None or not standard
        if not watched and sink is None:
            return EventList(self.events) if self.events is not None else Ring(self.state.seq)
        if not watched and self.events is None:
            return sink
        return Watched(sink, self.events, self._observer, self.state if self._check else None)

    # ------------------------------------------------------------------ the one path

    def _submit(self, event, apply=None) -> tuple:
        """validate -> put -> apply -> post: the path of every event outside a command's common case.

        Raises the event's precondition error, or what the journal's ``put`` raises; either
        way nothing changed. Returns the event's effects. (``apply`` is ignored: the table's.)
        """
        st = self.state
        validate, apply = st.dispatch[type(event)]  # a Ledger's state is configured from its first event on
        validate(st, event)
        seq = st.seq
        j = self._journal
        j.put(seq, event)
        effects = apply(st, event)
        if j.post is not None:
            j.post(seq, event, effects)
        return effects

    def _put_and_fold(self, event, apply=None) -> tuple:
        """An event whose precondition the command checked: put -> apply (``apply``, or the table's
        applier) -> post. Raises what ``put`` raises (nothing changed then)."""
        st = self.state
        seq = st.seq
        j = self._journal
        j.put(seq, event)
        effects = (apply or st.dispatch[type(event)][1])(st, event)
        if j.post is not None:
            j.post(seq, event, effects)
        return effects

    def _evict_lru(self, short: int) -> None:
        """A fast path's eviction: the ``short`` least recently used cached pages go (``short`` <=
        cached pages, the free stack without stale entries)."""
        st = self.state
        ev = PagesEvicted(page_ids=tuple(islice(st.cached, short)))
        if st.seq < self._journal.due:
            self._events.append(ev)
            fold_prefix.evicted(st, ev)
        else:
            self._decided(ev)

    def submit(self, event) -> tuple:
        """Type-check, validate and fold an event built elsewhere (tools, a log reader).

        Returns its effects. Raises ``InvalidArgumentError`` for an ill-typed event and
        the specific precondition error otherwise; nothing changes on either.
        """
        return self._submit(typed(event))

    # ------------------------------------------------------------------ what the ledger is

    @property
    def check(self) -> bool:
        """Check mode: every invariant after every fold."""
        return self._check

    @property
    def observer(self) -> EventObserver | None:
        """The observer given when the ledger was made (None: none)."""
        return self._observer

    @property
    def journal(self) -> Journal:
        """Where the ledger's events go (core/journal.py): its mode, chosen when it was made."""
        return self._journal

    @property
    def geometry(self) -> Geometry:
        return self.state.geometry  # type: ignore[return-value]

    @property
    def seq(self) -> int:
        """Sequence number the next event will get (= events folded so far)."""
        return self.state.seq

    def digest(self) -> str:
        return self.state.digest()

    # ------------------------------------------------------------------ requests

    def reserve(self, request: int, n: int, *, tenant: str | None = None) -> tuple[int, ...]:
        """Reserve ``n`` free pages for ``request`` (known or new). Returns the page ids.

        The allocator takes the top of the free stack (LIFO), skipping pages a restore
        is still writing; when free pages run short, the least recently used cached
        pages are evicted first (``PagesEvicted``, then the reservation). A known request
        keeps its tenant (``tenant=None`` means the same one). Raises ``OutOfPagesError``
        (nothing changed) when fewer than ``n`` are reservable, ``TenantMismatchError``
        when a known request names another tenant.
        """
        st = self.state
        if (type(request) is int and type(n) is int and n > 0 and not request >> _ID_BITS
                and not st.stale_entries and n <= len(st.free_stack) + len(st.cached)):
            # the top of the stack is free and reservable (PagesReserved's precondition)
            rec = st.requests.get(request)
            if tenant is None or (type(tenant) is str and len(tenant) <= _MAX_TENANT
                                  and (rec is None or rec.tenant == tenant)):
                if rec is not None:
                    tenant = rec.tenant
                short = n - len(st.free_stack)
                if short > 0:  # too few free: the least recently used cached pages go first
                    self._evict_lru(short)
                ev = PagesReserved(request=request, page_ids=tuple(st.free_stack[: -n - 1 : -1]), tenant=tenant)
                if st.seq < self._journal.due:
                    self._events.append(ev)
                    fold.reserved_top(st, rec, ev)
                else:
                    self._decided(ev)
                return ev.page_ids
        if type(request) is not int or request >> _ID_BITS:
            checks.ident(request, "request")
        if type(n) is not int or n < 1:
            checks.count(n, "n")
        if tenant is None:
            rec = st.requests.get(request)
            if rec is not None:
                tenant = rec.tenant
        else:
            checks.tenant(tenant)
            same_tenant(st, request, tenant)
        picked = st.pick_free(n)
        taken = self._evict_for(n, f"request {request}") if picked is None else picked
        self._submit(PagesReserved(request=request, page_ids=taken, tenant=tenant))
        return taken

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
        if (type(n) is int and type(request) is int and type(step) is int and n > 0
                and not (request | step) >> _ID_BITS and step >= st.open_step and not st.stale_entries):
            # both preconditions' common case: the top of the stack is reservable, the step is not
            # sealed, the request has no older reservation to commit first
            rec = st.requests.get(request)
            if rec is None:
                ok = tenant is None or (type(tenant) is str and len(tenant) <= _MAX_TENANT)
            else:
                ok = not rec.reserved and (tenant is None or tenant == rec.tenant)
            if ok:
                if rec is not None:
                    tenant = rec.tenant
                stack = st.free_stack
                if n <= len(stack) and st.seq + 1 < self._journal.due:
                    # the lean path: the top n (vLLM's get_new_blocks), none marked, in one pass
                    # (``_allocate_top`` has every other case; this one is inline: the hottest command)
                    marks = st.marks
                    if n == 1:
                        p = stack[-1]
                        if p not in marks:
                            ids: tuple[int, ...] = (p,)
                            r_ev = PagesReserved(request=request, page_ids=ids, tenant=tenant)
                            c_ev = PagesCommitted(request=request, step=step, page_ids=ids)
                            events = self._events
                            events.append(r_ev)
                            events.append(c_ev)
                            fold.allocated_one(st, rec, r_ev, c_ev)
                            return ids
                    else:
                        ids = tuple(stack[: -n - 1 : -1])
                        if not marks or marks.keys().isdisjoint(ids):
                            r_ev = PagesReserved(request=request, page_ids=ids, tenant=tenant)
                            c_ev = PagesCommitted(request=request, step=step, page_ids=ids)
                            self._events.extend((r_ev, c_ev))
                            fold.allocated_top(st, rec, r_ev, c_ev)
                            return ids
                if n <= len(stack) + len(st.cached):
                    return self._allocate_top(rec, request, step, n, tenant)
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
        commit_reads_allowed(st, reads)  # (the commit's, before the reservation: all-or-nothing)
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

    def _allocate_top(self, rec, request: int, step: int, n: int, tenant: str | None) -> tuple[int, ...]:
        """``allocate``'s common case (both preconditions checked; ``tenant``: the request's): the
        least recently used cached pages make up for too few free ones (``PagesEvicted``), then
        the top ``n`` of the stack are reserved and committed. One pass when none is marked: the
        top ``n`` (``fold.allocated_top``), or every free page and the evicted ones, which the
        eviction would push and the reservation take at once (``fold_prefix.taken_from_cache``)."""
        st = self.state
        stack = st.free_stack
        short = n - len(stack)
        j = self._journal
        if short > 0:
            marks = st.marks
            if self._open_sharing and (not marks or marks.keys().isdisjoint(stack)):
                # every free page and the least recently used cached pages, straight into the request
                e_ids = tuple(islice(st.cached, short))
                ids = (*reversed(e_ids), *reversed(stack))  # (what the eviction's push then the pop give)
                e_ev = PagesEvicted(page_ids=e_ids)
                r_ev = PagesReserved(request=request, page_ids=ids, tenant=tenant)
                c_ev = PagesCommitted(request=request, step=step, page_ids=ids)
                if st.seq + 2 < j.due:
                    self._events.extend((e_ev, r_ev, c_ev))
                    fold_prefix.taken_from_cache(st, rec, e_ev, r_ev, c_ev)
                else:
                    self._decided(e_ev)
                    self._decided(r_ev)
                    self._decided(c_ev)
                return ids
            self._evict_lru(short)
        pages = tuple(st.free_stack[: -n - 1 : -1])
        r_ev = PagesReserved(request=request, page_ids=pages, tenant=tenant)
        c_ev = PagesCommitted(request=request, step=step, page_ids=pages)
        if st.seq + 1 < j.due:
            self._events.extend((r_ev, c_ev))
            marks = st.marks
            if not marks or marks.keys().isdisjoint(pages):
                fold.allocated_top(st, rec, r_ev, c_ev)
            else:  # a marked page among them: the commit lists it
                fold.reserved_top(st, rec, r_ev)
                fold.pages_committed(st, c_ev)
        else:
            self._decided(r_ev)
            self._decided(c_ev)
        return pages

    def _allocate_pages(self, request: int, step: int, n: int | None, pages: Iterable[int],
                        tenant: str | None) -> tuple[int, ...]:
        """``allocate(request, step, pages=...)``: the named pages, each free and not restoring, are
        reserved and committed in that order (the same two events; older reserved pages stay
        reserved). Raises what ``PagesReserved`` / ``PagesCommitted`` raise for them
        (``PageNotHeldError`` for a page that is not free, ``RestoringPageError``,
        ``PageOutOfRangeError``, ``DuplicatePageError``, ``TenantMismatchError``), and
        ``StepOrderError`` for a sealed step before anything is reserved: a refused named
        allocation changes nothing. A cached page is not taken: ``evict(pages=...)`` it first.

        The common case (int ids, the step not sealed, a new request or one of the same
        tenant, a tuple of distinct free pages in range, none restoring) is checked here;
        otherwise every argument and the step are checked first, then the two events go
        through ``_submit``."""
        st = self.state
        if (n is None and type(pages) is tuple and type(request) is int and type(step) is int
                and not (request | step) >> _ID_BITS and step >= st.open_step and self._all_free(pages)):
            rec = st.requests.get(request)
            if (tenant is None or (type(tenant) is str and len(tenant) <= _MAX_TENANT
                                   and (rec is None or tenant == rec.tenant))):
                if rec is not None:
                    tenant = rec.tenant
                r_ev = PagesReserved(request=request, page_ids=pages, tenant=tenant)
                c_ev = PagesCommitted(request=request, step=step, page_ids=pages)
                if st.seq + 1 < self._journal.due:
                    self._events.extend((r_ev, c_ev))
                    fold.pages_reserved(st, r_ev)
                    fold.pages_committed(st, c_ev)
                else:
                    self._decided(r_ev)
                    self._decided(c_ev)
                return pages
        if n is not None:
            raise InvalidArgumentError("allocate: give exactly one of n= or pages=")
        checks.ident(request, "request")
        checks.ident(step, "step")
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
            return self._commit_reading(request, step, n, pages, reads)
        if (pages is None and type(request) is int and type(step) is int and type(n) is int
                and n > 0 and not (request | step) >> _ID_BITS and step >= st.open_step):
            rec = st.requests.get(request)
            if rec is not None and n <= len(rec.reserved):
                head = tuple(rec.reserved[:n])
                targets = st.restore_targets
                if not targets or targets.keys().isdisjoint(head):  # PagesCommitted's precondition holds
                    ev = PagesCommitted(request=request, step=step, page_ids=head)
                    if st.seq < self._journal.due:
                        self._events.append(ev)
                        effects = fold.pages_committed(st, ev, rec)
                    else:
                        effects = self._decided(ev)
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

    def _commit_reading(self, request: int, step: int, n: int | None, pages: Iterable[int] | None,
                        reads: CommitReads) -> tuple[int, ...]:
        """``commit`` of pages a step reads otherwise than its KV tail: every argument checked, the
        event through ``_submit``."""
        st = self.state
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
        self._release(RequestCancelled, request)

    def finish(self, request: int) -> None:
        """The request completed: its reserved and KV pages go back to the free list."""
        st = self.state
        if type(request) is int and request in st.requests:  # (``_release``'s lean path, copied: vLLM's
            ev = RequestFinished(request=request)              # free_blocks is as hot as its allocations)
            if st.seq < self._journal.due:
                self._events.append(ev)
                fold.request_gone(st, ev)
            else:
                self._decided(ev)
            return
        self._release(RequestFinished, request)

    def _release(self, event: type[RequestCancelled] | type[RequestFinished], request: int) -> None:
        st = self.state
        if type(request) is int and request in st.requests:  # r known is all the precondition asks
            ev = event(request=request)
            if st.seq < self._journal.due:
                self._events.append(ev)
                fold.request_gone(st, ev)
            else:
                self._decided(ev)
            return
        if type(request) is not int or request >> _ID_BITS:
            checks.ident(request, "request")
        self._submit(event(request=request))

    # ------------------------------------------------------------------ prefix caching (SPEC, "Prefix-shared pages")

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
        if (type(request) is int and type(start) is int and type(hashes) is tuple
                and type(token_ids) is tuple and lora_id is None and lora_name is None
                and start >= 0 and self._open_sharing):
            rec = st.requests.get(request)
            k = len(hashes)
            if (rec is not None and 0 < k <= len(rec.kv) - start
                    and len(token_ids) == k * st.geometry.page_tokens):  # type: ignore[union-attr]
                # PagesPublished's precondition for a run of the block table, as a slice; the
                # arguments' types and ranges in one C pass (checks.publish_args)
                if k == 1:  # (one block: vLLM's cache_full_blocks of a step's new full block)
                    h = hashes[0]
                    p = rec.kv[start]
                    step = rec.kv_steps[start]
                    ok = ((type(h) is bytes or type(h) is int) and 0 <= step <= st.completed_step
                          and p not in st.page_hash and h not in st.hash_page and step not in st.aborted_steps)
                    pages: tuple = (p,)
                else:
                    pages = tuple(rec.kv[start : start + k])
                    ok = self._publishable(pages, rec.kv_steps[start : start + k], hashes)
                if ok and checks.publish_args(hashes, parent_hash, token_ids):
                    if parent_hash is None and start:
                        parent_hash = st.page_hash.get(rec.kv[start - 1])
                    ev = PagesPublished(request=request, page_ids=pages, hashes=hashes, parent_hash=parent_hash,
                                        token_ids=token_ids)
                    j = self._journal
                    seq = st.seq
                    if seq < j.due:  # (put: a publish's tokens are a field no validation bounds)
                        j.put(seq, ev)
                        fold_prefix.published(st, ev)
                    else:
                        self._decided(ev)
                    return pages
        return self._publish(request, hashes, token_ids, start, parent_hash, lora_id, lora_name)

    def _publishable(self, pages: tuple, steps: list, hashes: tuple) -> bool:
        """``publish``'s common case for a run of ``k`` > 1 blocks (``pages`` of the block table,
        ``steps`` their commit steps): PagesPublished's precondition holds, the hashes are of
        the block-hash types and distinct (their ranges: ``checks.publish_args``)."""
        st = self.state
        aborted = st.aborted_steps
        return (min(steps) >= 0 and max(steps) <= st.completed_step
                and (not aborted or aborted.isdisjoint(steps))
                and st.page_hash.keys().isdisjoint(pages)
                and _HASH_TYPES.issuperset(map(type, hashes))
                and st.hash_page.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes))

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
        (``share`` refuses the others). A query: no event.
        """
        st = self.state
        if type(hashes) is tuple and self._open_sharing:
            # every published hash counts (a hashed page is never marked or restoring)
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
        if self._open_sharing and type(hashes) is tuple and tenant is None and type(request) is int:
            if len(hashes) == 1:
                h = hashes[0]  # one cached block into a known request (vLLM's touch): PagesShared's
                if type(h) is bytes or type(h) is int:  # precondition holds for a cached page
                    p = st.hash_page.get(h)
                    rec = st.requests.get(request)
                    if p is not None and rec is not None and st.holder[p] == HOLDER_CACHED:
                        ids = (p,)
                        ev = PagesShared(request=request, page_ids=ids, tenant=None)
                        if st.seq < self._journal.due:
                            self._events.append(ev)
                            fold_prefix.shared_cached(st, rec, ev)
                        else:
                            self._decided(ev)
                        return ids
            if hashes and not request >> _ID_BITS:
                # PagesShared's precondition page by page (a hashed page is kv or cached, never
                # marked or restoring; it must not be r's already), then distinct pages
                ids_ = self._shareable(request, hashes)
                if ids_ is not None:
                    ev = PagesShared(request=request, page_ids=ids_, tenant=None)
                    if st.seq < self._journal.due:
                        self._events.append(ev)
                        fold_prefix.shared(st, ev)
                    else:
                        self._decided(ev)
                    return ids_
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

    def _shareable(self, request: int, hashes: tuple) -> tuple[int, ...] | None:
        """``share``'s common case for any number of hashes (policy ``released_aliases``, no
        tenant): the pages, or None when a hash is not published or not a plain block hash,
        a page is the request's already, or pages repeat (the table's path raises)."""
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
        return tuple(pages)

    def evict(self, n: int | None = None, *, pages: Iterable[int] | None = None) -> tuple[int, ...]:
        """Evict cached pages: the ``n`` least recently used (fewer if fewer are cached), or the
        named ones, or all of them by default.

        Returns the page ids evicted; the fold's effect is a ``BlocksRemoved`` KV event.
        """
        st = self.state
        if n is None and (type(pages) is list or type(pages) is tuple):
            # vLLM's pool evicting the cached blocks its free queue picked: named, distinct int
            # pages, each cached (so in range)
            ids = tuple(pages)
            cached = st.cached
            if len(ids) == 1:
                ok = type(ids[0]) is int and ids[0] in cached
            else:
                ok = (bool(ids) and set(map(type, ids)) == _INT_ONLY and len(set(ids)) == len(ids)
                      and cached.keys() >= set(ids))
            if ok:
                ev = PagesEvicted(page_ids=ids)
                if st.seq < self._journal.due:
                    self._events.append(ev)
                    fold_prefix.evicted(st, ev)
                else:
                    self._decided(ev)
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

    # ------------------------------------------------------------------ snapshot rows and restores

    def alias_snapshot(
        self, snapshot: int, n: int | None = None, *, pages: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        """Back snapshot rows with pages: ``n`` free pages from the allocator (evicting cached
        ones when free pages run short), or named free/aliased pages (snapshot reuse). Returns
        the page ids."""
        checks.ident(snapshot, "snapshot")
        _one_of(n, pages, "alias_snapshot")
        if pages is None:
            k = checks.count(n, "n")
            got = self.state.pick_free(k)
            if got is None:
                got = self._evict_for(k, f"snapshot {snapshot}")
            ids = tuple(got)
        else:
            ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(SnapshotAliased(snapshot=snapshot, page_ids=ids))
        return ids

    def release_snapshot(self, snapshot: int) -> None:
        """The snapshot is gone; pages it was the last alias of become free and marked."""
        self._submit(SnapshotReleased(snapshot=checks.ident(snapshot, "snapshot")))

    def start_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        """An inbound host restore starts writing ``pages`` of a request or a snapshot."""
        into, target = _restore_target(request, snapshot)
        ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(RestoreStarted(into=into, target=target, page_ids=ids))

    def complete_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        """The restore into ``pages`` finished writing; they may be reserved and committed again."""
        into, target = _restore_target(request, snapshot)
        ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(RestoreCompleted(into=into, target=target, page_ids=ids))

    # ------------------------------------------------------------------ steps

    def seal_step(self, step: int) -> StepPlan:
        """Close the open step and return its plan (the pages every rank must zero).

        The clear list is derived once, here; the journal sees the seal before its fold (a
        durable log commits its batch there, per its fsync policy)."""
        st = self.state
        if type(step) is int and step == st.open_step:  # the open step is all the precondition asks
            ev = StepSealed(step=step, clear_list=st.derive_clear_list(step))
            j = self._journal
            seq = st.seq
            if seq < j.due:  # (put: a durable log commits its batch at a seal)
                j.put(seq, ev)
                return fold_steps.sealed(st, ev)[0]
            (plan,) = self._decided(ev, fold_steps.sealed)
            return plan
        if type(step) is not int or step >> _ID_BITS:
            checks.ident(step, "step")
        (plan,) = self._submit(StepSealed(step=step, clear_list=st.derive_clear_list(step)))
        return plan

    def complete_step(self, step: int, rank: int) -> None:
        """Rank ``rank`` ran step ``step``'s input copies, clears and graph."""
        st = self.state
        if (type(step) is int and type(rank) is int and 0 <= step < st.open_step
                and not rank >> _ID_BITS and rank >= 0):  # a sealed step is the whole precondition
            ev = StepCompleted(step=step, rank=rank)
            if st.seq < self._journal.due:
                self._events.append(ev)
                fold_steps.completed(st, ev)
            else:
                self._decided(ev)
            return
        self._submit(StepCompleted(step=checks.ident(step, "step"), rank=checks.ident(rank, "rank")))

    def record_violation(self, step: int, rank: int, plane: int, page_id: int,
                         kind: Literal["not_zero", "poison"]) -> None:
        """Record what the sanitizer found on ``rank``'s ``plane`` before step ``step``'s graph
        (``kind``: "not_zero" or "poison"); ``kvledger audit --page`` shows it."""
        if kind not in ("not_zero", "poison"):
            raise InvalidArgumentError(f"kind must be 'not_zero' or 'poison', got {kind!r}")
        self._submit(SanitizerViolation(step=checks.ident(step, "step"), rank=checks.ident(rank, "rank"),
                                        plane=checks.ident(plane, "plane"), page_id=checks.ident(page_id, "page"),
                                        kind=kind))

    def abort_step(self, step: int, reason: str = "") -> None:
        """Step ``step`` (in flight: sealed, not aborted, not yet completed on every rank) and
        every later step in flight did not run everywhere: nothing of them can be assumed
        zeroed. Their listed pages still in KV are carried into the open step's clear list;
        the others get their mark back. Raises ``StepOrderError`` for a step not in flight."""
        if type(reason) is not str:
            raise InvalidArgumentError(f"reason must be a str, got {reason!r}")
        self._submit(StepAborted(step=checks.ident(step, "step"), reason=reason))

    # ------------------------------------------------------------------ queries

    @property
    def free_count(self) -> int:
        return self.state.free_count

    @property
    def reservable_count(self) -> int:
        return self.state.reservable_count

    @property
    def open_step(self) -> int:
        return self.state.open_step

    def reserved_pages(self, request: int) -> tuple[int, ...]:
        rec = self.state.requests.get(request)
        return () if rec is None else tuple(rec.reserved)

    def kv_pages(self, request: int) -> tuple[int, ...]:
        """The request's block table (committed pages, in order)."""
        rec = self.state.requests.get(request)
        return () if rec is None else tuple(rec.kv)

    def snapshot_pages(self, snapshot: int) -> tuple[int, ...]:
        return tuple(self.state.snapshots.get(snapshot, ()))

    def holder_of(self, page_id: int) -> str:
        return self.state.holder_of(page_id)

    def holders_of(self, page_id: int) -> tuple[int, ...]:
        """The requests holding a page in KV (more than one: a shared page)."""
        return tuple(self.state.holders_of(page_id))

    @property
    def cached_count(self) -> int:
        """Pages that hold cached KV (no request holds them; evicted when free pages run out)."""
        return len(self.state.cached)

    def block_hash(self, page_id: int) -> int | bytes | None:
        """The block hash a page was published under (None: not published)."""
        return self.state.page_hash.get(page_id)

    def is_marked(self, page_id: int) -> bool:
        return page_id in self.state.marks

    def is_restoring(self, page_id: int) -> bool:
        return page_id in self.state.restore_targets

    def mark_of(self, page_id: int) -> str | None:
        """A page's mark: ``"all"`` (zeroed before any request reads it), ``"tenant"`` (policy
        ``cross_tenant``: zeroed unless its tenant reads it back) or None."""
        m = self.state.marks.get(page_id)
        return None if m is None else "all" if m == MARK_ALL else "tenant"

    def marked_pages(self) -> dict[int, str]:
        """Every marked page and its mark (``mark_of``), in no particular order."""
        return {p: ("all" if m == MARK_ALL else "tenant") for p, m in self.state.marks.items()}

    def request_of(self, page_id: int) -> int | None:
        """The request a page is reserved for or committed to (its writer, for a shared page); None
        for a page no request holds (free, aliased, cached)."""
        x = self.state.holder[page_id]
        return x if x >= 0 else None

    def requests(self) -> tuple[int, ...]:
        """The requests the ledger knows (reserved or KV pages, or both)."""
        return tuple(self.state.requests)

    def snapshots(self) -> tuple[int, ...]:
        """The live snapshots."""
        return tuple(self.state.snapshots)

    @property
    def policy(self) -> str:
        """The clear policy (``CacheConfigured``)."""
        return self.state.policy

    def recent_events(self) -> list:
        """The events the journal holds: every one (``record=True``, a recording sink), the last up
        to ``journal.RING`` (nothing attached), or none kept here (a callable sink, an observer)."""
        return list(self._journal.events)


def _one_of(n, pages, what: str) -> None:
    if (n is None) == (pages is None):
        raise InvalidArgumentError(f"{what}: give exactly one of n= or pages=")


def _restore_target(request, snapshot) -> tuple[Literal["request", "snapshot"], int]:
    if (request is None) == (snapshot is None):
        raise InvalidArgumentError("restore: give exactly one of request= or snapshot=")
    if request is not None:
        return "request", checks.ident(request, "request")
    return "snapshot", checks.ident(snapshot, "snapshot")


def replay(events: Iterable, *, check: bool = False) -> LedgerState:
    """Fold a sequence of events (first one ``CacheConfigured``) into a fresh state."""
    st = LedgerState()
    for ev in events:
        st.fold(ev)
        if check:
            check_invariants(st)
    return st

