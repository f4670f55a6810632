"""The command side: decide a command against state into one event, or reject it.

    command ─► check argument types ─► decide the event (the allocator's pages,
            a request's reserved pages) ─► _submit: validate (the event's
            precondition) ─► sink(seq, event) ─► apply ─► effects
            (ClearPages / StepPlan) ─► [check mode: every invariant]

The serving commands (allocate of n pages or of named ones, reserve, commit(n),
finish/cancel, seal_step, complete_step, and lookup/share/publish/eviction) have a
fast path inside that path: when their arguments fall in the common case of the
precondition (the top of a free stack without stale entries, named pages that are
free, the head of a reservation, the open step, a known request, published
hashes), the command checks that case itself as it
decides and folds through the table's own appliers (``fold.allocate_top``,
``reserve_top``, ``commit_pages``, ``release_request`` ...). Around the fold a fast
path calls only what is attached: ``_put(seq, event)`` before it (the sink, then the
record: the event is built for it, with the values ``_submit`` would fold) and, when
``_watch`` (check mode, an observer), ``_post`` after it; with nothing attached it
builds no event at all. Anything outside the common case takes ``_submit``, which
raises the specific error. A ledger whose state has another table than
``TRANSITIONS`` takes no fast path (R8 drives all three, and a ledger with only a
sink, and compares).

Every command is all-or-nothing: argument errors, precondition failures and a
failing sink (the durable log, when one is attached) all raise before the fold,
so state and effects are exactly as before. Running out of pages is an ordinary
``OutOfPagesError``: cheap, nothing changed. Synchronous and I/O-free by itself.
The request commands live in ``ledger_requests.py``, the prefix-caching commands in
``ledger_prefix.py``, the snapshot-row and restore commands in ``ledger_snapshots.py``,
the step commands in ``ledger_steps.py`` (mixins of ``Ledger``, on its plumbing:
``_submit``, ``_put``, ``_post``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from . import checks
from .errors import ConfigurationError, InvalidArgumentError
from .events.events import CacheConfigured, Geometry, typed
from .ledger_prefix import PrefixCommands
from .ledger_requests import RequestCommands
from .ledger_snapshots import SnapshotCommands
from .ledger_steps import StepCommands
from .state.invariants import check_invariants
from .state.state import LedgerState
from .state.transitions import TRANSITIONS

__all__ = ["Ledger", "EventObserver", "EventSink", "replay"]

# A sink receives every accepted event with its sequence number before it is folded.
# Raising refuses the event (the command fails, nothing changes).
EventSink = Callable[[int, object], None]
# An observer receives every folded event with its sequence number and its effects.
EventObserver = Callable[[int, object, tuple], None]


# An id is an int in [0, 2**63): the commands check ``(a | b) >> 63`` (0 exactly then).
assert checks.MAX_ID == (1 << 63) - 1


class Ledger(RequestCommands, PrefixCommands, SnapshotCommands, StepCommands):
    """The KV-page ledger of one cache. Commands mirror SPEC's event table.

    ``allocate(request, step, n)`` reserves and commits the allocator's next ``n``
    pages; ``allocate(request, step, pages=ids)`` the named ones, for a scheduler
    whose own free queue picks its blocks (vLLM's ``BlockPool``): the same two
    events, each page checked free (a refusal changes nothing).

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
        # What a fast path calls around its fold when something is attached, each None / False
        # when there is nothing to call: ``_put(seq, event)`` before it (the sink, then the
        # record: ``_pre``'s work in one call), ``_post`` after it when ``_watch`` (check mode,
        # an observer). ``_lean``: the standard table and nothing to watch, so a fast path needs
        # its events only for ``_put`` (the durable log's case), and builds them only then.
        if sink is not None and record:
            self._put: EventSink | None = self._pre
        elif sink is not None:
            self._put = sink
        elif record:
            self._put = self._record
        else:
            self._put = None
        self._watch = self._check or observer is not None
        self._lean = self._fast and not self._watch
        if state is not None:
            self._prefix_fast = self._fast and state.policy == "released_aliases"
            self._touch = self._prefix_fast and self._lean
            return
        if not isinstance(geometry, Geometry):
            raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
        checks.geometry(geometry)
        self.state = LedgerState()
        first = CacheConfigured(geometry=geometry, policy=policy)
        self.state.validate(first)
        self._submit(first)
        self._prefix_fast = self.state.policy == "released_aliases"
        self._touch = self._prefix_fast and self._lean

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

    def _record(self, seq: int, event) -> None:
        """``_put`` of a ledger that records and has no sink."""
        self.events.append(event)  # type: ignore[union-attr]

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


def replay(events: Iterable, *, check: bool = False) -> LedgerState:
    """Fold a sequence of events (first one ``CacheConfigured``) into a fresh state."""
    st = LedgerState()
    for ev in events:
        st.fold(ev)
        if check:
            check_invariants(st)
    return st


