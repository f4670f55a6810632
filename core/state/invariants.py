"""SPEC invariants 1-4, checked from scratch over the whole state (check mode, property tests).

Invariant 5 (replay reproduces digest and effects) is a property of the log and
is checked by replay, not here.
"""

from __future__ import annotations

from collections import Counter

from ..errors import InvariantViolation
from .state import ALIAS, FREE, KV, RESERVED, LedgerState

__all__ = ["check_invariants"]


def check_invariants(st: LedgerState) -> None:
    """Raise ``InvariantViolation`` naming the first broken invariant and page. Pure."""
    if st.geometry is None:
        return
    n = st.num_pages
    h, o, an = st.holder, st.owner, st.alias_n
    stale, rs, pend = st.stale, st.restoring, st.pending

    # 1. holders partition the pages, and every index agrees with the arrays.
    where: dict[int, tuple[int, int]] = {}
    for r, rec in st.requests.items():
        for kind, pages in ((RESERVED, rec.reserved), (KV, rec.kv)):
            for p in pages:
                if p in where:
                    raise InvariantViolation(1, f"page {p} listed twice in request tables")
                where[p] = (kind, r)
    alias_counts = Counter(p for pages in st.snapshots.values() for p in pages)
    for s, pages in st.snapshots.items():
        if len(set(pages)) != len(pages):
            raise InvariantViolation(1, f"snapshot {s} lists a page twice")
        if not pages:
            raise InvariantViolation(1, f"snapshot {s} is live with no pages")
    free = 0
    for p in range(n):
        kind = h[p]
        if kind == FREE:
            free += 1
            if o[p] != -1 or an[p] or p in where:
                raise InvariantViolation(1, f"free page {p} still has an owner or alias")
        elif kind == RESERVED or kind == KV:
            if where.get(p) != (kind, o[p]):
                raise InvariantViolation(1, f"page {p} holder {st.holder_of(p)} disagrees with request tables")
            if an[p]:
                raise InvariantViolation(1, f"page {p} is both {st.holder_of(p)} and aliased")
        elif kind == ALIAS:
            if an[p] < 1 or an[p] != alias_counts.get(p, 0) or p in where:
                raise InvariantViolation(1, f"alias page {p} count {an[p]} != snapshots {alias_counts.get(p, 0)}")
        else:
            raise InvariantViolation(1, f"page {p} has unknown holder code {kind}")
        if kind != ALIAS and alias_counts.get(p):
            raise InvariantViolation(1, f"page {p} is in a snapshot but held as {st.holder_of(p)}")
    if free != st.free_count:
        raise InvariantViolation(1, f"free_count {st.free_count} != {free} free pages")
    stack_counts = Counter(st.free_stack)
    for p in range(n):
        c = stack_counts.get(p, 0)
        if c > 1 or c != st.in_stack[p]:
            raise InvariantViolation(1, f"free stack holds page {p} {c} times (in_stack={st.in_stack[p]})")
        if h[p] == FREE and c != 1:
            raise InvariantViolation(1, f"free page {p} is missing from the free stack")

    # 2. no KV page carries a mark. 3. a mark is either set or pending, never both.
    listed = set()
    for step, pages in st.clear_lists.items():
        if step < st.open_step:
            raise InvariantViolation(3, f"clear list of sealed step {step} was never planned")
        listed.update(pages)
    for p in range(n):
        if stale[p] and h[p] == KV:
            raise InvariantViolation(2, f"page {p} is in kv({o[p]}) and still marked")
        if pend[p]:
            if h[p] != KV:
                raise InvariantViolation(3, f"page {p} pending a clear but held as {st.holder_of(p)}")
            if p not in listed:
                raise InvariantViolation(3, f"page {p} pending a clear but in no step's clear list")
            if stale[p]:
                raise InvariantViolation(3, f"page {p} is both marked and pending a clear")

    # 4. clear lists hold valid ids; the last plan's ids are distinct and none restoring.
    for pages in st.clear_lists.values():
        for p in pages:
            if not 0 <= p < n:
                raise InvariantViolation(4, f"clear list holds out-of-range page {p}")
    if st.last_plan is not None:
        cl = st.last_plan.clear_list
        if len(set(cl)) != len(cl):
            raise InvariantViolation(4, f"plan of step {st.last_plan.step} lists a page twice")
    for p in range(n):
        if rs[p]:
            t = st.restore_targets.get(p)
            if t is None:
                raise InvariantViolation(4, f"page {p} restoring with no recorded target")
            if h[p] == KV or pend[p]:
                raise InvariantViolation(4, f"restoring page {p} is {st.holder_of(p)} / pending a clear")
    if len(st.restore_targets) != sum(1 for p in range(n) if rs[p]):
        raise InvariantViolation(4, "restore targets disagree with restoring flags")
