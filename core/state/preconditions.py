"""Preconditions: one function per event, ``(state, event) -> None``, raising the specific error.

Each function is the whole of its event's precondition (SPEC's table, column
"precondition"): the command side decides events and calls these, replay calls
these, nothing re-checks them elsewhere. Pure; nothing changes when one raises.

Events the ledger decided from state itself (the allocator's pages, a request's
first reserved pages) pass a cheap proof first — "these ids are exactly the top
of the free stack" or "exactly the head of r's reservation", which implies they
are valid, distinct and held as required — and fall back to the full per-page
checks only when it fails, so the error raised is the same either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import checks
from ..errors import (
    ConfigurationError,
    CrossTenantShareError,
    DuplicatePageError,
    InvalidArgumentError,
    PageNotHeldError,
    ReplayMismatchError,
    RestoringPageError,
    StepOrderError,
    TenantMismatchError,
    UnknownRequestError,
    UnknownSnapshotError,
)
from ..events.events import (
    CLEAR_POLICIES,
    CacheConfigured,
    PagesCommitted,
    PagesEvicted,
    PagesPublished,
    PagesReleased,
    PagesReserved,
    PagesShared,
    PagesUnwritten,
    RequestLabelled,
    SanitizerViolation,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepSealed,
)
from .table import HOLDER_CACHED, HOLDER_FREE, MAX_IN_FLIGHT, RequestRecord

if TYPE_CHECKING:
    from .state import LedgerState

__all__ = [
    "same_tenant",
    "commit_reads_allowed",
    "cache_configured",
    "pages_committed",
    "pages_evicted",
    "pages_published",
    "pages_released",
    "pages_reserved",
    "pages_shared",
    "pages_unwritten",
    "request_known",
    "request_labelled",
    "sanitizer_violation",
    "reservation_returned",
    "restore_completed",
    "restore_started",
    "snapshot_aliased",
    "snapshot_released",
    "step_aborted",
    "step_completed",
    "step_sealed",
]


# ---------------------------------------------------------------------- shared pieces


def _pages(st: LedgerState, page_ids) -> None:
    checks.page_ids(page_ids, st.num_pages, allow_empty=False)


def _not_restoring(st: LedgerState, page_ids, what: str) -> None:
    targets = st.restore_targets
    if targets and not targets.keys().isdisjoint(page_ids):
        raise RestoringPageError([p for p in page_ids if p in targets], what)


def _request(st: LedgerState, request: int) -> RequestRecord:
    rec = st.requests.get(request)
    if rec is None:
        raise UnknownRequestError(request)
    return rec


def same_tenant(st: LedgerState, request: int, tenant: str | None) -> None:
    """A known request keeps its tenant (``TenantMismatchError``). The command side calls
    this before it allocates, so a mismatch is reported before a shortage."""
    rec = st.requests.get(request)
    if rec is not None and rec.tenant != tenant:
        raise TenantMismatchError(request, rec.tenant, tenant)


def _head_of(mine: list[int], page_ids) -> bool:
    """``page_ids`` is exactly the head of ``mine`` (then they are valid and distinct)."""
    k = len(page_ids)
    return 0 < k <= len(mine) and tuple(mine[:k]) == page_ids


def _top_of_stack(st: LedgerState, page_ids) -> bool:
    """``page_ids`` is exactly the top of a free stack without stale entries, top first (then
    they are valid, distinct, free and reservable: a restoring free page is parked, never
    in the stack)."""
    stack, k = st.free_stack, len(page_ids)
    return 0 < k <= len(stack) and not st.stale_entries and tuple(stack[: -k - 1 : -1]) == page_ids


def _held(st: LedgerState, request: int, page_ids, kind: str) -> None:
    """Every page is in ``request``'s ``reserved`` (kind "reserved") or ``kv`` list."""
    rec = _request(st, request)
    mine = rec.reserved if kind == "reserved" else rec.kv
    if _head_of(mine, page_ids):
        return
    have = set(mine)
    for p in page_ids:
        if p not in have:
            raise PageNotHeldError(p, f"{kind}({request})", st.holder_of(p))


# ---------------------------------------------------------------------- one per event


def cache_configured(st: LedgerState, e: CacheConfigured) -> None:
    if st.geometry is not None:
        raise ConfigurationError("CacheConfigured may only be the first event")
    checks.geometry(e.geometry)
    if e.policy not in CLEAR_POLICIES:
        raise ConfigurationError(f"unknown clear policy {e.policy!r}; one of {CLEAR_POLICIES}")


def pages_reserved(st: LedgerState, e: PagesReserved) -> None:
    """Each page free and not restoring; a known request keeps its tenant."""
    pages = e.page_ids
    # the allocator's choice, the top of the free stack, needs no per-page check
    top = _top_of_stack(st, pages)
    if not top:
        _pages(st, pages)
    rec = st.requests.get(e.request)
    if rec is not None and rec.tenant != e.tenant:
        same_tenant(st, e.request, e.tenant)
    if top:
        return
    holder = st.holder
    taken = [p for p in pages if holder[p] != HOLDER_FREE]
    if taken:
        raise PageNotHeldError(taken[0], "free", st.holder_of(taken[0]))
    _not_restoring(st, pages, "cannot reserve")


def reservation_returned(st: LedgerState, e: ReservationReturned) -> None:
    """Each page reserved(r)."""
    rec = st.requests.get(e.request)
    if rec is None or not _head_of(rec.reserved, e.page_ids):
        _pages(st, e.page_ids)
    _held(st, e.request, e.page_ids, "reserved")


def commit_reads_allowed(st: LedgerState, reads: str) -> None:
    """A commit that reads the whole page needs a policy that marks a request's bytes."""
    if reads == "whole" and st.policy == "released_aliases":
        raise ConfigurationError(f"a commit that reads the whole page (reads={reads!r}) needs a clear policy "
                                 "that marks a request's bytes (cross_tenant or all_reused), not released_aliases")


def pages_committed(st: LedgerState, e: PagesCommitted) -> None:
    """Each page reserved(r), not restoring; the step not older than the open step; a commit that
    reads the whole page needs a policy that marks a request's bytes (``released_aliases`` does
    not: another request's state would be read unzeroed)."""
    pages = e.page_ids
    if e.reads == "whole":
        commit_reads_allowed(st, e.reads)
    rec = st.requests.get(e.request)
    # the usual commit, the head of r's reservation, needs no per-page check
    head = rec is not None and _head_of(rec.reserved, pages)
    if not head:
        _pages(st, pages)
    if e.step < st.open_step:
        raise StepOrderError(e.step, st.open_step, "commit into a sealed step")
    if not head:
        _held(st, e.request, pages, "reserved")
    if st.restore_targets:
        _not_restoring(st, pages, "cannot commit")


def request_known(st: LedgerState, e) -> None:
    """RequestCancelled / RequestFinished: r known."""
    if e.request not in st.requests:
        raise UnknownRequestError(e.request)


def pages_released(st: LedgerState, e: PagesReleased) -> None:
    """r known; each page one of r's KV pages (valid, distinct, in its block table)."""
    rec = st.requests.get(e.request)
    if rec is None or not _head_of(rec.kv, e.page_ids):
        _pages(st, e.page_ids)
    _held(st, e.request, e.page_ids, "kv")


def request_labelled(st: LedgerState, e: RequestLabelled) -> None:
    """None beyond the event's types (a record; it may name a request before its first event,
    so that an audit following the label sees all of them)."""


def pages_unwritten(st: LedgerState, e: PagesUnwritten) -> None:
    """The step was sealed (it ran, without the request); the pages are valid and distinct, and the
    request (it ended, or lives on without them) holds none of them."""
    if not 0 <= e.step < st.open_step:
        raise StepOrderError(e.step, st.open_step, "pages unwritten by a step that was never sealed")
    _pages(st, e.page_ids)
    rec = st.requests.get(e.request)
    if rec is not None and not set(rec.kv).isdisjoint(e.page_ids):
        held = [p for p in e.page_ids if p in set(rec.kv)]
        raise InvalidArgumentError(f"request {e.request} still holds pages {held[:8]}: a step that ran without it "
                                   "wrote none of its pages, and those it keeps would be read as written")


def snapshot_aliased(st: LedgerState, e: SnapshotAliased) -> None:
    """Each page free or alias(S) with s not in S, not restoring."""
    pages = e.page_ids
    _pages(st, pages)
    holder = st.holder
    for p in pages:
        if holder[p] >= 0 or holder[p] == HOLDER_CACHED:  # (a cached page holds KV that may still be shared)
            raise PageNotHeldError(p, "free or alias", st.holder_of(p))
    _not_restoring(st, pages, "cannot alias")
    mine = st.snapshots.get(e.snapshot)
    if mine is not None:
        again = set(mine).intersection(pages)
        if again:
            raise DuplicatePageError(sorted(again))


def snapshot_released(st: LedgerState, e: SnapshotReleased) -> None:
    """s live."""
    if e.snapshot not in st.snapshots:
        raise UnknownSnapshotError(e.snapshot, "release of a snapshot that is not live")


def restore_started(st: LedgerState, e: RestoreStarted) -> None:
    """Into r: each page reserved(r); into s: each page in alias(S ∋ s). None restoring."""
    pages = e.page_ids
    _pages(st, pages)
    if e.into == "request":
        _held(st, e.target, pages, "reserved")
    elif e.into == "snapshot":
        mine = st.snapshots.get(e.target)
        if mine is None:
            raise UnknownSnapshotError(e.target, "restore into a snapshot that is not live")
        mine_set = set(mine)
        for p in pages:
            if p not in mine_set:
                raise PageNotHeldError(p, f"aliased by snapshot {e.target}", st.holder_of(p))
    else:
        raise InvalidArgumentError(f"restore target must be 'request' or 'snapshot', not {e.into!r}")
    _not_restoring(st, pages, "a restore is already writing them")


def restore_completed(st: LedgerState, e: RestoreCompleted) -> None:
    """Each page restoring, into the same target."""
    pages = e.page_ids
    _pages(st, pages)
    want = (e.into, e.target)
    targets = st.restore_targets
    for p in pages:
        got = targets.get(p)
        if got != want:
            detail = "no restore in flight" if got is None else f"restore in flight into {got[0]} {got[1]}"
            raise PageNotHeldError(p, f"restoring into {e.into} {e.target}", detail)


def step_sealed(st: LedgerState, e: StepSealed) -> None:
    """The step is open, and its recorded clear list is the one the fold derives."""
    if e.step != st.open_step:
        raise StepOrderError(e.step, st.open_step, "only the open step can be sealed")
    if not e.clear_list and e.step not in st.clear_lists:
        return  # nothing listed, nothing recorded
    derived = st.derive_clear_list(e.step)
    if tuple(e.clear_list) != derived:
        raise ReplayMismatchError(
            st.seq,
            f"step {e.step} recorded clear list {list(e.clear_list)[:16]} but the fold derives {list(derived)[:16]}",
        )


def step_completed(st: LedgerState, e: StepCompleted) -> None:
    """The step was sealed."""
    if not 0 <= e.step < st.open_step:
        raise StepOrderError(e.step, st.open_step, "completion of a step that was never sealed")
    if e.rank < 0:
        raise InvalidArgumentError(f"rank must be >= 0, got {e.rank}")


def step_aborted(st: LedgerState, e: StepAborted) -> None:
    """The step is in flight: sealed, not aborted, not completed on every rank, among the
    last MAX_IN_FLIGHT sealed."""
    if not any(plan.step == e.step for plan in st.in_flight):
        raise StepOrderError(e.step, st.open_step, "only a step in flight (sealed, not aborted, not yet completed "
                             f"on every rank, among the last {MAX_IN_FLIGHT} sealed) can be aborted")


# ---------------------------------------------------------------------- prefix caching


def pages_published(st: LedgerState, e: PagesPublished) -> None:
    """Each page kv(r) written by r, full, committed in a step that completed (and was not
    aborted); not hashed yet; each hash new."""
    rec = _request(st, e.request)
    pages = e.page_ids
    k = len(pages)
    if len(e.hashes) != k:
        raise InvalidArgumentError(f"{k} pages need {k} hashes, got {len(e.hashes)}")
    want = k * st.geometry.page_tokens  # type: ignore[union-attr]
    if len(e.token_ids) != want:
        raise InvalidArgumentError(f"{k} full pages hold {want} tokens, got {len(e.token_ids)}")
    if len(set(e.hashes)) != k:
        raise InvalidArgumentError(f"block hashes repeat within one publish: {list(e.hashes)[:8]}")
    # the usual publish: a run of the block table (valid, distinct ids); its commit steps checked as a slice
    try:
        i0 = rec.kv.index(pages[0]) if pages else -1
    except ValueError:
        i0 = -1
    if i0 >= 0 and tuple(rec.kv[i0 : i0 + k]) == pages:
        steps = rec.kv_steps[i0 : i0 + k]
        if (min(steps) >= 0 and max(steps) <= st.completed_step and st.aborted_steps.isdisjoint(steps)
                and st.page_hash.keys().isdisjoint(pages) and st.hash_page.keys().isdisjoint(e.hashes)):
            return
    _published_page_by_page(st, rec, e)


def _published_page_by_page(st: LedgerState, rec: RequestRecord, e: PagesPublished) -> None:
    """The per-page precondition of PagesPublished: raises naming the first page that fails it."""
    _pages(st, e.page_ids)
    where = {p: i for i, p in enumerate(rec.kv)}
    done, aborted = st.completed_step, st.aborted_steps
    for p, h in zip(e.page_ids, e.hashes, strict=True):
        i = where.get(p)
        if i is None:
            raise PageNotHeldError(p, f"kv({e.request})", st.holder_of(p))
        step = rec.kv_steps[i]
        if step < 0:
            detail = "another request wrote it" if step == -1 else "its commit step is unknown (an old checkpoint)"
            raise PageNotHeldError(p, f"written by request {e.request}", detail)
        if step in aborted:
            raise StepOrderError(step, st.open_step, f"page {p} was committed in step {step}, which was aborted: "
                                 "its KV was never written")
        if step > done:
            raise StepOrderError(step, st.open_step, f"page {p} was committed in step {step}, which has not "
                                 f"completed on every rank (completed through {done}); its KV is not written yet")
        if p in st.page_hash:
            raise PageNotHeldError(p, "not yet published", f"published as {st.page_hash[p]!r}")
        if h in st.hash_page:
            raise InvalidArgumentError(f"block hash {h!r} is already published (page {st.hash_page[h]})")


def _share_tenant(st: LedgerState, e: PagesShared) -> str | None:
    rec = st.requests.get(e.request)
    if rec is None:
        return e.tenant
    if e.tenant is not None and e.tenant != rec.tenant:
        raise TenantMismatchError(e.request, rec.tenant, e.tenant)
    return rec.tenant


def pages_shared(st: LedgerState, e: PagesShared) -> None:
    """Each page hashed, kv(R) or cached(h), not stale, not restoring, not already r's;
    under cross_tenant / all_reused the writer's tenant is r's.

    A hashed page is kv or cached and never marked or restoring (invariants), so once
    every page is hashed, those hold; the page-by-page walk names the first failure.
    """
    pages = e.page_ids
    tenant = _share_tenant(st, e)
    rec = st.requests.get(e.request)
    hashed = st.page_hash
    distinct = set(pages)
    if (pages and len(distinct) == len(pages) and hashed.keys() >= distinct
            and (not st.marks or st.marks.keys().isdisjoint(pages))
            and (rec is None or (distinct.isdisjoint(rec.kv) and distinct.isdisjoint(rec.reserved)))):
        if st.policy != "released_aliases":
            ht = st.hash_tenant
            for p in pages:
                if ht[p] != tenant:
                    raise CrossTenantShareError(e.request, tenant, p, ht[p], st.policy)
        return
    _shared_page_by_page(st, e, tenant)


def _shared_page_by_page(st: LedgerState, e: PagesShared, tenant: str | None) -> None:
    pages = e.page_ids
    _pages(st, pages)
    rec = st.requests.get(e.request)
    mine = set(rec.kv).union(rec.reserved) if rec is not None else ()
    holder, hashed = st.holder, st.page_hash
    for p in pages:
        if p not in hashed:
            raise PageNotHeldError(p, "hashed (published)", st.holder_of(p))
        if p in st.marks:
            raise PageNotHeldError(p, "not stale", "marked")
        if p in mine:
            raise PageNotHeldError(p, f"not held by request {e.request}", st.holder_of(p))
        if holder[p] < 0 and holder[p] != HOLDER_CACHED:
            raise PageNotHeldError(p, "kv(R) or cached", st.holder_of(p))
        if st.policy != "released_aliases" and st.hash_tenant.get(p) != tenant:
            raise CrossTenantShareError(e.request, tenant, p, st.hash_tenant.get(p), st.policy)
    _not_restoring(st, pages, "cannot share")


def pages_evicted(st: LedgerState, e: PagesEvicted) -> None:
    """Each page cached(h)."""
    pages = e.page_ids
    distinct = set(pages)
    if pages and len(distinct) == len(pages) and st.cached.keys() >= distinct:
        return  # (the cache holds exactly the cached(h) pages)
    _pages(st, pages)
    holder = st.holder
    for p in pages:
        if holder[p] != HOLDER_CACHED:
            raise PageNotHeldError(p, "cached", st.holder_of(p))


def sanitizer_violation(st: LedgerState, e: SanitizerViolation) -> None:
    """The step was sealed; the page is in range."""
    if not 0 <= e.step < st.open_step:
        raise StepOrderError(e.step, st.open_step, "a sanitizer violation in a step that was never sealed")
    checks.page_ids((e.page_id,), st.num_pages, allow_empty=False)
