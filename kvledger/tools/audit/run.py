"""``audit_log``: the library's fold loop over a log, with the audit watching every event.

    open_view ─► start_state (fresh, or the checkpoint at or before --since)
              ─► fold_records(apply=_Audit.apply): for each event
                     pages it touches, their view before ─► validate ─► apply
                     ─► ContentModel.post (--check) ─► Timelines.record ─► SvgTrack.after
              ─► open_at_end: faults of a closed log, what is still open

Unlike a replay, an event the fold rejects does not end the audit: it is a
fault (``rejected_event``, ``double_release``, ...), skipped, and the audit goes
on; a sealed step whose recorded plan differs from the derived one is a
``plan_mismatch`` fault, and the recorded plan is folded (it is what the ranks
ran).
"""

from __future__ import annotations

import time

from kvledger.core.errors import (
    CorruptLogError,
    InvalidArgumentError,
    KVLedgerError,
    ReplayMismatchError,
    UnknownRequestError,
    UnknownSnapshotError,
)
from kvledger.core.events.events import (
    CacheConfigured,
    RequestCancelled,
    RequestFinished,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepSealed,
)
from kvledger.core.log import open_view
from kvledger.core.log.fold import fold_records, start_state
from kvledger.core.state import LedgerState

from .model import ContentModel, is_free, open_at_end
from .report import AuditReport, Faults, event_tag
from .svg import SvgTrack
from .views import Timelines, page_view

__all__ = ["audit_log"]


def audit_log(path, *, page: int | None = None, request: int | None = None, snapshot: int | None = None,
              check: bool = False, svg_pages: list[int] | None = None, since: int | None = None,
              until: int | None = None, layer=None, state_factory=LedgerState) -> AuditReport:
    """Audit the log at ``path`` (see ``kvledger.tools.audit``); never raises for what is in the records.

    ``state_factory`` builds the fold the audit watches (``LedgerState``; a test
    hands it a deliberately broken one to show the independent checks catch it).

    Raises ``LogError`` for an unreadable file, ``CorruptLogError`` for a bad
    header, ``InvalidArgumentError`` for a page id out of range. A corrupt
    record ends the audit with ``report.error`` set.
    """
    t0 = time.perf_counter()
    with open_view(path, layer=layer, until=until) as view:
        sc, hdr = view.scan, view.header
        n = hdr.geometry.num_pages
        _check_pages(page, svg_pages, n)
        subject = (f"page {page}" if page is not None else f"request {request}" if request is not None
                   else f"snapshot {snapshot}" if snapshot is not None else "check")
        rep = AuditReport(path=view.path, num_pages=n, page_tokens=hdr.geometry.page_tokens, policy=hdr.policy,
                          start_seq=0, end_seq=0, events=0, closed_cleanly=sc.closed, torn_at=sc.torn_at,
                          torn_bytes=sc.torn_bytes, subject=subject)
        since = since or 0
        try:
            st, start, ck = start_state(view, at=since) if since > 0 else (state_factory(), 0, None)
        except KVLedgerError as exc:
            rep.error = _err(exc)
            rep.seconds = time.perf_counter() - t0
            return rep
        if ck is None and since > 0:
            st = state_factory()  # no checkpoint at or before since: the watched fold from seq 0
        rep.start_seq = max(st.seq, since)
        audit = _Audit(st, rep, page=page, request=request, snapshot=snapshot, check=check,
                       svg_pages=svg_pages or [], since=since)
        try:
            fold_records(view, st, start, until=until, apply=audit.apply)
        except KVLedgerError as exc:
            rep.error = _err(exc)
        if rep.error is None and sc.error is not None and (until is None or until >= sc.error.seq):
            rep.error = _err(sc.error)
        audit.finish(closed=sc.closed and rep.error is None and until is None)
        rep.seconds = time.perf_counter() - t0
    return rep


def _check_pages(page: int | None, svg_pages: list[int] | None, n: int) -> None:
    if page is not None and not 0 <= page < n:
        raise InvalidArgumentError(f"page {page} is out of range [0, {n})")
    if svg_pages:
        bad = [p for p in svg_pages if not 0 <= p < n]
        if bad:
            raise InvalidArgumentError(f"pages {bad[:8]} are out of range [0, {n})")


def _err(exc: KVLedgerError) -> dict:
    return {"kind": "corrupt" if isinstance(exc, CorruptLogError) else "error", "error": type(exc).__name__,
            "seq": getattr(exc, "seq", None), "offset": getattr(exc, "offset", None), "message": str(exc)}


class _Audit:
    """The audit's ``apply`` hook: folds each event itself and shows it to the watchers.

    The watchers (``Timelines``, ``ContentModel`` with ``check``, ``SvgTrack``
    with SVG pages) are made once the state has a geometry: at once from a
    checkpoint, else after seq 0 (``CacheConfigured``).
    """

    def __init__(self, st: LedgerState, rep: AuditReport, *, page: int | None, request: int | None,
                 snapshot: int | None, check: bool, svg_pages: list[int], since: int) -> None:
        self.st, self.rep = st, rep
        self.subject = {"page": page, "request": request, "snapshot": snapshot}
        self.check = check
        self.svg_pages = svg_pages
        self.since = since
        self.next_seq = st.seq  # the seq after the last event audited
        self.started = False
        self.svg: SvgTrack | None = None
        self.model: ContentModel | None = None
        self.step_seqs: list[tuple[int, int]] = []  # (seq, step) of every StepSealed
        self.marked_pages: dict[int, None] = {}  # first pages ever marked by a release (SVG default)
        if st.geometry is not None:
            self._start(max(st.seq, since))

    def _start(self, at: int) -> None:
        st = self.st
        self.svg = SvgTrack(st, self.svg_pages) if self.svg_pages else None
        self.faults = Faults(self.svg)
        self.model = ContentModel(st, self.faults) if self.check else None
        self.views = Timelines(st, **self.subject)
        page = self.subject["page"]
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
            self._event(seq, ev)
        self.next_seq = seq + 1
        self.rep.events += 1

    def _touched(self, ev, t) -> tuple:
        """The pages an event touches, read before it is folded."""
        st = self.st
        if t is RequestCancelled or t is RequestFinished:
            rec = st.requests.get(ev.request)
            return () if rec is None else tuple(rec.reserved) + tuple(rec.kv)
        if t is SnapshotReleased:
            return tuple(st.snapshots.get(ev.snapshot, ()))
        if t is StepSealed:
            return tuple(ev.clear_list)
        if t is StepAborted:
            lp = st.last_plan
            return () if lp is None else tuple(lp.clear_list)
        if t is StepCompleted or t is CacheConfigured:
            return ()
        return ev.page_ids

    def _event(self, seq: int, ev) -> None:
        st, model = self.st, self.model
        t = type(ev)
        pages = self._touched(ev, t)
        want = [p for p in pages if p in self.wanted] if self.wanted else ()
        before = {p: page_view(st, p) for p in want}
        open_step = st.open_step
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
        effects = st.apply(ev)
        if model is not None:
            model.post(seq, ev, t, pre)
        if t is StepSealed:
            self.step_seqs.append((seq, ev.step))
        elif t is SnapshotReleased and len(self.marked_pages) < 64:
            for p in pages:
                if p in st.marks and is_free(st, p):
                    self.marked_pages[p] = None
        if seq >= self.since:
            self.views.record(seq, ev, t, pages, before, effects, open_step)
        if self.svg is not None:
            self.svg.after(seq, ev, t, want, before)

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

    def finish(self, *, closed: bool) -> None:
        """The end-of-log pass, and everything the watchers found, into the report."""
        rep = self.rep
        rep.end_seq = self.next_seq
        if not self.started:
            return
        rep.open = open_at_end(self.st, self.model, self.faults, closed)
        if self.svg is not None:
            self.svg.close(self.next_seq)
            rep.segments = self.svg.segments
            rep.markers = self.svg.markers
        rep.rows = self.views.rows
        rep.faults = self.faults.found
        rep.fault_counts = dict(self.faults.counts)
        rep.svg_pages = list(self.svg_pages)
        rep.steps = self.step_seqs
        rep.marked_pages = list(self.marked_pages)[:64]
