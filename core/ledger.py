"""The command side: decide a command against state into one event, or reject it.

    command ─► check argument types ─► decide the event (the allocator's pages,
            a request's reserved pages) ─► _submit: validate (the event's
            precondition) ─► sink(seq, event) ─► apply ─► effects
            (ClearPages / StepPlan) ─► [check mode: every invariant]

The serving commands (allocate, reserve, commit(n), finish/cancel, seal_step,
complete_step, and lookup/share/publish/eviction in ``ledger_prefix.py``) have a
fast path inside that path: when their arguments fall in the common case of the
precondition (the top of a free stack without stale entries, the head of a
reservation, the open step, a known request, published hashes), the command checks
that case itself as it decides and folds through the table's own appliers
(``fold.reserve_top``, ``commit_pages``, ``release_request`` ...). With a sink,
observer, record or check mode attached it still builds each event (the values
``_submit`` would fold) and hands it to the sink before the fold and to the observer
after (``_pre`` / ``_post``); with nothing attached it skips building them. Anything
outside the common case takes ``_submit``, which raises the specific error. A ledger
whose state has another table than ``TRANSITIONS`` takes no fast path (R8 drives all
three and compares).

Every command is all-or-nothing: argument errors, precondition failures and a
failing sink (the durable log, when one is attached) all raise before the fold,
so state and effects are exactly as before. Running out of pages is an ordinary
``OutOfPagesError``: cheap, nothing changed. Synchronous and I/O-free by itself.
The prefix-caching commands live in ``ledger_prefix.py``, the snapshot-row and
restore commands in ``ledger_snapshots.py``, the step commands in ``ledger_steps.py``
(mixins of ``Ledger``, on its plumbing: ``_submit``, ``_pre``, ``_post``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice

from . import checks
from .errors import (
    ConfigurationError,
    InvalidArgumentError,
    OutOfPagesError,
    UnknownRequestError,
)
from .ledger_prefix import PrefixCommands
from .ledger_snapshots import SnapshotCommands
from .ledger_steps import StepCommands
from .events.events import (
    CacheConfigured, Geometry, PagesCommitted, PagesEvicted, PagesReserved, RequestCancelled,
    RequestFinished, ReservationReturned, typed,
)
from .state import fold, fold_prefix
from .state.invariants import check_invariants
from .state.preconditions import same_tenant
from .state.state import LedgerState
from .state.table import RequestRecord
from .state.transitions import TRANSITIONS

__all__ = ["Ledger", "EventObserver", "EventSink", "replay"]

# A sink receives every accepted event with its sequence number before it is folded.
# Raising refuses the event (the command fails, nothing changes).
EventSink = Callable[[int, object], None]
# An observer receives every folded event with its sequence number and its effects.
EventObserver = Callable[[int, object, tuple], None]


# An id is an int in [0, 2**63): for an int x, ``x >> 63`` is 0 exactly then (-1 below, >= 1 above),
# so ``(a | b) >> 63`` checks two ints at once. ``checks.ident`` raises the error.
_ID_BITS = 63
assert checks.MAX_ID == (1 << _ID_BITS) - 1


class Ledger(PrefixCommands, SnapshotCommands, StepCommands):
    """The KV-page ledger of one cache. Commands mirror SPEC's event table.

    Every command decides one event against the state and hands it to ``_submit``,
    the one path every event takes: ``validate`` (the event's precondition, from
    the transition table) -> ``sink`` (the durable log, when one is attached) ->
    ``apply`` (the fold) -> in check mode, every invariant. Every precondition
    lives in ``core/state/preconditions.py``; the serving commands' fast paths
    (the module docstring) check the common case of theirs in the command, in the
    same order: the case, then the sink, then the fold.

    ``sink(seq, event)`` (optional) sees each accepted event before the fold;
    raising refuses it (nothing changes). ``observer(seq, event, effects)``
    (optional) sees it after the fold (metrics, debug logs, KV-event publishers);
    it must not raise. ``record=True`` keeps the events in ``self.events`` (tests,
    small tools). ``check=True`` runs every invariant after every fold
    (O(num_pages) each: for tests and debugging). All are fixed when the ledger
    is made.
    """

    def __init__(
        self,
        geometry: Geometry,
        *,
        policy: str = "released_aliases",
        check: bool = False,
        sink: EventSink | None = None,
        record: bool = False,
        state: LedgerState | None = None,
        observer: EventObserver | None = None,
    ) -> None:
        self.events: list | None = [] if record else None
        self._sink = sink
        self._observer = observer
        self._check = bool(check)
        if state is not None:
            if state.geometry != geometry:
                raise ConfigurationError(f"state geometry {state.geometry} != {geometry}")
            self.state = state
        # The standard table: the commands' fast paths (a precondition's common case decided
        # and checked in the command, folded by the table's own appliers) may be taken. With
        # nothing around the fold (no sink, observer, record or check) they skip the events.
        self._fast = state is None or state.transitions is TRANSITIONS
        self._plain = self._fast and not check and sink is None and not record and observer is None
        if state is not None:
            return
        if not isinstance(geometry, Geometry):
            raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
        checks.geometry(geometry)
        self.state = LedgerState()
        first = CacheConfigured(geometry=geometry, policy=policy)
        self.state.validate(first)
        self._submit(first)

    # ------------------------------------------------------------------ plumbing

    @property
    def check(self) -> bool:
        """Check mode: every invariant after every fold."""
        return self._check

    @property
    def geometry(self) -> Geometry:
        return self.state.geometry  # type: ignore[return-value]

    @property
    def seq(self) -> int:
        """Sequence number the next event will get (= events folded so far)."""
        return self.state.seq

    def digest(self) -> str:
        return self.state.digest()

    def _submit(self, event) -> tuple:
        """validate -> sink -> [record] -> apply -> [check] -> [observe]: the one path of every event.

        Raises the event's precondition error, or what the sink raises; either way
        nothing changed. Returns the event's effects.
        """
        st = self.state
        validate, apply = st.dispatch[type(event)]  # a Ledger's state is configured from its first event on
        validate(st, event)
        if self._plain:
            return apply(st, event)
        seq = st.seq
        if self._sink is not None:
            self._sink(seq, event)
        if self.events is not None:
            self.events.append(event)
        effects = apply(st, event)
        if self._check:
            check_invariants(st)
        if self._observer is not None:
            self._observer(seq, event, effects)
        return effects

    def _pre(self, seq: int, event) -> None:
        """A fast path's event before its fold: the sink (raising refuses it), the record."""
        if self._sink is not None:
            self._sink(seq, event)
        if self.events is not None:
            self.events.append(event)

    def _post(self, seq: int, event, effects: tuple) -> None:
        """A fast path's event after its fold: check mode, the observer."""
        if self._check:
            check_invariants(self.state)
        if self._observer is not None:
            self._observer(seq, event, effects)

    def submit(self, event) -> tuple:
        """Type-check, validate and fold an event built elsewhere (tools, a log reader).

        Returns its effects. Raises ``InvalidArgumentError`` for an ill-typed event and
        the specific precondition error otherwise; nothing changes on either.
        """
        return self._submit(typed(event))

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

    # ------------------------------------------------------------------ commands

    def reserve(self, request: int, n: int, *, tenant: str | None = None) -> tuple[int, ...]:
        """Reserve ``n`` free pages for ``request`` (known or new). Returns the page ids.

        The allocator takes the top of the free stack (LIFO), skipping pages a restore
        is still writing. A known request keeps its tenant (``tenant=None`` means the
        same one). Raises ``OutOfPagesError`` (nothing changed) when fewer than ``n``
        are reservable, ``TenantMismatchError`` when a known request names another tenant.
        """
        st = self.state
        if (self._fast and type(request) is int and type(n) is int and n > 0 and not request >> _ID_BITS
                and not st.stale_entries and n <= len(st.free_stack) + (len(st.cached) if self._plain else 0)):
            # fast path: the top of the stack is free and reservable (PagesReserved's precondition)
            rec = st.requests.get(request)
            if tenant is None or (type(tenant) is str and (rec is None or rec.tenant == tenant)):
                if rec is not None:
                    tenant = rec.tenant
                if self._plain:
                    if n > len(st.free_stack):
                        self._evict_plain(n)
                    return fold.reserve_top(st, rec, request, n, tenant)
                seq = st.seq
                ev = PagesReserved(request=request, page_ids=tuple(st.free_stack[: -n - 1 : -1]), tenant=tenant)
                self._pre(seq, ev)
                pages = fold.reserve_top(st, rec, request, n, tenant)
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

    def allocate(self, request: int, step: int, n: int, *, tenant: str | None = None) -> tuple[int, ...]:
        """``reserve(request, n)`` then ``commit`` those pages for ``step``: the usual way a
        scheduler grows a request (vLLM's ``get_new_blocks``). Two events, exactly as the
        two commands write them, with the same errors; returns the pages. If the commit is
        refused (a sealed step, a bad step id), the reservation stands: return it with
        ``return_reservation``.
        """
        st = self.state
        if (self._plain and type(n) is int and n == 1 and type(request) is int and type(step) is int
                and not (request | step) >> _ID_BITS and step >= st.open_step and st.free_stack
                and not st.stale_entries and not st.parked):
            rec = st.requests.get(request)  # one page, nothing attached: the common case inline
            stack = st.free_stack
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
        if (self._fast and type(request) is int and type(step) is int and type(n) is int and n > 0
                and not (request | step) >> _ID_BITS and step >= st.open_step
                and not st.stale_entries and n <= len(st.free_stack) + (len(st.cached) if self._plain else 0)):
            # fast path: both preconditions hold (the top of the stack is reservable; the
            # step is not sealed; the request has no older reservation to commit first)
            rec = st.requests.get(request)
            if rec is None:
                fast = tenant is None or type(tenant) is str
            else:
                fast = not rec.reserved and (tenant is None or tenant == rec.tenant)
            if fast and not self._plain:
                return self._allocate_recorded(rec, request, step, n, tenant)
            if fast:
                if n > len(st.free_stack):
                    self._evict_plain(n)
                pages = fold.reserve_top(st, rec, request, n, tenant if rec is None else rec.tenant)
                fold.commit_pages(st, st.requests[request], step, pages)
                return pages
        pages = self.reserve(request, n, tenant=tenant)
        if len(st.requests[request].reserved) != n:
            self.commit(request, step, pages=pages)  # older reserved pages stay reserved
        elif type(step) is not int:
            checks.ident(step, "step")
        else:
            self._commit(request, step, pages)  # the reservation is exactly these pages: its head
        return pages

    def _allocate_recorded(self, rec: RequestRecord | None, request: int, step: int, n: int,
                           tenant: str | None) -> tuple[int, ...]:
        """``allocate``'s fast path with something attached: the two events, each through the
        sink before its fold and to the observer after it, exactly as ``reserve`` + ``commit``
        write them (a sink refusing the commit leaves the reservation standing)."""
        st = self.state
        pages = tuple(st.free_stack[: -n - 1 : -1])
        if rec is not None:
            tenant = rec.tenant
        seq = st.seq
        ev = PagesReserved(request=request, page_ids=pages, tenant=tenant)
        self._pre(seq, ev)
        fold.reserve_top(st, rec, request, n, tenant)
        self._post(seq, ev, ())
        ev2 = PagesCommitted(request=request, step=step, page_ids=pages)
        self._pre(seq + 1, ev2)
        effects = fold.commit_pages(st, st.requests[request], step, pages)
        self._post(seq + 1, ev2, effects)
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
        self, request: int, step: int, n: int | None = None, *, pages: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        """Move reserved pages into the request's KV pages (its block table) for ``step``.

        ``n`` takes the first ``n`` reserved pages; ``pages`` names them. Returns the
        page ids this commit listed for ``step``'s clear list (usually none). That is
        not yet the plan: a listed page whose request lets go of it before the seal
        leaves the list again (and gets its mark back), and an aborted step's pages
        are carried in. ``seal_step(step).clear_list`` is the authority on what every
        rank zeroes.
        """
        st = self.state
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
                        self._pre(seq, ev)
                        effects = fold.commit_pages(st, rec, step, head)
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
        if self._fast and type(request) is int and request in st.requests:  # fast path: r known is all it needs
            if self._plain:
                fold.release_request(st, request)
            else:
                seq, ev = st.seq, RequestCancelled(request=request)
                self._pre(seq, ev)
                self._post(seq, ev, fold.release_request(st, request))
            return
        if type(request) is not int or request >> _ID_BITS:
            checks.ident(request, "request")
        self._submit(RequestCancelled(request=request))

    def finish(self, request: int) -> None:
        """The request completed: its reserved and KV pages go back to the free list."""
        st = self.state
        if self._fast and type(request) is int and request in st.requests:  # fast path: r known is all it needs
            if self._plain:
                fold.release_request(st, request)
            else:
                seq, ev = st.seq, RequestFinished(request=request)
                self._pre(seq, ev)
                self._post(seq, ev, fold.release_request(st, request))
            return
        if type(request) is not int or request >> _ID_BITS:
            checks.ident(request, "request")
        self._submit(RequestFinished(request=request))


def replay(events: Iterable, *, check: bool = False) -> LedgerState:
    """Fold a sequence of events (first one ``CacheConfigured``) into a fresh state."""
    st = LedgerState()
    for ev in events:
        st.fold(ev)
        if check:
            check_invariants(st)
    return st


