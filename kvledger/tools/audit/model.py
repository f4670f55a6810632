"""The audit's own model of page contents (``--check``): whose bytes a request reads.

It watches the fold for holders but keeps its own account of what every page
holds (ZERO, ROW bytes of a snapshot, KV bytes of a request incarnation and its
tenant), when a request first reads a page (when the step it was committed for
is sealed, after that step's clears; an abort undoes both) and which bytes are
foreign to it under the policy; ``kvledger.tools.audit`` states the rules and
the faults they find.

``ContentModel.pre`` / ``post`` run around each folded event (``check_pages``
after it); ``ending.py`` has the end-of-log pass (faults of a cleanly closed
log, and what is left open).
"""

from __future__ import annotations

from kvledger.core.events.events import (
    RequestCancelled,
    RequestFinished,
    StepAborted,
    StepSealed,
)
from kvledger.core.state import CACHED, FREE, KV, MARK_TENANT, LedgerState
from kvledger.core.state.transitions import handlers

from .report import Faults

__all__ = ["ContentModel", "holds_kv", "is_free", "let_go"]

# page contents
ZERO, CLEAN, ROW, KVB, STALE = 0, 1, 2, 3, 4
_CONTENT = ("zero", "clean", "row", "kv", "stale")


def holds_kv(st: LedgerState, p: int, r: int) -> bool:
    """Is page ``p`` one of request ``r``'s KV pages (its block table)?"""
    rec = st.requests.get(r)
    return rec is not None and p in rec.kv


def is_free(st: LedgerState, p: int) -> bool:
    """Is page ``p`` free? False also when the fold's own tables disagree about its holder."""
    try:
        return st.holder_code(p) == FREE
    except (KeyError, IndexError):
        return False


def let_go(st: LedgerState, p: int, r: int) -> bool:
    """Did request ``r`` (just ended) let go of page ``p``? Free, cached for reuse, or still
    shared by the other requests of its kv(R), never held by ``r``; False also when the
    fold's own tables disagree about its holder."""
    try:
        code = st.holder_code(p)
    except (KeyError, IndexError):
        return False
    if code in (FREE, CACHED):
        return True
    return code == KV and r not in st.holders_of(p)


class ContentModel:
    """What every page holds (see the module docstring), and the faults that follow from it."""

    def __init__(self, st: LedgerState, faults: Faults) -> None:
        n = st.num_pages
        self.st = st
        self.faults = faults
        self.policy = st.policy
        self.content = bytearray(n)
        self.dirty = bytearray(n)  # held (kv, alias) or written since last zeroed
        self.c_owner: dict[int, int] = {}  # page -> request incarnation (KVB) / snapshot (ROW)
        self.c_tenant: dict[int, object] = {}
        self.zeroed_at: dict[int, int] = {}  # page -> seq of the plan that zeroed it
        self.inc_of: dict[int, int] = {}  # live request -> incarnation
        self.inc_req: dict[int, int] = {}
        self.inc_tenant: dict[int, object] = {}
        self.next_inc = 0
        self.reads: dict[int, list] = {}  # step -> [(page, incarnation, commit seq, how the step reads it)]
        self.in_flight: list[tuple] = []  # (step, clears saved, reads done) of the seals an abort may undo
        self.shadow: dict[int, set] = {}  # incarnation -> pages its events gave it
        self.ended: set[int] = set()
        self.released: set[int] = set()
        self.restore_seq: dict[int, int] = {}  # page -> seq its restore started
        self.sealed: list[int] = []  # sealed steps (only if ranks report)
        self.aborted: set[int] = set()  # aborted steps, named or in a cascade
        self.done: dict[int, set] = {}  # rank -> completed steps
        self.first_done: dict[int, int] = {}
        self._seed_from_state()

    # ------------------------------------------------------------------ seeding

    def _new_inc(self, r: int, tenant) -> int:
        inc = self.next_inc
        self.next_inc += 1
        self.inc_of[r] = inc
        self.inc_req[inc] = r
        self.inc_tenant[inc] = tenant
        return inc

    def _put_kv(self, p: int, inc: int, tenant) -> None:
        self.content[p] = KVB
        self.c_owner[p] = inc
        self.c_tenant[p] = tenant

    def _put_row(self, p: int, snapshot: int) -> None:
        self.content[p] = ROW
        self.c_owner[p] = snapshot

    def _seed_from_state(self) -> None:
        """Contents as far as a state tells (a fresh cache, or a checkpoint)."""
        st, content = self.st, self.content
        for r, rec in sorted(st.requests.items()):
            inc = self._new_inc(r, rec.tenant)
            self.shadow[inc] = set(rec.reserved) | set(rec.kv)
            for p in rec.kv:
                if st.holder[p] == r:  # a shared page holds the KV of the first of its holders
                    self._put_kv(p, inc, rec.tenant)
            for p in rec.restored or ():
                self._put_kv(p, inc, rec.tenant)
        for p in st.cached:  # KV of a request that ended, kept for reuse
            self._put_kv(p, -1, st.hash_tenant.get(p))
        for s, pages in st.snapshots.items():
            for p in pages:
                self._put_row(p, s)
        for p, m in st.marks.items():
            if m == MARK_TENANT:
                self._put_kv(p, -1, st.residue.get(p))
            else:
                content[p] = STALE
        if st.seq > 1:  # a checkpoint: pages with no history are not known to be zero
            for p in range(len(content)):
                if content[p] == ZERO:
                    content[p] = CLEAN
            self.dirty[:] = b"\x01" * len(content)
        self._seed_reads()
        if st.completed:
            for rank in st.completed:
                self.first_done[rank] = st.completed[rank] + 1
                self.done[rank] = set()

    def _seed_reads(self) -> None:
        """Reads still to come (listed pages of unsealed steps), and the seals in flight, which an abort may undo."""
        st = self.st
        holder = {p: r for r, rec in st.requests.items() for p in (*rec.reserved, *rec.kv)}
        for step, pages in st.clear_lists.items():
            lst = self.reads.setdefault(step, [])
            for p in pages:
                if p in st.pending and p in holder:
                    lst.append((p, self.inc_of.get(holder[p], -1), None, "tail"))
                    self.content[p] = STALE  # listed: it was marked when its request committed it
        for plan in st.in_flight:  # seals an abort may still undo
            saved, done = [], []
            for p in plan.clear_list:
                saved.append((p, (STALE, None, None, None, 1), self._content_of(p)))
                r = holder.get(p)
                if r is not None and holds_kv(st, p, r):
                    done.append((p, self.inc_of.get(r, -1), None, "tail"))
            self.in_flight.append((plan.step, saved, done))

    # ------------------------------------------------------------------ describing contents

    def describe(self, p: int) -> str:
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

    def _foreign(self, p: int, inc: int, whole: bool = False) -> bool:
        """Would reading page ``p`` show incarnation ``inc`` bytes that are not its own KV? Under
        the policy, for a read of its KV and a masked tail; for a read of the ``whole`` page
        before it is written (a recurrent state), any other incarnation's bytes."""
        k = self.content[p]
        if k in (ROW, STALE):
            return True
        if k == KVB and whole:
            return self.c_owner.get(p) != inc
        if k != KVB or self.policy == "released_aliases":
            return False
        if self.policy == "cross_tenant":
            return self.c_tenant.get(p) != self.inc_tenant.get(inc)
        return self.c_owner.get(p) != inc

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

    # ------------------------------------------------------------------ around each folded event

    def pre(self, ev, t):
        """What ``post`` needs from before the fold: a request's incarnation; for an abort the open
        step and the steps in flight it takes with it; for a seal, the shared and hashed pages its
        plan zeroes (a fault)."""
        st = self.st
        if t is RequestFinished or t is RequestCancelled:
            return self.inc_of.get(ev.request)
        if t is StepAborted:
            return st.open_step, [plan.step for plan in st.in_flight if plan.step >= ev.step]
        if t is StepSealed and (st.sharers or st.page_hash):
            return [p for p in ev.clear_list if p in st.sharers or p in st.page_hash]
        return None

    def post(self, seq: int, ev, t, pre) -> None:
        """Follow a folded event into the contents (its handler: ``_on_<event>``, one per row of
        the transition table, checked when the module is imported); seals, aborts and
        completions have their own."""
        _POST[t](self, seq, ev, pre)

    def _on_pages_reserved(self, seq: int, ev, pre) -> None:
        inc = self.inc_of.get(ev.request)
        if inc is None:
            inc = self._new_inc(ev.request, ev.tenant)
            self.shadow[inc] = set()
        self.shadow[inc].update(ev.page_ids)

    def _on_reservation_returned(self, seq: int, ev, pre) -> None:
        inc = self.inc_of.get(ev.request)
        if inc is not None:
            self.shadow[inc].difference_update(ev.page_ids)

    def _on_pages_committed(self, seq: int, ev, pre) -> None:
        lst = self.reads.setdefault(ev.step, [])
        inc, dirty, reads = self.inc_of[ev.request], self.dirty, ev.reads
        for p in ev.page_ids:
            lst.append((p, inc, seq, reads))
            dirty[p] = 1

    def _on_pages_released(self, seq: int, ev, pre) -> None:
        self._pages_released(seq, ev)

    def _on_pages_unwritten(self, seq: int, ev, pre) -> None:
        """(A record: the step ran without the request; the bytes are what they were.)"""

    def _on_request_labelled(self, seq: int, ev, pre) -> None:
        """(A record: the engine's name for a request.)"""

    def _on_request_finished(self, seq: int, ev, pre) -> None:
        self._request_gone(seq, ev.request, pre)

    _on_request_cancelled = _on_request_finished

    def _on_snapshot_aliased(self, seq: int, ev, pre) -> None:
        for p in ev.page_ids:
            self._put_row(p, ev.snapshot)
            self.dirty[p] = 1

    def _on_snapshot_released(self, seq: int, ev, pre) -> None:
        self.released.add(ev.snapshot)

    def _on_restore_started(self, seq: int, ev, pre) -> None:
        self._restore_started(seq, ev)

    def _on_restore_completed(self, seq: int, ev, pre) -> None:
        for p in ev.page_ids:
            self.restore_seq.pop(p, None)

    def _on_step_sealed(self, seq: int, ev, pre) -> None:
        self._seal(seq, ev, pre)

    def _on_step_aborted(self, seq: int, ev, pre) -> None:
        self._abort(ev, *pre)

    def _on_step_completed(self, seq: int, ev, pre) -> None:
        self._completed(ev)

    def _on_pages_shared(self, seq: int, ev, pre) -> None:
        inc = self.inc_of.get(ev.request)
        if inc is None:
            inc = self._new_inc(ev.request, self.st.requests[ev.request].tenant)
            self.shadow[inc] = set()
        self.shadow[inc].update(ev.page_ids)

    def _on_sanitizer_violation(self, seq: int, ev, pre) -> None:
        self._violation(seq, ev)

    def _on_cache_configured(self, seq: int, ev, pre) -> None:
        """(Every page starts zero: the model's initial state.)"""

    def _on_pages_published(self, seq: int, ev, pre) -> None:
        """(A hash names the bytes a page holds; it changes none.)"""

    def _on_pages_evicted(self, seq: int, ev, pre) -> None:
        """(Evicted pages go free holding what they held: no byte changes.)"""

    def check_pages(self, seq: int, pages) -> None:
        """After an event: none of the pages it touched may be cached and marked (a cached page
        is shared again without a clear: a mark on it would never be honoured)."""
        st = self.st
        if not st.cached:
            return
        cached, marks = st.cached, st.marks
        bad = [p for p in pages if p in cached and p in marks]
        if bad:
            self.faults.add("marked_cached_page", seq, st.open_step, f"pages {bad[:16]} are cached for reuse "
                            f"and marked: a request sharing them would read stale bytes unzeroed", page_ids=bad[:64])

    def _violation(self, seq: int, ev) -> None:
        """A recorded sanitizer violation: a fault naming rank, plane and step, with the page's lifecycle
        as the fold and the model see it (holder, mark, the step's plan, the last clear, the policy)."""
        p, st = ev.page_id, self.st
        found = "not zeroed" if ev.kind == "not_zero" else "still holding poison"
        plans = [plan for plan in st.in_flight if plan.step == ev.step]
        listed = ("listed it" if p in plans[0].clear_list else "did not list it") if plans else "is not in flight"
        when = self.zeroed_at.get(p)
        zeroed = f"last zeroed by the plan at seq {when}" if when is not None else "not zeroed since the audit began"
        self.faults.add("sanitizer_violation", seq, ev.step, f"the sanitizer on rank {ev.rank} plane {ev.plane} "
                        f"found page {p} {found} before step {ev.step}'s graph; page {p} is {st.holder_of(p)}, "
                        f"{'marked' if p in st.marks else 'not marked'}, step {ev.step}'s plan {listed}, {zeroed} "
                        f"(policy {self.policy}); the audit's model says it holds {self.describe(p)}; "
                        f"--page {p} shows its lifecycle", page_ids=[p])

    def _request_gone(self, seq: int, r: int, inc: int | None) -> None:
        """A request finished or was cancelled: every page its own events gave it must have left it
        (free, cached, or still shared by the others)."""
        st = self.st
        self.ended.add(r)
        self.inc_of.pop(r, None)
        held = self.shadow.pop(inc, set()) if inc is not None else set()
        leaked = sorted(p for p in held if not let_go(st, p, r))
        if leaked:
            try:
                held_as = st.holder_of(leaked[0])
            except (KeyError, IndexError):  # the fold's own tables disagree about the holder
                held_as = "by a holder the fold's own tables disagree on"
            self.faults.add("leak", seq, st.open_step, f"request {r} ended but pages {leaked[:16]} are still "
                            f"held ({held_as})", page_ids=leaked[:64], request=r)

    def _pages_released(self, seq: int, ev) -> None:
        """A live request let go of some pages: each must have left it (free, cached, or still held
        by the others); their bytes stay behind as its KV."""
        st = self.st
        inc = self.inc_of.get(ev.request)
        if inc is not None:
            self.shadow.get(inc, set()).difference_update(ev.page_ids)
        kept = [p for p in ev.page_ids if not let_go(st, p, ev.request)]
        if kept:
            self.faults.add("leak", seq, st.open_step, f"request {ev.request} released pages {kept[:16]} but still "
                            f"holds them ({st.holder_of(kept[0])})", page_ids=kept[:64], request=ev.request)

    def _restore_started(self, seq: int, ev) -> None:
        for p in ev.page_ids:
            self.restore_seq[p] = seq
            self.dirty[p] = 1
        if ev.into == "snapshot":
            for p in ev.page_ids:
                self._put_row(p, ev.target)
        else:
            inc = self.inc_of[ev.target]
            tenant = self.inc_tenant[inc]
            for p in ev.page_ids:
                self._put_kv(p, inc, tenant)

    def _seal(self, seq: int, ev, shared: list | None) -> None:
        """The plan zeroes its pages, then every request reads the pages committed for this step.
        ``shared``: pages of the plan that were shared or published (zeroing them wipes KV that other
        requests read or will share): a fault."""
        if shared:
            self.faults.add("shared_page_listed", seq, ev.step, f"step {ev.step}'s plan zeroes pages {shared[:16]}, "
                            "which hold published or shared KV other requests read", page_ids=shared[:64])
        saved = self._zero(seq, ev)
        done = []
        st, content, dirty = self.st, self.content, self.dirty
        for item in self.reads.pop(ev.step, ()):
            p, inc, cseq, reads = item
            r = self.inc_req.get(inc)
            if r is None or self.inc_of.get(r) != inc or not holds_kv(st, p, r):
                continue  # the request let go of the page before its step ran: no read
            if reads != "none" and self._foreign(p, inc, reads == "whole"):  # ("none": written whole first)
                self.faults.add("unzeroed_read", seq, ev.step,
                                f"request {r} reads page {p} in step {ev.step} (committed at seq {cseq}) while it "
                                f"holds {self.describe(p)}; step {ev.step}'s plan did not zero it",
                                page_ids=[p], request=r)
            before = self._content_of(p)
            content[p] = KVB
            self.c_owner[p] = inc
            self.c_tenant[p] = self.inc_tenant.get(inc)
            dirty[p] = 1
            saved.append((p, before, self._content_of(p)))
            done.append(item)
        self.in_flight.append((ev.step, saved, done))
        self._prune()
        self.sealed.append(ev.step)

    def _zero(self, seq: int, ev) -> list:
        """The plan's clears; returns ``(page, content before, after)`` for an abort to undo."""
        content, dirty = self.content, self.dirty
        saved = []
        released_only = self.policy == "released_aliases"
        for p in ev.clear_list:
            k = content[p]
            if released_only and k not in (ROW, STALE):
                self.faults.add("needless_clear", seq, ev.step, f"step {ev.step}'s plan zeroes page {p}, which "
                                f"holds {self.describe(p)}, not row bytes", page_ids=[p])
            elif not dirty[p]:
                when = self.zeroed_at.get(p)
                since = f"the plan at seq {when} zeroed it" if when is not None else "the cache was configured"
                self.faults.add("redundant_clear", seq, ev.step, f"step {ev.step}'s plan zeroes page {p} again: "
                                f"nothing held or wrote it since {since}", page_ids=[p])
            before = self._content_of(p)
            content[p] = ZERO
            dirty[p] = 0
            self.zeroed_at[p] = seq
            saved.append((p, before, self._content_of(p)))
        return saved

    def _abort(self, ev, next_step: int, taken: list[int]) -> None:
        """Nothing of the aborted steps ran (``taken``: the named one and every later one in flight):
        undo their clears and reads, the last seal first (where nothing touched the page since); the
        reads move to the open step, the oldest plan's first."""
        self.aborted.update(taken)
        gone = set(taken)
        undone = [entry for entry in self.in_flight if entry[0] in gone]
        self.in_flight = [entry for entry in self.in_flight if entry[0] not in gone]
        moved: list = []
        for _, saved, done in reversed(undone):
            for p, before, after in reversed(saved):
                if self._content_of(p) == after:
                    self._set_content(p, before)
            moved[:0] = done
        if moved:
            self.reads.setdefault(next_step, [])[:0] = moved

    def _prune(self) -> None:
        """Keep the seals of the plans the fold still holds in flight (an abort can reach only those)."""
        live = {plan.step for plan in self.st.in_flight}
        if len(live) != len(self.in_flight):
            self.in_flight = [entry for entry in self.in_flight if entry[0] in live]

    def _completed(self, ev) -> None:
        rank = ev.rank
        if rank not in self.done:
            self.done[rank] = set()
            self.first_done[rank] = ev.step
        self.done[rank].add(ev.step)
        self._prune()


_POST = handlers(ContentModel, "_on_")  # one handler per event type of the table (TypeError here otherwise)
