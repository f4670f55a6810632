"""Scheduler state and the fold: ``validate(event)`` then ``apply(event) -> effects``.

The page table is one flat list indexed by page id plus a free stack and a few
sparse maps, never an object per page. ``validate`` raises a specific
``KVLedgerError`` and changes nothing; ``apply`` assumes a validated event and
never raises for one. Both are pure (no I/O, no logging, no clock).

Per page:
    holder[p]         the holder in one int: a request id r >= 0 (reserved(r) or
                      kv(r): which one is told by r's ``reserved`` / ``kv`` lists),
                      HOLDER_FREE (-1) or HOLDER_ALIAS (-2). One store per page per
                      transition; a commit moves pages between r's lists and
                      stores nothing per page.
    alias_count[p]    number of live snapshots aliasing p (alias iff > 0)
Sparse (a page is in the map only while the flag is set):
    marks[p]          the mark: MARK_ALL (zero before any request reads it) or
                      MARK_TENANT (cross_tenant policy: zero unless the reader is
                      the tenant in residue[p])
    restore_targets   p -> (into, target) while an inbound restore writes p
                      (the ``restoring`` flag)
    pending           page -> the unsealed step whose clear list it sits in
    restored_since_seal  pages a restore into a request overwrote since the last
                      seal (an abort of that step must not zero them again)

The free stack holds exactly the free pages; the allocator takes from its top
(LIFO), freed pages are pushed in event order. Taking pages anywhere but the top
(a snapshot aliasing named free pages, the allocator skipping a page a restore
is still writing) removes them from the middle: rare, and still C-speed. The
stack is derived from the event sequence alone, so replay reproduces the
allocator's future choices exactly.

Marks and clear lists (the seed's rule, policy ``released_aliases``):
    SnapshotReleased   sets the mark on every page whose last alias went away
    PagesCommitted     takes the mark off each marked page and lists it for ``step``
    RestoreStarted     into a request: takes the mark off (the restore overwrites
                       the whole page), never lists it
    StepSealed         the plan: the step's listed pages still held as KV, once each
    a listed page that leaves KV before its step is sealed gets its mark back:
    nothing has zeroed it yet.
The other policies also mark pages when a request lets go of bytes it wrote
(``cross_tenant``: marked for other tenants only; ``all_reused``: for everyone).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import msgspec

from .. import checks
from ..errors import (
    ConfigurationError,
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
    MAX_PAGES,
    CacheConfigured,
    ClearPages,
    Geometry,
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
    StepPlan,
    StepSealed,
)

__all__ = [
    "FREE",
    "RESERVED",
    "KV",
    "ALIAS",
    "HOLDER_FREE",
    "HOLDER_ALIAS",
    "HOLDER_NAMES",
    "MARK_ALL",
    "MARK_TENANT",
    "MAX_PAGES",
    "LedgerState",
    "RequestRecord",
]

FREE, RESERVED, KV, ALIAS = 0, 1, 2, 3  # holder codes (``LedgerState.holder_codes()``)
HOLDER_NAMES = ("free", "reserved", "kv", "alias")
HOLDER_FREE, HOLDER_ALIAS = -1, -2
MARK_ALL, MARK_TENANT = 1, 2
DIGEST_VERSION = 1
_NO_EFFECTS: tuple = ()


class RequestRecord(msgspec.Struct, gc=False):
    """One request: its tenant, its reserved pages and its KV pages (block table) in order.

    ``restored``: reserved pages an inbound restore wrote (tracked for the non-default
    policies only). Built in C (a msgspec Struct): one is made per request.
    """

    request: int
    tenant: Optional[str]
    reserved: list
    kv: list
    restored: Optional[set] = None


class LedgerState:
    """The fold. ``validate`` rejects, ``apply`` folds; ``seq`` counts folded events."""

    def __init__(self) -> None:
        self.geometry: Geometry | None = None
        self.policy = "released_aliases"
        self.seq = 0
        self.num_pages = 0
        self.holder: list[int] = []
        self.alias_count: list[int] = []
        self.marks: dict[int, int] = {}
        self.residue: dict[int, Optional[str]] = {}
        self.restore_targets: dict[int, tuple[str, int]] = {}
        self.pending: dict[int, int] = {}
        self.restored_since_seal: set[int] = set()
        self.free_stack: list[int] = []
        self.requests: dict[int, RequestRecord] = {}
        self.snapshots: dict[int, list[int]] = {}
        self.open_step = 0
        self.clear_lists: dict[int, list[int]] = {}
        self.last_plan: StepPlan | None = None
        self.completed: dict[int, int] = {}  # rank -> highest step it completed
        self._validators: dict[type, Callable[[Any], None]] = {
            CacheConfigured: self._v_configured,
            PagesReserved: self._v_reserved,
            ReservationReturned: self._v_returned,
            PagesCommitted: self._v_committed,
            RequestCancelled: self._v_request_known,
            RequestFinished: self._v_request_known,
            SnapshotAliased: self._v_aliased,
            SnapshotReleased: self._v_released,
            RestoreStarted: self._v_restore_started,
            RestoreCompleted: self._v_restore_completed,
            StepSealed: self._v_sealed,
            StepCompleted: self._v_step_completed,
            StepAborted: self._v_step_aborted,
        }
        self._appliers: dict[type, Callable[[Any], tuple]] = {
            CacheConfigured: self._a_configured,
            PagesReserved: self.apply_reserved,
            ReservationReturned: self._a_returned,
            PagesCommitted: self.apply_committed,
            RequestCancelled: self.apply_request_gone,
            RequestFinished: self.apply_request_gone,
            SnapshotAliased: self._a_aliased,
            SnapshotReleased: self._a_released,
            RestoreStarted: self._a_restore_started,
            RestoreCompleted: self._a_restore_completed,
            StepSealed: self._a_sealed,
            StepCompleted: self._a_step_completed,
            StepAborted: self._a_step_aborted,
        }

    # ------------------------------------------------------------------ entry points

    def validate(self, event) -> None:
        """Raise the specific ``KVLedgerError`` if ``event`` breaks a precondition. Pure."""
        try:
            check = self._validators[type(event)]
        except KeyError:
            raise InvalidArgumentError(f"not a kvledger event: {type(event).__name__}") from None
        if self.geometry is None and type(event) is not CacheConfigured:
            raise ConfigurationError(
                f"{type(event).__name__} before CacheConfigured: the first event configures the cache"
            )
        check(event)

    def apply(self, event) -> tuple:
        """Fold a validated event; return its effects (``ClearPages``, ``StepPlan``) or ``()``.

        Each applier advances ``seq`` itself, so the command side may call the hot
        ones (``apply_reserved``, ``apply_committed``, ``apply_request_gone``) directly.
        """
        return self._appliers[type(event)](event)

    def fold(self, event) -> tuple:
        """``validate`` then ``apply``: the replay path for events from outside."""
        self.validate(event)
        return self._appliers[type(event)](event)

    # ------------------------------------------------------------------ queries

    @property
    def free_count(self) -> int:
        return len(self.free_stack)

    @property
    def reservable_count(self) -> int:
        """Free pages an allocation may take now (free and not restoring)."""
        if not self.restore_targets:
            return len(self.free_stack)
        o = self.holder
        return len(self.free_stack) - sum(1 for p in self.restore_targets if o[p] == HOLDER_FREE)

    def pick_free(self, n: int) -> list[int] | None:
        """The ``n`` pages the allocator takes next (top of the free stack), or None. Pure."""
        stack, targets = self.free_stack, self.restore_targets
        if n > len(stack):
            return None
        top = stack[: -n - 1 : -1]  # pop order: the top of the stack first
        if not targets or targets.keys().isdisjoint(top):
            return top
        picked: list[int] = []
        for i in range(len(stack) - 1, -1, -1):
            p = stack[i]
            if p not in targets:
                picked.append(p)
                if len(picked) == n:
                    return picked
        return None

    def holder_code(self, page_id: int) -> int:
        """FREE, RESERVED, KV or ALIAS for one page (O(pages of its request))."""
        x = self.holder[page_id]
        if x >= 0:
            return KV if page_id in self.requests[x].kv else RESERVED
        return FREE if x == HOLDER_FREE else ALIAS

    def holder_codes(self) -> bytearray:
        """Holder codes of every page, derived (O(held pages)): for checks and tools, not loops."""
        h = bytearray(self.num_pages)
        for pages in self.snapshots.values():
            for p in pages:
                h[p] = ALIAS
        for rec in self.requests.values():
            for p in rec.reserved:
                h[p] = RESERVED
            for p in rec.kv:
                h[p] = KV
        return h

    def mark_codes(self) -> bytearray:
        """Mark codes of every page (0, MARK_ALL, MARK_TENANT), derived: for tools."""
        out = bytearray(self.num_pages)
        for p, m in self.marks.items():
            out[p] = m
        return out

    def restoring_flags(self) -> bytearray:
        """1 for every page an inbound restore is writing, derived: for tools."""
        out = bytearray(self.num_pages)
        for p in self.restore_targets:
            out[p] = 1
        return out

    def holder_of(self, page_id: int) -> str:
        """Human-readable holder of a page: ``free``, ``reserved(r)``, ``kv(r)``, ``alias({s,...})``."""
        kind = self.holder_code(page_id)
        if kind == RESERVED or kind == KV:
            return f"{HOLDER_NAMES[kind]}({self.holder[page_id]})"
        if kind == ALIAS:
            return "alias({" + ",".join(map(str, self.snapshot_ids_of(page_id))) + "})"
        return "free"

    def snapshot_ids_of(self, page_id: int) -> list[int]:
        return sorted(s for s, pages in self.snapshots.items() if page_id in pages)

    # ------------------------------------------------------------------ validation helpers

    def _check_pages(self, page_ids) -> None:
        checks.page_ids(page_ids, self.num_pages, allow_empty=False)

    def _not_restoring(self, page_ids, what: str) -> None:
        targets = self.restore_targets
        if targets and not targets.keys().isdisjoint(page_ids):
            raise RestoringPageError([p for p in page_ids if p in targets], what)

    def _request(self, request: int) -> RequestRecord:
        rec = self.requests.get(request)
        if rec is None:
            raise UnknownRequestError(request)
        return rec

    def _owned(self, request: int, pages, kind: int) -> None:
        rec = self._request(request)
        mine = rec.reserved if kind == RESERVED else rec.kv
        if len(mine) >= len(pages) and tuple(mine[: len(pages)]) == tuple(pages):
            return  # the usual case: the first pages of the list, in order
        mine = set(mine)
        for p in pages:
            if p not in mine:
                raise PageNotHeldError(p, f"{HOLDER_NAMES[kind]}({request})", self.holder_of(p))

    # ------------------------------------------------------------------ validators

    def _v_configured(self, e: CacheConfigured) -> None:
        if self.geometry is not None:
            raise ConfigurationError("CacheConfigured may only be the first event")
        checks.geometry(e.geometry)
        if e.policy not in CLEAR_POLICIES:
            raise ConfigurationError(f"unknown clear policy {e.policy!r}; one of {CLEAR_POLICIES}")

    def _v_reserved(self, e: PagesReserved) -> None:
        pages = e.page_ids
        self._check_pages(pages)
        rec = self.requests.get(e.request)
        if rec is not None and rec.tenant != e.tenant:
            raise TenantMismatchError(e.request, rec.tenant, e.tenant)
        o = self.holder
        for p in pages:
            if o[p] != HOLDER_FREE:
                raise PageNotHeldError(p, "free", self.holder_of(p))
        self._not_restoring(pages, "cannot reserve")

    def _v_returned(self, e: ReservationReturned) -> None:
        pages = e.page_ids
        self._check_pages(pages)
        self._owned(e.request, pages, RESERVED)

    def _v_committed(self, e: PagesCommitted) -> None:
        pages = e.page_ids
        self._check_pages(pages)
        if e.step < self.open_step:
            raise StepOrderError(e.step, self.open_step, "commit into a sealed step")
        self._owned(e.request, pages, RESERVED)
        self._not_restoring(pages, "cannot commit")

    def _v_request_known(self, e) -> None:
        self._request(e.request)

    def _v_aliased(self, e: SnapshotAliased) -> None:
        pages = e.page_ids
        self._check_pages(pages)
        o = self.holder
        for p in pages:
            if o[p] >= 0:
                raise PageNotHeldError(p, "free or alias", self.holder_of(p))
        self._not_restoring(pages, "cannot alias")
        mine = self.snapshots.get(e.snapshot)
        if mine is not None:
            again = set(mine).intersection(pages)
            if again:
                raise DuplicatePageError(sorted(again))

    def _v_released(self, e: SnapshotReleased) -> None:
        if e.snapshot not in self.snapshots:
            raise UnknownSnapshotError(e.snapshot, "release of a snapshot that is not live")

    def _v_restore_started(self, e: RestoreStarted) -> None:
        pages = e.page_ids
        self._check_pages(pages)
        if e.into == "request":
            self._owned(e.target, pages, RESERVED)
        elif e.into == "snapshot":
            mine = self.snapshots.get(e.target)
            if mine is None:
                raise UnknownSnapshotError(e.target, "restore into a snapshot that is not live")
            mine_set = set(mine)
            for p in pages:
                if p not in mine_set:
                    raise PageNotHeldError(p, f"aliased by snapshot {e.target}", self.holder_of(p))
        else:
            raise InvalidArgumentError(f"restore target must be 'request' or 'snapshot', not {e.into!r}")
        self._not_restoring(pages, "a restore is already writing them")

    def _v_restore_completed(self, e: RestoreCompleted) -> None:
        pages = e.page_ids
        self._check_pages(pages)
        want = (e.into, e.target)
        targets = self.restore_targets
        for p in pages:
            got = targets.get(p)
            if got != want:
                detail = "no restore in flight" if got is None else f"restore in flight into {got[0]} {got[1]}"
                raise PageNotHeldError(p, f"restoring into {e.into} {e.target}", detail)

    def _v_sealed(self, e: StepSealed) -> None:
        if e.step != self.open_step:
            raise StepOrderError(e.step, self.open_step, "only the open step can be sealed")
        derived = self.derive_clear_list(e.step)
        if tuple(e.clear_list) != derived:
            raise ReplayMismatchError(
                self.seq,
                f"step {e.step} recorded clear list {list(e.clear_list)[:16]} "
                f"but the fold derives {list(derived)[:16]}",
            )

    def _v_step_completed(self, e: StepCompleted) -> None:
        if not 0 <= e.step < self.open_step:
            raise StepOrderError(e.step, self.open_step, "completion of a step that was never sealed")
        if e.rank < 0:
            raise InvalidArgumentError(f"rank must be >= 0, got {e.rank}")

    def _v_step_aborted(self, e: StepAborted) -> None:
        last = self.last_plan
        if last is None or last.step != e.step:
            raise StepOrderError(e.step, self.open_step, "only the last sealed step can be aborted")

    # ------------------------------------------------------------------ appliers

    def _a_configured(self, e: CacheConfigured) -> tuple:
        n = e.geometry.num_pages
        self.geometry = e.geometry
        self.policy = e.policy
        self.num_pages = n
        self.holder = [HOLDER_FREE] * n
        self.alias_count = [0] * n
        # Lowest ids on top: the first reservation of a fresh cache takes pages 0, 1, ...
        self.free_stack = list(range(n - 1, -1, -1))
        self.seq += 1
        return _NO_EFFECTS

    def _take_from_stack(self, pages) -> None:
        """Remove ``pages`` (all free until now) from the free stack."""
        stack = self.free_stack
        k = len(pages)
        if stack[: -k - 1 : -1] == list(pages):  # the allocator's choice: the top
            del stack[-k:]
        else:
            for p in pages:
                stack.remove(p)

    def apply_reserved(self, e: PagesReserved) -> tuple:
        pages = e.page_ids
        r = e.request
        rec = self.requests.get(r)
        if rec is None:
            rec = self.requests[r] = RequestRecord(r, e.tenant, [], [])
        o = self.holder
        for p in pages:
            o[p] = r
        stack = self.free_stack
        k = len(pages)
        if tuple(stack[: -k - 1 : -1]) == pages:  # the allocator's choice: the top
            del stack[-k:]
        else:
            for p in pages:
                stack.remove(p)
        rec.reserved.extend(pages)
        self.seq += 1
        return _NO_EFFECTS

    def _free_pages(self, pages, tenant: Optional[str], dirty) -> None:
        """Pages leave a request for the free stack; marks follow the policy.

        ``dirty``: the pages among them that hold bytes the request wrote (its KV
        pages, reserved pages a restore wrote); only the non-default policies mark them.
        """
        o = self.holder
        for p in pages:
            o[p] = HOLDER_FREE
        pend = self.pending
        if pend and not pend.keys().isdisjoint(pages):
            marks, residue = self.marks, self.residue
            for p in pages:
                if p in pend:
                    # Listed for a step that has not been sealed: nothing zeroed it yet.
                    del pend[p]
                    marks[p] = MARK_ALL
                    residue.pop(p, None)
        self.free_stack.extend(pages)
        if dirty and self.policy != "released_aliases":
            marks = self.marks
            if self.policy == "all_reused":
                for p in dirty:
                    marks[p] = MARK_ALL
            else:
                residue = self.residue
                for p in dirty:
                    if marks.get(p) != MARK_ALL:
                        marks[p] = MARK_TENANT
                        residue[p] = tenant

    def _a_returned(self, e: ReservationReturned) -> tuple:
        rec = self.requests[e.request]
        pages = e.page_ids
        _remove(rec.reserved, pages)
        dirty = ()
        if rec.restored:
            dirty = [p for p in pages if p in rec.restored]
            rec.restored.difference_update(pages)
        self._free_pages(pages, rec.tenant, dirty)
        self.seq += 1
        return _NO_EFFECTS

    def apply_committed(self, e: PagesCommitted) -> tuple:
        rec = self.requests[e.request]
        pages = e.page_ids
        marks = self.marks
        listed = None
        if marks and not marks.keys().isdisjoint(pages):
            residue, pend = self.residue, self.pending
            listed = []
            for p in pages:
                m = marks.pop(p, 0)
                if m:
                    if m == MARK_TENANT and residue.pop(p) == rec.tenant:
                        continue  # the committing tenant's own bytes
                    if p not in pend:
                        pend[p] = e.step
                        listed.append(p)
        reserved = rec.reserved
        k = len(pages)
        if tuple(reserved[:k]) == pages:  # commits take the reservation in order
            del reserved[:k]
        else:
            _remove(reserved, pages)
        if rec.restored:
            rec.restored.difference_update(pages)
        rec.kv.extend(pages)
        self.seq += 1
        if not listed:
            return _NO_EFFECTS
        cl = self.clear_lists.get(e.step)
        if cl is None:
            self.clear_lists[e.step] = listed
        else:
            cl.extend(listed)
        return (ClearPages(step=e.step, page_ids=tuple(listed)),)

    def apply_request_gone(self, e) -> tuple:
        rec = self.requests.pop(e.request)
        dirty = ()
        if self.policy != "released_aliases":
            dirty = rec.kv + [p for p in rec.reserved if rec.restored and p in rec.restored]
        self._free_pages(rec.reserved + rec.kv, rec.tenant, dirty)
        self.seq += 1
        return _NO_EFFECTS

    def _a_aliased(self, e: SnapshotAliased) -> tuple:
        pages = e.page_ids
        o, an = self.holder, self.alias_count
        newly = []
        for p in pages:
            if o[p] == HOLDER_FREE:
                o[p] = HOLDER_ALIAS
                an[p] = 1
                newly.append(p)
            else:
                an[p] += 1
        if newly:
            self._take_from_stack(newly)
        mine = self.snapshots.get(e.snapshot)
        if mine is None:
            self.snapshots[e.snapshot] = list(pages)
        else:
            mine.extend(pages)
        self.seq += 1
        return _NO_EFFECTS

    def _a_released(self, e: SnapshotReleased) -> tuple:
        pages = self.snapshots.pop(e.snapshot)
        o, an, marks, residue = self.holder, self.alias_count, self.marks, self.residue
        stack = self.free_stack
        for p in pages:
            c = an[p] - 1
            an[p] = c
            if c == 0:
                o[p] = HOLDER_FREE
                marks[p] = MARK_ALL
                residue.pop(p, None)
                stack.append(p)
        self.seq += 1
        return _NO_EFFECTS

    def _a_restore_started(self, e: RestoreStarted) -> tuple:
        pages = e.page_ids
        targets = self.restore_targets
        t = (e.into, e.target)
        for p in pages:
            targets[p] = t
        if e.into == "request":
            marks, residue = self.marks, self.residue
            for p in pages:
                marks.pop(p, None)  # overwritten whole: the restore removes the mark
                residue.pop(p, None)
            self.restored_since_seal.update(pages)
            if self.policy != "released_aliases":
                rec = self.requests[e.target]
                if rec.restored is None:
                    rec.restored = set()
                rec.restored.update(pages)
        self.seq += 1
        return _NO_EFFECTS

    def _a_restore_completed(self, e: RestoreCompleted) -> tuple:
        targets = self.restore_targets
        for p in e.page_ids:
            del targets[p]
        self.seq += 1
        return _NO_EFFECTS

    def derive_clear_list(self, step: int) -> tuple[int, ...]:
        """The plan's clear list for ``step``: listed pages still pending, once each, in order."""
        listed = self.clear_lists.get(step)
        if not listed:
            return ()
        pend = self.pending
        return tuple(p for p in dict.fromkeys(listed) if pend.get(p) == step)

    def _a_sealed(self, e: StepSealed) -> tuple:
        clear_list = self.derive_clear_list(e.step)
        self.clear_lists.pop(e.step, None)
        pend = self.pending
        for p in clear_list:
            del pend[p]
        self.restored_since_seal.clear()
        self.open_step = e.step + 1
        plan = StepPlan(step=e.step, clear_list=clear_list)
        self.last_plan = plan
        self.seq += 1
        return (plan,)

    def _a_step_completed(self, e: StepCompleted) -> tuple:
        if e.step > self.completed.get(e.rank, -1):
            self.completed[e.rank] = e.step
        self.seq += 1
        return _NO_EFFECTS

    def _a_step_aborted(self, e: StepAborted) -> tuple:
        """Nothing of the aborted step can be assumed zeroed: its pages go back to pending."""
        plan = self.last_plan
        self.last_plan = None
        marks, residue, pend = self.marks, self.residue, self.pending
        carry: list[int] = []
        step = self.open_step
        overwritten = self.restored_since_seal
        for p in plan.clear_list:
            if p in overwritten:
                continue  # a restore into a request rewrote it whole after the seal
            if self.holder_code(p) == KV:
                if p not in pend:
                    pend[p] = step
                    carry.append(p)
            else:
                marks[p] = MARK_ALL
                residue.pop(p, None)
        if carry:
            self.clear_lists[step] = carry + self.clear_lists.get(step, [])
        self.seq += 1
        return _NO_EFFECTS

    # ------------------------------------------------------------------ canonical form

    def canonical(self) -> dict:
        """Every field of the state, in a form independent of hash seed and insertion order.

        A snapshot (copies, not views): later folds do not change it. Used for the
        digest and for log checkpoints (``from_canonical`` restores it).
        """
        g = self.geometry
        return {
            "v": DIGEST_VERSION,
            "geometry": None if g is None else [g.num_pages, g.page_tokens],
            "policy": self.policy,
            "seq": self.seq,
            "open_step": self.open_step,
            "owner": list(self.holder),
            "alias_n": list(self.alias_count),
            "marks": sorted(self.marks.items()),
            "residue": sorted(self.residue.items()),
            "restore_targets": [[p, t[0], t[1]] for p, t in sorted(self.restore_targets.items())],
            "pending": sorted(self.pending.items()),
            "restored_since_seal": sorted(self.restored_since_seal),
            "free_stack": list(self.free_stack),
            "requests": [
                [r, rec.tenant, list(rec.reserved), list(rec.kv), sorted(rec.restored or ())]
                for r, rec in sorted(self.requests.items())
            ],
            "snapshots": [[s, list(pages)] for s, pages in sorted(self.snapshots.items())],
            "clear_lists": [[s, list(pages)] for s, pages in sorted(self.clear_lists.items())],
            "last_plan": None
            if self.last_plan is None
            else [self.last_plan.step, list(self.last_plan.clear_list)],
            "completed": sorted(self.completed.items()),
        }

    def canonical_bytes(self) -> bytes:
        return msgspec.msgpack.encode(self.canonical())

    def digest(self) -> str:
        """BLAKE2b-256 of the canonical encoding, hex. Equal states give equal digests anywhere."""
        return hashlib.blake2b(self.canonical_bytes(), digest_size=32).hexdigest()

    @classmethod
    def from_canonical(cls, data: dict) -> "LedgerState":
        """Rebuild a state from ``canonical()`` output (a checkpoint)."""
        st = cls()
        if data.get("v") != DIGEST_VERSION:
            raise ConfigurationError(f"unsupported checkpoint version {data.get('v')!r}")
        if data["geometry"] is not None:
            n, t = data["geometry"]
            st._a_configured(CacheConfigured(geometry=Geometry(num_pages=n, page_tokens=t), policy=data["policy"]))
        st.seq = data["seq"]
        st.open_step = data["open_step"]
        st.holder = list(data["owner"])
        st.alias_count = list(data["alias_n"])
        st.marks = {p: m for p, m in data["marks"]}
        st.residue = {p: t for p, t in data["residue"]}
        st.restore_targets = {p: (into, t) for p, into, t in data["restore_targets"]}
        st.pending = {p: step for p, step in data["pending"]}
        st.restored_since_seal = set(data["restored_since_seal"])
        st.free_stack = list(data["free_stack"])
        for r, tenant, reserved, kv, restored in data["requests"]:
            st.requests[r] = RequestRecord(r, tenant, list(reserved), list(kv), set(restored) or None)
        st.snapshots = {s: list(pages) for s, pages in data["snapshots"]}
        st.clear_lists = {s: list(pages) for s, pages in data["clear_lists"]}
        lp = data["last_plan"]
        st.last_plan = None if lp is None else StepPlan(step=lp[0], clear_list=tuple(lp[1]))
        st.completed = {int(r): s for r, s in data["completed"]}
        return st


def _remove(seq: list[int], pages) -> None:
    """Remove ``pages`` from ``seq`` keeping order; fast when they are its prefix."""
    k = len(pages)
    if seq[:k] == list(pages):
        del seq[:k]
        return
    gone = set(pages)
    seq[:] = [p for p in seq if p not in gone]
