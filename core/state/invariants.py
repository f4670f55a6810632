"""SPEC invariants 1-4, checked from scratch over the whole state (check mode, property tests).

Invariant 5 (replay reproduces digest and effects) is a property of the log and
is checked by replay, not here.
"""

from __future__ import annotations

from collections import Counter

from ..errors import InvariantViolation
from .state import LedgerState
from .table import ALIAS, FREE, HOLDER_ALIAS, HOLDER_FREE, KV, MARK_ALL, MARK_TENANT, RESERVED

__all__ = ["check_invariants"]


def check_invariants(st: LedgerState) -> None:
    """Raise ``InvariantViolation`` naming the first broken invariant and page. Pure."""
    if st.geometry is None:
        return
    h = st.holder_codes()  # derived from the holder list and the request lists
    _holders_partition(st, h)
    _free_stack_agrees(st, h)
    _marks_and_pending(st, h)
    _clear_lists_and_restores(st, h)


def _request_index(st: LedgerState) -> dict[int, tuple[int, int]]:
    """page -> (RESERVED or KV, request) from the request tables; a page twice is a violation."""
    where: dict[int, tuple[int, int]] = {}
    for r, rec in st.requests.items():
        for kind, pages in ((RESERVED, rec.reserved), (KV, rec.kv)):
            for p in pages:
                if p in where:
                    raise InvariantViolation(1, f"page {p} listed twice in request tables")
                where[p] = (kind, r)
    return where


def _holders_partition(st: LedgerState, h: bytearray) -> None:
    """1. The holders partition the pages, and every index agrees with the arrays."""
    o, an = st.holder, st.alias_count
    where = _request_index(st)
    alias_counts = Counter(p for pages in st.snapshots.values() for p in pages)
    for s, pages in st.snapshots.items():
        if len(set(pages)) != len(pages):
            raise InvariantViolation(1, f"snapshot {s} lists a page twice")
        if not pages:
            raise InvariantViolation(1, f"snapshot {s} is live with no pages")
    for p in range(st.num_pages):
        kind = h[p]
        if kind == FREE:
            if o[p] != HOLDER_FREE or an[p] or p in where:
                raise InvariantViolation(1, f"free page {p} still has a holder or alias")
        elif kind in (RESERVED, KV):
            if where.get(p) != (kind, o[p]):
                raise InvariantViolation(1, f"page {p} holder {st.holder_of(p)} disagrees with request tables")
            if an[p]:
                raise InvariantViolation(1, f"page {p} is both {st.holder_of(p)} and aliased")
        elif kind == ALIAS:
            if o[p] != HOLDER_ALIAS or an[p] < 1 or an[p] != alias_counts.get(p, 0) or p in where:
                raise InvariantViolation(1, f"alias page {p} count {an[p]} != snapshots {alias_counts.get(p, 0)}")
        else:
            raise InvariantViolation(1, f"page {p} has unknown holder code {kind}")
        if kind != ALIAS and alias_counts.get(p):
            raise InvariantViolation(1, f"page {p} is in a snapshot but held as {st.holder_of(p)}")


def _free_stack_agrees(st: LedgerState, h: bytearray) -> None:
    """1. The free stack holds exactly the free pages, each once."""
    free = h.count(FREE)
    live = st.live_free_stack()
    if free != len(live) or len(st.free_stack) - st.stale_entries != free:
        raise InvariantViolation(1, f"free stack holds {len(live)} live pages ({len(st.free_stack)} entries, "
                                 f"{st.stale_entries} counted stale), {free} are free")
    if st.free_stack and h[st.free_stack[-1]] != FREE:
        raise InvariantViolation(1, f"the top of the free stack, page {st.free_stack[-1]}, is not free")
    stack_counts = Counter(live)
    for p in range(st.num_pages):
        c = stack_counts.get(p, 0)
        if c != (h[p] == FREE):
            raise InvariantViolation(1, f"free stack holds page {p} {c} times, holder {st.holder_of(p)}")


def _marks_and_pending(st: LedgerState, h: bytearray) -> None:
    """2. No KV page carries a mark. 3. A mark is either set or pending, never both."""
    n, o = st.num_pages, st.holder
    marks, pend = st.marks, st.pending
    for step in st.clear_lists:
        if step < st.open_step:
            raise InvariantViolation(3, f"clear list of sealed step {step} was never planned")
    for p, m in marks.items():
        if not 0 <= p < n or m not in (MARK_ALL, MARK_TENANT):
            raise InvariantViolation(3, f"bad mark {m!r} on page {p}")
        if h[p] == KV:
            raise InvariantViolation(2, f"page {p} is in kv({o[p]}) and still marked")
        if p in pend:
            raise InvariantViolation(3, f"page {p} is both marked and pending a clear")
        if (m == MARK_TENANT) != (p in st.residue):
            raise InvariantViolation(3, f"page {p} mark {m} disagrees with its residue tenant")
    if len(st.residue) != sum(1 for m in marks.values() if m == MARK_TENANT):
        raise InvariantViolation(3, "residue tenants recorded for unmarked pages")
    for p, step in pend.items():
        if h[p] != KV:
            raise InvariantViolation(3, f"page {p} pending a clear but held as {st.holder_of(p)}")
        if p not in st.clear_lists.get(step, ()):
            raise InvariantViolation(3, f"page {p} pending a clear in step {step} but not in its clear list")


def _clear_lists_and_restores(st: LedgerState, h: bytearray) -> None:
    """4. Clear lists hold valid ids; the last plan's ids are distinct and none restoring."""
    n = st.num_pages
    for pages in st.clear_lists.values():
        for p in pages:
            if not 0 <= p < n:
                raise InvariantViolation(4, f"clear list holds out-of-range page {p}")
    if st.last_plan is not None:
        cl = st.last_plan.clear_list
        if len(set(cl)) != len(cl):
            raise InvariantViolation(4, f"plan of step {st.last_plan.step} lists a page twice")
    for p in st.restore_targets:
        if not 0 <= p < n:
            raise InvariantViolation(4, f"restoring page {p} out of range")
        if h[p] == KV or p in st.pending:
            raise InvariantViolation(4, f"restoring page {p} is {st.holder_of(p)} / pending a clear")
