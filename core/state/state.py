"""Scheduler state and the fold: ``validate(event)`` then ``apply(event) -> effects``.

The page table is a handful of flat arrays indexed by page id plus an intrusive
free stack, never an object per page. ``validate`` raises a specific
``KVLedgerError`` and changes nothing; ``apply`` assumes a validated event and
never raises for one. Both are pure (no I/O, no logging, no clock).

Per page:
    holder[p]     FREE | RESERVED | KV | ALIAS
    owner[p]      request id for RESERVED / KV, -1 otherwise
    alias_n[p]    number of live snapshots aliasing p (ALIAS iff > 0)
    stale[p]      the mark: 0 clean, MARK_ALL (zero before any request reads it),
                  MARK_TENANT (cross_tenant policy: zero unless the reader is
                  residue[p]'s tenant)
    restoring[p]  an inbound restore is writing p
    pending[p]    p sits in an unsealed step's clear list

The free stack is lazy: a page taken out of the middle of the stack (by an
alias or an explicit reservation) leaves its entry behind; ``in_stack[p]`` keeps
each page in the stack at most once, and the fold pops dead entries off the top.
All of it is derived from the event sequence alone, so replay reproduces the
allocator's future choices exactly.

Marks and clear lists (the seed's rule, policy ``released_aliases``):
    SnapshotReleased   sets the mark on every page whose last alias went away
    PagesCommitted     takes the mark off each marked page and lists it for ``step``
    RestoreStarted     into a request: takes the mark off (the restore overwrites
                       the whole page), never lists it
    StepSealed         the plan: the step's listed pages still held as KV, once each
    a listed page that leaves KV before its step is sealed gets its mark back:
    nothing has zeroed it yet.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import msgspec

from ..errors import (
    ConfigurationError,
    DuplicateIdError,
    DuplicatePageError,
    InvalidArgumentError,
    PageNotHeldError,
    PageOutOfRangeError,
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
    "HOLDER_NAMES",
    "MARK_ALL",
    "MARK_TENANT",
    "MAX_PAGES",
    "LedgerState",
    "RequestRecord",
    "validate_geometry",
]

FREE, RESERVED, KV, ALIAS = 0, 1, 2, 3
HOLDER_NAMES = ("free", "reserved", "kv", "alias")
MARK_ALL, MARK_TENANT = 1, 2
MAX_PAGES = 1 << 32  # page ids travel as unsigned 32-bit integers on the wire
DIGEST_VERSION = 1
_NO_EFFECTS: tuple = ()


def validate_geometry(geometry: Geometry) -> None:
    n, t = geometry.num_pages, geometry.page_tokens
    if type(n) is not int or not 1 <= n <= MAX_PAGES:
        raise ConfigurationError(f"num_pages must be an int in [1, {MAX_PAGES}], got {n!r}")
    if type(t) is not int or t < 1:
        raise ConfigurationError(f"page_tokens must be a positive int, got {t!r}")


class RequestRecord:
    """One request: its tenant, its reserved pages and its KV pages (block table) in order."""

    __slots__ = ("request", "tenant", "reserved", "kv", "restored")

    def __init__(self, request: int, tenant: str | None) -> None:
        self.request = request
        self.tenant = tenant
        self.reserved: list[int] = []
        self.kv: list[int] = []
        self.restored: set[int] = set()  # reserved pages a restore wrote (non-default policies)


class LedgerState:
    """The fold. ``validate`` rejects, ``apply`` folds; ``seq`` counts folded events."""

    def __init__(self) -> None:
        self.geometry: Geometry | None = None
        self.policy = "released_aliases"
        self.seq = 0
        self.num_pages = 0
        self.holder: bytearray = bytearray()
        self.owner: list[int] = []
        self.alias_n: list[int] = []
        self.stale: bytearray = bytearray()
        self.residue: list[str | None] = []
        self.restoring: bytearray = bytearray()
        self.pending: bytearray = bytearray()
        self.in_stack: bytearray = bytearray()
        self.free_stack: list[int] = []
        self.free_count = 0
        self.requests: dict[int, RequestRecord] = {}
        self.snapshots: dict[int, list[int]] = {}
        self.restore_targets: dict[int, tuple[str, int]] = {}
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
            PagesReserved: self._a_reserved,
            ReservationReturned: self._a_returned,
            PagesCommitted: self._a_committed,
            RequestCancelled: self._a_request_gone,
            RequestFinished: self._a_request_gone,
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
        """Fold a validated event; return its effects (``ClearPages``, ``StepPlan``) or ``()``."""
        effects = self._appliers[type(event)](event)
        self.seq += 1
        return effects

    def fold(self, event) -> tuple:
        """``validate`` then ``apply``: the replay path for events from outside."""
        self.validate(event)
        return self.apply(event)

    # ------------------------------------------------------------------ queries

    @property
    def reservable_count(self) -> int:
        """Free pages an allocation may take now (free and not restoring)."""
        if not self.restore_targets:
            return self.free_count
        h = self.holder
        return self.free_count - sum(1 for p in self.restore_targets if h[p] == FREE)

    def pick_free(self, n: int) -> list[int] | None:
        """The ``n`` pages the allocator takes next (top of the free stack), or None. Pure."""
        if n > self.free_count:
            return None
        stack, h, rs = self.free_stack, self.holder, self.restoring
        top = stack[-n:]
        top.reverse()  # pop order: the top of the stack first
        ok = True
        for p in top:
            if h[p] or rs[p]:
                ok = False
                break
        if ok:
            return top
        picked: list[int] = []
        for i in range(len(stack) - 1, -1, -1):
            p = stack[i]
            if h[p] == FREE and not rs[p]:
                picked.append(p)
                if len(picked) == n:
                    return picked
        return None

    def holder_of(self, page_id: int) -> str:
        """Human-readable holder of a page: ``free``, ``reserved(r)``, ``kv(r)``, ``alias({s,...})``."""
        kind = self.holder[page_id]
        if kind == RESERVED or kind == KV:
            return f"{HOLDER_NAMES[kind]}({self.owner[page_id]})"
        if kind == ALIAS:
            ss = sorted(s for s, pages in self.snapshots.items() if page_id in pages)
            return "alias({" + ",".join(map(str, ss)) + "})"
        return "free"

    def snapshot_ids_of(self, page_id: int) -> list[int]:
        return sorted(s for s, pages in self.snapshots.items() if page_id in pages)

    # ------------------------------------------------------------------ validation helpers

    def _check_pages(self, page_ids) -> None:
        if not page_ids:
            raise InvalidArgumentError("an event needs at least one page id")
        n = self.num_pages
        if min(page_ids) < 0 or max(page_ids) >= n:
            raise PageOutOfRangeError([p for p in page_ids if not 0 <= p < n], n)
        if len(set(page_ids)) != len(page_ids):
            seen: set[int] = set()
            raise DuplicatePageError(sorted({p for p in page_ids if p in seen or seen.add(p)}))

    def _not_restoring(self, page_ids, what: str) -> None:
        rs = self.restoring
        for p in page_ids:
            if rs[p]:
                raise RestoringPageError([q for q in page_ids if rs[q]], what)

    def _request(self, request: int) -> RequestRecord:
        rec = self.requests.get(request)
        if rec is None:
            raise UnknownRequestError(request)
        return rec

    # ------------------------------------------------------------------ validators

    def _v_configured(self, e: CacheConfigured) -> None:
        if self.geometry is not None:
            raise ConfigurationError("CacheConfigured may only be the first event")
        validate_geometry(e.geometry)
        if e.policy not in CLEAR_POLICIES:
            raise ConfigurationError(f"unknown clear policy {e.policy!r}; one of {CLEAR_POLICIES}")

    def _v_reserved(self, e: PagesReserved) -> None:
        pages = e.page_ids
        self._check_pages(pages)
        rec = self.requests.get(e.request)
        if rec is not None and rec.tenant != e.tenant:
            raise TenantMismatchError(e.request, rec.tenant, e.tenant)
        h = self.holder
        for p in pages:
            if h[p] != FREE:
                raise PageNotHeldError(p, "free", self.holder_of(p))
        self._not_restoring(pages, "cannot reserve")

    def _v_returned(self, e: ReservationReturned) -> None:
        pages = e.page_ids
        self._check_pages(pages)
        self._owned(e.request, pages, RESERVED)

    def _owned(self, request: int, pages, kind: int) -> None:
        self._request(request)
        h, o = self.holder, self.owner
        for p in pages:
            if h[p] != kind or o[p] != request:
                raise PageNotHeldError(p, f"{HOLDER_NAMES[kind]}({request})", self.holder_of(p))

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
        h = self.holder
        for p in pages:
            if h[p] != FREE and h[p] != ALIAS:
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
        self.holder = bytearray(n)
        self.owner = [-1] * n
        self.alias_n = [0] * n
        self.stale = bytearray(n)
        self.residue = [None] * n
        self.restoring = bytearray(n)
        self.pending = bytearray(n)
        self.in_stack = bytearray(b"\x01") * n
        # Lowest ids on top: the first reservation of a fresh cache takes pages 0, 1, ...
        self.free_stack = list(range(n - 1, -1, -1))
        self.free_count = n
        return _NO_EFFECTS

    def _take_from_stack(self) -> None:
        stack, h, ins = self.free_stack, self.holder, self.in_stack
        while stack and h[stack[-1]]:
            ins[stack.pop()] = 0

    def _a_reserved(self, e: PagesReserved) -> tuple:
        pages = e.page_ids
        r = e.request
        rec = self.requests.get(r)
        if rec is None:
            rec = self.requests[r] = RequestRecord(r, e.tenant)
        h, o = self.holder, self.owner
        stack = self.free_stack
        k = len(pages)
        top = list(pages)
        top.reverse()
        if stack[-k:] == top:
            # The allocator's choice: the top of the stack. Pop it in one go.
            del stack[-k:]
            ins = self.in_stack
            for p in pages:
                h[p] = RESERVED
                o[p] = r
                ins[p] = 0
        else:
            for p in pages:
                h[p] = RESERVED
                o[p] = r
            self._take_from_stack()
        rec.reserved.extend(pages)
        self.free_count -= k
        return _NO_EFFECTS

    def _release_to_free(self, pages, tenant: str | None, dirty) -> None:
        """Pages leave a request for the free stack; marks follow the policy."""
        h, o, ins, stack = self.holder, self.owner, self.in_stack, self.free_stack
        pend, stale = self.pending, self.stale
        for p in pages:
            h[p] = FREE
            o[p] = -1
            if pend[p]:
                # Listed for a step that has not been sealed: nothing zeroed it yet.
                pend[p] = 0
                stale[p] = MARK_ALL
            if not ins[p]:
                ins[p] = 1
                stack.append(p)
        self.free_count += len(pages)
        if self.policy != "released_aliases" and dirty:
            if self.policy == "all_reused":
                for p in dirty:
                    stale[p] = MARK_ALL
            else:
                res = self.residue
                for p in dirty:
                    if stale[p] != MARK_ALL:
                        stale[p] = MARK_TENANT
                        res[p] = tenant

    def _a_returned(self, e: ReservationReturned) -> tuple:
        rec = self.requests[e.request]
        pages = e.page_ids
        _remove(rec.reserved, pages)
        dirty = ()
        if rec.restored:
            dirty = [p for p in pages if p in rec.restored]
            rec.restored.difference_update(pages)
        self._release_to_free(pages, rec.tenant, dirty)
        return _NO_EFFECTS

    def _a_committed(self, e: PagesCommitted) -> tuple:
        rec = self.requests[e.request]
        pages = e.page_ids
        h, stale, pend = self.holder, self.stale, self.pending
        listed = None
        for p in pages:
            h[p] = KV
            if stale[p]:
                if stale[p] == MARK_TENANT and self.residue[p] == rec.tenant:
                    stale[p] = 0  # the committing tenant's own bytes
                    continue
                stale[p] = 0
                if not pend[p]:
                    pend[p] = 1
                    if listed is None:
                        listed = [p]
                    else:
                        listed.append(p)
        _remove(rec.reserved, pages)
        if rec.restored:
            rec.restored.difference_update(pages)
        rec.kv.extend(pages)
        if listed is None:
            return _NO_EFFECTS
        cl = self.clear_lists.get(e.step)
        if cl is None:
            self.clear_lists[e.step] = listed
        else:
            cl.extend(listed)
        return (ClearPages(step=e.step, page_ids=tuple(listed)),)

    def _a_request_gone(self, e) -> tuple:
        rec = self.requests.pop(e.request)
        pages = rec.reserved + rec.kv
        dirty = ()
        if self.policy != "released_aliases":
            dirty = rec.kv + [p for p in rec.reserved if p in rec.restored]
        self._release_to_free(pages, rec.tenant, dirty)
        return _NO_EFFECTS

    def _a_aliased(self, e: SnapshotAliased) -> tuple:
        pages = e.page_ids
        h, an = self.holder, self.alias_n
        newly = 0
        for p in pages:
            if h[p] == FREE:
                h[p] = ALIAS
                an[p] = 1
                newly += 1
            else:
                an[p] += 1
        if newly:
            self.free_count -= newly
            self._take_from_stack()
        mine = self.snapshots.get(e.snapshot)
        if mine is None:
            self.snapshots[e.snapshot] = list(pages)
        else:
            mine.extend(pages)
        return _NO_EFFECTS

    def _a_released(self, e: SnapshotReleased) -> tuple:
        pages = self.snapshots.pop(e.snapshot)
        h, an, stale, ins, stack = self.holder, self.alias_n, self.stale, self.in_stack, self.free_stack
        freed = 0
        for p in pages:
            c = an[p] - 1
            an[p] = c
            if c == 0:
                h[p] = FREE
                stale[p] = MARK_ALL
                freed += 1
                if not ins[p]:
                    ins[p] = 1
                    stack.append(p)
        self.free_count += freed
        return _NO_EFFECTS

    def _a_restore_started(self, e: RestoreStarted) -> tuple:
        pages = e.page_ids
        rs, targets = self.restoring, self.restore_targets
        t = (e.into, e.target)
        for p in pages:
            rs[p] = 1
            targets[p] = t
        if e.into == "request":
            stale = self.stale
            for p in pages:
                stale[p] = 0  # overwritten whole: the restore removes the mark
            if self.policy != "released_aliases":
                self.requests[e.target].restored.update(pages)
        return _NO_EFFECTS

    def _a_restore_completed(self, e: RestoreCompleted) -> tuple:
        rs, targets = self.restoring, self.restore_targets
        for p in e.page_ids:
            rs[p] = 0
            del targets[p]
        return _NO_EFFECTS

    def derive_clear_list(self, step: int) -> tuple[int, ...]:
        """The plan's clear list for ``step``: listed pages still pending, once each, in order."""
        listed = self.clear_lists.get(step)
        if not listed:
            return ()
        pend = self.pending
        out = []
        seen = set()
        for p in listed:
            if pend[p] and p not in seen:
                seen.add(p)
                out.append(p)
        return tuple(out)

    def _a_sealed(self, e: StepSealed) -> tuple:
        clear_list = self.derive_clear_list(e.step)
        self.clear_lists.pop(e.step, None)
        pend = self.pending
        for p in clear_list:
            pend[p] = 0
        self.open_step = e.step + 1
        plan = StepPlan(step=e.step, clear_list=clear_list)
        self.last_plan = plan
        return (plan,)

    def _a_step_completed(self, e: StepCompleted) -> tuple:
        if e.step > self.completed.get(e.rank, -1):
            self.completed[e.rank] = e.step
        return _NO_EFFECTS

    def _a_step_aborted(self, e: StepAborted) -> tuple:
        """Nothing of the aborted step can be assumed zeroed: its pages go back to pending."""
        plan = self.last_plan
        self.last_plan = None
        h, stale, pend, rs = self.holder, self.stale, self.pending, self.restoring
        carry: list[int] = []
        for p in plan.clear_list:
            if h[p] == KV:
                if not pend[p]:
                    pend[p] = 1
                    carry.append(p)
            elif not (rs[p] and self.restore_targets[p][0] == "request"):
                stale[p] = MARK_ALL
        if carry:
            step = self.open_step
            self.clear_lists[step] = carry + self.clear_lists.get(step, [])
        return _NO_EFFECTS

    # ------------------------------------------------------------------ canonical form

    def canonical(self) -> dict:
        """Every field of the state, in a form independent of hash seed and insertion order.

        Used for the digest and for log checkpoints (``from_canonical`` restores it).
        """
        g = self.geometry
        return {
            "v": DIGEST_VERSION,
            "geometry": None if g is None else [g.num_pages, g.page_tokens],
            "policy": self.policy,
            "seq": self.seq,
            "open_step": self.open_step,
            "holder": bytes(self.holder),
            "owner": self.owner,
            "alias_n": self.alias_n,
            "stale": bytes(self.stale),
            "residue": self.residue if self.policy == "cross_tenant" else [],
            "restoring": bytes(self.restoring),
            "pending": bytes(self.pending),
            "in_stack": bytes(self.in_stack),
            "free_stack": self.free_stack,
            "free_count": self.free_count,
            "requests": [
                [r, rec.tenant, rec.reserved, rec.kv, sorted(rec.restored)]
                for r, rec in sorted(self.requests.items())
            ],
            "snapshots": [[s, pages] for s, pages in sorted(self.snapshots.items())],
            "restore_targets": [[p, t[0], t[1]] for p, t in sorted(self.restore_targets.items())],
            "clear_lists": [[s, pages] for s, pages in sorted(self.clear_lists.items())],
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
        st.holder = bytearray(data["holder"])
        st.owner = list(data["owner"])
        st.alias_n = list(data["alias_n"])
        st.stale = bytearray(data["stale"])
        if data["residue"]:
            st.residue = list(data["residue"])
        st.restoring = bytearray(data["restoring"])
        st.pending = bytearray(data["pending"])
        st.in_stack = bytearray(data["in_stack"])
        st.free_stack = list(data["free_stack"])
        st.free_count = data["free_count"]
        for r, tenant, reserved, kv, restored in data["requests"]:
            rec = RequestRecord(r, tenant)
            rec.reserved = list(reserved)
            rec.kv = list(kv)
            rec.restored = set(restored)
            st.requests[r] = rec
        st.snapshots = {s: list(pages) for s, pages in data["snapshots"]}
        st.restore_targets = {p: (into, t) for p, into, t in data["restore_targets"]}
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
