"""``kvledger audit LOG``: page, request and snapshot lifecycles, and lifecycle faults.

    kvledger audit LOG --page N        every transition of page N: seq, step, event,
                                       holder before -> after, mark and restoring
                                       flags, the step whose plan zeroed it
    kvledger audit LOG --request R     R's events, the pages its commits listed and
                                       the step plans that zeroed them
    kvledger audit LOG --snapshot S    S's aliases, restores and release, then what
                                       became of every page the release marked
    kvledger audit LOG --check         lifecycle faults over the whole log
    ... --json                         machine-readable output
    ... --svg OUT                      a page x seq timeline (pages of the chosen
                                       page / request / snapshot, or --pages)
    ... --since SEQ / --until SEQ      a window; --since starts from the nearest
                                       checkpoint at or before SEQ

How ``--check`` decides, independently of the fold's own bookkeeping
(it folds the log for holders, and keeps its own model of page *contents*):

    contents     every page holds ZERO (fresh, or zeroed by a step plan), ROW(s)
                 (snapshot rows: a page ever aliased by a snapshot, or restored
                 into one) or KV(request incarnation, tenant) (a request's own
                 bytes, from its first step on or from a restore into it)
    a read       a request first reads a committed page when the step it was
                 committed for is sealed (after that step's clears); an aborted
                 step undoes its clears and its reads, which move to the next step
    foreign      ROW under every policy; KV of another tenant under cross_tenant;
                 KV of another request under all_reused

Faults (exit status 1):
    unzeroed_read            a request read a page holding foreign bytes
    needless_clear           (released_aliases) a plan zeroed a page that held no
                             row bytes: only released rows are ever zeroed
    redundant_clear          a plan zeroed a page that no one held or wrote since
                             it was last zeroed (the other policies clear pages a
                             request held, even if its step never ran: by design)
    plan_mismatch            a sealed step's recorded clear list differs from the
                             one the fold derives (the plan the ranks ran is the
                             recorded one; the audit goes on with it)
    leak                     a page the request's own events gave it is still held
                             after the request finished or was cancelled
    double_release / double_finish / unknown_snapshot / unknown_request /
    rejected_event           an event the fold refuses (a ledger never writes
                             one; the audit records it, skips it and goes on)
    restore_never_completed  (cleanly closed log) a restore still in flight at close
    step_never_completed     a rank skipped a sealed step, or (cleanly closed log)
                             never completed one; only for logs whose ranks report
                             completions
Open at the end (reported, not faults): requests holding pages, live snapshots,
marked free pages, and on a log that was not closed (live or crashed) restores
in flight and steps not yet completed.

Exit status: 0 no faults; 1 faults; 2 bad usage or an unreadable file; 3 corrupt log.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import msgspec
import structlog

from kvledger.core.errors import (
    CorruptLogError,
    InvalidArgumentError,
    KVLedgerError,
    LogError,
    ReplayMismatchError,
    UnknownRequestError,
    UnknownSnapshotError,
)
from kvledger.core.log.format import KIND_EVENTS
from kvledger.core.events.events import (
    CacheConfigured,
    PagesCommitted,
    PagesReserved,
    RequestCancelled,
    RequestFinished,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepSealed,
)
from kvledger.core.log import open_view
from kvledger.core.state import HOLDER_ALIAS, HOLDER_FREE, KV, MARK_TENANT, LedgerState
from kvledger.core.log.fold import check_first_event, state_from_checkpoint

__all__ = ["Finding", "Row", "Segment", "AuditReport", "audit_log", "main", "FAULT_KINDS"]

FAULT_KINDS = (
    "unzeroed_read", "needless_clear", "redundant_clear", "plan_mismatch", "leak", "double_release", "double_finish",
    "unknown_snapshot", "unknown_request", "rejected_event", "restore_never_completed", "step_never_completed",
)
MAX_FINDINGS = 1000  # per kind; the count keeps going

# page contents (the audit's own model)
ZERO, CLEAN, ROW, KVB, STALE = 0, 1, 2, 3, 4
_CONTENT = ("zero", "clean", "row", "kv", "stale")


def _tag(ev) -> str:
    return type(ev).__struct_config__.tag


class Finding(msgspec.Struct, kw_only=True, gc=False):
    kind: str
    seq: Optional[int]
    step: Optional[int]
    detail: str
    page_ids: list = []
    request: Optional[int] = None
    snapshot: Optional[int] = None


class Row(msgspec.Struct, kw_only=True, gc=False):
    """One line of a timeline. Page rows fill the holder/mark/restoring fields."""

    seq: int
    step: int  # the open step when the event was folded (the event's own step for commits)
    event: str
    page_ids: list = []
    holder_before: str = ""
    holder_after: str = ""
    marked_before: bool = False
    marked_after: bool = False
    restoring_before: bool = False
    restoring_after: bool = False
    note: str = ""


class Segment(msgspec.Struct, frozen=True, gc=False):
    """A stretch of seqs [start, end) over which a page kept one holder and flags (for SVG)."""

    page: int
    start: int
    end: int
    holder: str  # free | reserved | kv | alias
    label: str  # holder_of text, e.g. kv(12)
    marked: bool
    restoring: bool


class AuditReport(msgspec.Struct, kw_only=True, gc=False):
    path: str
    num_pages: int
    page_tokens: int
    policy: str
    start_seq: int
    end_seq: int  # seq after the last event audited
    events: int
    closed_cleanly: bool
    torn_at: Optional[int] = None
    torn_bytes: int = 0
    subject: str = ""  # "page 3" / "request 7" / "snapshot 2" / "check"
    rows: list = []
    faults: list = []
    open: list = []
    fault_counts: dict = {}
    segments: list = []  # SVG data: Segment
    markers: list = []  # SVG data: [kind, page, seq], kind zeroed | zeroed_aborted | marked | fault
    svg_pages: list = []
    marked_pages: list = []  # the first pages a snapshot release marked (the default SVG pages)
    steps: list = []  # SVG data: (seq, step) of every StepSealed (for the axis)
    error: Optional[dict] = None  # corruption / decode problem that ended the audit
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.faults and self.error is None


class _Auditor:
    """Drives the fold over a log's events and watches it (see the module docstring)."""

    def __init__(self, st: LedgerState, *, page: int | None, request: int | None, snapshot: int | None,
                 check: bool, svg_pages: list[int] | None, since: int) -> None:
        self.st = st
        self.n = st.num_pages
        self.policy = st.policy
        self.page = page
        self.request = request
        self.snapshot = snapshot
        self.check = check
        self.since = since
        self.rows: list[Row] = []
        self.faults: list[Finding] = []
        self.counts: dict[str, int] = {}
        # pages whose transitions become rows
        self.watch: set[int] = set()
        if page is not None:
            self.watch.add(page)
        self.follow: dict[int, int] = {}  # snapshot view: page marked by S's release -> release seq
        self.req_listed: dict[int, int] = {}  # request view: page listed by R's commit -> commit seq
        # svg
        self.svg_pages = svg_pages or []
        self.svg_set = set(self.svg_pages)
        self.seg_state: dict[int, tuple] = {}
        self.seg_start: dict[int, int] = {}
        self.segments: list[Segment] = []
        self.markers: list[list] = []
        self._seal_markers: list[int] = []  # markers of the last sealed plan (an abort undoes them)
        self.step_seqs: list[int] = []
        self.marked_pages: dict[int, None] = {}  # first pages ever marked by a release (SVG default)
        # content model and shadows (check mode)
        self.content = bytearray(self.n) if check else None
        self.dirty = bytearray(self.n) if check else None  # held (kv, alias) or written since last zeroed
        self.c_owner: dict[int, int] = {}  # page -> request incarnation (KVB) / snapshot (ROW)
        self.c_tenant: dict[int, object] = {}
        self.zeroed_at: dict[int, int] = {}  # page -> seq of the plan that zeroed it
        self.inc_of: dict[int, int] = {}  # live request -> incarnation
        self.inc_req: dict[int, int] = {}
        self.inc_tenant: dict[int, object] = {}
        self.next_inc = 0
        self.reads: dict[int, list] = {}  # step -> [(page, incarnation, commit seq)]
        self.last_seal: tuple | None = None
        self.shadow: dict[int, set] = {}  # incarnation -> pages its events gave it
        self.ended: set[int] = set()
        self.released: set[int] = set()
        self.restore_seq: dict[int, int] = {}  # page -> seq its restore started
        self.sealed: list[int] = []  # sealed, not aborted steps (check mode, only if ranks report)
        self.aborted: set[int] = set()
        self.done: dict[int, set] = {}  # rank -> completed steps
        self.first_done: dict[int, int] = {}
        if check:
            self._seed_from_state()

    # ------------------------------------------------------------------ helpers

    def _fault(self, kind: str, seq, step, detail: str, **kw) -> None:
        c = self.counts.get(kind, 0)
        self.counts[kind] = c + 1
        if c < MAX_FINDINGS:
            self.faults.append(Finding(kind=kind, seq=seq, step=step, detail=detail, **kw))
            if self.svg_set:
                for p in kw.get("page_ids", ()):
                    if p in self.svg_set:
                        self.markers.append(["fault", p, seq])

    def _new_inc(self, r: int, tenant) -> int:
        inc = self.next_inc
        self.next_inc += 1
        self.inc_of[r] = inc
        self.inc_req[inc] = r
        self.inc_tenant[inc] = tenant
        return inc

    def _seed_from_state(self) -> None:
        """Contents as far as a state tells (a fresh cache, or a checkpoint)."""
        st, content = self.st, self.content
        for r, rec in sorted(st.requests.items()):
            inc = self._new_inc(r, rec.tenant)
            self.shadow[inc] = set(rec.reserved) | set(rec.kv)
            for p in rec.kv:
                content[p] = KVB
                self.c_owner[p] = inc
                self.c_tenant[p] = rec.tenant
            for p in rec.restored or ():
                content[p] = KVB
                self.c_owner[p] = inc
                self.c_tenant[p] = rec.tenant
        for s, pages in st.snapshots.items():
            for p in pages:
                content[p] = ROW
                self.c_owner[p] = s
        for p, m in st.marks.items():
            if m == MARK_TENANT:
                content[p] = KVB
                self.c_owner[p] = -1
                self.c_tenant[p] = st.residue.get(p)
            else:
                content[p] = STALE
        if st.seq > 1:  # a checkpoint: pages with no history are not known to be zero
            for p in range(self.n):
                if content[p] == ZERO:
                    content[p] = CLEAN
            self.dirty[:] = b"\x01" * self.n
        for step, pages in st.clear_lists.items():
            lst = self.reads.setdefault(step, [])
            for p in pages:
                if p in st.pending and st.holder[p] >= 0:
                    lst.append((p, self.inc_of.get(st.holder[p], -1), None))
                    content[p] = STALE  # listed: it was marked when its request committed it
        lp = st.last_plan
        if lp is not None and lp.clear_list:
            # The last sealed step can still be aborted: make that undo possible.
            saved, done = [], []
            for p in lp.clear_list:
                after = self._content_of(p)
                before = (STALE, None, None, None, 1)
                saved.append((p, before, after))
                if st.holder[p] >= 0 and st.holder_code(p) == KV:
                    done.append((p, self.inc_of.get(st.holder[p], -1), None))
            self.last_seal = (lp.step, saved, done)
        if st.completed:
            for rank in st.completed:
                self.first_done[rank] = st.completed[rank] + 1
                self.done[rank] = set()

    def _page_view(self, p: int) -> tuple:
        st = self.st
        return (st.holder_of(p), p in st.marks, p in st.restore_targets, p in st.pending)

    def _describe(self, p: int) -> str:
        k = self.content[p]
        if k == ROW:
            return f"snapshot {self.c_owner.get(p)}'s row bytes"
        if k == KVB:
            inc = self.c_owner.get(p, -1)
            if inc < 0:
                return f"bytes of tenant {self.c_tenant.get(p)!r}"
            return f"request {self.inc_req.get(inc)}'s KV bytes (tenant {self.inc_tenant.get(inc)!r})"
        if k == STALE:
            return "stale bytes (marked at the checkpoint)"
        return _CONTENT[k]

    def _foreign(self, p: int, inc: int) -> bool:
        k = self.content[p]
        if k == ROW or k == STALE:
            return True
        if k != KVB or self.policy == "released_aliases":
            return False
        if self.policy == "cross_tenant":
            return self.c_tenant.get(p) != self.inc_tenant.get(inc)
        return self.c_owner.get(p) != inc

    # ------------------------------------------------------------------ the event loop

    def touched(self, ev, t) -> tuple:
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

    def event(self, seq: int, ev) -> None:
        st = self.st
        t = type(ev)
        pages = self.touched(ev, t)
        rowed = seq >= self.since
        want = ()
        if self.watch or self.svg_set:
            want = [p for p in pages if p in self.watch or p in self.svg_set]
        before = {p: self._page_view(p) for p in want}
        open_step = st.open_step
        pre = self._pre(seq, ev, t) if self.check else None
        try:
            st.validate(ev)
        except ReplayMismatchError as exc:
            if t is not StepSealed:
                raise
            self._fault("plan_mismatch", seq, ev.step, str(exc), page_ids=sorted(set(ev.clear_list) ^ set(
                st.derive_clear_list(ev.step)))[:64])
        except KVLedgerError as exc:
            self._rejected(seq, ev, t, exc, open_step)
            return
        effects = st.apply(ev)
        if self.check:
            self._post(seq, ev, t, pre)
        if t is StepSealed:
            self.step_seqs.append((seq, ev.step))
        elif t is SnapshotReleased and len(self.marked_pages) < 64:
            for p in pages:
                if p in st.marks and st.holder[p] == HOLDER_FREE:
                    self.marked_pages[p] = None
        if rowed:
            self._rows(seq, ev, t, pages, before, effects, open_step)
        if self.svg_set:
            for p in want:
                if p in self.svg_set:
                    self._svg_update(p, seq + 1)
            if t is StepSealed:
                self._seal_markers = []
                for p in ev.clear_list:
                    if p in self.svg_set:
                        self._seal_markers.append(len(self.markers))
                        self.markers.append(["zeroed", p, seq])
            elif t is StepAborted:
                for i in self._seal_markers:  # that zeroing never ran: drawn hollow
                    self.markers[i][0] = "zeroed_aborted"
                self._seal_markers = []
            elif t is SnapshotReleased:
                for p in want:
                    if p in self.svg_set and not before[p][1] and p in st.marks:
                        self.markers.append(["marked", p, seq])

    def _rejected(self, seq: int, ev, t, exc: KVLedgerError, step: int) -> None:
        if t is SnapshotReleased and isinstance(exc, UnknownSnapshotError):
            kind = "double_release" if ev.snapshot in self.released else "unknown_snapshot"
            self._fault(kind, seq, step, f"release of snapshot {ev.snapshot}: {exc}", snapshot=ev.snapshot)
        elif t in (RequestFinished, RequestCancelled) and isinstance(exc, UnknownRequestError):
            kind = "double_finish" if ev.request in self.ended else "unknown_request"
            self._fault(kind, seq, step, f"{_tag(ev)} of request {ev.request}: {exc}", request=ev.request)
        else:
            self._fault("rejected_event", seq, step, f"{_tag(ev)} rejected by the fold: {type(exc).__name__}: {exc}",
                        page_ids=list(getattr(ev, "page_ids", ()) or ())[:64],
                        request=getattr(ev, "request", None), snapshot=getattr(ev, "snapshot", None))
        if seq >= self.since:
            self.rows.append(Row(seq=seq, step=step, event=_tag(ev), note=f"REJECTED: {exc}"))

    # ------------------------------------------------------------------ check mode

    def _pre(self, seq: int, ev, t):
        """What ``_post`` needs from before the fold: a request's incarnation, the open step."""
        if t is RequestFinished or t is RequestCancelled:
            return self.inc_of.get(ev.request)
        if t is StepAborted:
            return self.st.open_step
        return None

    def _post(self, seq: int, ev, t, pre) -> None:
        st, content = self.st, self.content
        if t is PagesReserved:
            r = ev.request
            inc = self.inc_of.get(r)
            if inc is None:
                inc = self._new_inc(r, ev.tenant)
                self.shadow[inc] = set()
            self.shadow[inc].update(ev.page_ids)
        elif t is ReservationReturned:
            inc = self.inc_of.get(ev.request)
            if inc is not None:
                self.shadow[inc].difference_update(ev.page_ids)
        elif t is PagesCommitted:
            inc = self.inc_of[ev.request]
            lst = self.reads.setdefault(ev.step, [])
            dirty = self.dirty
            for p in ev.page_ids:
                lst.append((p, inc, seq))
                dirty[p] = 1
        elif t is RequestFinished or t is RequestCancelled:
            r, inc = ev.request, pre
            self.ended.add(r)
            self.inc_of.pop(r, None)
            held = self.shadow.pop(inc, set()) if inc is not None else set()
            owner = st.holder
            leaked = sorted(p for p in held if owner[p] != HOLDER_FREE)
            if leaked:
                try:
                    held_as = st.holder_of(leaked[0])
                except (KeyError, IndexError):  # the fold's own tables disagree: say what the owner says
                    held_as = "owner %r" % (owner[leaked[0]],)
                self._fault("leak", seq, st.open_step, f"request {r} ended but pages {leaked[:16]} are still "
                            f"held ({held_as})", page_ids=leaked[:64], request=r)
        elif t is SnapshotAliased:
            for p in ev.page_ids:
                content[p] = ROW
                self.c_owner[p] = ev.snapshot
                self.dirty[p] = 1
        elif t is SnapshotReleased:
            self.released.add(ev.snapshot)
        elif t is RestoreStarted:
            for p in ev.page_ids:
                self.restore_seq[p] = seq
                self.dirty[p] = 1
            if ev.into == "snapshot":
                for p in ev.page_ids:
                    content[p] = ROW
                    self.c_owner[p] = ev.target
            else:
                inc = self.inc_of[ev.target]
                tenant = self.inc_tenant[inc]
                for p in ev.page_ids:
                    content[p] = KVB
                    self.c_owner[p] = inc
                    self.c_tenant[p] = tenant
        elif t is RestoreCompleted:
            for p in ev.page_ids:
                self.restore_seq.pop(p, None)
        elif t is StepSealed:
            self._seal(seq, ev)
        elif t is StepAborted:
            self._abort(seq, ev, pre)
        elif t is StepCompleted:
            self._completed(seq, ev)

    def _seal(self, seq: int, ev) -> None:
        content, owner, dirty = self.content, self.st.holder, self.dirty
        saved = []  # (page, content before, after) for an abort to undo
        released_only = self.policy == "released_aliases"
        for p in ev.clear_list:
            k = content[p]
            if released_only and k != ROW and k != STALE:
                self._fault("needless_clear", seq, ev.step,
                            f"step {ev.step}'s plan zeroes page {p}, which holds {self._describe(p)}, not row bytes",
                            page_ids=[p])
            elif not dirty[p]:
                when = self.zeroed_at.get(p)
                self._fault("redundant_clear", seq, ev.step,
                            f"step {ev.step}'s plan zeroes page {p} again: nothing held or wrote it since "
                            + (f"the plan at seq {when} zeroed it" if when is not None else "the cache was configured"),
                            page_ids=[p])
            before = self._content_of(p)
            content[p] = ZERO
            dirty[p] = 0
            self.zeroed_at[p] = seq
            saved.append((p, before, self._content_of(p)))
        done = []
        for item in self.reads.pop(ev.step, ()):
            p, inc, cseq = item
            r = self.inc_req.get(inc)
            if r is None or self.inc_of.get(r) != inc or owner[p] != r or self.st.holder_code(p) != KV:
                continue  # the request let go of the page before its step ran: no read
            if self._foreign(p, inc):
                self._fault("unzeroed_read", seq, ev.step,
                            f"request {r} reads page {p} in step {ev.step} (committed at seq {cseq}) while it "
                            f"holds {self._describe(p)}; step {ev.step}'s plan did not zero it",
                            page_ids=[p], request=r)
            before = self._content_of(p)
            content[p] = KVB
            self.c_owner[p] = inc
            self.c_tenant[p] = self.inc_tenant.get(inc)
            dirty[p] = 1
            saved.append((p, before, self._content_of(p)))
            done.append(item)
        self.last_seal = (ev.step, saved, done)
        self.sealed.append(ev.step)

    def _content_of(self, p: int) -> tuple:
        return (self.content[p], self.c_owner.get(p), self.c_tenant.get(p), self.zeroed_at.get(p), self.dirty[p])

    def _set_content(self, p: int, v: tuple) -> None:
        k, o, tn, z, d = v
        self.content[p] = k
        self.dirty[p] = d
        for table, x in ((self.c_owner, o), (self.c_tenant, tn), (self.zeroed_at, z)):
            if x is None:
                table.pop(p, None)
            else:
                table[p] = x

    def _abort(self, seq: int, ev, next_step: int) -> None:
        """Nothing of the aborted step ran: undo its clears and reads (where nothing touched the page since)."""
        self.aborted.add(ev.step)
        if self.last_seal is None or self.last_seal[0] != ev.step:
            return
        _, saved, done = self.last_seal
        self.last_seal = None
        for p, before, after in reversed(saved):
            if self._content_of(p) == after:
                self._set_content(p, before)
        if done:
            self.reads.setdefault(next_step, [])[:0] = done

    def _completed(self, seq: int, ev) -> None:
        rank = ev.rank
        if rank not in self.done:
            self.done[rank] = set()
            self.first_done[rank] = ev.step
        self.done[rank].add(ev.step)

    def finish(self, closed: bool, end_seq: int) -> list[Finding]:
        """End-of-log checks; returns the 'open' findings (faults go to self.faults)."""
        st = self.st
        out: list[Finding] = []
        step = st.open_step
        if st.restore_targets:
            by_target: dict = {}
            for p, tgt in sorted(st.restore_targets.items()):
                by_target.setdefault(tgt, []).append(p)
            for (into, target), pages in sorted(by_target.items()):
                started = min((self.restore_seq.get(p, -1) for p in pages), default=-1)
                detail = (f"restore into {into} {target} of pages {pages[:16]} started at seq {started} "
                          "never completed")
                kw = {"request": target} if into == "request" else {"snapshot": target}
                if closed and self.check:
                    self._fault("restore_never_completed", started, step, detail + " before the log was closed",
                                page_ids=pages[:64], **kw)
                else:
                    out.append(Finding(kind="restore_in_flight", seq=started, step=step, detail=detail + " (yet)",
                                       page_ids=pages[:64], **kw))
        if self.check and self.done:
            aborted = self.aborted
            steps = [s for s in self.sealed if s not in aborted]
            for rank in sorted(self.done):
                done, first = self.done[rank], self.first_done[rank]
                last = max(done) if done else first - 1
                missing = [s for s in steps if s >= first and s not in done]
                skipped = [s for s in missing if s < last]
                tail = [s for s in missing if s > last]
                if skipped:
                    self._fault("step_never_completed", None, skipped[0],
                                f"rank {rank} completed step {last} but never steps {skipped[:16]}",
                                page_ids=[])
                if tail:
                    if closed:
                        self._fault("step_never_completed", None, tail[0],
                                    f"rank {rank} never completed steps {tail[:16]} before the log was closed")
                    else:
                        out.append(Finding(kind="steps_in_flight", seq=None, step=tail[0],
                                           detail=f"rank {rank} has not completed steps {tail[:16]} (yet)"))
        for r, rec in sorted(st.requests.items()):
            if rec.reserved or rec.kv:
                out.append(Finding(kind="request_open", seq=None, step=step, request=r,
                                   page_ids=(rec.kv + rec.reserved)[:64],
                                   detail=f"request {r} holds {len(rec.kv)} kv and {len(rec.reserved)} reserved pages"))
            if len(out) > MAX_FINDINGS:
                break
        for s, pages in sorted(st.snapshots.items()):
            out.append(Finding(kind="snapshot_live", seq=None, step=step, snapshot=s, page_ids=pages[:64],
                               detail=f"snapshot {s} aliases {len(pages)} pages"))
            if len(out) > 2 * MAX_FINDINGS:
                break
        free_marked = sorted(p for p in st.marks if st.holder[p] == HOLDER_FREE)
        if free_marked:
            out.append(Finding(kind="marked_free_pages", seq=None, step=step, page_ids=free_marked[:64],
                               detail=f"{len(free_marked)} free pages are marked: each is zeroed when a request "
                                      "first commits it"))
        if self.svg_set:
            for p in self.svg_pages:
                old = self.seg_state.get(p)
                start = self.seg_start.get(p, end_seq)
                if old is not None and end_seq > start:
                    self.segments.append(Segment(p, start, end_seq, old[0].split("(")[0], old[0], old[1], old[2]))
                self.seg_state.pop(p, None)
        return out

    # ------------------------------------------------------------------ rows

    def _rows(self, seq: int, ev, t, pages, before: dict, effects, open_step: int) -> None:
        tag = _tag(ev)
        step = ev.step if t is PagesCommitted else open_step
        listed = effects[0].page_ids if effects and t is PagesCommitted else ()
        if self.page is not None and self.page in before:
            p = self.page
            b = before[p]
            a = self._page_view(p)
            note = self._page_note(p, ev, t, b, a, listed)
            self.rows.append(Row(seq=seq, step=step, event=tag, page_ids=[p], holder_before=b[0], holder_after=a[0],
                                 marked_before=b[1], marked_after=a[1], restoring_before=b[2], restoring_after=a[2],
                                 note=note))
        if self.request is not None:
            self._request_rows(seq, ev, t, step, listed)
        if self.snapshot is not None:
            self._snapshot_rows(seq, ev, t, step, pages, listed)

    def _page_note(self, p: int, ev, t, b, a, listed) -> str:
        if t is StepSealed:
            return f"zeroed by step {ev.step}'s plan, before any request read it"
        if t is SnapshotReleased and a[1] and not b[1]:
            return "last alias released: marked (holds row bytes)"
        if t is SnapshotReleased and a[0] == b[0]:
            return "still aliased by other snapshots"
        if t is SnapshotReleased and a[1]:
            return "last alias released: still marked"
        if t is PagesCommitted:
            if p in listed:
                return f"marked: listed for step {ev.step}'s clear list"
            if b[1] and not a[1]:
                return "the committing tenant's own bytes: mark removed without a clear"
            return "not marked: nothing to zero"
        if t is RestoreStarted:
            if ev.into == "request" and b[1]:
                return f"overwritten whole by a restore into request {ev.target}: mark removed, never listed"
            return f"restore into {ev.into} {ev.target} writing"
        if t is RestoreCompleted:
            return "restore done"
        if t is StepAborted:
            return f"step {ev.step} aborted: " + ("listed again for the next step" if a[3] else "marked again")
        if (t is RequestFinished or t is RequestCancelled or t is ReservationReturned) and b[3] and a[1]:
            return "left the request before its step ran: marked again"
        if a[1] and b[1] and t in (PagesReserved, ReservationReturned, RequestCancelled, RequestFinished, SnapshotAliased):
            return "mark kept"
        if a[1] and not b[1]:
            return "marked (the clear policy: the request's bytes stay behind)"
        return ""

    def _request_rows(self, seq: int, ev, t, step: int, listed) -> None:
        r = self.request
        if t is StepSealed:
            mine = [p for p in ev.clear_list if p in self.req_listed]
            if mine:
                for p in mine:
                    del self.req_listed[p]
                self.rows.append(Row(seq=seq, step=ev.step, event=_tag(ev), page_ids=mine,
                                     note=f"step {ev.step}'s plan zeroes {len(mine)} page(s) request {r} committed"))
            return
        if getattr(ev, "request", None) != r and not (t in (RestoreStarted, RestoreCompleted) and ev.into == "request"
                                                     and ev.target == r):
            return
        ids = list(getattr(ev, "page_ids", ()) or ())
        note = ""
        if t is PagesReserved:
            note = f"tenant {ev.tenant!r}" if ev.tenant is not None else ""
            marked = [p for p in ids if p in self.st.marks]
            if marked:
                note = (note + "; " if note else "") + f"{len(marked)} marked page(s): {marked[:16]}"
        elif t is PagesCommitted:
            if listed:
                for p in listed:
                    self.req_listed[p] = seq
                note = f"listed for step {ev.step}'s clear list: {list(listed)[:16]}"
            else:
                note = "no marked page"
        elif t is RequestFinished or t is RequestCancelled:
            note = "its pages are free again"
        elif t is RestoreStarted:
            note = "inbound restore into the request: pages overwritten whole, never listed"
        self.rows.append(Row(seq=seq, step=step, event=_tag(ev), page_ids=ids, note=note))

    def _snapshot_rows(self, seq: int, ev, t, step: int, pages, listed) -> None:
        s = self.snapshot
        st = self.st
        if getattr(ev, "snapshot", None) == s or (t in (RestoreStarted, RestoreCompleted) and ev.into == "snapshot"
                                                   and ev.target == s):
            note = ""
            ids = list(getattr(ev, "page_ids", ()) or ())
            if t is SnapshotReleased:
                ids = list(pages)
                freed = [p for p in ids if p in st.marks and st.holder[p] == HOLDER_FREE]
                for p in freed:
                    self.follow[p] = seq
                kept = [p for p in ids if st.holder[p] == HOLDER_ALIAS]
                note = f"{len(freed)} page(s) freed and marked {freed[:16]}"
                if kept:
                    note += f"; {len(kept)} still aliased by other snapshots"
            elif t is SnapshotAliased:
                marked = [p for p in ids if p in st.marks]
                note = "reuse of marked free pages (the mark stays): %s" % marked[:16] if marked else ""
            self.rows.append(Row(seq=seq, step=step, event=_tag(ev), page_ids=ids, note=note))
            return
        if not self.follow:
            return
        hit = [p for p in pages if p in self.follow]
        if not hit:
            return
        groups: dict[str, list[int]] = {}
        for p in hit:
            note = ""
            if t is PagesCommitted:
                if p in listed:
                    note = f"request {ev.request} commits them: listed for step {ev.step}'s clear list"
            elif t is StepSealed:
                note = f"zeroed by step {ev.step}'s plan (marked by the release at seq {self.follow.pop(p)})"
            elif t is RestoreStarted and ev.into == "request":
                if p not in st.marks:
                    note = f"overwritten whole by a restore into request {ev.target}: mark removed, never listed"
                    del self.follow[p]
            elif t is SnapshotAliased:
                note = f"aliased again by snapshot {ev.snapshot} (mark kept)"
            elif t is SnapshotReleased:
                if st.holder[p] == HOLDER_FREE:
                    note = f"free again after snapshot {ev.snapshot}'s release (still marked)"
            elif t is PagesReserved:
                note = f"reserved by request {ev.request} (mark kept)"
            elif t in (ReservationReturned, RequestCancelled, RequestFinished):
                if p in st.marks:
                    note = f"request {ev.request} let go of them before they were zeroed: still marked"
            elif t is StepAborted:
                note = f"step {ev.step} aborted: not zeroed yet"
            if note:
                groups.setdefault(note, []).append(p)
        for note, ids in groups.items():
            self.rows.append(Row(seq=seq, step=step, event=_tag(ev), page_ids=ids, note=note))

    # ------------------------------------------------------------------ svg

    def _svg_update(self, p: int, at: int) -> None:
        st = self.st
        label = st.holder_of(p)
        state = (label, p in st.marks, p in st.restore_targets)
        old = self.seg_state.get(p)
        if old == state:
            return
        if old is not None:
            start = self.seg_start[p]
            if at > start:
                self.segments.append(Segment(p, start, at, old[0].split("(")[0], old[0], old[1], old[2]))
        self.seg_state[p] = state
        self.seg_start[p] = at

    def svg_begin(self, at: int) -> None:
        for p in self.svg_pages:
            self.seg_state.pop(p, None)
            self._svg_update(p, at)


def audit_log(path, *, page: int | None = None, request: int | None = None, snapshot: int | None = None,
              check: bool = False, svg_pages: list[int] | None = None, since: int | None = None,
              until: int | None = None, layer=None, state_factory=LedgerState) -> AuditReport:
    """Audit the log at ``path`` (see the module docstring); never raises for what is in the records.

    ``state_factory`` builds the fold the audit watches (``LedgerState``; a test
    hands it a deliberately broken one to show the independent checks catch it).

    Raises ``LogError`` for an unreadable file, ``CorruptLogError`` for a bad
    header, ``InvalidArgumentError`` for a page id out of range. A corrupt
    record ends the audit with ``report.error`` set.
    """
    t0 = time.perf_counter()
    view = open_view(path, layer=layer, until=until)
    with view:
        sc, hdr = view.scan, view.header
        n = hdr.geometry.num_pages
        if page is not None and not 0 <= page < n:
            raise InvalidArgumentError(f"page {page} is out of range [0, {n})")
        if svg_pages:
            bad = [p for p in svg_pages if not 0 <= p < n]
            if bad:
                raise InvalidArgumentError(f"pages {bad[:8]} are out of range [0, {n})")
        subject = ("page %d" % page if page is not None else "request %d" % request if request is not None
                   else "snapshot %d" % snapshot if snapshot is not None else "check")
        rep = AuditReport(path=view.path, num_pages=n, page_tokens=hdr.geometry.page_tokens, policy=hdr.policy,
                          start_seq=0, end_seq=0, events=0, closed_cleanly=sc.closed, torn_at=sc.torn_at,
                          torn_bytes=sc.torn_bytes, subject=subject)
        recs = sc.records
        st = state_factory()
        start_idx = 0
        since = since or 0
        try:
            if since > 0:
                i = view.last_checkpoint(since)
                if i >= 0:
                    rec = recs[i]
                    st = state_from_checkpoint(view.checkpoint(rec), hdr, path=view.path, offset=rec.offset)
                    start_idx = i + 1
        except KVLedgerError as exc:
            rep.error = _err(exc)
            rep.seconds = time.perf_counter() - t0
            return rep
        rep.start_seq = max(st.seq, since)
        aud = None
        if st.geometry is not None:
            aud = _Auditor(st, page=page, request=request, snapshot=snapshot, check=check, svg_pages=svg_pages,
                           since=since)
            aud.svg_begin(max(st.seq, since))
        seq = st.seq
        try:
            for idx in range(start_idx, len(recs)):
                rec = recs[idx]
                if rec.kind != KIND_EVENTS:
                    continue
                if until is not None and rec.seq > until:
                    break
                seq = rec.seq
                for ev in view.events(rec):
                    if until is not None and seq > until:
                        break
                    if seq == 0:
                        check_first_event(ev, hdr, view.path, rec.offset)
                        st.fold(ev)
                        aud = _Auditor(st, page=page, request=request, snapshot=snapshot, check=check,
                                       svg_pages=svg_pages, since=since)
                        aud.svg_begin(max(1, since))
                    else:
                        if seq == since and aud.svg_set:
                            aud.svg_begin(since)
                        aud.event(seq, ev)
                    seq += 1
                    rep.events += 1
        except KVLedgerError as exc:
            rep.error = _err(exc)
        if rep.error is None and sc.error is not None and (until is None or until >= sc.error.seq):
            rep.error = _err(sc.error)
        rep.end_seq = seq
        if aud is not None:
            rep.open = aud.finish(sc.closed and rep.error is None and until is None, seq)
            rep.rows = aud.rows
            rep.faults = aud.faults
            rep.fault_counts = dict(aud.counts)
            rep.segments = aud.segments
            rep.markers = aud.markers
            rep.svg_pages = list(svg_pages or [])
            rep.steps = aud.step_seqs
            rep.marked_pages = list(aud.marked_pages)[:64]
        rep.seconds = time.perf_counter() - t0
    return rep


def _err(exc: KVLedgerError) -> dict:
    return {"kind": "corrupt" if isinstance(exc, CorruptLogError) else "error", "error": type(exc).__name__,
            "seq": getattr(exc, "seq", None), "offset": getattr(exc, "offset", None), "message": str(exc)}


# ---------------------------------------------------------------------- CLI


def _flags(marked: bool, restoring: bool) -> str:
    return ("*" if marked else "-") + ("R" if restoring else "-")


def render(rep: AuditReport) -> str:
    out = [f"audit of {rep.path}: {rep.subject}; {rep.num_pages:,} pages, policy {rep.policy}; "
           f"seq {rep.start_seq:,}..{max(rep.end_seq - 1, 0):,} ({rep.events:,} events"
           + (", closed cleanly)" if rep.closed_cleanly else ", not closed)")]
    if rep.torn_at is not None:
        out.append(f"torn tail: {rep.torn_bytes} bytes from offset {rep.torn_at} (not audited)")
    if rep.rows:
        page_view = rep.subject.startswith("page")
        if page_view:
            out.append("flags: * marked (must be zeroed before a request reads it), R restore writing")
            hdr = ("seq", "step", "event", "holder", "flags", "note")
            lines = [(f"{r.seq:,}", str(r.step), r.event,
                      r.holder_before if r.holder_before == r.holder_after else f"{r.holder_before} -> {r.holder_after}",
                      _flags(r.marked_before, r.restoring_before) + (
                          " -> " + _flags(r.marked_after, r.restoring_after)
                          if (r.marked_before, r.restoring_before) != (r.marked_after, r.restoring_after) else ""),
                      r.note) for r in rep.rows]
        else:
            hdr = ("seq", "step", "event", "pages", "note")
            lines = [(f"{r.seq:,}", str(r.step), r.event, _pages(r.page_ids), r.note) for r in rep.rows]
        widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(hdr)]
        widths[-1] = 0
        out.append("  ".join(h.ljust(w) for h, w in zip(hdr, widths)).rstrip())
        for x in lines:
            out.append("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip())
    elif rep.subject != "check":
        out.append("no events touch it in this window")
    if rep.subject == "check" or rep.faults:
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
    if rep.error is not None:
        e = rep.error
        out.append(f"FAILED ({e['kind']}, offset {e['offset']}, seq {e['seq']}): {e['message']}")
    return "\n".join(out)


def _pages(ids) -> str:
    ids = list(ids)
    if not ids:
        return "-"
    s = ",".join(map(str, ids[:8]))
    return s + (f",+{len(ids) - 8}" if len(ids) > 8 else "")


def _parse_pages(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b) if b else int(a)
        if hi < lo or hi - lo > 100_000:
            raise ValueError(part)
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


def _svg_pages(rep_view: AuditReport | None, ns, num_pages: int) -> list[int]:
    if ns.pages:
        return _parse_pages(ns.pages)
    if ns.page is not None:
        lo = max(0, ns.page - 4)
        return list(range(lo, min(num_pages, lo + 9)))
    if rep_view is not None:
        seen: list[int] = []
        for r in rep_view.rows:
            for p in r.page_ids:
                if p not in seen:
                    seen.append(p)
        for f in rep_view.faults:
            for p in f.page_ids:
                if p not in seen:
                    seen.append(p)
        if seen:
            return sorted(seen[:48])
        if rep_view.marked_pages:
            return sorted(rep_view.marked_pages[:32])
    return list(range(min(num_pages, 32)))


EXIT_OK, EXIT_FAULTS, EXIT_USAGE, EXIT_CORRUPT = 0, 1, 2, 3


def main(argv=None, *, prog: str = "kvledger audit") -> int:
    from kvledger.cli import add_logging_arguments, configure_logging

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the log file")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--page", type=int, metavar="N", help="timeline of page N")
    what.add_argument("--request", type=int, metavar="R", help="timeline of request R")
    what.add_argument("--snapshot", type=int, metavar="S", help="timeline of snapshot S and the pages it marked")
    what.add_argument("--check", action="store_true", help="report lifecycle faults over the whole log")
    ap.add_argument("--since", type=int, metavar="SEQ", help="start at this seq (from the nearest checkpoint)")
    ap.add_argument("--until", type=int, metavar="SEQ", help="stop after the event with this seq")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--svg", metavar="OUT", help="also write a page x seq timeline as a standalone SVG")
    ap.add_argument("--pages", metavar="LIST", help="pages for --svg, e.g. 0-31,40 (default: the subject's pages)")
    add_logging_arguments(ap)
    ns = ap.parse_args(argv)
    configure_logging(ns)
    log = structlog.get_logger("kvledger").bind(log=ns.log)
    for name in ("since", "until"):
        if getattr(ns, name) is not None and getattr(ns, name) < 0:
            ap.error(f"--{name} must be >= 0")
    if ns.pages:
        try:
            _parse_pages(ns.pages)
        except ValueError:
            ap.error(f"--pages: cannot parse {ns.pages!r} (ranges like 0-31,40)")
    kw = dict(page=ns.page, request=ns.request, snapshot=ns.snapshot, check=ns.check, since=ns.since, until=ns.until)
    try:
        rep = audit_log(ns.log, **kw)
        if ns.svg:
            from kvledger.core.log import open_view as _ov

            with _ov(ns.log) as v:
                n = v.header.geometry.num_pages
            pages = _svg_pages(rep, ns, n)
            if rep.subject == "check" or pages != rep.svg_pages:
                full = audit_log(ns.log, **{**kw, "check": True}, svg_pages=pages)
            else:
                full = rep
            from kvledger.audit_svg import render_svg

            with open(ns.svg, "w", encoding="utf-8") as f:
                f.write(render_svg(full))
    except CorruptLogError as exc:
        log.error("audit_failed", error=str(exc))
        print(f"FAILED (corrupt): {exc}")
        return EXIT_CORRUPT
    except (LogError, InvalidArgumentError, OSError) as exc:
        log.error("audit_failed", error=str(exc))
        print(f"FAILED: {exc}")
        return EXIT_USAGE
    if ns.json:
        data = msgspec.to_builtins(rep)
        for k in ("segments", "markers", "steps", "svg_pages", "marked_pages"):
            data.pop(k, None)
        data["ok"] = rep.ok
        sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
    else:
        print(render(rep))
    if rep.error is not None:
        return EXIT_CORRUPT if rep.error["kind"] == "corrupt" else EXIT_FAULTS
    return EXIT_FAULTS if rep.faults else EXIT_OK
