"""A state projected onto one page: what that page's transitions read (``kvledger audit --page``).

``project_state(st, p)`` builds, from ``st``, a state holding p's entries of the page
table, its flags and hash; the requests holding p (reserved or kv, sharers included)
and the snapshots aliasing it, their lists cut to [p]; plans in flight and clear lists
cut to p; every rank's completions. The audit's page fold (``kvledger/tools/audit/
pages.py``) runs the table's appliers on it over the events that touch p; its
docstring says why that is exact. Here because it builds a state: only ``core/state``
writes one.
"""

from __future__ import annotations

from collections import OrderedDict

from ..events.events import StepPlan
from .state import LedgerState
from .table import HOLDER_FREE, RequestRecord

__all__ = ["project_state"]


def project_state(st: LedgerState, p: int) -> LedgerState:
    """A state holding only what page ``p``'s transitions read (see the module docstring)."""
    ps = LedgerState(st.transitions)
    ps.geometry, ps.policy, ps.num_pages = st.geometry, st.policy, st.num_pages
    ps.seq, ps.open_step = st.seq, st.open_step
    n = st.num_pages
    ps.holder = [HOLDER_FREE] * n
    ps.alias_count = [0] * n
    ps.holder[p], ps.alias_count[p] = st.holder[p], st.alias_count[p]
    for name in ("marks", "residue", "restore_targets", "pending", "restored_since", "overwritten"):
        table = getattr(st, name)
        setattr(ps, name, {p: table[p]} if p in table else {})
    ps.free_stack = [p] if st.holder[p] == HOLDER_FREE else []
    for r in dict.fromkeys([*st.sharers.get(p, ()), *([st.holder[p]] if st.holder[p] >= 0 else [])]):
        rec = st.requests[r]
        kv = [(q, s) for q, s in zip(rec.kv, rec.kv_steps, strict=True) if q == p]
        ps.requests[r] = RequestRecord(r, rec.tenant, [q for q in rec.reserved if q == p], [q for q, _ in kv],
                                       [s for _, s in kv], {p} if rec.restored and p in rec.restored else None)
    ps.snapshots = {s: [p] for s in st.snapshot_ids_of(p)} if st.alias_count[p] else {}
    ps.clear_lists = {s: [q for q in pages if q == p] for s, pages in st.clear_lists.items() if p in pages}
    ps.in_flight = [StepPlan(step=plan.step, clear_list=(p,) if p in plan.clear_list else ())
                    for plan in st.in_flight]
    ps.completed = dict(st.completed)
    if p in st.page_hash:
        h = st.page_hash[p]
        ps.page_hash, ps.hash_page = {p: h}, {h: p}
        if p in st.hash_tenant:
            ps.hash_tenant = {p: st.hash_tenant[p]}
    ps.sharers = {p: st.sharers[p].copy()} if p in st.sharers else {}  # (an ordered set: core.state.table)
    ps.cached = OrderedDict({p: None}) if p in st.cached else OrderedDict()
    ps.aborted_steps = set(st.aborted_steps)
    return ps
