"""The checked engine of an audit: the library's fold loop with an ``apply`` hook that validates each event.

    fold_records(apply=CheckedAudit.apply): for each event
        pages it touches, their view before ─► validate ─► StepTable.event ─► apply
        ─► ContentModel.post and check_pages (--check) ─► Timelines.record ─► SvgTrack.after
    finish: open_at_end (faults of a closed log, what is still open), every watcher into the report

Unlike a replay, an event the fold rejects does not end the audit: it is a
fault (``rejected_event``, ``double_release``, ...), skipped, and the audit goes
on; a sealed step whose recorded plan differs from the derived one is a
``plan_mismatch`` fault, and the recorded plan is folded (it is what the ranks
ran).
"""

from __future__ import annotations


from kvledger.core.errors import KVLedgerError, ReplayMismatchError, UnknownRequestError, UnknownSnapshotError
from kvledger.core.events.events import RequestCancelled, RequestFinished, SnapshotReleased, StepAborted, StepSealed
from kvledger.core.state import LedgerState
from kvledger.core.state.transitions import touched

from .ending import open_at_end
from .model import ContentModel, is_free
from .pages import page_view, plan_step_of, start_row
from .report import AuditReport, Faults, event_tag
from .steps import StepTable
from .svg import SvgTrack
from .views import Timelines

__all__ = ["CheckedAudit"]


class CheckedAudit:
    """The audit's ``apply`` hook: folds each event itself and shows it to the watchers.

    The watchers (``Timelines``, ``StepTable``, ``ContentModel`` with ``check``,
    ``SvgTrack`` with SVG pages) are made once the state has a geometry: at once
    from a checkpoint, else after seq 0 (``CacheConfigured``).
    """

    def __init__(self, st: LedgerState, rep: AuditReport, *, page: int | None, request: int | str | None,
                 snapshot: int | None, check: bool, svg_pages: list[int], since: int) -> None:
        self.st, self.rep = st, rep
        self.page, self.request, self.snapshot = page, request, snapshot  # the timeline asked for
        self.check = check
        self.svg_pages = svg_pages
        self.since = since
        self.next_seq = st.seq  # the seq after the last event audited
        self.started = False
        self.svg: SvgTrack | None = None
        self.model: ContentModel | None = None
        self.steps: StepTable | None = None
        self.step_seqs: list[tuple[int, int]] = []  # (seq, step) of every StepSealed
        self.marked_pages: dict[int, None] = {}  # first pages ever marked by a release (SVG default)
        self.started_page = page is None or since == 0  # the page's window-start row is written
        if st.geometry is not None:
            self._start(max(st.seq, since))

    def _start(self, at: int) -> None:
        st = self.st
        self.svg = SvgTrack(st, self.svg_pages) if self.svg_pages else None
        self.faults = Faults(self.svg)
        self.model = ContentModel(st, self.faults) if self.check else None
        self.views = Timelines(st, page=self.page, request=self.request, snapshot=self.snapshot)
        self.steps = StepTable(st)
        page = self.page
        self.wanted = ({page} if page is not None else set()) | set(self.svg_pages)
        self.started = True
        if self.svg is not None:
            self.svg.begin(at)

    def apply(self, seq: int, ev) -> None:
        if seq == 0:
            self.st.fold(ev)
            self._start(max(1, self.since))
        else:
            if seq == self.since and self.svg is not None:
                self.svg.begin(self.since)
            if not self.started_page and seq >= self.since:
                self._page_start()
            self._event(seq, ev)
        self.next_seq = seq + 1
        self.rep.events += 1

    def _page_start(self) -> None:
        """The page's window-start row (as in the fold of one page)."""
        page = self.page
        if not self.started_page and page is not None:
            self.started_page = True
            self.views.rows.append(start_row(self.st, page, self.since, self.views.names))

    def _event(self, seq: int, ev) -> None:
        st, model = self.st, self.model
        t = type(ev)
        pages = touched(st, ev)  # (the table's touches column: read before the fold)
        want = [p for p in pages if p in self.wanted] if self.wanted else ()
        before = {p: page_view(st, p) for p in want}
        open_step = st.open_step
        page = self.page
        plan_step = plan_step_of(st, page, ev) if t is StepAborted and page is not None and page in before else None
        pre = model.pre(ev, t) if model is not None else None
        try:
            st.validate(ev)
        except ReplayMismatchError as exc:
            if t is not StepSealed:
                raise
            derived = st.derive_clear_list(ev.step)
            self.faults.add("plan_mismatch", seq, ev.step, str(exc),
                            page_ids=sorted(set(ev.clear_list) ^ set(derived))[:64])
        except KVLedgerError as exc:
            self._rejected(seq, ev, t, exc, open_step)
            return
        if self.steps is not None and seq >= self.since:
            self.steps.event(seq, ev, t, st)
        effects = st.apply(ev)
        if model is not None:
            model.post(seq, ev, t, pre)
            model.check_pages(seq, pages)
        self._note_seal_or_release(seq, ev, t, pages)
        self.views.names.event(ev, t, st)
        if seq >= self.since:
            self.views.record(seq, ev, t, pages, before, effects, open_step, plan_step)
        if self.svg is not None:
            self.svg.after(seq, ev, t, want, before)

    def _note_seal_or_release(self, seq: int, ev, t, pages) -> None:
        """The SVG's axis (sealed steps) and its default pages (the first pages a release marked)."""
        if t is StepSealed:
            self.step_seqs.append((seq, ev.step))
        elif t is SnapshotReleased and len(self.marked_pages) < 64:
            st = self.st
            for p in pages:
                if p in st.marks and is_free(st, p):
                    self.marked_pages[p] = None

    def _rejected(self, seq: int, ev, t, exc: KVLedgerError, step: int) -> None:
        """An event the fold refuses: a fault (a ledger never writes one), skipped."""
        released = self.model.released if self.model is not None else ()
        ended = self.model.ended if self.model is not None else ()
        if t is SnapshotReleased and isinstance(exc, UnknownSnapshotError):
            kind = "double_release" if ev.snapshot in released else "unknown_snapshot"
            self.faults.add(kind, seq, step, f"release of snapshot {ev.snapshot}: {exc}", snapshot=ev.snapshot)
        elif t in (RequestFinished, RequestCancelled) and isinstance(exc, UnknownRequestError):
            kind = "double_finish" if ev.request in ended else "unknown_request"
            self.faults.add(kind, seq, step, f"{event_tag(ev)} of request {ev.request}: {exc}", request=ev.request)
        else:
            self.faults.add("rejected_event", seq, step,
                            f"{event_tag(ev)} rejected by the fold: {type(exc).__name__}: {exc}",
                            page_ids=list(getattr(ev, "page_ids", ()) or ())[:64],
                            request=getattr(ev, "request", None), snapshot=getattr(ev, "snapshot", None))
        if seq >= self.since:
            self.views.rejected(seq, ev, step, exc)

    def finish(self, *, closed: bool, steps_table: bool) -> None:
        """The end-of-log pass, and everything the watchers found, into the report."""
        rep = self.rep
        rep.end_seq = self.next_seq
        if not self.started:
            return
        if rep.error is None:
            self._page_start()
        rep.open = open_at_end(self.st, self.model, self.faults, closed)
        if self.svg is not None:
            self.svg.close(self.next_seq)
            rep.segments = self.svg.segments
            rep.markers = self.svg.markers
        if self.steps is not None and (steps_table or self.check):
            self.steps.finish(rep, table=steps_table)
        rep.rows = self.views.rows
        rep.faults = self.faults.found
        rep.fault_counts = dict(self.faults.counts)
        rep.svg_pages = list(self.svg_pages)
        rep.steps = self.step_seqs
        rep.marked_pages = list(self.marked_pages)[:64]
