"""R8's reference model: SPEC's event tables written slowly and obviously (tests/core/test_state_machine.py).

Plain dicts, lists and sets: no flat arrays, no free stack, no pending map, no
pruning. The model predicts every page's holder (rendered as
``LedgerState.holder_of`` renders it), its mark, its restoring flag and its
block hash; the cache's least-recently-used order; each commit's clear list and
each step's plan (in order); the steps in flight (sealed, neither aborted nor
completed on every reporting rank, at most ``MAX_IN_FLIGHT``); what an abort
carries and what it marks; which pages an allocation evicts; and which pages
every event marks (the ``PagesMarked`` effects). It never reads a ledger.

Steps in flight, as the ledger must treat them:

    seal(k) ──► in flight ──complete on every reporting rank──► retired (publishable)
                   │   (the oldest leaves when a 17th is sealed)
                   └──abort(j <= k)──► aborted, with every later step in flight:
                        each plan's page (oldest plan first, each page once)
                        still in KV is listed again for the open step, any other
                        is marked, unless a restore into a request rewrote it
                        after that plan's seal
"""

from __future__ import annotations

from kvledger import CrossTenantShareError, InvalidArgumentError, PageNotHeldError, StepOrderError, TenantMismatchError
from kvledger.core.state.table import MAX_IN_FLIGHT

__all__ = ["ALL", "MAX_IN_FLIGHT", "SHARED", "Model", "Req", "hash_text"]

ALL = "all"
SHARED = -1  # the "commit step" of a page a request shares and did not write: readable at once


def hash_text(h) -> str:
    """A block hash as holders show it: the first 8 bytes in hex (``...`` if longer), or the int."""
    if isinstance(h, bytes):
        return h[:8].hex() + ("..." if len(h) > 8 else "")
    return str(h)


class Req:
    """One request incarnation (an id may be reused after cancel/finish)."""

    def __init__(self, rid, tenant, inc):
        self.rid, self.tenant, self.inc = rid, tenant, inc
        self.reserved: list[int] = []
        self.kv: list[tuple[int, int]] = []  # (page, step it was committed for, or SHARED), in order
        self.restored: set[int] = set()

    def kv_pages(self):
        return [p for p, _ in self.kv]


class Model:
    """SPEC's event tables, slowly and obviously."""

    def __init__(self, n, policy):
        self.n, self.policy = n, policy
        self.held: list[list[Req]] = [[] for _ in range(n)]  # reserved: [r]; kv: R in the order they joined
        self.aliases: list[set] = [set() for _ in range(n)]
        self.mark: list = [None] * n  # None | ALL | ("tenant", t)
        self.restoring: dict[int, tuple[str, int]] = {}
        self.requests: dict[int, Req] = {}
        self.snapshots: dict[int, list[int]] = {}
        self.open_step = 0
        self.listings: list[list] = []  # live [step, page, inc], in listing order
        self.in_flight: list[tuple[int, list[int]]] = []  # (step, plan), oldest first
        self.restored_at: dict[int, int] = {}  # page -> the open step when a restore into a request last wrote it
        self.incs = 0
        self.hashes: dict[int, object] = {}  # page -> block hash
        self.pages_of: dict[object, int] = {}  # block hash -> page
        self.hash_tenant: dict[int, object] = {}  # page -> its writer's tenant
        self.lru: list[int] = []  # cached pages, least recently used first
        self.completed: dict[int, int] = {}  # rank -> highest step completed
        self.aborted: set[int] = set()
        self.marked: list[int] = []  # pages marked since ``take_marked`` last ran
        self.overwritten: dict[int, int] = {}  # page -> the step a reads="none" commit took its mark off for

    # ------------------------------------------------------------------ queries

    def first(self, p):
        return self.held[p][0] if self.held[p] else None

    def kind(self, p):
        r = self.first(p)
        if r is not None:
            return "reserved" if p in r.reserved else "kv"
        if p in self.lru:
            return "cached"
        return "alias" if self.aliases[p] else "free"

    def holder(self, p):
        k = self.kind(p)
        if k == "kv" and len(self.held[p]) > 1:
            return "kv({" + ",".join(str(r.rid) for r in self.held[p]) + "})"
        if k in ("reserved", "kv"):
            return f"{k}({self.held[p][0].rid})"
        if k == "alias":
            return "alias({" + ",".join(str(s) for s in sorted(self.aliases[p])) + "})"
        if k == "cached":
            return f"cached({hash_text(self.hashes[p])})"
        return "free"

    def free(self):
        return [p for p in range(self.n) if self.kind(p) == "free"]

    def reservable(self):
        return [p for p in self.free() if p not in self.restoring]

    def listed(self, p):
        return any(x[1] == p for x in self.listings)

    def done(self):
        return min(self.completed.values()) if self.completed else -1

    def in_flight_steps(self):
        return [s for s, _ in self.in_flight]

    def lookup(self, hashes, tenant):
        """Leading blocks published (under the isolating policies: written by ``tenant``)."""
        n = 0
        for h in hashes:
            p = self.pages_of.get(h)
            if p is None or (self.policy != "released_aliases" and self.hash_tenant[p] != tenant):
                break
            n += 1
        return n

    def to_evict(self, n):
        """The cached pages an allocation of ``n`` evicts ([] if none), or None: out of pages."""
        short = n - len(self.reservable())
        if short > len(self.lru):
            return None
        return self.lru[:max(short, 0)]

    def take_marked(self):
        out, self.marked = self.marked, []
        return out

    # ------------------------------------------------------------------ marks

    def _mark_all(self, pages):
        for p in pages:
            self.mark[p] = ALL
        self.marked.extend(pages)

    def _dirty(self, pages, tenant):
        """A request's own bytes go free: marked for everyone (all_reused), for other tenants
        (cross_tenant, unless marked for everyone already), or not at all (released_aliases)."""
        if self.policy == "all_reused":
            self._mark_all(pages)
        elif self.policy == "cross_tenant":
            for p in pages:
                if self.mark[p] != ALL:
                    self.mark[p] = ("tenant", tenant)
            self.marked.extend(pages)

    # ------------------------------------------------------------------ transitions

    def reserve(self, rid, pages, tenant):
        r = self.requests.get(rid)
        if r is None:
            self.incs += 1
            r = self.requests[rid] = Req(rid, tenant, self.incs)
        for p in pages:
            self.held[p] = [r]
        r.reserved.extend(pages)

    def return_(self, rid, pages):
        r = self.requests[rid]
        for p in pages:
            r.reserved.remove(p)
            self.held[p] = []
        dirty = [p for p in pages if p in r.restored]
        r.restored.difference_update(pages)
        self._dirty(dirty, r.tenant)

    def commit(self, rid, step, pages, whole=False, none=False):
        """``whole``: the step reads the whole page before writing it: every mark is listed.
        ``none``: the step writes the page whole before reading it: marks come off, unlisted,
        until the step can no longer fail to write it."""
        r = self.requests[rid]
        listed = []
        for p in pages:
            m = self.mark[p]
            self.mark[p] = None
            if m is not None and none:
                self.overwritten[p] = step
                continue
            if m is None or (m == ("tenant", r.tenant) and not whole):
                continue
            listed.append(p)
            self.listings.append([step, p, r.inc])
        for p in pages:
            r.reserved.remove(p)
            r.kv.append((p, step))
        r.restored.difference_update(pages)
        return listed

    def gone(self, rid):
        """r leaves: its reserved pages go free; each KV page loses r as a holder; a page no one
        holds goes cached if hashed (the last block first in line), free otherwise."""
        r = self.requests.pop(rid)
        freed = []
        for p in reversed(r.kv_pages()):
            self.held[p].remove(r)
            if self.held[p]:
                continue
            if p in self.hashes:
                self.lru.append(p)
            else:
                freed.append(p)
        freed.reverse()
        for p in freed:
            if any(x[1] == p and x[2] == r.inc for x in self.listings):
                # listed, never zeroed: the mark comes back
                self.listings = [x for x in self.listings if x[1] != p]
                self._mark_all([p])
        self._unwritten_before_seal(freed)
        for p in r.reserved:
            self.held[p] = []
        self._dirty(freed + [p for p in r.reserved if p in r.restored], r.tenant)
        return r, freed

    def release_pages(self, rid, pages):
        """r lets go of some KV pages, as ``gone`` lets go of all of them; it keeps the rest.
        Returns the pages that went free."""
        r = self.requests[rid]
        for p in pages:
            r.kv = [(q, s) for q, s in r.kv if q != p]
            self.held[p].remove(r)
        for p in reversed(pages):
            if not self.held[p] and p in self.hashes:
                self.lru.append(p)
        freed = [p for p in pages if not self.held[p] and p not in self.hashes]
        for p in freed:
            if any(x[1] == p and x[2] == r.inc for x in self.listings):
                self.listings = [x for x in self.listings if x[1] != p]
                self._mark_all([p])
        self._unwritten_before_seal(freed)
        self._dirty(freed, r.tenant)
        return freed

    def _unwritten_before_seal(self, freed):
        """Pages going free that a reads="none" commit of a step not sealed yet was to write: nothing
        wrote them, the mark comes back."""
        for p in freed:
            s = self.overwritten.get(p)
            if s is not None and s >= self.open_step:
                del self.overwritten[p]
                self._mark_all([p])

    def alias(self, sid, pages):
        for p in pages:
            self.aliases[p].add(sid)
        self.snapshots.setdefault(sid, []).extend(pages)

    def release(self, sid):
        for p in self.snapshots.pop(sid):
            self.aliases[p].discard(sid)
            if not self.aliases[p]:
                self._mark_all([p])

    def start_restore(self, into, target, pages):
        for p in pages:
            self.restoring[p] = (into, target)
        if into == "request":
            self.requests[target].restored.update(pages)
            for p in pages:
                self.mark[p] = None
                self.restored_at[p] = self.open_step

    def complete_restore(self, pages):
        for p in pages:
            del self.restoring[p]

    def seal(self, step):
        """The plan: the step's live listings, in listing order. Returns (plan, the step that
        left the steps in flight at the cap, or None)."""
        plan = [x[1] for x in self.listings if x[0] == step]
        self.listings = [x for x in self.listings if x[0] != step]
        self.open_step = step + 1
        self.in_flight.append((step, plan))
        dropped = None
        if len(self.in_flight) > MAX_IN_FLIGHT:
            dropped = self.in_flight.pop(0)[0]
            oldest = self.in_flight[0][0]
            self.overwritten = {p: s for p, s in self.overwritten.items() if s >= oldest}
        return plan, dropped

    def complete(self, step, rank):
        """Returns the steps this completion retired (completed on every reporting rank)."""
        self.completed[rank] = max(self.completed.get(rank, -1), step)
        retired = [s for s, _ in self.in_flight if s <= self.done()]
        self.in_flight = [x for x in self.in_flight if x[0] > self.done()]
        self.overwritten = {p: s for p, s in self.overwritten.items() if s > self.done()}
        return retired

    def abort(self, step):
        """Abort ``step`` and every later step in flight. Returns (the aborted steps, the carried pages)."""
        aborted = [x for x in self.in_flight if x[0] >= step]
        self.in_flight = [x for x in self.in_flight if x[0] < step]
        carry: list[list] = []
        for s, plan in aborted:
            self.aborted.add(s)
            for p in plan:
                if self.restored_at.get(p, -1) > s:
                    continue  # a restore into a request rewrote it whole after this plan was sealed
                if self.kind(p) != "kv":
                    self._mark_all([p])
                elif not self.listed(p) and all(c[1] != p for c in carry):
                    carry.append([self.open_step, p, self.first(p).inc])
        gone = {s for s, _ in aborted}
        # a reads="none" commit of an aborted step wrote nothing; its pages come back in page order
        # (the order a checkpoint keeps them in, so a replay from any segment derives the same list)
        for p in sorted(q for q, s in self.overwritten.items() if s in gone):
            del self.overwritten[p]
            if self.kind(p) != "kv":
                self._mark_all([p])
            elif not self.listed(p) and all(c[1] != p for c in carry):
                carry.append([self.open_step, p, self.first(p).inc])
        self.listings = carry + self.listings
        return [s for s, _ in aborted], [c[1] for c in carry]

    # ------------------------------------------------------------------ prefix caching

    def publish_error(self, r, entries, hashes):
        """The error publishing ``entries`` (r's (page, step) pairs) under ``hashes`` raises, or None."""
        if len(set(hashes)) != len(hashes):
            return InvalidArgumentError
        done = self.done()
        for (p, step), h in zip(entries, hashes, strict=True):
            if step == SHARED:
                return PageNotHeldError
            if step > done or step in self.aborted:
                return StepOrderError
            if p in self.hashes:
                return PageNotHeldError
            if h in self.pages_of:
                return InvalidArgumentError
        return None

    def publish(self, r, entries, hashes):
        for (p, _), h in zip(entries, hashes, strict=True):
            self.hashes[p], self.pages_of[h] = h, p
            self.hash_tenant[p] = r.tenant

    def share_error(self, rid, tenant, pages):
        r = self.requests.get(rid)
        if r is not None and tenant is not None and tenant != r.tenant:
            return TenantMismatchError
        if not pages:
            return InvalidArgumentError
        t = tenant if r is None else r.tenant
        mine = set() if r is None else set(r.reserved) | set(r.kv_pages())
        for p in pages:
            if p in mine:
                return PageNotHeldError
            if self.policy != "released_aliases" and self.hash_tenant[p] != t:
                return CrossTenantShareError
        return None

    def share(self, rid, tenant, pages):
        r = self.requests.get(rid)
        if r is None:
            self.incs += 1
            r = self.requests[rid] = Req(rid, tenant, self.incs)
        for p in pages:
            if p in self.lru:
                self.lru.remove(p)
            self.held[p].append(r)
            r.kv.append((p, SHARED))
        return r

    def evict(self, pages):
        """Cached pages go free, hashes dropped, marked as a request's page going free would be
        under the policy (with the writer's tenant). Returns their hashes, in order."""
        out = []
        for p in pages:
            h = self.hashes.pop(p)
            del self.pages_of[h]
            tenant = self.hash_tenant.pop(p)
            self.lru.remove(p)
            out.append(h)
            self._dirty([p], tenant)
        return out
