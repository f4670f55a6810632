"""R8's invalid commands: every refusal the model can predict from its own state, with its error class.

``invalid_commands(model)`` lists ``(call, error class)`` pairs, each a command
the ledger must refuse with exactly that class (tests/core/test_state_machine.py
draws one per ``invalid_command`` rule and checks that nothing changed).
"""

from __future__ import annotations

from kvledger import (
    DuplicatePageError,
    InvalidArgumentError,
    OutOfPagesError,
    PageNotHeldError,
    PageOutOfRangeError,
    RestoringPageError,
    StepOrderError,
    TenantMismatchError,
    UnknownBlockHashError,
    UnknownRequestError,
    UnknownSnapshotError,
)
from kvledger.core.events import PagesReserved

__all__ = ["UNKNOWN_HASH", "invalid_commands"]

UNKNOWN_HASH = b"never published"


def invalid_commands(m, num_pages, request_ids, snapshot_ids, tenants, page_tokens) -> list:
    out: list = []
    _pages(m, num_pages, out)
    _requests(m, num_pages, tenants, page_tokens, out)
    _unknown_requests(m, request_ids, page_tokens, out)
    _snapshots(m, num_pages, snapshot_ids, out)
    _steps(m, out)
    _arguments(m, num_pages, out)
    return out


def _pages(m, num_pages, out):
    for p in range(num_pages):
        k = m.kind(p)
        if k != "free":
            known = sorted(m.requests)
            rid = known[0] if known else 0
            tenant = m.requests[rid].tenant if known else None
            ev = PagesReserved(request=rid, page_ids=(p,), tenant=tenant)
            out.append((lambda L, ev=ev: L.submit(ev), PageNotHeldError))
        elif p in m.restoring:
            out.append((lambda L, p=p: L.submit(PagesReserved(request=99, page_ids=(p,))), RestoringPageError))
        if k != "free":  # named allocation (vLLM's choice of pages): only free ones
            out.append((lambda L, p=p: L.allocate(98, m.open_step, pages=(p,)), PageNotHeldError))
        elif p in m.restoring:
            out.append((lambda L, p=p: L.allocate(98, m.open_step, pages=(p,)), RestoringPageError))
        elif m.open_step > 0:  # a sealed step is refused before anything is reserved
            out.append((lambda L, p=p: L.allocate(98, m.open_step - 1, pages=(p,)), StepOrderError))
        if k in ("reserved", "kv", "cached"):  # a cached page holds KV that may still be shared
            out.append((lambda L, p=p: L.alias_snapshot(0, pages=[p]), PageNotHeldError))
        elif p in m.restoring:
            out.append((lambda L, p=p: L.alias_snapshot(0, pages=[p]), RestoringPageError))
        if p not in m.restoring:
            out.append((lambda L, p=p: L.complete_restore([p], request=0), PageNotHeldError))
        if k != "cached":
            out.append((lambda L, p=p: L.evict(pages=[p]), PageNotHeldError))


def _requests(m, num_pages, tenants, page_tokens, out):
    for rid in sorted(m.requests):
        r = m.requests[rid]
        mine = set(r.reserved)
        for p in range(num_pages):
            if p not in mine:
                out.append((lambda L, rid=rid, p=p: L.commit(rid, m.open_step, pages=[p]), PageNotHeldError))
                out.append((lambda L, rid=rid, p=p: L.return_reservation(rid, [p]), PageNotHeldError))
                out.append((lambda L, rid=rid, p=p: L.start_restore([p], request=rid), PageNotHeldError))
        for p in r.reserved:
            if p in m.restoring:
                out.append((lambda L, rid=rid, p=p: L.commit(rid, m.open_step, pages=[p]), RestoringPageError))
                out.append((lambda L, rid=rid, p=p: L.start_restore([p], request=rid), RestoringPageError))
            elif m.open_step > 0:
                out.append((lambda L, rid=rid, p=p: L.commit(rid, m.open_step - 1, pages=[p]), StepOrderError))
        other = [t for t in tenants if t is not None and t != r.tenant][0]
        out.append((lambda L, rid=rid, t=other: L.reserve(rid, 1, tenant=t), TenantMismatchError))
        out.append((lambda L, rid=rid: L.commit(rid, m.open_step, pages=[]), InvalidArgumentError))
        if m.pages_of:
            h = m.hashes[min(m.hashes)]
            out.append((lambda L, rid=rid, t=other, h=h: L.share(rid, [h], tenant=t), TenantMismatchError))
        for i in range(len(r.kv)):  # the right pages, the wrong number of tokens
            out.append((lambda L, rid=rid, i=i: L.publish(rid, [UNKNOWN_HASH], (1,) * (page_tokens - 1), start=i),
                        InvalidArgumentError))
        end = len(r.kv)  # past the end of the block table
        out.append((lambda L, rid=rid, end=end: L.publish(rid, [UNKNOWN_HASH], (1,) * page_tokens, start=end),
                    InvalidArgumentError))
        # one bytes value where a list of hashes belongs
        out.append((lambda L, rid=rid: L.publish(rid, UNKNOWN_HASH, (1,) * page_tokens), InvalidArgumentError))


def _unknown_requests(m, request_ids, page_tokens, out):
    for rid in request_ids:
        if rid not in m.requests:
            out.append((lambda L, rid=rid: L.cancel(rid), UnknownRequestError))
            out.append((lambda L, rid=rid: L.finish(rid), UnknownRequestError))
            out.append((lambda L, rid=rid: L.commit(rid, m.open_step, pages=[0]), UnknownRequestError))
            out.append((lambda L, rid=rid: L.start_restore([0], request=rid), UnknownRequestError))
            out.append((lambda L, rid=rid: L.publish(rid, [UNKNOWN_HASH], (1,) * page_tokens), UnknownRequestError))
        out.append((lambda L, rid=rid: L.share(rid, [UNKNOWN_HASH]), UnknownBlockHashError))
        out.append((lambda L, rid=rid: L.share(rid, UNKNOWN_HASH), InvalidArgumentError))


def _snapshots(m, num_pages, snapshot_ids, out):
    for sid in snapshot_ids:
        if sid not in m.snapshots:
            out.append((lambda L, sid=sid: L.release_snapshot(sid), UnknownSnapshotError))
            out.append((lambda L, sid=sid: L.start_restore([0], snapshot=sid), UnknownSnapshotError))
            continue
        mine = m.snapshots[sid]
        for p in mine:
            if p not in m.restoring:
                out.append((lambda L, sid=sid, p=p: L.alias_snapshot(sid, pages=[p]), DuplicatePageError))
        for p in range(num_pages):
            if p not in mine:
                out.append((lambda L, sid=sid, p=p: L.start_restore([p], snapshot=sid), PageNotHeldError))


def _steps(m, out):
    """Sealing any but the open step, completing an unsealed one, aborting one not in flight
    (never sealed, aborted, retired by completions, or older than the last MAX_IN_FLIGHT)."""
    out.append((lambda L: L.seal_step(m.open_step + 1), StepOrderError))
    out.append((lambda L: L.complete_step(m.open_step, 0), StepOrderError))
    out.append((lambda L: L.abort_step(m.open_step), StepOrderError))
    if m.open_step > 0:
        out.append((lambda L: L.seal_step(m.open_step - 1), StepOrderError))
    flying = set(m.in_flight_steps())
    for s in range(max(0, m.open_step - 20), m.open_step):
        if s not in flying:
            out.append((lambda L, s=s: L.abort_step(s), StepOrderError))


def _arguments(m, num_pages, out):
    too_many = len(m.reservable()) + len(m.lru) + 1
    out.append((lambda L: L.reserve(98, too_many), OutOfPagesError))
    out.append((lambda L: L.alias_snapshot(0, too_many), OutOfPagesError))
    out.append((lambda L: L.alias_snapshot(0, pages=[num_pages]), PageOutOfRangeError))
    out.append((lambda L: L.alias_snapshot(0, pages=[-1]), PageOutOfRangeError))
    out.append((lambda L: L.alias_snapshot(0, pages=[1, 1]), DuplicatePageError))
    out.append((lambda L: L.evict(pages=[num_pages]), PageOutOfRangeError))
    out.append((lambda L: L.evict(1, pages=[0]), InvalidArgumentError))
    out.append((lambda L: L.lookup(UNKNOWN_HASH), InvalidArgumentError))
    out.append((lambda L: L.lookup([[1]]), InvalidArgumentError))
