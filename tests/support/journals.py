"""Journals for tests: a recording sink that behaves like the durable log (the lean path and the gate).

``GatedJournal`` keeps every event, as ``EventList`` does, but moves its ``due`` the way
``EventLog`` moves its own (a checkpoint, a full batch): the ledger appends events to
``events`` itself while their seq is below ``due``, and hands the one at ``due`` to
``put``, which checks the order, may refuse it (``refuse_at``: that seq), and sets the
next ``due`` a few events on. So a ledger with this sink takes both roads of the
durable log's case: the lean path, and the put path at the gates.
"""

from __future__ import annotations

import random

from kvledger.core.journal import Journal

__all__ = ["GatedJournal", "Refused"]


class Refused(Exception):
    """What a ``GatedJournal`` raises for the event it refuses."""


class GatedJournal(Journal):
    def __init__(self, ledger_seq=None, *, every: int = 5, refuse_at: int | None = None, seed: int = 0) -> None:
        self.events: list = []
        self.due = 0  # (seq 0 is put: a CacheConfigured)
        self.puts = 0
        self.every = every
        self.refuse_at = refuse_at
        self.ledger_seq = ledger_seq  # a callable: the ledger's seq, which put checks (everything before folded)
        self._rng = random.Random(seed)

    def put(self, seq: int, event) -> None:
        if seq != len(self.events):
            raise AssertionError(f"put of seq {seq} with {len(self.events)} events recorded (one seq each, in order)")
        if self.ledger_seq is not None and self.ledger_seq() != seq:
            raise AssertionError(f"put of seq {seq} with the ledger at seq {self.ledger_seq()}")
        if seq == self.refuse_at:
            self.due = seq  # (the next command that reaches it is refused again, as a failed log refuses)
            raise Refused(f"seq {seq}")
        self.puts += 1
        self.events.append(event)
        self.due = seq + 1 + self._rng.randint(0, self.every)
        if self.refuse_at is not None and seq < self.refuse_at:
            self.due = min(self.due, self.refuse_at)  # (the event to refuse is put, as a log's gate)
