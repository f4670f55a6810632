"""The fold of the step book: seals, completions, aborts, pages a step left unwritten, sanitizer records.

As ``fold.py`` (its docstring says what an applier is): ``(state, event) -> effects``,
for an event that passed its precondition. The step book is the open step, the
clear lists of unsealed steps (``pending``), the plans in flight (sealed, not yet
completed on every rank, at most ``MAX_IN_FLIGHT``), every rank's completions and
the aborted steps. ``sealed`` and ``completed`` are the commands' fast cases (a seal
with the clear list the command derived from this very state; a completion).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..events.events import SanitizerViolation, StepAborted, StepCompleted, StepPlan, StepSealed
from .fold import NO_EFFECTS, marked_effect
from .table import HOLDER_FREE, MARK_ALL, MAX_IN_FLIGHT

if TYPE_CHECKING:
    from .state import LedgerState

__all__ = ["completed", "in_kv", "pages_unwritten", "sanitizer_violation", "sealed", "step_aborted", "step_completed",
           "step_sealed"]


def step_sealed(st: LedgerState, e: StepSealed) -> tuple:
    """The table's applier: the plan of the clear list the state derives (replay compares it
    with the recorded one: the precondition, or the trusted fold after this)."""
    return (_seal(st, e.step, st.derive_clear_list(e.step)),)


def sealed(st: LedgerState, e: StepSealed) -> tuple:
    """The seal of a command, whose ``e.clear_list`` it derived from this very state (once)."""
    return (_seal(st, e.step, e.clear_list),)


def _seal(st: LedgerState, step: int, clear_list: tuple) -> StepPlan:
    """Seal ``step`` (the open step) with its derived clear list: the plan joins the steps in
    flight (the last ``MAX_IN_FLIGHT`` sealed and not aborted)."""
    if st.clear_lists.pop(step, None) is not None:
        pend = st.pending
        for p in clear_list:
            del pend[p]
    st.open_step = step + 1
    plan = StepPlan(step=step, clear_list=clear_list)
    in_flight = st.in_flight
    in_flight.append(plan)
    if len(in_flight) > MAX_IN_FLIGHT:
        del in_flight[0]  # too old to abort: its restore records go too
        oldest = in_flight[0].step
        if st.restored_since:
            st.restored_since = {p: s for p, s in st.restored_since.items() if s > oldest}
        if st.overwritten:
            st.overwritten = {p: s for p, s in st.overwritten.items() if s >= oldest}
    st.seq += 1
    return plan


def step_completed(st: LedgerState, e: StepCompleted) -> tuple:
    completed(st, e)
    return NO_EFFECTS


def completed(st: LedgerState, e: StepCompleted) -> None:
    """A rank ran the step. Once every rank that reports completions has completed a step,
    its plan leaves the steps in flight: it can no longer be aborted (its pages may be
    published from now on)."""
    step, rank = e.step, e.rank
    if step > st.completed.get(rank, -1):
        st.completed[rank] = step
        in_flight = st.in_flight
        if in_flight and in_flight[0].step <= step:
            done = st.completed_step
            while in_flight and in_flight[0].step <= done:
                del in_flight[0]
            if not in_flight:
                if st.restored_since:
                    st.restored_since.clear()
            elif st.restored_since:  # a restore matters only to a plan sealed before it: the oldest bounds them
                oldest = in_flight[0].step
                st.restored_since = {p: s for p, s in st.restored_since.items() if s > oldest}
        if st.overwritten:  # (a step that ran everywhere wrote its pages: nothing can give their marks back)
            done = st.completed_step
            st.overwritten = {p: s for p, s in st.overwritten.items() if s > done}
    st.seq += 1


def sanitizer_violation(st: LedgerState, e: SanitizerViolation) -> tuple:
    """A record only: the step it names is aborted by its own event."""
    st.seq += 1
    return NO_EFFECTS


def step_aborted(st: LedgerState, e: StepAborted) -> tuple:
    """Step ``e.step`` and every later step in flight did not run everywhere: nothing of them
    can be assumed zeroed. Their pages still in KV are listed again for the open step
    (first in its clear list, the oldest plan's first), the others get their mark back,
    except pages a restore into a request rewrote whole after the plan was sealed."""
    aborted = [plan for plan in st.in_flight if plan.step >= e.step]
    st.in_flight = [plan for plan in st.in_flight if plan.step < e.step]
    marks, residue, pend = st.marks, st.residue, st.pending
    carry: list[int] = []
    step = st.open_step
    restored = st.restored_since
    kv_of: dict[int, set[int]] = {}  # request -> its KV pages, built once per request
    holder, requests = st.holder, st.requests
    marked: list[int] = []
    seen: set[int] = set()  # a page in two aborted plans is named once
    for plan in aborted:
        for p in plan.clear_list:
            if restored.get(p, -1) > plan.step:
                continue  # a restore into a request rewrote it whole after this plan was sealed
            r = holder[p]
            if r >= 0:
                kv = kv_of.get(r)
                if kv is None:
                    kv = kv_of[r] = set(requests[r].kv)
                if p in kv:
                    if p not in pend:
                        pend[p] = step
                        carry.append(p)
                    continue
            if p not in seen:
                seen.add(p)
                marked.append(p)
            marks[p] = MARK_ALL
            residue.pop(p, None)
        st.aborted_steps.add(plan.step)
    if st.overwritten:  # pages a commit of an aborted step was to write whole: nothing wrote them
        gone = {plan.step for plan in aborted}
        for p in sorted(q for q, s in st.overwritten.items() if s in gone):  # (page order: a checkpoint keeps no other)
            del st.overwritten[p]
            if in_kv(st, p, kv_of):
                if p not in pend:
                    pend[p] = step
                    carry.append(p)
            else:
                if p not in seen:
                    seen.add(p)
                    marked.append(p)
                marks[p] = MARK_ALL
                residue.pop(p, None)
    if carry:
        listed = st.clear_lists.get(step)
        if listed:  # entries of a carried page there are stale (it was not pending): carried is its last listing
            moved = set(carry)
            listed = [q for q in listed if q not in moved]
        st.clear_lists[step] = carry + listed if listed else carry
    if not st.in_flight:
        st.restored_since.clear()
    st.seq += 1
    return marked_effect(marked)


def in_kv(st: LedgerState, p: int, kv_of: dict[int, set[int]]) -> bool:
    """Is page ``p`` in some request's KV pages (``kv_of``: request -> its KV pages, built once)?"""
    r = st.holder[p]
    if r < 0:
        return False
    kv = kv_of.get(r)
    if kv is None:
        kv = kv_of[r] = set(st.requests[r].kv)
    return p in kv


def pages_unwritten(st: LedgerState, e) -> tuple:
    """The step ran without the request: pages a ``reads="none"`` commit of it took a mark off for
    that step get it back when they are free or reserved (marked for everyone). A page another
    request committed since is left to that commit (an engine that reuses a page before it
    learns of a dropped share commits it reading whole). Returns ``PagesMarked``."""
    ow = st.overwritten
    marked: list[int] = []
    if ow:
        kv_of: dict[int, set[int]] = {}
        holder = st.holder
        for p in e.page_ids:
            if ow.get(p) != e.step:
                continue
            del ow[p]
            if holder[p] == HOLDER_FREE or (holder[p] >= 0 and not in_kv(st, p, kv_of)):
                st.marks[p] = MARK_ALL
                st.residue.pop(p, None)
                marked.append(p)
    st.seq += 1
    return marked_effect(marked)
