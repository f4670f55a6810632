"""The command side: decide a command against state into one event, or reject it.

    command ─► check arguments ─► build event ─► state.validate ─► sink(seq, event)
            ─► state.apply ─► effects (ClearPages / StepPlan) ─► [check mode: invariants]

Every command is all-or-nothing: argument errors, precondition failures and a
failing sink (the durable log, when one is attached) all raise before the fold,
so state and effects are exactly as before. Running out of pages is an ordinary
``OutOfPagesError``: cheap, nothing changed. Synchronous and I/O-free by itself.
"""

from __future__ import annotations

from typing import Callable, Iterable

from . import checks
from .errors import (
    ConfigurationError,
    InvalidArgumentError,
    OutOfPagesError,
    TenantMismatchError,
    UnknownRequestError,
)
from .events.events import (
    CacheConfigured,
    Geometry,
    PagesCommitted,
    PagesReserved,
    RequestCancelled,
    RequestFinished,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepPlan,
    StepSealed,
    typed,
)
from .state.invariants import check_invariants
from .state.state import LedgerState

__all__ = ["Ledger", "EventSink", "replay"]

# A sink receives every accepted event with its sequence number before it is folded.
# Raising refuses the event (the command fails, nothing changes).
EventSink = Callable[[int, object], None]


def _one_of(n, pages, what: str):
    if (n is None) == (pages is None):
        raise InvalidArgumentError(f"{what}: give exactly one of n= or pages=")


class Ledger:
    """The KV-page ledger of one cache. Commands mirror SPEC's event table.

    ``sink`` (optional) sees each accepted event with its sequence number before
    the fold; the durable log plugs in here. ``record=True`` keeps the events in
    ``self.events`` (tests, small tools). ``check=True`` runs every invariant after
    every fold (O(num_pages) each: for tests and debugging).
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
    ) -> None:
        self.events: list | None = [] if record else None
        self._sink = sink
        self.check = check  # also sets _plain
        if state is not None:
            if state.geometry != geometry:
                raise ConfigurationError(f"state geometry {state.geometry} != {geometry}")
            self.state = state
            return
        if not isinstance(geometry, Geometry):
            raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
        checks.geometry(geometry)
        self.state = LedgerState()
        self._submit(CacheConfigured(geometry=geometry, policy=policy))

    # ------------------------------------------------------------------ plumbing

    @property
    def check(self) -> bool:
        """Check mode: validate every event, even those built from state, and run
        every invariant after every fold."""
        return self._check

    @check.setter
    def check(self, value: bool) -> None:
        self._check = bool(value)
        # Nothing to do around a fold but the fold itself: the hot commands skip a layer.
        self._plain = not self._check and self.events is None and self._sink is None

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
        """Validate, hand to the sink, fold, and in check mode verify every invariant."""
        st = self.state
        st.validate(event)
        if self._sink is not None:
            self._sink(st.seq, event)
        if self.events is not None:
            self.events.append(event)
        effects = st.apply(event)
        if self._check:
            check_invariants(st)
        return effects

    def _submit_built(self, event, fold) -> tuple:
        """``_submit`` for an event the command built from state itself (valid by
        construction; check mode still validates), folded by ``fold`` directly."""
        st = self.state
        check = self._check
        if check:
            st.validate(event)
        if self._sink is not None:
            self._sink(st.seq, event)
        if self.events is not None:
            self.events.append(event)
        effects = fold(event)
        if check:
            check_invariants(st)
        return effects

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

    def is_marked(self, page_id: int) -> bool:
        return page_id in self.state.marks

    def is_restoring(self, page_id: int) -> bool:
        return page_id in self.state.restore_targets

    # ------------------------------------------------------------------ commands

    def reserve(self, request: int, n: int, *, tenant: str | None = None) -> tuple[int, ...]:
        """Reserve ``n`` free pages for ``request`` (known or new). Returns the page ids.

        Raises ``OutOfPagesError`` (nothing changed) when fewer than ``n`` are reservable,
        ``TenantMismatchError`` when a known request names another tenant.
        """
        if type(request) is not int or not 0 <= request <= checks.MAX_ID:
            checks.ident(request, "request")
        if type(n) is not int or n < 1:
            checks.count(n, "n")
        st = self.state
        if tenant is not None and type(tenant) is not str:
            checks.tenant(tenant)
        rec = st.requests.get(request)
        if rec is not None:
            if tenant is None:
                tenant = rec.tenant
            elif tenant != rec.tenant:
                raise TenantMismatchError(request, rec.tenant, tenant)
        stack = st.free_stack
        if n > len(stack):
            raise OutOfPagesError(n, st.reservable_count, f"request {request}")
        top = stack[: -n - 1 : -1]  # the allocator: LIFO, top of the free stack first
        if st.restore_targets and not st.restore_targets.keys().isdisjoint(top):
            top = st.pick_free(n)  # skip pages a restore is still writing
            if top is None:
                raise OutOfPagesError(n, st.reservable_count, f"request {request}")
        ev = PagesReserved(request=request, page_ids=tuple(top), tenant=tenant)
        if self._plain:  # hot path: no check mode, no sink, no recording
            st.apply_reserved(ev)
        else:
            self._submit_built(ev, st.apply_reserved)
        return ev.page_ids

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
        """Move reserved pages into the request's KV pages for ``step``.

        ``n`` takes the first ``n`` reserved pages; ``pages`` names them. Returns the
        page ids that entered ``step``'s clear list (usually empty).
        """
        st = self.state
        if pages is None and type(n) is int and type(request) is int and type(step) is int:
            # Hot path: the first n reserved pages are reserved(request) by construction;
            # only the count, the step and in-flight restores remain to check.
            rec = st.requests.get(request)
            if (
                rec is not None
                and 0 < n <= len(rec.reserved)
                and st.open_step <= step <= checks.MAX_ID
                and (not st.restore_targets or st.restore_targets.keys().isdisjoint(rec.reserved[:n]))
            ):
                ev = PagesCommitted(request=request, step=step, page_ids=tuple(rec.reserved[:n]))
                if self._plain:
                    effects = st.apply_committed(ev)
                else:
                    effects = self._submit_built(ev, st.apply_committed)
                return effects[0].page_ids if effects else ()
        checks.ident(request, "request")
        checks.ident(step, "step")
        _one_of(n, pages, "commit")
        if n is not None:
            checks.count(n, "n")
            rec = st.requests.get(request)
            if rec is None:
                raise UnknownRequestError(request)
            if len(rec.reserved) < n:
                raise InvalidArgumentError(
                    f"request {request} has {len(rec.reserved)} reserved pages, cannot commit {n}"
                )
            ids = tuple(rec.reserved[:n])
        else:
            ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        effects = self._submit(PagesCommitted(request=request, step=step, page_ids=ids))
        return effects[0].page_ids if effects else ()

    def cancel(self, request: int) -> None:
        """The request is aborted: its reserved and KV pages go back to the free list."""
        self._request_gone(RequestCancelled, request)

    def finish(self, request: int) -> None:
        """The request completed: its reserved and KV pages go back to the free list."""
        self._request_gone(RequestFinished, request)

    def _request_gone(self, event_type, request: int) -> None:
        st = self.state
        if type(request) is not int or request not in st.requests:
            checks.ident(request, "request")
            raise UnknownRequestError(request)
        if self._plain:
            st.apply_request_gone(event_type(request=request))
        else:
            self._submit_built(event_type(request=request), st.apply_request_gone)

    def alias_snapshot(
        self, snapshot: int, n: int | None = None, *, pages: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        """Back snapshot rows with pages: ``n`` free pages from the allocator, or named
        free/aliased pages (snapshot reuse). Returns the page ids."""
        checks.ident(snapshot, "snapshot")
        _one_of(n, pages, "alias_snapshot")
        if n is not None:
            checks.count(n, "n")
            got = self.state.pick_free(n)
            if got is None:
                raise OutOfPagesError(n, self.state.reservable_count, f"snapshot {snapshot}")
            ids = tuple(got)
        else:
            ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(SnapshotAliased(snapshot=snapshot, page_ids=ids))
        return ids

    def release_snapshot(self, snapshot: int) -> None:
        """The snapshot is gone; pages it was the last alias of become free and marked."""
        self._submit(SnapshotReleased(snapshot=checks.ident(snapshot, "snapshot")))

    def _restore_target(self, request, snapshot) -> tuple[str, int]:
        if (request is None) == (snapshot is None):
            raise InvalidArgumentError("restore: give exactly one of request= or snapshot=")
        if request is not None:
            return "request", checks.ident(request, "request")
        return "snapshot", checks.ident(snapshot, "snapshot")

    def start_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        """An inbound host restore starts writing ``pages`` of a request or a snapshot."""
        into, target = self._restore_target(request, snapshot)
        self._submit(RestoreStarted(into=into, target=target, page_ids=checks.page_ids(pages, self.state.num_pages, allow_empty=False)))

    def complete_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        into, target = self._restore_target(request, snapshot)
        self._submit(RestoreCompleted(into=into, target=target, page_ids=checks.page_ids(pages, self.state.num_pages, allow_empty=False)))

    def seal_step(self, step: int) -> StepPlan:
        """Close the open step and return its plan (the pages every rank must zero)."""
        checks.ident(step, "step")
        clear_list = self.state.derive_clear_list(step)
        (plan,) = self._submit(StepSealed(step=step, clear_list=clear_list))
        return plan

    def complete_step(self, step: int, rank: int) -> None:
        self._submit(StepCompleted(step=checks.ident(step, "step"), rank=checks.ident(rank, "rank")))

    def abort_step(self, step: int, reason: str = "") -> None:
        """The last sealed step did not run everywhere: its clear list is carried into the next."""
        if type(reason) is not str:
            raise InvalidArgumentError(f"reason must be a str, got {reason!r}")
        self._submit(StepAborted(step=checks.ident(step, "step"), reason=reason))


def replay(events: Iterable, *, check: bool = False) -> LedgerState:
    """Fold a sequence of events (first one ``CacheConfigured``) into a fresh state."""
    st = LedgerState()
    for ev in events:
        st.fold(ev)
        if check:
            check_invariants(st)
    return st


