"""The engine's side of the sanitizer (SPEC "The sanitizer"): what every rank poisons and checks, and why.

    ledger observer (sanitize mode only)   SanitizerTracker.observe(seq, event, effects): one handler
                                           per event type (``_on_<event>``), the dispatch built from
                                           the transition table (a new event without one fails at import)
      PagesMarked effects                  pages marked since the last plan: candidates for poison
      RestoreStarted                       its pages leave the candidates (the restore rewrites them)
      PagesCommitted                       the step's committed pages: to check for poison
      StepSealed                           the plan's two lists (below), handed to take(step)
      StepAborted                          the aborted plans' poison becomes a candidate again
      every event                          one line in the history of each page it touched (the
                                           table's ``touches``: the pages it names; those of the
                                           request or snapshot it ends, kept from their events)

    at the seal of step s:
      poison    = candidates still marked for everyone, or in s's clear list (zeroed right after);
                  never a page a restore is writing (kept for the next plan while still marked);
                  a page freed and reserved again in between is poisoned all the same: its bytes
                  are nobody's to read
      committed = the pages committed for s, still held by a request, not marked now

    run_step ─► seal ─► sealed hook: take(s) ─► StepJob(poison=, committed=) on every local rank:
                input copies -> poison -> clear -> check -> graph (RankExecutor(sanitize=True))
             ─► a rank found violations ─► SanitizerViolation per violation, StepAborted (the log)
                                        ─► failed hook, error(): SanitizerError naming rank, plane, page,
                                           its request now, the step, the kind, the policy,
                                           and the page's lifecycle from this tracker

Pages marked under ``cross_tenant`` for one tenant only are not poisoned: that tenant may
read them back without a clear. The history keeps the last ``HISTORY`` events per page
that touched it, as ``(seq, event, holder before, holder after, note)``, formatted only
when an error is raised (a line's holder before is the last line's holder after). What
it knows of the ledger it reads through the ledger's read API (``holder_of``,
``mark_of``, ``is_restoring``, ``request_of``, ``holders_of``, ...) and the effects, never
its state. Memory: O(pages touched x HISTORY) and one set of pages per live request and
snapshot (an observer sees a request's end after the fold: its pages are gone from
the ledger by then). Nothing here runs unless the engine was opened with
``sanitize=True``. Remote peers are not sanitized (the wire carries clear lists only).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kvledger.core.errors import SanitizerError, StepFailedError
from kvledger.core.events import ClearPages, PagesMarked, SanitizerViolation, StepAborted, StepPlan
from kvledger.core.state.table import MAX_IN_FLIGHT
from kvledger.core.state.transitions import event_name, handlers

from .plugins import StepHook
from .records import SealedStep

__all__ = ["HISTORY", "SanitizerTracker"]

HISTORY = 16  # events kept per page
_KIND_ORDER = {"not_zero": 0, "poison": 1}


class _Found:
    """A history note: what the sanitizer found on one page before one step's graph."""

    __slots__ = ("step", "found")

    def __init__(self, step: int) -> None:
        self.step = step
        self.found: dict[tuple[int, str], list[int]] = {}  # (rank, kind) -> planes

    def add(self, rank: int, plane: int, kind: str) -> None:
        self.found.setdefault((rank, kind), []).append(plane)

    def __str__(self) -> str:
        what = "; ".join(f"{kind} on rank {rank} in plane{'s' if len(planes) > 1 else ''} "
                         f"{', '.join(map(str, planes))}" for (rank, kind), planes in self.found.items())
        return f"the sanitizer found {what}, before step {self.step}'s graph"


class SanitizerTracker(StepHook):
    """The sanitize-mode ledger observer and step hook (module docstring). ``attach(ledger)``
    once the ledger exists; as a hook: ``sealed`` hands each plan its poison and committed
    lists (``take``), ``failed`` turns a step whose ranks found violations into a
    ``SanitizerError`` (``error``)."""

    def __init__(self) -> None:
        self._ledger: Any = None
        self.policy = ""
        self._fresh = False  # saw CacheConfigured: an untouched page was free
        self._pending: dict[int, int] = {}  # candidates for poison -> seq of the mark
        self._committed: dict[int, list[int]] = {}  # step -> pages committed for it
        self._ready: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None  # (step, poison, committed)
        self._plans: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # step -> (clear list, poison)
        self._requests: dict[int, dict[int, None]] = {}  # request -> its pages, in order
        self._snapshots: dict[int, dict[int, None]] = {}
        self._history: dict[int, deque] = {}
        self._marked_at: dict[int, tuple[int, str]] = {}  # page -> (seq, event) of its last mark
        self._listed: dict[int, int] = {}  # page -> the step whose clear list last named it

    def attach(self, ledger: Any) -> None:
        """Read ``ledger`` (its read API) from now on. A ledger opened on an existing log starts
        with its marked pages as candidates (the bytes behind them are nobody's) and its requests'
        and snapshots' pages known."""
        self._ledger = ledger
        self.policy = ledger.policy
        for p, mark in ledger.marked_pages().items():
            if mark == "all":
                self._pending.setdefault(p, ledger.seq)
        for r in ledger.requests():
            self._requests[r] = dict.fromkeys([*ledger.reserved_pages(r), *ledger.kv_pages(r)])
        for s in ledger.snapshots():
            self._snapshots[s] = dict.fromkeys(ledger.snapshot_pages(s))

    # ------------------------------------------------------------------ the observer

    def observe(self, seq: int, event: Any, effects: tuple) -> None:
        """The ``Ledger`` observer: candidates, committed pages, plans, histories (the event's
        handler). Never raises for an event the ledger folded."""
        _OBSERVE[type(event)](self, seq, event, effects)

    def _on_step_sealed(self, seq: int, event: Any, effects: tuple) -> None:
        self._seal(seq, effects[0])

    def _on_step_aborted(self, seq: int, event: Any, effects: tuple) -> None:
        self._abort(seq, event, effects)

    def _on_cache_configured(self, seq: int, event: Any, effects: tuple) -> None:
        self._fresh = True

    def _on_sanitizer_violation(self, seq: int, event: Any, effects: tuple) -> None:
        self._violation(seq, event)

    def _on_step_completed(self, seq: int, event: Any, effects: tuple) -> None:
        """(A completion touches no page.)"""

    def _on_pages_reserved(self, seq: int, event: Any, effects: tuple) -> None:
        self._requests.setdefault(event.request, {}).update(dict.fromkeys(event.page_ids))
        self._lines(seq, event, event.page_ids, effects)

    _on_pages_shared = _on_pages_reserved

    def _on_reservation_returned(self, seq: int, event: Any, effects: tuple) -> None:
        held = self._requests.get(event.request, {})
        for p in event.page_ids:
            held.pop(p, None)
        self._lines(seq, event, event.page_ids, effects)

    _on_pages_released = _on_reservation_returned

    def _on_request_labelled(self, seq: int, event: Any, effects: tuple) -> None:
        """(A record: the engine's name for a request; no page.)"""

    def _on_pages_committed(self, seq: int, event: Any, effects: tuple) -> None:
        if event.reads != "none":  # (written whole by the graph: poison there is fine)
            self._committed.setdefault(event.step, []).extend(event.page_ids)
        self._lines(seq, event, event.page_ids, effects)

    def _on_snapshot_aliased(self, seq: int, event: Any, effects: tuple) -> None:
        self._snapshots.setdefault(event.snapshot, {}).update(dict.fromkeys(event.page_ids))
        self._lines(seq, event, event.page_ids, effects)

    def _on_restore_started(self, seq: int, event: Any, effects: tuple) -> None:
        for p in event.page_ids:
            self._pending.pop(p, None)  # the restore rewrites it: its bytes are the restore's
        self._lines(seq, event, event.page_ids, effects)

    def _on_restore_completed(self, seq: int, event: Any, effects: tuple) -> None:
        self._lines(seq, event, event.page_ids, effects)

    _on_pages_published = _on_restore_completed
    _on_pages_evicted = _on_restore_completed
    _on_pages_unwritten = _on_restore_completed

    def _on_request_finished(self, seq: int, event: Any, effects: tuple) -> None:
        self._lines(seq, event, tuple(self._requests.pop(event.request, ())), effects)

    _on_request_cancelled = _on_request_finished

    def _on_snapshot_released(self, seq: int, event: Any, effects: tuple) -> None:
        self._lines(seq, event, tuple(self._snapshots.pop(event.snapshot, ())), effects)

    def _lines(self, seq: int, event: Any, pages: Sequence[int], effects: tuple) -> None:
        """One history line for each page ``event`` touched, noting the marks and listings its
        effects name."""
        marked: set[int] = set()
        listed: dict[int, int] = {}
        for eff in effects:
            te = type(eff)
            if te is PagesMarked:
                marked.update(eff.page_ids)
            elif te is ClearPages:
                listed.update(dict.fromkeys(eff.page_ids, eff.step))
        tag = event_name(type(event))
        for p in pages:
            note = ""
            if p in marked:
                note = "marked"
                self._pending[p] = seq
                self._marked_at[p] = (seq, tag)
            if p in listed:
                note = f"listed for step {listed[p]}" if not note else f"{note}, listed for step {listed[p]}"
                self._listed[p] = listed[p]
            self._line(p, seq, tag, note)

    def _seal(self, seq: int, plan: StepPlan) -> None:
        """The plan's poison and committed lists (module docstring), ready for ``take``."""
        led, step = self._ledger, plan.step
        mark_of, restoring, request_of = led.mark_of, led.is_restoring, led.request_of
        clear = plan.clear_list
        in_clear = set(clear)
        poison: list[int] = []
        keep: dict[int, int] = {}
        for p, at in self._pending.items():
            if restoring(p):
                if mark_of(p) is not None:
                    keep[p] = at  # poisoned in a later plan, once the restore is done with it
            elif mark_of(p) == "all" or p in in_clear:
                poison.append(p)
        self._pending = keep
        committed = [p for p in dict.fromkeys(self._committed.pop(step, ()))
                     if mark_of(p) is None and request_of(p) is not None and not restoring(p)]
        self._ready = (step, tuple(poison), tuple(committed))
        self._plans[step] = (clear, self._ready[1])
        if len(self._plans) > MAX_IN_FLIGHT:
            del self._plans[min(self._plans)]
        poisoned = set(poison)
        for p in poison:
            self._line(p, seq, "step_sealed", f"poisoned before step {step}'s clear"
                       + (", then in its clear list" if p in in_clear else ""))
        for p in clear:
            self._listed[p] = step
            if p not in poisoned:
                self._line(p, seq, "step_sealed", f"in step {step}'s clear list")

    def _abort(self, seq: int, event: StepAborted, effects: tuple) -> None:
        """Aborted plans: their poison is a candidate again, their pages noted; marks as usual."""
        marked: set[int] = set()
        for eff in effects:
            if type(eff) is PagesMarked:
                marked.update(eff.page_ids)
        for step in [s for s in self._plans if s >= event.step]:
            clear, poison = self._plans.pop(step)
            for p in poison:
                self._pending.setdefault(p, seq)
            for p in clear:
                if p not in marked:
                    self._line(p, seq, "step_aborted", f"step {step} aborted: carried into the next clear list")
        for p in marked:
            self._pending[p] = seq
            self._marked_at[p] = (seq, "step_aborted")
            self._line(p, seq, "step_aborted", f"step {event.step} aborted: marked again")

    def _violation(self, seq: int, e: SanitizerViolation) -> None:
        """One line per page and step for what the ranks found (the planes and kinds merged)."""
        lines = self._history.get(e.page_id)
        last = lines[-1] if lines else None
        if last is not None and type(last[4]) is _Found and last[4].step == e.step:
            last[4].add(e.rank, e.plane, e.kind)
            return
        found = _Found(e.step)
        found.add(e.rank, e.plane, e.kind)
        self._line(e.page_id, seq, "sanitizer_violation", found)

    def _line(self, page: int, seq: int, tag: str, note: object) -> None:
        lines = self._history.get(page)
        if lines is None:
            lines = self._history[page] = deque(maxlen=HISTORY)
            before = "free" if self._fresh else "?"
        else:
            before = lines[-1][3]  # (the holder after the line before)
        after = self._ledger.holder_of(page) if self._ledger is not None else before
        lines.append((seq, tag, before, after, note))

    # ------------------------------------------------------------------ the engine's side

    def sealed(self, sealed: SealedStep) -> None:
        """The step hook: the plan just sealed gets its poison and committed lists."""
        sealed.poison, sealed.committed = self.take(sealed.step)

    def failed(self, sealed: SealedStep, error: StepFailedError, found: Sequence[tuple[int, Any]]
               ) -> BaseException | None:
        """The step hook: a failed step whose ranks found violations raises ``SanitizerError``."""
        if not found:
            return None
        return self.error(sealed.plan, sealed.committed or (), found)

    def take(self, step: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(poison, committed)`` for the plan of ``step`` just sealed (empty lists for another step)."""
        ready, self._ready = self._ready, None
        if ready is None or ready[0] != step:
            return (), ()
        return ready[1], ready[2]

    def history(self, page: int) -> list[str]:
        """The page's last ``HISTORY`` events, one line each:
        ``seq 12 snapshot_released: alias({3}) -> free, marked``."""
        return [f"seq {seq} {tag}: {before} -> {after}" + (f", {note}" if note else "")
                for seq, tag, before, after, note in self._history.get(page, ())]

    def error(self, plan: StepPlan, committed: Sequence[int], found: Sequence[tuple[int, Any]]) -> SanitizerError:
        """The ``SanitizerError`` for a step whose ranks found ``found`` (``(rank, Violation)``):
        it names the first violation (the lowest rank; then the page read first: clear-list
        order, then commit order; then the plane; not_zero before poison) and every other."""
        order = {p: i for i, p in enumerate(plan.clear_list)}
        for p in committed:
            order.setdefault(p, len(order))
        rank, v = min(found, key=lambda rv: (rv[0], order.get(rv[1].page, len(order)), rv[1].plane,
                                              _KIND_ORDER.get(rv[1].kind, 2)))
        holders = self._ledger.holders_of(v.page)
        request = holders[0] if holders else self._ledger.request_of(v.page)
        lines = [*self.history(v.page), self._verdict(plan, v.page)]
        return SanitizerError(rank=rank, plane=v.plane, page_id=v.page, step=plan.step, kind=v.kind,
                              request=request, lifecycle=lines, policy=self.policy,
                              violations=[(r, x.plane, x.page, x.kind) for r, x in found])

    def _verdict(self, plan: StepPlan, page: int) -> str:
        """When the page was marked and which step should have zeroed it."""
        marked = self._marked_at.get(page)
        when = f"marked at seq {marked[0]} ({marked[1]})" if marked is not None else "no mark seen by the sanitizer"
        if page in plan.clear_list:
            return f"{when}; step {plan.step}'s clear should have zeroed it on every rank and plane"
        listed = self._listed.get(page)
        if listed is not None and listed != plan.step:
            return f"{when}; step {listed}'s clear list named it, and that clear should have zeroed it"
        return f"{when}; no clear list named it, yet step {plan.step} commits it to a request"


_OBSERVE = handlers(SanitizerTracker, "_on_")  # one handler per event type of the table (TypeError here otherwise)
