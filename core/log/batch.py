"""The appender's side of the log: the open batch of events and the records queued behind it.

    Batch
        events       the events appended since the last hand-off, as objects (appending one is
                     a ``list.append``: encoding is the writer's, ``live.py``). One list for the
                     batch's life: a ledger appends to it directly (``EventLog.events``), and
                     closing the events copies them out and empties it
        first_seq    the seq of ``events[0]``; ``next_seq`` = first_seq + len(events)
        pending      records queued for the next hand-off, in log order: ``(kind, seq, count, body)``
                     with body the events list of an events record or the payload of any other;
                     and two instructions for the writer, FLUSH (write and fsync what came before)
                     and ROLL (the next segment, opening with the checkpoint in body)
        pending_bytes  the payload bytes queued (checkpoints: they can be large)

    add_record(kind, seq, payload)   closes the open events into a record first (log order)
    take() -> (items, events, bytes) everything queued, its events and payload bytes (what the
                                     writer will encode: the back-pressure estimate); the batch
                                     restarts empty at ``next_seq``

No I/O and no encoding here; one thread (the appender's) uses a batch.
"""

from __future__ import annotations

from .format import KIND_EVENTS

__all__ = ["FLUSH", "ROLL", "Batch"]

FLUSH = 100  # write and fsync everything before it (a close record then claims all of it synced)
ROLL = 101  # roll to the next segment, opening with the checkpoint payload in body


class Batch:
    """The open batch and the records behind it (see the module docstring)."""

    __slots__ = ("events", "first_seq", "pending", "pending_bytes", "pending_events")

    def __init__(self, first_seq: int) -> None:
        self.events: list = []
        self.first_seq = first_seq
        self.pending: list[tuple] = []
        self.pending_bytes = 0
        self.pending_events = 0

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.events)

    def close_events(self) -> None:
        """Queue the open events as one events record (nothing when there are none)."""
        events = self.events
        if events:
            n = len(events)
            self.pending.append((KIND_EVENTS, self.first_seq, n, events.copy()))
            self.pending_events += n
            self.first_seq += n
            events.clear()

    def add_record(self, kind: int, seq: int, payload: bytes) -> None:
        """Queue a record (or a writer instruction) after the events appended so far."""
        self.close_events()
        self.pending.append((kind, seq, 0, payload))
        self.pending_bytes += len(payload)

    def take(self) -> tuple[list, int, int]:
        """``(items, events, payload bytes)`` of everything queued; the batch restarts empty."""
        self.close_events()
        out = (self.pending, self.pending_events, self.pending_bytes)
        self.pending = []
        self.pending_bytes = self.pending_events = 0
        return out
