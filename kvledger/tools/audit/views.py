"""The audit's timelines (``--page``, ``--request``, ``--snapshot``) and the text report.

``Timelines.record`` turns each folded event into rows for the chosen subject:

    --page N        every transition of page N: holder before -> after, mark and
                    restoring flags, and a note saying why
    --request R     R's events, the pages its commits listed and the step plans
                    that zeroed them; R an engine's label (``--label``, or a --request
                    that is not a number): every ledger request labelled with it
                    (a vLLM request's holds, in each KV cache group)
    --snapshot S    S's aliases, restores and release, then what became of every
                    page the release marked, until a plan zeroed it

``render`` prints an ``AuditReport`` (rows, faults, what is open at the end).
"""

from __future__ import annotations

from kvledger.core.events.events import (
    PagesCommitted,
    PagesMarked,
    PagesPublished,
    PagesReleased,
    PagesReserved,
    PagesShared,
    PagesUnwritten,
    RequestLabelled,
    RequestCancelled,
    RequestFinished,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepSealed,
)
from kvledger.core.state import ALIAS, LedgerState

from .model import is_free
from .names import HolderNames
from .pages import page_row, page_view
from .report import MAX_FINDINGS, AuditReport, Row, event_tag
from .steps import render_steps, summary_line

__all__ = ["Timelines", "render"]

class Timelines:
    """Rows for the chosen page, request or snapshot, one folded event at a time."""

    def __init__(self, st: LedgerState, *, page: int | None, request: int | str | None,
                 snapshot: int | None) -> None:
        self.st = st
        self.page = page
        # ``request``: a ledger request id, or an engine's label (a vLLM request id: every ledger
        # request labelled with it, each from its ``RequestLabelled`` on)
        self.request = request
        self.label = request if isinstance(request, str) else None
        self.following: set[int] = set() if self.label is not None or request is None else {int(request)}
        self.snapshot = snapshot
        self.rows: list[Row] = []
        self.follow: dict[int, int] = {}  # snapshot view: page marked by S's release -> release seq
        self.req_listed: dict[int, int] = {}  # request view: page listed by R's commit -> commit seq
        self.names = HolderNames(st)

    def record(self, seq: int, ev, t, pages, before: dict, effects, open_step: int,
               plan_step: int | None = None) -> None:
        """Rows for a folded event. ``pages``: the pages it touched; ``before``: ``page_view`` of the watched
        ones; ``plan_step``: for an abort, the step whose plan listed the watched page."""
        step = ev.step if t is PagesCommitted else open_step
        listed = effects[0].page_ids if effects and t is PagesCommitted else ()
        if self.page is not None and self.page in before:
            p = self.page
            self.rows.append(page_row(seq, ev, t, p, before[p], page_view(self.st, p), step, p in listed,
                                      plan_step, self.names))
        if self.label is not None and t is RequestLabelled:
            if ev.label == self.label:
                self.following.add(ev.request)
                self.rows.append(Row(seq=seq, step=open_step, event=event_tag(ev), page_ids=[],
                                     note=f"ledger request {ev.request} is {self.label!r}"))
            else:
                self.following.discard(ev.request)
        if self.following:
            self._request_rows(seq, ev, t, step, listed, pages, _marked_by(effects))
        if self.snapshot is not None:
            self._snapshot_rows(seq, ev, t, step, pages, listed)

    def rejected(self, seq: int, ev, step: int, exc: Exception) -> None:
        self.rows.append(Row(seq=seq, step=step, event=event_tag(ev), note=f"REJECTED: {exc}"))

    def _request_rows(self, seq: int, ev, t, step: int, listed, pages, marked: list[int]) -> None:
        """R's own events (``marked``: the pages the fold's ``PagesMarked`` effect says the event marked)."""
        mine = self.following
        if t is StepSealed:
            zeroed = [p for p in ev.clear_list if p in self.req_listed]
            if zeroed:
                for p in zeroed:
                    del self.req_listed[p]
                self.rows.append(Row(seq=seq, step=ev.step, event=event_tag(ev), page_ids=zeroed,
                                     note=f"step {ev.step}'s plan zeroes {len(zeroed)} page(s) request "
                                          f"{self.request} committed"))
            return
        if t is RequestLabelled:
            return  # (its row is the label view's own)
        restore_into_r = t in (RestoreStarted, RestoreCompleted) and ev.into == "request" and ev.target in mine
        if getattr(ev, "request", None) not in mine and not restore_into_r:
            return
        ids = list(getattr(ev, "page_ids", ()) or ())
        note = ""
        if t is PagesReserved:
            note = f"tenant {ev.tenant!r}" if ev.tenant is not None else ""
            stale = [p for p in ids if p in self.st.marks]
            if stale:
                note = (f"{note}; " if note else "") + f"{len(stale)} marked page(s): {stale[:16]}"
        elif t is PagesCommitted:
            if listed:
                for p in listed:
                    self.req_listed[p] = seq
                note = f"listed for step {ev.step}'s clear list: {list(listed)[:16]}"
            else:
                note = "no marked page"
        elif t is RequestFinished or t is RequestCancelled:
            kept = [p for p in pages if not is_free(self.st, p)]
            note = "its pages are free again" + (f", but {len(kept)} cached or still shared: {kept[:16]}"
                                                 if kept else "")
            if marked:
                note += f"; {len(marked)} marked by the clear policy (its bytes stay behind): {marked[:16]}"
        elif t is ReservationReturned and marked:
            note = f"{len(marked)} returned page(s) marked by the clear policy: {marked[:16]}"
        elif t is PagesPublished:
            note = f"published {len(ids)} block(s): other requests may share them"
        elif t is PagesShared:
            note = f"shares {len(ids)} page(s) of published KV: read-only, never listed"
        elif t is PagesReleased:
            note = f"lets go of {len(ids)} page(s), keeps the rest" + (
                f"; {len(marked)} marked by the clear policy: {marked[:16]}" if marked else "")
        elif t is PagesUnwritten:
            note = f"step {ev.step} ran without it: {len(ids)} page(s) never written ({ev.reason})"
        elif t is RestoreStarted:
            note = "inbound restore into the request: pages overwritten whole, never listed"
        self.rows.append(Row(seq=seq, step=step, event=event_tag(ev), page_ids=ids, note=note))

    def _snapshot_rows(self, seq: int, ev, t, step: int, pages, listed) -> None:
        s = self.snapshot
        restore_into_s = t in (RestoreStarted, RestoreCompleted) and ev.into == "snapshot" and ev.target == s
        if getattr(ev, "snapshot", None) == s or restore_into_s:
            self._own_snapshot_row(seq, ev, t, step, pages)
        elif self.follow:
            self._followed_rows(seq, ev, t, step, pages, listed)

    def _own_snapshot_row(self, seq: int, ev, t, step: int, pages) -> None:
        """An event of the snapshot itself; its release starts following the pages it marked."""
        st = self.st
        note = ""
        ids = list(getattr(ev, "page_ids", ()) or ())
        if t is SnapshotReleased:
            ids = list(pages)
            freed = [p for p in ids if p in st.marks and is_free(st, p)]
            for p in freed:
                self.follow[p] = seq
            kept = [p for p in ids if st.holder_code(p) == ALIAS]
            note = f"{len(freed)} page(s) freed and marked {freed[:16]}"
            if kept:
                note += f"; {len(kept)} still aliased by other snapshots"
        elif t is SnapshotAliased:
            marked = [p for p in ids if p in st.marks]
            note = f"reuse of marked free pages (the mark stays): {marked[:16]}" if marked else ""
        self.rows.append(Row(seq=seq, step=step, event=event_tag(ev), page_ids=ids, note=note))

    def _followed_rows(self, seq: int, ev, t, step: int, pages, listed) -> None:
        """What became of the pages the snapshot's release marked, grouped by what happened."""
        groups: dict[str, list[int]] = {}
        for p in pages:
            if p in self.follow:
                note = self._followed_note(p, ev, t, listed)
                if note:
                    groups.setdefault(note, []).append(p)
        for note, ids in groups.items():
            self.rows.append(Row(seq=seq, step=step, event=event_tag(ev), page_ids=ids, note=note))

    def _followed_note(self, p: int, ev, t, listed) -> str:
        st = self.st
        if t is PagesCommitted:
            return f"request {ev.request} commits them: listed for step {ev.step}'s clear list" if p in listed else ""
        if t is StepSealed:
            return f"zeroed by step {ev.step}'s plan (marked by the release at seq {self.follow.pop(p)})"
        if t is RestoreStarted and ev.into == "request":
            if p in st.marks:
                return ""
            del self.follow[p]
            return f"overwritten whole by a restore into request {ev.target}: mark removed, never listed"
        if t is SnapshotAliased:
            return f"aliased again by snapshot {ev.snapshot} (mark kept)"
        if t is SnapshotReleased:
            return f"free again after snapshot {ev.snapshot}'s release (still marked)" if is_free(st, p) else ""
        if t is PagesReserved:
            return f"reserved by request {ev.request} (mark kept)"
        if t in (ReservationReturned, RequestCancelled, RequestFinished):
            if p in st.marks:
                return f"request {ev.request} let go of them before they were zeroed: still marked"
            return ""
        if t is StepAborted:
            return f"step {ev.step} aborted: not zeroed yet"
        return ""


def _marked_by(effects) -> list[int]:
    """The pages an event's ``PagesMarked`` effect names (the fold's word on what it just marked)."""
    return [p for e in effects if type(e) is PagesMarked for p in e.page_ids]


# ---------------------------------------------------------------------- the text report


def render(rep: AuditReport) -> str:
    """The human report: a header line, the subject's rows, then faults and what is open (``--check``)."""
    out = [f"audit of {rep.path}: {rep.subject}; {rep.num_pages:,} pages, policy {rep.policy}; "
           f"seq {rep.start_seq:,}..{max(rep.end_seq - 1, 0):,} ({rep.events:,} events"
           + (", closed cleanly)" if rep.closed_cleanly else ", not closed)")]
    if rep.torn_at is not None:
        out.append(f"torn tail: {rep.torn_bytes} bytes from offset {rep.torn_at} (not audited)")
    if rep.window:
        out.append(f"window: {rep.window}")
    if rep.subject == "steps":
        out += render_steps(rep)
    elif rep.rows:
        out += _rows_table(rep)
    elif rep.subject != "check":
        out.append("no events touch it in this window")
    if rep.subject == "check" and (rep.ranks or rep.aborted.get("named")):
        out.append(summary_line(rep))
    if rep.subject == "check" or rep.faults:
        out += _faults_section(rep)
    if rep.error is not None:
        e = rep.error
        where = f"{e['file']}, " if e.get("file") and e["file"] != rep.path else ""
        out.append(f"FAILED ({e['kind']}, {where}offset {e['offset']}, seq {e['seq']}): {e['message']}")
    return "\n".join(out)


def _flags(marked: bool, restoring: bool) -> str:
    return ("*" if marked else "-") + ("R" if restoring else "-")


def _rows_table(rep: AuditReport) -> list[str]:
    out = []
    if rep.subject.startswith("page"):
        out.append("flags: * marked (must be zeroed before a request reads it), R restore writing")
        hdr: tuple[str, ...] = ("seq", "step", "event", "holder", "flags", "note")
        lines: list[tuple[str, ...]] = []
        for r in rep.rows:
            holder = r.holder_before if r.holder_before == r.holder_after else f"{r.holder_before} -> {r.holder_after}"
            flags = _flags(r.marked_before, r.restoring_before)
            if (r.marked_before, r.restoring_before) != (r.marked_after, r.restoring_after):
                flags += f" -> {_flags(r.marked_after, r.restoring_after)}"
            lines.append((f"{r.seq:,}", str(r.step), r.event, holder, flags, r.note))
    else:
        hdr = ("seq", "step", "event", "pages", "note")
        lines = [(f"{r.seq:,}", str(r.step), r.event, _pages(r.page_ids), r.note) for r in rep.rows]
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(hdr)]
    widths[-1] = 0
    out.append("  ".join(h.ljust(w) for h, w in zip(hdr, widths, strict=True)).rstrip())
    for x in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip())
    return out


def _faults_section(rep: AuditReport) -> list[str]:
    out = []
    if rep.faults:
        total = sum(rep.fault_counts.values())
        out.append(f"FAULTS: {total} (" + ", ".join(f"{k} {v}" for k, v in sorted(rep.fault_counts.items())) + ")")
        for f in rep.faults[:200]:
            out.append(f"  {f.kind:<24} seq {f.seq if f.seq is not None else '-':<8} step "
                       f"{f.step if f.step is not None else '-':<6} {f.detail}")
        if len(rep.faults) > 200:
            out.append(f"  ... {len(rep.faults) - 200} more (--json lists up to {MAX_FINDINGS} per kind)")
    else:
        out.append("no lifecycle faults")
    if rep.open:
        counts: dict = {}
        for f in rep.open:
            counts[f.kind] = counts.get(f.kind, 0) + 1
        out.append("open at the end: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        for f in rep.open[:20]:
            out.append(f"  {f.kind:<24} {f.detail}")
        if len(rep.open) > 20:
            out.append(f"  ... {len(rep.open) - 20} more")
    return out


def _pages(ids) -> str:
    ids = list(ids)
    if not ids:
        return "-"
    s = ",".join(map(str, ids[:8]))
    return s + (f",+{len(ids) - 8}" if len(ids) > 8 else "")
