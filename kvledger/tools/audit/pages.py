"""The page timeline (``--page N``): its rows, and the fold of one page that answers fast on any log.

    page_view(st, p)   (holder text, marked, restoring, listed) of page p
    page_row(...)      one Row: holder before -> after, the flags, and a note saying why

``PageFold`` is the default engine of ``--page`` (the checked engine in ``run.py``
gives the same rows, validating every event, at the cost of the whole fold). It
runs the ledger's own appliers (the transition table) on a state *projected*
onto page p, over the events projected onto p:

    state (a checkpoint, or seq 0) ─► project_state(st, p): p's entries of the page table, its
        flags and hash; the requests holding p (reserved or kv, sharers included) and the
        snapshots aliasing it, their lists cut to [p]; plans in flight and clear lists cut
        to p; every rank's completions; every live request's tenant (``tenants``)
    each event ─► naming p (page_ids, clear_list, page_id)     cut to p, applied, a row
               ─► ending a request / snapshot that holds p        applied, a row
               ─► a seal, completion, abort or violation         applied (a row if it names p)
               ─► anything else                                   skipped: it cannot change p

Why that is exact: an applier reads and writes only the page-table entries of
the pages its event names, the records of the requests and snapshots it names,
and the step bookkeeping (open step, plans in flight, clear lists, completions);
an event that names neither p nor a holder of p changes nothing p's view or
its future transitions read, except a request's tenant, which ``tenants``
follows for every request. ``tests/tools/test_audit_pages.py`` holds the rows equal
to the checked engine's for every page of logs that use every event.

Cost: the events of the window are decoded and looked at once (a membership
test each); the fold runs only for the few that touch p. The window's checkpoint
is verified (bytes and digest) as for any trusted start. Like any trusted fold
(``docs/LOG-FORMAT.md``), every event's bounds are still checked (page ids in the
geometry, step numbers against the open step and the steps in flight:
``core.log.fold.bounds_problem``), and each sealed step's recorded plan must list
page p exactly when p's history says so; a log that breaks them is corrupt.
"""

from __future__ import annotations


import msgspec

from kvledger.core.errors import CorruptLogError, KVLedgerError
from kvledger.core.events.events import (
    CacheConfigured,
    PagesCommitted,
    PagesEvicted,
    PagesPublished,
    PagesReleased,
    PagesReserved,
    PagesShared,
    PagesUnwritten,
    RequestCancelled,
    RequestFinished,
    RequestLabelled,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SanitizerViolation,
    SnapshotReleased,
    StepAborted,
    StepSealed,
)
from kvledger.core.log.fold import bounds_problem
from kvledger.core.state import LedgerState
from kvledger.core.state.projection import project_state
from kvledger.core.state.transitions import TRANSITIONS
from kvledger.core.state.state import hash_text

from ..replay import record_of
from .names import HolderNames
from .report import Row, event_tag

__all__ = ["PageFold", "page_row", "page_view", "plan_step_of", "project_state", "start_row"]

# From the transition table's columns: the events that keep a mark, that name their pages, that
# end a request, that act on a step (without naming pages), and those that carry a tenant.
_KEEPS_MARK = tuple(t for t, row in TRANSITIONS.items() if row.marks.change == "kept")
_NAMES_PAGES = frozenset(t for t, row in TRANSITIONS.items() if row.touches == "page_ids")
_ENDS = tuple(t for t, row in TRANSITIONS.items() if row.touches == "request")
_STEP_EVENTS = frozenset(t for t, row in TRANSITIONS.items() if row.requires.step and row.touches != "page_ids")
_CREATES = tuple(t for t in _NAMES_PAGES if "tenant" in t.__struct_fields__)  # type: ignore[attr-defined]


def page_view(st: LedgerState, p: int) -> tuple:
    """``(holder text, marked, restoring, listed for an unsealed step)`` of page ``p``."""
    return (st.holder_of(p), p in st.marks, p in st.restore_targets, p in st.pending)


def plan_step_of(st: LedgerState, p: int, ev: StepAborted) -> int | None:
    """The step of the last plan in flight that an abort of ``ev.step`` takes with it and that lists ``p``."""
    steps = [plan.step for plan in st.in_flight if plan.step >= ev.step and p in plan.clear_list]
    return steps[-1] if steps else None


def page_row(seq: int, ev, t, p: int, before: tuple, after: tuple, step: int, listed: bool,
             plan_step: int | None = None, names: HolderNames | None = None) -> Row:
    """The timeline row of page ``p`` for a folded event (``before`` / ``after``: ``page_view`` tuples;
    ``listed``: a commit listed p; ``plan_step``: for an abort, the step whose plan listed p; ``names``:
    the requests' labels and tenants, written beside their ids)."""
    b, a = before, after
    if names is not None:
        b = (names.decorate(b[0]), *b[1:])
        a = (names.decorate(a[0]), *a[1:])
    return Row(seq=seq, step=step, event=event_tag(ev), page_ids=[p], holder_before=b[0], holder_after=a[0],
               marked_before=b[1], marked_after=a[1], restoring_before=b[2], restoring_after=a[2],
               note=_note(p, ev, t, b, a, listed, plan_step))


def start_row(st: LedgerState, p: int, seq: int, names: HolderNames | None = None) -> Row:
    """The first row of a window that starts after seq 0: page ``p`` as it is before event ``seq``."""
    v = page_view(st, p)
    if names is not None:
        v = (names.decorate(v[0]), *v[1:])
    note = f"page {p} where the window starts" + ("; listed for the open step's clear list" if v[3] else "")
    return Row(seq=seq, step=st.open_step, event="window_start", page_ids=[p], holder_before=v[0],
               holder_after=v[0], marked_before=v[1], marked_after=v[1], restoring_before=v[2],
               restoring_after=v[2], note=note)


def _note(p: int, ev, t, b: tuple, a: tuple, listed: bool, plan_step: int | None) -> str:
    """Why page ``p`` went from view ``b`` to view ``a``."""
    if t is StepSealed:
        return f"zeroed by step {ev.step}'s plan, before any request read it"
    if t is SnapshotReleased:
        if a[1] and not b[1]:
            return "last alias released: marked (holds row bytes)"
        if a[0] == b[0]:
            return "still aliased by other snapshots"
        if a[1]:
            return "last alias released: still marked"
    if t is PagesCommitted:
        if ev.reads == "none" and b[1]:
            return f"written whole by step {ev.step} before any read: mark removed without a clear"
        whole = " (the step reads the whole page before writing it)" if ev.reads == "whole" else ""
        if listed:
            return f"marked: listed for step {ev.step}'s clear list" + whole
        if b[1] and not a[1]:
            return "the committing tenant's own bytes: mark removed without a clear"
        return "not marked: nothing to zero"
    if t is PagesReleased:
        if a[0].startswith("cached"):
            return f"released by request {ev.request} (it keeps its other pages): cached, its KV kept for reuse"
        if a[0].startswith("free"):
            return f"released by request {ev.request} (it keeps its other pages): free" + \
                ("; marked (the clear policy: its bytes stay behind)" if a[1] else "")
        return f"released by request {ev.request}: still held by the others"
    if t is PagesUnwritten:
        why = f" ({ev.reason})" if ev.reason else ""
        return f"NOT WRITTEN: step {ev.step} ran without request {ev.request}{why}; its prefix-cache hash withdrawn"
    if t is RestoreStarted:
        if ev.into == "request" and b[1]:
            return f"overwritten whole by a restore into request {ev.target}: mark removed, never listed"
        return f"restore into {ev.into} {ev.target} writing"
    if t is RestoreCompleted:
        return "restore done"
    if t is StepAborted:
        which = f"step {ev.step}" if plan_step in (None, ev.step) else \
            f"step {plan_step} (in flight behind step {ev.step}, aborted with it)"
        return f"{which} aborted: " + ("listed again for the next step" if a[3] else
                                      "marked again" if a[1] else "not zeroed there")
    note = _prefix_cache_note(p, ev, t, b, a)
    if note is not None:
        return note
    if (t is RequestFinished or t is RequestCancelled or t is ReservationReturned) and b[3] and a[1]:
        return "left the request before its step ran: marked again"
    if a[1] and b[1] and t in _KEEPS_MARK:
        return "mark kept"
    if a[1] and not b[1]:
        return "marked (the clear policy: the request's bytes stay behind)"
    return ""


def _prefix_cache_note(p: int, ev, t, b: tuple, a: tuple) -> str | None:
    """Notes for the prefix cache's transitions and the sanitizer's record (None: not one of them)."""
    if t is PagesPublished:
        return f"published as block {hash_text(ev.hashes[ev.page_ids.index(p)])}: other requests may share it"
    if t is PagesShared:
        if b[0].startswith("cached"):
            return f"taken from the cache by request {ev.request}: its KV reused, never listed"
        return f"shared into request {ev.request}: read-only, never listed"
    if t is PagesEvicted:
        return "evicted from the cache: block removed, free" + ("; marked (the clear policy)" if a[1] else "")
    if t is SanitizerViolation:
        found = "not zeroed" if ev.kind == "not_zero" else "still holding poison"
        return f"SANITIZER: rank {ev.rank} plane {ev.plane} found it {found} before step {ev.step}'s graph"
    if (t is RequestFinished or t is RequestCancelled) and not a[0].startswith(("free", "reserved")):
        if a[0].startswith("cached"):
            return f"request {ev.request} let go, the last holder: cached, its KV kept for reuse"
        return f"request {ev.request} let go: still held by the others"
    return None


# ---------------------------------------------------------------------- the fold of one page


class PageFold:
    """``apply(seq, event)`` for ``fold_records``: page ``p``'s rows from seq ``since`` on (module docstring).

    Raises ``CorruptLogError`` (naming the record's file, offset and seq in ``view``)
    for an event that cannot be applied to the projection: a log the ledger did not write.
    """

    def __init__(self, st: LedgerState, p: int, since: int, view) -> None:
        self.p, self.since, self.view = p, since, view
        self.rows: list[Row] = []
        self.started = since == 0  # the window-start row is written (none for a window from seq 0)
        if st.geometry is not None:
            self.ps = project_state(st, p)
        else:  # from seq 0: CacheConfigured comes first
            self.ps = LedgerState(st.transitions)
        self.tenants = {r: rec.tenant for r, rec in st.requests.items()}
        self.names = HolderNames(st)
        self.apply = self._hook()

    def _hook(self):
        """``apply(seq, event)``: the per-event test, kept to a few lookups (it runs for every event)."""
        p, tenants, fold, narrow, bounds = self.p, self.tenants, self._fold, self._narrow, bounds_problem
        names_pages, step_events, creates, ends, names = _NAMES_PAGES, _STEP_EVENTS, _CREATES, _ENDS, self.names

        def apply(seq: int, ev) -> None:
            problem = bounds(self.ps, ev)
            if problem is not None:
                raise self._corrupt(seq, f"{type(ev).__name__} at seq {seq}: {problem} (a log the ledger did not "
                                         "write)")
            t = type(ev)
            if t in names_pages:
                if t in creates:
                    tenants.setdefault(ev.request, ev.tenant)
                if p in ev.page_ids:
                    fold(seq, narrow(ev, t), t)
            elif t in ends:
                tenants.pop(ev.request, None)
                if ev.request in self.ps.requests:
                    fold(seq, ev, t)
            elif t in step_events or (t is SnapshotReleased and ev.snapshot in self.ps.snapshots):
                fold(seq, ev, t)
            elif t is RequestLabelled:
                names.event(ev, t, self.ps)
            elif t is CacheConfigured:  # seq 0 of a log folded from its start
                self.ps.apply(ev)
                self.ps = project_state(self.ps, p)

        return apply

    def _narrow(self, ev, t):
        """The event cut to page p (a new request gets the tenant it has in the whole log)."""
        p = self.p
        if t is PagesPublished:
            i = ev.page_ids.index(p)
            return msgspec.structs.replace(ev, page_ids=(p,), hashes=(ev.hashes[i],), token_ids=())
        if t is PagesReserved or t is PagesShared:
            return msgspec.structs.replace(ev, page_ids=(p,), tenant=self.tenants[ev.request])
        return msgspec.structs.replace(ev, page_ids=(p,))

    def _fold(self, seq: int, ev, t) -> None:
        """Apply the (projected) event; a row when it touches p and lies in the window."""
        p, ps = self.p, self.ps
        if not self.started and seq >= self.since:
            self.start()
        touched = self._touches(ev, t)
        before = page_view(ps, p) if touched else None
        step = ev.step if t is PagesCommitted or t is StepSealed else ps.open_step
        plan_step = plan_step_of(ps, p, ev) if t is StepAborted and touched else None
        try:
            effects = ps.transitions[t].apply(ps, ev)
        except (KVLedgerError, LookupError, ValueError, TypeError, AttributeError) as exc:
            raise self._corrupt(seq, f"{type(ev).__name__} at seq {seq} cannot be applied to page {p}'s history: "
                                     f"{type(exc).__name__}: {exc}") from exc
        self.names.event(ev, t, ps)
        if t is StepSealed and (p in effects[0].clear_list) != (p in ev.clear_list):
            raise self._corrupt(seq, f"StepSealed at seq {seq}: clear_list: step {ev.step}'s recorded plan "
                                     f"{'lists' if p in ev.clear_list else 'leaves out'} page {p}, its history says "
                                     "the opposite")
        if before is not None and seq >= self.since:
            listed = bool(effects) and t is PagesCommitted
            self.rows.append(page_row(seq, ev, t, p, before, page_view(ps, p), step, listed, plan_step, self.names))

    def _corrupt(self, seq: int, detail: str) -> CorruptLogError:
        """``CorruptLogError`` at the record of ``view`` that holds event ``seq``."""
        rec = record_of(self.view, seq)
        path, offset = (self.view.path, -1) if rec is None else (self.view.paths[rec.segment], rec.offset)
        return CorruptLogError(path, offset, seq, detail)

    def start(self) -> None:
        """The window-start row (the page as it is now); at the end if no event after the start touched it."""
        if not self.started:
            self.started = True
            self.rows.append(start_row(self.ps, self.p, self.since, self.names))

    def _touches(self, ev, t) -> bool:
        """Whether the (projected) event touches page p: by its row's ``touches`` column."""
        p, how = self.p, TRANSITIONS[t].touches
        if how == "clear_list":
            return p in ev.clear_list
        if how == "plans":
            return any(plan.step >= ev.step and plan.clear_list for plan in self.ps.in_flight)
        if how == "page_id":
            return ev.page_id == p
        if how == "request":
            rec = self.ps.requests[ev.request]  # (it may have let go of p before it ended)
            return bool(rec.reserved or rec.kv)
        return how != ""  # its page_ids cut to p, or a snapshot the projection holds only p of
