"""Where a ledger's events go: one object, chosen when the ledger is made (the ledger's mode).

Every event a ledger folds is built and recorded, whatever is attached: a
command decides its events, hands them to its journal, then folds them. A
journal has one face of four members:

    events    a list: while an event's seq is below ``due``, the command appends the
              event to it itself (the lean path: no call per event), then folds it
    due       the first seq the lean path may not append: from there on (and for an
              event with a field no validation bounds, a publish's tokens) the command
              calls ``put`` instead
    put(seq, event)             before the fold: takes the event, or raises to refuse
                                it (the command then fails; nothing of that event
                                changed, the events of the command before it stand)
    post(seq, event, effects)   after the fold, for every event ``put`` took (None: nothing to
                                do after a fold, the usual case: no call is made)

The journals, by what is attached to the ledger:

    Ring       nothing: the last events, up to ``RING`` of them (cleared when full:
               ``recent``), for nobody in particular; the lean path throughout
    EventList  ``record=True`` or a recording sink: every event, in ``events``
    CallSink   a callable ``sink(seq, event)``: called for every event (``due`` is -1,
               so every event takes ``put``; a sink that raises refuses the event)
    Watched    an observer, check mode, a record beside a sink, or a state with its own
               transition table: every event through ``put`` and ``post``
    EventLog   (``core/log/writer.py``) the durable log: ``events`` is its open batch,
               ``due`` its next checkpoint, full batch, segment roll or failure

A ``Journal`` passed as a ledger's sink is used as it is (the durable log's case);
any other callable is a ``CallSink``. Pure data structures: no I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .state.invariants import check_invariants

__all__ = ["NEVER", "RING", "CallSink", "EventList", "Journal", "Ring", "Watched"]

RING = 8192  # events a quiet ledger keeps (its last ones)
NEVER = 1 << 62  # a ``due`` no seq reaches


class Journal:
    """The face a ledger writes its events to (the module docstring): every subclass gives
    ``events``, ``due`` and ``put`` (a method or an attribute), and ``post`` when it has
    something to do after a fold (None by default)."""

    __slots__ = ()

    events: list
    due: int
    put: Callable[[int, Any], None]
    post: Callable[[int, Any, tuple], None] | None = None


class Ring(Journal):
    """A quiet ledger's journal: its last events, between none and ``RING`` of them."""

    __slots__ = ("events", "due")

    def __init__(self, seq: int) -> None:
        self.events: list = []
        self.due = seq + RING

    def put(self, seq: int, event: Any) -> None:
        if seq >= self.due:
            self.events.clear()
            self.due = seq + RING
        self.events.append(event)


class EventList(Journal):
    """A recording sink: every event it is given, in order, in ``events`` (a list, or the one passed)."""

    __slots__ = ("events", "due")

    def __init__(self, events: list | None = None) -> None:
        self.events: list = [] if events is None else events
        self.due = NEVER

    def put(self, seq: int, event: Any) -> None:
        self.events.append(event)


class CallSink(Journal):
    """A callable ``sink(seq, event)``, called for every event before its fold (``put`` is the sink)."""

    def __init__(self, sink: Callable[[int, Any], None]) -> None:
        self.events: list = []  # (never appended to: due is -1)
        self.due = -1
        self.put = sink


class Watched(Journal):
    """Every event through ``put`` (the sink's journal, then the record) and ``post`` (check mode: every
    invariant of ``state``; then the observer). ``due`` is -1: no lean path."""

    def __init__(self, inner: Journal | None, record: list | None, observer: Callable[[int, Any, tuple], None] | None,
                 check_state: Any | None) -> None:
        self.events: list = [] if record is None else record
        self.due = -1
        if inner is None:
            self.put = _nothing if record is None else _appender(record)
        elif record is None:
            self.put = inner.put
        else:
            self.put = _both(inner.put, record)
        if check_state is not None:
            self.post = _checked(check_state, observer)
        elif observer is not None:
            self.post = observer


def _nothing(seq: int, event: Any) -> None:
    return None


def _appender(record: list) -> Callable[[int, Any], None]:
    append = record.append

    def put(seq: int, event: Any) -> None:
        append(event)

    return put


def _both(put: Callable[[int, Any], None], record: list) -> Callable[[int, Any], None]:
    append = record.append

    def both(seq: int, event: Any) -> None:
        put(seq, event)
        append(event)

    return both


def _checked(state: Any, observer: Callable[[int, Any, tuple], None] | None) -> Callable[[int, Any, tuple], None]:
    def post(seq: int, event: Any, effects: tuple) -> None:
        check_invariants(state)
        if observer is not None:
            observer(seq, event, effects)

    return post
