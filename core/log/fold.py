"""The one loop that folds a log into a state: reopen, replay and audit all call it.

    view (verified records) ─► start_state: the last checkpoint at or before a seq,
                                            rebuilt and verified, or a fresh state
                            ─► fold_records: for each record from there on
                                   events      decode ─► [seq 0: check_first_event]
                                               ─► apply(seq, event) for each event
                                                  (default: state.fold; a rejected
                                                  event is a CorruptLogError naming
                                                  its record's offset and its seq)
                                   checkpoint  on_checkpoint(record, checkpoint)
                                   after each  on_record(record)

``rebuild_state`` is the two in a row with the defaults (what ``open_ledger``
does on reopen). Tools pass their own ``apply`` to watch every event (replay
counts and compares plans, audit follows page lifecycles) and keep the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from ..errors import CorruptLogError, KVLedgerError
from ..events.events import CacheConfigured
from ..state.invariants import check_invariants
from ..state.state import LedgerState
from .format import KIND_CHECKPOINT, KIND_EVENTS, Checkpoint, LogHeader, RecordInfo
from .reader import LogView

__all__ = ["check_first_event", "fold_records", "rebuild_state", "start_state", "state_from_checkpoint"]

Apply = Callable[[int, object], object]


def check_first_event(event, header: LogHeader, path: str, offset: int) -> None:
    """Seq 0 must configure the geometry and policy the header names; else ``CorruptLogError``."""
    if type(event) is not CacheConfigured or event.geometry != header.geometry or event.policy != header.policy:
        raise CorruptLogError(path, offset, 0, f"first event {event!r} does not configure the header's "
                              f"{header.geometry} with policy {header.policy!r}")


def _int_list(x, n: int | None, lo: int, hi: int) -> bool:
    if type(x) is not list or (n is not None and len(x) != n):
        return False
    return all(type(v) is int and lo <= v < hi for v in x)


def state_from_checkpoint(cp: Checkpoint, header: LogHeader, *, path: str = "<memory>", offset: int = 0) -> LedgerState:
    """Rebuild and verify the state a checkpoint holds.

    The state must decode, fit the header's geometry and policy, re-encode to
    exactly the recorded bytes, reproduce the recorded digest and pass every
    invariant; otherwise ``CorruptLogError`` names ``offset`` and the
    checkpoint's seq. Only the layout ``LedgerState.canonical()`` writes is
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
        version = data.get("v")  # checkpoints of an older kvledger keep their own layout
        if st.canonical_bytes(version) != cp.state:
            raise bad("state does not re-encode to the recorded bytes")
        digest = st.digest(version)
        if digest != cp.digest:
            raise bad(f"state digest {digest[:16]}... differs from the recorded {cp.digest[:16]}...")
        check_invariants(st)
    except CorruptLogError:
        raise
    except (KVLedgerError, ValueError, TypeError, KeyError, IndexError, OverflowError, AttributeError) as exc:
        raise bad(f"state is inconsistent: {type(exc).__name__}: {exc}") from None
    return st


def start_state(view: LogView, *, at: int | None = None) -> tuple[LedgerState, int, RecordInfo | None]:
    """Where a fold starts: ``(state, index of the first record to fold, checkpoint record or None)``.

    The state of the last checkpoint with seq <= ``at`` (any checkpoint when ``at`` is
    None), verified by ``state_from_checkpoint``; a fresh state and index 0 when there is none.
    """
    i = view.last_checkpoint(at)
    if i < 0:
        return LedgerState(), 0, None
    rec = view.records[i]
    return state_from_checkpoint(view.checkpoint(rec), view.header, path=view.path, offset=rec.offset), i + 1, rec


def fold_records(
    view: LogView,
    st: LedgerState,
    start: int = 0,
    *,
    until: int | None = None,
    apply: Apply | None = None,
    on_checkpoint: Callable[[RecordInfo, Checkpoint], object] | None = None,
    on_record: Callable[[RecordInfo], object] | None = None,
) -> int:
    """Fold the records from index ``start`` into ``st``, up to the event with seq ``until``.

    ``apply(seq, event)`` folds one event (default ``st.fold``, whose rejection is
    raised as ``CorruptLogError`` naming the record's offset and the seq; a custom
    ``apply`` raises what it raises). Returns the number of events handed to it.
    Raises ``CorruptLogError`` for a payload that does not decode or a first event
    that does not match the header.
    """
    recs = view.records
    header, path = view.header, view.path
    folded = 0
    fold = st.fold
    for idx in range(start, len(recs)):
        rec = recs[idx]
        if until is not None and rec.seq > until:
            break
        kind = rec.kind
        if kind == KIND_EVENTS:
            events = view.events(rec)
            if until is not None and rec.seq + len(events) - 1 > until:
                events = events[: until - rec.seq + 1]
            if rec.seq == 0:
                check_first_event(events[0], header, path, rec.offset)
            if apply is None:
                i = 0
                try:
                    for i, ev in enumerate(events):  # noqa: B007  (i names the failing event)
                        fold(ev)
                except KVLedgerError as exc:
                    seq = rec.seq + i
                    raise CorruptLogError(path, rec.offset, seq, f"{type(events[i]).__name__} at seq {seq} is "
                                          f"rejected by the fold: {exc}") from exc
            else:
                for seq, ev in enumerate(events, rec.seq):
                    apply(seq, ev)
            folded += len(events)
        elif kind == KIND_CHECKPOINT and on_checkpoint is not None:
            on_checkpoint(rec, view.checkpoint(rec))
        if on_record is not None:
            on_record(rec)
    return folded


def rebuild_state(view: LogView, *, from_checkpoint: bool = True, check: bool = False):
    """Fold a verified log into a state: ``(state or None, checkpoint seq or None, events folded)``.

    Starts from the last checkpoint unless ``from_checkpoint`` is false; ``None``
    for a log with no events. Raises ``CorruptLogError`` for a payload that does
    not decode, a bad checkpoint, an event the fold rejects, a log that ends short
    of its own seq, or (``check``) a final state that breaks an invariant.
    """
    if view.scan.next_seq == 0:
        return None, None, 0
    if from_checkpoint:
        st, start, ck = start_state(view)
    else:
        st, start, ck = LedgerState(), 0, None
    folded = fold_records(view, st, start)
    if st.seq != view.scan.next_seq:
        raise CorruptLogError(view.path, view.scan.end, st.seq,
                              f"state at seq {st.seq}, the log holds {view.scan.next_seq} events")
    if check:
        try:
            check_invariants(st)
        except KVLedgerError as exc:
            raise CorruptLogError(view.path, view.scan.end, st.seq, f"state breaks an invariant: {exc}") from exc
    return st, (None if ck is None else ck.seq), folded
