"""The one loop that folds a log into a state: reopen, replay and audit all call it.

    view (verified records) ─► start_state: the last checkpoint at or before a seq,
                                            rebuilt and verified, or a fresh state
                            ─► fold_records: for each record from there on
                                   events      decode ─► [seq 0: check_first_event]
                                               ─► apply(seq, event) for each event
                                                  (checked, the default: state.fold;
                                                  a rejected event is a CorruptLogError
                                                  naming its record's offset and seq;
                                                  trusted: state.apply, no validation)
                                   checkpoint  on_checkpoint(record, checkpoint); trusted:
                                               digest + invariants, amortized
                                   after each  on_record(record)

``rebuild_state`` is the two in a row with the defaults (what ``open_ledger``
does on reopen). Tools pass their own ``apply`` to watch every event (replay
counts and compares plans, audit follows page lifecycles) and keep the loop.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any

import msgspec

from ..errors import CorruptLogError, InvalidArgumentError, KVLedgerError
from ..events.events import CacheConfigured, PagesCommitted, StepSealed
from ..state.canonical import digest_of
from ..state.invariants import check_invariants, check_page_ids
from ..state.state import LedgerState
from ..state.transitions import TRANSITIONS, Transition, event_name
from .format import KIND_CHECKPOINT, KIND_EVENTS, Checkpoint, LogHeader, RecordInfo
from .reader import LogView

__all__ = ["bounds_problem", "check_first_event", "fold_records", "rebuild_state", "start_state",
           "state_from_checkpoint", "without_gc"]

Apply = Callable[[int, object], object]


@contextlib.contextmanager
def without_gc():
    """The cyclic collector paused while a long fold runs (restored after; for the tools and reopen):
    a fold makes no reference cycles, and on a large cache the collector's full passes over the
    growing state cost a third of a long replay's time."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def check_first_event(event, header: LogHeader, path: str, offset: int) -> None:
    """Seq 0 must configure the geometry and policy the header names; else ``CorruptLogError``."""
    if type(event) is not CacheConfigured or event.geometry != header.geometry or event.policy != header.policy:
        raise CorruptLogError(path, offset, 0, f"first event {event!r} does not configure the header's "
                              f"{header.geometry} with policy {header.policy!r}")


def _int_list(x, n: int | None, lo: int, hi: int) -> bool:
    if type(x) is not list or (n is not None and len(x) != n):
        return False
    return all(type(v) is int and lo <= v < hi for v in x)


def state_from_checkpoint(cp: Checkpoint, header: LogHeader, *, path: str = "<memory>", offset: int = 0,
                          invariants: bool = True) -> LedgerState:
    """Rebuild and verify the state a checkpoint holds.

    The state must decode, fit the header's geometry and policy, re-encode to
    exactly the recorded bytes, reproduce the recorded digest and (unless
    ``invariants=False``: O(num_pages), for a trusted start that checks the
    state it reaches instead) pass every invariant; otherwise ``CorruptLogError``
    names ``offset`` and the checkpoint's seq. Only the layout ``LedgerState.canonical()`` writes is
    accepted, whatever it is (this module does not duplicate it).
    """
    g = header.geometry
    n = g.num_pages

    def bad(detail: str) -> CorruptLogError:
        return CorruptLogError(path, offset, cp.seq, "checkpoint " + detail)

    try:
        data = msgspec.msgpack.decode(cp.state)
    except msgspec.DecodeError as exc:
        raise bad(f"state does not decode: {exc}") from None
    if type(data) is not dict or data.get("geometry") != [n, g.page_tokens] or data.get("policy") != header.policy \
            or data.get("seq") != cp.seq:
        raise bad(f"is not a state of this log's geometry ({n}, {g.page_tokens}), policy {header.policy!r} "
                  f"and seq {cp.seq}")
    try:
        st = LedgerState.from_canonical(data)
        if st.num_pages != n or not _int_list(st.holder, n, -3, 1 << 63) \
                or not _int_list(st.alias_count, n, 0, 1 << 63) or not _int_list(st.free_stack, None, 0, n):
            raise bad("page table does not match the geometry")
        check_page_ids(st)  # (bounds, O(ids named): a trusted start checks them even without the invariants)
        version = int(data["v"])  # checkpoints of an older kvledger keep their own layout
        if st.canonical_bytes(version) != cp.state:
            raise bad("state does not re-encode to the recorded bytes")
        digest = digest_of(cp.state)  # those very bytes: no second encoding
        if digest != cp.digest:
            raise bad(f"state digest {digest[:16]}... differs from the recorded {cp.digest[:16]}...")
        if invariants:
            check_invariants(st)
    except CorruptLogError:
        raise
    except (KVLedgerError, ValueError, TypeError, KeyError, IndexError, OverflowError, AttributeError) as exc:
        raise bad(f"state is inconsistent: {type(exc).__name__}: {exc}") from None
    return st


def start_state(view: LogView, *, at: int | None = None,
                trusted: bool = False) -> tuple[LedgerState, int, RecordInfo | None]:
    """Where a fold starts: ``(state, index of the first record to fold, checkpoint record or None)``.

    The state of the last checkpoint with seq <= ``at`` (any checkpoint when ``at`` is
    None), verified by ``state_from_checkpoint`` (``trusted``: bytes and digest, not the O(num_pages)
    invariants: a trusted fold checks the state it reaches); a fresh state and index 0 when there is none.
    """
    i = view.last_checkpoint(at)
    if i < 0:
        return LedgerState(), 0, None
    rec = view.records[i]
    st = state_from_checkpoint(view.checkpoint(rec), view.header, path=view.paths[rec.segment], offset=rec.offset,
                               invariants=not trusted)
    return st, i + 1, rec


class _CheckedFold:
    """Validate and apply each event (the state's own dispatch table: what ``LedgerState.fold`` does,
    without its per-event wrappers); a rejection is corruption at the event's seq (``raw``: the
    fold's own error, for a tool that reports rejections as such). Counts the commits that listed
    pages from their effects, for ``on_events``."""

    def __init__(self, st: LedgerState, on_events=None, raw: bool = False) -> None:
        self.st, self.on_events, self.raw = st, on_events, raw

    def __call__(self, events: list, rec: RecordInfo, path: str) -> None:
        st = self.st
        dispatch, commit = st.dispatch, PagesCommitted
        listed = i = 0
        try:
            for i, ev in enumerate(events):  # noqa: B007  (i names the failing event)
                validate, apply = dispatch[type(ev)]
                validate(st, ev)
                if apply(st, ev) and type(ev) is commit:
                    listed += 1
        except KVLedgerError as exc:
            if self.on_events is not None:
                self.on_events(rec, events[:i], listed)  # (what folded before the rejected event)
            if self.raw:
                raise
            seq = rec.seq + i
            raise CorruptLogError(path, rec.offset, seq, f"{type(events[i]).__name__} at seq {seq} is "
                                  f"rejected by the fold: {exc}") from exc
        if self.on_events is not None:
            self.on_events(rec, events, listed)


class _Impossible(Exception):
    """A field of an event that no state of this log can hold (a trusted fold's bounds check)."""

    def __init__(self, field: str, detail: str, applied: bool = False) -> None:
        super().__init__(field, detail)
        self.field, self.detail, self.applied = field, detail, applied


def _pages_in_range(st: LedgerState, ev, field: str = "page_ids") -> None:
    ids = getattr(ev, field)
    if ids and (min(ids) < 0 or max(ids) >= st.num_pages):
        bad = [p for p in ids if not 0 <= p < st.num_pages][:4]
        raise _Impossible(field, f"page ids {bad} outside the geometry's [0, {st.num_pages})")


def _page_id_in_range(st: LedgerState, ev) -> None:
    if not 0 <= ev.page_id < st.num_pages:
        raise _Impossible("page_id", f"page id {ev.page_id} outside the geometry's [0, {st.num_pages})")


def _step(rule: str) -> Callable[[LedgerState, Any], None]:
    """The check of an event's step against the open step and the steps in flight, by the table's
    ``requires.step`` (``transitions.STEP_RULES``)."""
    def not_older(st: LedgerState, ev) -> None:
        if ev.step < st.open_step:
            raise _Impossible("step", f"{event_name(type(ev))} for step {ev.step}, older than the open step "
                                      f"{st.open_step}")

    def is_open(st: LedgerState, ev) -> None:
        if ev.step != st.open_step:
            raise _Impossible("step", f"{event_name(type(ev))} of step {ev.step}, the open step is {st.open_step}")

    def sealed(st: LedgerState, ev) -> None:
        if ev.step >= st.open_step:
            raise _Impossible("step", f"{event_name(type(ev))} of step {ev.step}, never sealed (the open step is "
                                      f"{st.open_step})")

    def in_flight(st: LedgerState, ev) -> None:
        if not any(plan.step == ev.step for plan in st.in_flight):
            raise _Impossible("step", f"{event_name(type(ev))} of step {ev.step}, not in flight (the open step is "
                                      f"{st.open_step})")

    return {"not older": not_older, "open": is_open, "sealed": sealed, "in flight": in_flight}[rule]


def _bounds(row: Transition) -> Callable[[LedgerState, Any], None] | None:
    """What a trusted fold checks of an event of ``row`` before applying it: the page ids its
    ``touches`` column names against the geometry, its step by its ``requires.step``."""
    pages = row.touches if row.touches in ("page_ids", "clear_list") else None
    page_id = row.touches == "page_id"
    step = _step(row.requires.step) if row.requires.step else None
    if pages is None and not page_id and step is None:
        return None
    if step is None:
        return _pages_in_range if pages == "page_ids" else None

    def check(st: LedgerState, ev) -> None:
        if pages is not None:
            _pages_in_range(st, ev, pages)
        if page_id:
            _page_id_in_range(st, ev)
        step(st, ev)

    return check


# What a trusted fold still checks of every event before it applies it, from the transition table:
# page ids against the geometry, step numbers against the open step and the steps in flight. O(ids)
# and a few compares: the bounds a CRC-valid but forged or buggy record could break to reach a state no
# validated history reaches (a negative page id indexing the page table from its end, a completion of
# a step never sealed that would let its pages be published before their clear ran).
_BOUNDS: dict[type, Callable] = {t: check for t, row in TRANSITIONS.items() if (check := _bounds(row)) is not None}


def bounds_problem(st: LedgerState, ev) -> str | None:
    """What a trusted fold would refuse about ``ev`` in ``st`` before applying it (``_BOUNDS``):
    ``"field: detail"``, or None. For folds of their own (``audit --page``'s projection)."""
    check = _BOUNDS.get(type(ev))
    if check is None:
        first = TRANSITIONS[type(ev)].requires.first
        return f"type: {type(ev).__name__} after seq 0" if first and st.geometry is not None else None
    try:
        check(st, ev)
    except _Impossible as exc:
        return f"{exc.field}: {exc.detail}"
    return None


# how the trusted loop checks an event's bounds: _PAGES (page ids only, inlined), _COMMIT_B (page ids
# and the step, inlined), _OTHER (its _BOUNDS function), _FIRST (CacheConfigured: seq 0 only), 0 (none)
_PAGES, _COMMIT_B, _OTHER, _FIRST = 1, 2, 3, 4


def _bounds_kind(t: type) -> int:
    row = TRANSITIONS[t]
    if row.requires.first:
        return _FIRST
    if row.touches == "page_ids" and row.requires.step == "not older":
        return _COMMIT_B
    check = _BOUNDS.get(t)
    return 0 if check is None else _PAGES if check is _pages_in_range else _OTHER


class _TrustedFold:
    """Apply each event without its precondition (a verified log of this library's own writing),
    after its bounds (``_BOUNDS``; the two commonest, page ids alone and a commit's, inlined); a
    sealed step's recorded clear list must be the derived one.

    Refuses a ``CacheConfigured`` after seq 0 (it would allocate a page table); an event out of
    bounds, a recorded plan that differs, and anything an applier raises on an event that would
    not have validated are corruption at its seq, naming the field. One table lookup an event
    gives both how to check it and how to apply it.
    """

    def __init__(self, st: LedgerState, on_event=None, on_events=None) -> None:
        self.st, self.on_event, self.on_events = st, on_event, on_events
        self.table = {t: (_bounds_kind(t), row.apply) for t, row in st.transitions.items()}

    def __call__(self, events: list, rec: RecordInfo, path: str) -> None:
        st, table, on_event = self.st, self.table, self.on_event
        n = st.num_pages
        listed = 0
        ev = None
        try:
            for ev in events:
                kind, apply = table[type(ev)]
                if kind == _PAGES:
                    ids = ev.page_ids
                    if ids and (min(ids) < 0 or max(ids) >= n):
                        _pages_in_range(st, ev)  # (raises, naming the field)
                elif kind == _COMMIT_B:
                    ids = ev.page_ids
                    if ids and (min(ids) < 0 or max(ids) >= n) or ev.step < st.open_step:
                        _BOUNDS[type(ev)](st, ev)
                elif kind == _OTHER:
                    _BOUNDS[type(ev)](st, ev)
                elif kind == _FIRST and (st.geometry is not None or rec.seq):
                    raise _Impossible("type", "CacheConfigured after seq 0")
                effects = apply(st, ev)
                if effects and kind >= _COMMIT_B:
                    if kind == _COMMIT_B:
                        listed += 1
                    elif type(ev) is StepSealed and effects[0].clear_list != tuple(ev.clear_list):
                        raise _Impossible("clear_list", f"recorded clear list {list(ev.clear_list)[:16]}, the "
                                          f"fold derives {list(effects[0].clear_list)[:16]}", applied=True)
                if kind == _FIRST:
                    n = st.num_pages
                if on_event is not None:
                    on_event(st.seq - 1, ev)
        except _Impossible as exc:
            seq = st.seq - exc.applied  # (a refused event was not applied: it would have been st.seq)
            raise CorruptLogError(path, rec.offset, seq, f"{type(ev).__name__} at seq {seq}: {exc.field}: "
                                  f"{exc.detail} (trusted fold)") from None
        except (KVLedgerError, LookupError, ValueError, TypeError, AttributeError) as exc:
            seq = st.seq
            raise CorruptLogError(path, rec.offset, seq, f"{type(ev).__name__} at seq {seq} cannot be "
                                  f"applied (trusted fold): {type(exc).__name__}: {exc}") from exc
        if self.on_events is not None:
            self.on_events(rec, events, listed)


class _Verifier:
    """Trusted mode: at checkpoints at least ``gap`` events apart, the state digest must equal the
    recorded one and every invariant must hold (O(num_pages) each: amortized over ``gap`` events)."""

    def __init__(self, st: LedgerState, gap: int) -> None:
        self.st, self.gap, self.last, self.checks = st, gap, st.seq, 0

    def __call__(self, rec: RecordInfo, cp: Checkpoint, path: str) -> None:
        st = self.st
        if rec.seq != st.seq or st.seq - self.last < self.gap:
            return
        digest = st.digest()
        if digest != cp.digest:
            raise CorruptLogError(path, rec.offset, rec.seq, f"trusted fold reached state digest {digest[:16]}..., "
                                  f"the checkpoint recorded {cp.digest[:16]}...")
        try:
            check_invariants(st)
        except KVLedgerError as exc:
            raise CorruptLogError(path, rec.offset, rec.seq, f"state breaks an invariant: {exc}") from exc
        self.last = st.seq
        self.checks += 1


def _fold_events(view: LogView, rec: RecordInfo, until: int | None, apply: Apply | None, fold) -> int:
    """Decode one events record (up to seq ``until``) and fold it the chosen way; returns its event count."""
    events = view.events(rec)
    if until is not None and rec.seq + len(events) - 1 > until:
        events = events[: until - rec.seq + 1]
    path = view.paths[rec.segment]
    if rec.seq == 0:
        check_first_event(events[0], view.header, path, rec.offset)
    if apply is not None:
        for seq, ev in enumerate(events, rec.seq):
            apply(seq, ev)
    else:
        fold(events, rec, path)
    return len(events)


def fold_records(
    view: LogView,
    st: LedgerState,
    start: int = 0,
    *,
    until: int | None = None,
    apply: Apply | None = None,
    on_checkpoint: Callable[[RecordInfo, Checkpoint], object] | None = None,
    on_record: Callable[[RecordInfo], object] | None = None,
    trusted: bool = False,
    verify_gap: int | None = None,
    on_event: Callable[[int, object], object] | None = None,
    on_events: Callable[[RecordInfo, list, int], object] | None = None,
    raw_rejections: bool = False,
) -> int:
    """Fold the records from index ``start`` into ``st``, up to the event with seq ``until``.

    Checked (default): each event validated then applied (``_CheckedFold``), a rejection raised as
    ``CorruptLogError`` naming the record's offset and the seq (``raw_rejections``: as the fold's own
    error); or a custom ``apply(seq, event)`` that raises what it raises. Trusted (a log whose CRCs
    and chain verified): each event's bounds checked, then applied without its precondition
    (``_TrustedFold``); at checkpoints ``verify_gap`` events apart (default 16 x num_pages) the
    digest is compared and every invariant checked. ``on_event(seq, event)`` sees each event a
    trusted fold applied; ``on_events(record, events, listed)`` each record's events once folded
    (``listed``: its commits that listed pages), so a tool that only counts pays nothing per event.
    Returns the number of events folded. Raises ``CorruptLogError`` for a payload that does not
    decode, a first event that does not match the header, a rejected or out-of-bounds event, or
    (trusted) a digest mismatch or a broken invariant.
    """
    recs = view.records
    folded = 0
    verify = None
    fold: _TrustedFold | _CheckedFold
    if trusted:
        if apply is not None:
            raise InvalidArgumentError("fold_records: trusted folds apply events themselves (watch them with "
                                       "on_event=, not apply=)")
        verify = _Verifier(st, 16 * view.header.geometry.num_pages if verify_gap is None else verify_gap)
        fold = _TrustedFold(st, on_event, on_events)
    else:
        fold = _CheckedFold(st, on_events, raw_rejections)
    for idx in range(start, len(recs)):
        rec = recs[idx]
        if until is not None and rec.seq > until:
            break
        kind = rec.kind
        if kind == KIND_EVENTS:
            folded += _fold_events(view, rec, until, apply, fold)
        elif kind == KIND_CHECKPOINT and (on_checkpoint is not None or verify is not None):
            cp = view.checkpoint(rec)
            if verify is not None:
                verify(rec, cp, view.path)
            if on_checkpoint is not None:
                on_checkpoint(rec, cp)
        if on_record is not None:
            on_record(rec)
    return folded


def rebuild_state(view: LogView, *, from_checkpoint: bool = True, check: bool = False, trusted: bool = True):
    """Fold a verified log into a state: ``(state or None, checkpoint seq or None, events folded)``.

    Starts from the last checkpoint unless ``from_checkpoint`` is false; ``None``
    for a log with no events. ``trusted`` (default): the events after the
    checkpoint are applied without re-validation (the view's records passed
    their CRC and chain checks) and the final state's invariants are checked
    once; ``trusted=False`` validates every event. Raises ``CorruptLogError``
    for a payload that does not decode, a bad checkpoint, an event the fold
    rejects, a log that ends short of its own seq, or a final state that breaks
    an invariant (checked when ``trusted`` or ``check``).
    """
    if view.scan.next_seq == 0:
        return None, None, 0
    if from_checkpoint:
        st, start, ck = start_state(view, trusted=trusted)
    else:
        st, start, ck = LedgerState(), 0, None
    folded = fold_records(view, st, start, trusted=trusted)
    if st.seq != view.scan.next_seq:
        raise CorruptLogError(view.path, view.scan.end, st.seq,
                              f"state at seq {st.seq}, the log holds {view.scan.next_seq} events")
    if check or trusted:
        try:
            check_invariants(st)
        except KVLedgerError as exc:
            raise CorruptLogError(view.path, view.scan.end, st.seq, f"state breaks an invariant: {exc}") from exc
    return st, (None if ck is None else ck.seq), folded
