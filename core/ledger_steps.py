"""The ledger's step commands: seal a step, record how it ran on each rank, abort it.

A mixin of ``Ledger`` (as ``ledger_prefix.PrefixCommands``): each command checks
its arguments, decides one event and hands it to ``self._submit``; ``seal_step``
and ``complete_step`` have fast paths inside that path (``ledger.py``'s module
docstring: the common case checked in the command, folded by the table's own
appliers, the event built and sunk first when anything is attached).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from . import checks
from .errors import InvalidArgumentError
from .events.events import SanitizerViolation, StepAborted, StepCompleted, StepPlan, StepSealed
from .state import fold

if TYPE_CHECKING:
    from .state.state import LedgerState

__all__ = ["StepCommands"]

_ID_BITS = 63


class StepCommands:
    """Seal, complete, abort a step; record a sanitizer violation. Mixed into ``Ledger``,
    which supplies ``state``, ``_submit`` and the fast paths' ``_fast`` / ``_plain`` /
    ``_put`` / ``_watch`` / ``_post``."""

    state: LedgerState
    _submit: Callable[[Any], tuple]
    _fast: bool
    _plain: bool
    _put: Callable[[int, Any], None] | None
    _watch: bool
    _post: Callable[[int, Any, tuple], None]

    def seal_step(self, step: int) -> StepPlan:
        """Close the open step and return its plan (the pages every rank must zero)."""
        st = self.state
        if self._fast and type(step) is int and step == st.open_step:  # fast path: the open step is all it needs
            if self._plain:
                return fold.seal(st, step)
            seq, ev = st.seq, StepSealed(step=step, clear_list=st.derive_clear_list(step))
            if self._put is not None:
                self._put(seq, ev)
            plan = fold.seal(st, step)
            if self._watch:
                self._post(seq, ev, (plan,))
            return plan
        if type(step) is not int or step >> _ID_BITS:
            checks.ident(step, "step")
        clear_list = st.derive_clear_list(step)
        (plan,) = self._submit(StepSealed(step=step, clear_list=clear_list))
        return plan

    def complete_step(self, step: int, rank: int) -> None:
        """Rank ``rank`` ran step ``step``'s input copies, clears and graph."""
        st = self.state
        if (self._fast and type(step) is int and type(rank) is int and 0 <= step < st.open_step
                and not rank >> _ID_BITS and rank >= 0):  # fast path: a sealed step is the whole precondition
            if self._plain:
                fold.complete(st, step, rank)
            else:
                seq, ev = st.seq, StepCompleted(step=step, rank=rank)
                if self._put is not None:
                    self._put(seq, ev)
                fold.complete(st, step, rank)
                if self._watch:
                    self._post(seq, ev, ())
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
