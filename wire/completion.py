"""Which peers completed which launched step: the leader's completion ledger. Pure.

    launch(step, ranks)  ──► step awaited ──┬─ Completed(ok) from every rank ──────► settled, ok
                                            ├─ a Completed(ok=False) ──────────────► that rank failed
                                            ├─ lose(rank): its link closed or broke ─► that rank missing
                                            └─ expire(step): the caller's deadline ──► the rest missing
                                                 (settled: a COMPLETE arriving later is counted as
                                                  late and changes nothing)

A rank counts as having completed a step only from its own COMPLETE (the leader
link turns it into ``Completed``): nothing here is inferred from a LAUNCH, a
READY or silence. Each settled answer is final. The drivers own the clock and
feed it in (``WireLeader.wait_completed``).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from ..core.errors import InvalidArgumentError
from .protocol import Completed

__all__ = ["StepCompletion", "Completions"]


class StepCompletion(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What the peers reported for launched ``step`` (wire ranks, ascending).

    ``completed``: ranks whose COMPLETE said ok. ``failed``: ``(rank, detail)`` whose
    COMPLETE said failed. ``missing``: ``(rank, why)`` given up on (link lost, or no
    COMPLETE by the deadline). ``pending``: still awaited. ``settled`` once nothing
    is pending; ``ok`` when settled with every rank completed.
    """

    step: int
    completed: tuple[int, ...] = ()
    failed: tuple[tuple[int, str], ...] = ()
    missing: tuple[tuple[int, str], ...] = ()
    pending: tuple[int, ...] = ()

    @property
    def settled(self) -> bool:
        return not self.pending

    @property
    def ok(self) -> bool:
        return not (self.pending or self.failed or self.missing)


class _Track:
    __slots__ = ("pending", "completed", "failed", "missing")

    def __init__(self, ranks: Iterable[int]) -> None:
        self.pending = set(ranks)
        self.completed: set[int] = set()
        self.failed: dict[int, str] = {}
        self.missing: dict[int, str] = {}

    def give_up(self, rank: int, why: str) -> None:
        self.pending.discard(rank)
        self.missing[rank] = why

    def seen(self, rank: int) -> str:
        """Why a COMPLETE from ``rank`` is not counted: ``late``, ``duplicate`` or ``unknown``."""
        if rank in self.missing:
            return "late"
        return "duplicate" if rank in self.completed or rank in self.failed else "unknown"


class Completions:
    """The completion of the last ``memory`` launched steps, by step and rank (pure).

        done = Completions()
        done.launch(step, ranks=(1, 2, 3))      # LAUNCH went to these peers
        done.record(completed_event)            # True when it settled the step
        done.lose(rank, "link lost")            # steps it settled
        done.expire(step, "no COMPLETE in 1 s") # settle now: the rest are missing
        done.get(step)                          # StepCompletion, at any time

    Raises ``InvalidArgumentError`` for a step launched twice or one it does not
    know (never launched, or older than ``memory`` launches).
    """

    def __init__(self, memory: int = 256) -> None:
        if type(memory) is not int or memory < 1:
            raise InvalidArgumentError(f"memory must be an int >= 1, got {memory!r}")
        self.memory = memory
        self._steps: dict[int, _Track] = {}
        self._stats = dict.fromkeys(("launched", "completed", "failed", "missing", "late", "duplicate", "unknown"), 0)

    def launch(self, step: int, ranks: Iterable[int], lost: Iterable[int] = ()) -> None:
        """``step`` was launched on ``ranks``; those in ``lost`` never got the LAUNCH (missing now)."""
        if step in self._steps:
            raise InvalidArgumentError(f"step {step} was already launched")
        track = _Track(ranks)
        for r in lost:
            if r in track.pending:
                track.give_up(r, "link lost before LAUNCH")
                self._stats["missing"] += 1
        self._steps[step] = track
        self._stats["launched"] += 1
        if len(self._steps) > self.memory:
            del self._steps[next(iter(self._steps))]

    def record(self, ev: Completed) -> bool:
        """Count a peer's ``Completed``; True when it settled its step. One from a rank
        already given up on (late), a second one (duplicate), or for a step or rank not
        awaited (unknown) changes nothing but a counter."""
        track = self._steps.get(ev.step)
        if track is None or ev.rank not in track.pending:
            self._stats["unknown" if track is None else track.seen(ev.rank)] += 1
            return False
        track.pending.discard(ev.rank)
        if ev.ok:
            track.completed.add(ev.rank)
            self._stats["completed"] += 1
        else:
            track.failed[ev.rank] = ev.detail
            self._stats["failed"] += 1
        return not track.pending

    def lose(self, rank: int, why: str = "link lost") -> list[int]:
        """Rank ``rank``'s link is gone: it will complete nothing it still owes. Returns
        the steps this settled."""
        settled = []
        for step, track in self._steps.items():
            if rank in track.pending:
                track.give_up(rank, why)
                self._stats["missing"] += 1
                if not track.pending:
                    settled.append(step)
        return settled

    def expire(self, step: int, why: str) -> StepCompletion:
        """The deadline for ``step`` passed: every rank still pending is missing (``why``)."""
        track = self._track(step)
        for r in sorted(track.pending):
            track.give_up(r, why)
            self._stats["missing"] += 1
        return self.get(step)

    def get(self, step: int) -> StepCompletion:
        """Where ``step`` stands now."""
        t = self._track(step)
        return StepCompletion(
            step=step,
            completed=tuple(sorted(t.completed)),
            failed=tuple(sorted(t.failed.items())),
            missing=tuple(sorted(t.missing.items())),
            pending=tuple(sorted(t.pending)),
        )

    def __contains__(self, step: object) -> bool:
        return step in self._steps

    def _track(self, step: int) -> _Track:
        track = self._steps.get(step)
        if track is None:
            raise InvalidArgumentError(
                f"step {step!r} was not launched, or is older than the last {self.memory} launched steps"
            )
        return track

    def statistics(self) -> dict[str, int]:
        """Counters: steps launched; COMPLETEs ok, failed, late, duplicate or unknown; ranks given up."""
        return dict(self._stats)
