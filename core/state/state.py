"""Scheduler state: the page table, its queries, and the dispatch through the transition table.

The page table is one flat list indexed by page id plus a free stack and a few
sparse maps, never an object per page (``table.py`` names the codes):

    holder[p]         the holder in one int: a request id r >= 0 (reserved(r) or
                      kv(r): which one is told by r's ``reserved`` / ``kv`` lists),
                      HOLDER_FREE (-1) or HOLDER_ALIAS (-2). One store per page per
                      transition; a commit moves pages between r's lists and
                      stores nothing per page.
    alias_count[p]    number of live snapshots aliasing p (alias iff > 0)
Sparse (a page is in the map only while the flag is set):
    marks[p]          the mark: MARK_ALL or MARK_TENANT (cross_tenant policy: zero
                      unless the reader is the tenant in residue[p])
    restore_targets   p -> (into, target) while an inbound restore writes p
                      (the ``restoring`` flag)
    pending           page -> the unsealed step whose clear list it sits in
    overwritten       page -> the step a ``reads="none"`` commit took its mark off for,
                      while that step may still not run for it (not retired): an
                      abort, a release before the seal or PagesUnwritten give it back
    restored_since    page -> the open step when a restore into a request last
                      overwrote it (an abort of a plan sealed before must not zero it)
    in_flight         the plans of the last sealed steps not aborted (at most
                      MAX_IN_FLIGHT, oldest first): the steps an abort may still reach
    clear_lists       step -> pages listed for it, in listing order (a page that
                      left KV before the seal stays in the list, no longer pending;
                      ``derive_clear_list`` skips it)
Prefix caching (sparse, empty until a request publishes):
    page_hash / hash_page   a hashed page's block hash, and back
    hash_tenant       a hashed page's writer's tenant (cross_tenant / all_reused only:
                      sharing across tenants is refused, eviction marks for the writer)
    sharers           p -> R, the requests of a page in kv(R) with |R| >= 2, in the
                      order they joined (holder[p] is R[0]): an ordered set, dict keys
                      (``table.sharer_set``: O(1) to join, to leave, and for R[0])
    cached            the cached pages, least recently used first (an OrderedDict)
    aborted_steps     steps recorded as aborted (their pages are never published)

The free stack: the allocator takes from its top (LIFO), freed pages are pushed
in event order. Taking a page from anywhere but the top (a snapshot aliasing
named free pages, the allocator skipping a page a restore is still writing)
leaves its entry in place as a stale entry (lazy deletion, O(1)): an entry is
live iff its page is free and no entry of the same page lies above it (a page
freed again is pushed above its stale entries). ``stale_entries`` counts them,
the top is kept live, and the stack is compacted once more than half of it is
stale. ``live_free_stack()`` is the free pages in stack order (what the digest
and checkpoints hold), the same order as if pages were removed in place. The
stack is derived from the event sequence alone, so replay reproduces the
allocator's future choices.

``validate(event)`` raises a specific ``KVLedgerError`` and changes nothing;
``apply(event)`` folds a validated event and returns its effects. Both go through
``transitions.TRANSITIONS`` (the rule of every event); both are pure.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice

from ..errors import ConfigurationError, InvalidArgumentError
from ..events.events import CacheConfigured, Geometry, StepPlan
from . import canonical as _canonical
from .table import ALIAS, CACHED, FREE, HOLDER_CACHED, HOLDER_FREE, HOLDER_NAMES, KV, RESERVED, RequestRecord
from .transitions import TRANSITIONS, Transition

__all__ = ["LedgerState", "hash_text"]


def hash_text(h: int | bytes) -> str:
    """A block hash for people: hex for bytes (first 8 bytes), decimal for ints."""
    if isinstance(h, bytes):
        return h[:8].hex() + ("..." if len(h) > 8 else "")
    return str(h)


class LedgerState:
    """The fold's state. ``validate`` rejects, ``apply`` folds; ``seq`` counts folded events.

    ``transitions`` is the table this state dispatches through (``TRANSITIONS``;
    a test may give one state a broken row to prove that a checker catches it).
    """

    transitions: dict[type, Transition] = TRANSITIONS

    def __init__(self, transitions: dict[type, Transition] | None = None) -> None:
        if transitions is not None and transitions is not self.transitions:
            self.transitions = transitions  # (an instance's own table: dispatch below follows it)
        self.geometry: Geometry | None = None
        self.policy = "released_aliases"
        self.seq = 0
        self.num_pages = 0
        self.holder: list[int] = []
        self.alias_count: list[int] = []
        self.marks: dict[int, int] = {}
        self.residue: dict[int, str | None] = {}
        self.restore_targets: dict[int, tuple[str, int]] = {}
        self.pending: dict[int, int] = {}
        self.restored_since: dict[int, int] = {}
        self.overwritten: dict[int, int] = {}
        self.free_stack: list[int] = []
        self.stale_entries = 0  # stale entries in free_stack (see the module docstring)
        self.parked: list[list] = []  # [marker, pages]: free pages a restore is writing (the module docstring)
        self.parked_count = 0
        self.requests: dict[int, RequestRecord] = {}
        self.snapshots: dict[int, list[int]] = {}
        self.open_step = 0
        self.clear_lists: dict[int, list[int]] = {}
        self.in_flight: list[StepPlan] = []
        self.completed: dict[int, int] = {}  # rank -> highest step it completed
        self.page_hash: dict[int, int | bytes] = {}
        self.hash_page: dict[int | bytes, int] = {}
        self.hash_tenant: dict[int, str | None] = {}
        self.sharers: dict[int, dict[int, None]] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.aborted_steps: set[int] = set()
        self.dispatch = {t: (row.validate, row.apply) for t, row in self.transitions.items()}

    # ------------------------------------------------------------------ entry points

    def validate(self, event) -> None:
        """Raise the specific ``KVLedgerError`` if ``event`` breaks its precondition. Pure."""
        row = self.transitions.get(type(event))
        if row is None:
            raise InvalidArgumentError(f"not a kvledger event: {type(event).__name__}")
        if self.geometry is None and type(event) is not CacheConfigured:
            raise ConfigurationError(
                f"{type(event).__name__} before CacheConfigured: the first event configures the cache"
            )
        row.validate(self, event)

    def apply(self, event) -> tuple:
        """Fold a validated event; return its effects (``ClearPages``, ``StepPlan``) or ``()``."""
        return self.transitions[type(event)].apply(self, event)

    def fold(self, event) -> tuple:
        """``validate`` then ``apply``: the path for events from outside (replay)."""
        self.validate(event)
        return self.transitions[type(event)].apply(self, event)

    @property
    def last_plan(self) -> StepPlan | None:
        """The plan of the last sealed step, unless it was aborted."""
        return self.in_flight[-1] if self.in_flight else None

    # ------------------------------------------------------------------ the allocator

    @property
    def free_count(self) -> int:
        return len(self.free_stack) - self.stale_entries + self.parked_count

    @property
    def cached_count(self) -> int:
        return len(self.cached)

    @property
    def free_reservable(self) -> int:
        """Free pages an allocation may take without evicting (free and not restoring: the
        live entries of the free stack; the restoring ones are parked beside it)."""
        return len(self.free_stack) - self.stale_entries

    @property
    def reservable_count(self) -> int:
        """Pages an allocation may take now: free and not restoring, plus cached ones
        (evicted least recently used first when the free ones run out)."""
        return self.free_reservable + len(self.cached)

    def evictable(self, n: int) -> list[int]:
        """The ``n`` cached pages an allocation would evict next (least recently used first)."""
        return list(islice(self.cached, n))

    @property
    def completed_step(self) -> int:
        """The highest step every rank that reported completions has completed (-1: none)."""
        return min(self.completed.values()) if self.completed else -1

    def pick_free(self, n: int) -> tuple[int, ...] | None:
        """The ``n`` pages the allocator takes next (top of the free stack first; pages a
        restore is still writing are parked beside it, never in it), or None when there
        are too few. Pure."""
        stack = self.free_stack
        if n > len(stack) - self.stale_entries:
            return None
        if not self.stale_entries:
            return tuple(stack[: -n - 1 : -1])  # pop order: the top of the stack first
        picked: list[int] = []
        holder, targets, seen = self.holder, self.restore_targets, set()
        for i in range(len(stack) - 1, -1, -1):
            p = stack[i]
            if p in seen or holder[p] != HOLDER_FREE or p in targets:
                continue  # a stale entry (an entry of a parked page is one too)
            seen.add(p)
            picked.append(p)
            if len(picked) == n:
                return tuple(picked)
        return None

    # The parked pages. A page that goes free while a restore is still writing it cannot
    # be reserved until the restore completes, yet its place in the allocator's order is
    # where it was freed. It is parked beside the stack instead of pushed: ``parked`` holds
    # runs ``[marker, pages]`` (markers ascending, distinct), a run sitting between
    # ``free_stack[marker - 1]`` and ``free_stack[marker]``, its pages bottom to top. The
    # stack itself then holds no restoring page, so the allocator takes its top whatever
    # the number of restores in flight; when the stack shrinks below a marker, the runs
    # above sink with it (``clamp_parked``); a completed restore puts its page back into
    # the stack where its run sits (``unpark``: O(the entries above it)).

    def push_free(self, pages) -> None:
        """Push pages that just went free, in order; restoring ones are parked in place."""
        targets = self.restore_targets
        if not targets or targets.keys().isdisjoint(pages):
            self.free_stack += pages
            return
        stack, runs = self.free_stack, self.parked
        for p in pages:
            if p in targets:
                marker = len(stack)
                if runs and runs[-1][0] == marker:
                    runs[-1][1].append(p)
                else:
                    runs.append([marker, [p]])
                self.parked_count += 1
            else:
                stack.append(p)

    def clamp_parked(self) -> None:
        """After the stack shrank: runs above its new top sink onto it (merged, in order)."""
        runs, top = self.parked, len(self.free_stack)
        if not runs or runs[-1][0] <= top:
            return
        if len(runs) == 1 or runs[-2][0] < top:
            runs[-1][0] = top  # (one run sinks: the usual case)
            return
        i = len(runs)
        while i and runs[i - 1][0] >= top:
            i -= 1
        base = runs[i][1]
        for _, pages in runs[i + 1 :]:
            base += pages
        del runs[i + 1 :]
        runs[i][0] = top

    def unpark(self, pages) -> None:
        """Restores into ``pages`` completed: the parked ones among them go back into the
        stack where they sit (pages that are not parked are left alone)."""
        done = set(pages)
        runs, stack = self.parked, self.free_stack
        shift = 0  # pages put back so far: the markers above move up by as many
        out: list[list] = []
        for marker, run in runs:
            marker += shift
            if done.isdisjoint(run):
                out.append([marker, run])
                continue
            back: list[int] = []
            rest: list[int] = []
            for p in run:
                if p in done:
                    if rest:
                        out.append([marker + len(back), rest])
                        rest = []
                    back.append(p)
                else:
                    rest.append(p)
            if rest:
                out.append([marker + len(back), rest])
            if marker == len(stack):
                stack += back
            else:
                stack[marker:marker] = back
            shift += len(back)
            self.parked_count -= len(back)
        self.parked = out

    def live_free_stack(self) -> list[int]:
        """The free pages in stack order, bottom to top: the live entries of the stack
        (stale entries left out) with the parked runs in their places. O(stack)."""
        stack, runs = self.free_stack, self.parked
        if not self.stale_entries:
            if not runs:
                return list(stack)
            live_at = None
        else:
            live_at = self._live_entries()
        out: list[int] = []
        at = 0
        for marker, pages in (*runs, (len(stack), ())):
            if live_at is None:
                out += stack[at:marker]
            else:
                out += [stack[i] for i in range(at, marker) if live_at[i]]
            out += pages
            at = marker
        return out

    def _live_entries(self) -> list[bool]:
        """For each free-stack entry, whether it is live: the topmost entry of a page that is free
        and no restore's target (a page freed again leaves its older entries stale below)."""
        stack, holder, targets, seen = self.free_stack, self.holder, self.restore_targets, set()
        live_at = [False] * len(stack)
        for i in range(len(stack) - 1, -1, -1):
            p = stack[i]
            if p not in seen and holder[p] == HOLDER_FREE and p not in targets:
                seen.add(p)
                live_at[i] = True
        return live_at

    def compact_free_stack(self) -> None:
        """Drop the stale entries (the allocator's order is unchanged; the runs' markers follow)."""
        if not self.stale_entries:
            return
        stack, runs = self.free_stack, self.parked
        live_at = self._live_entries()
        kept: list[int] = []
        at = 0
        for run in runs:
            kept += [stack[i] for i in range(at, run[0]) if live_at[i]]
            at, run[0] = run[0], len(kept)
        kept += [stack[i] for i in range(at, len(stack)) if live_at[i]]
        self.free_stack = kept
        self.stale_entries = 0
        merged: list[list] = []
        for run in runs:  # (runs whose stale entries between them went are now at one marker)
            if merged and merged[-1][0] == run[0]:
                merged[-1][1] += run[1]
            else:
                merged.append(run)
        self.parked = merged

    def derive_clear_list(self, step: int) -> tuple[int, ...]:
        """The plan's clear list for ``step``: its listed pages still pending for it, each
        once, in the order they were last listed (carried pages of an aborted step first)."""
        listed = self.clear_lists.get(step)
        if not listed:
            return ()
        pend = self.pending
        out: list[int] = []
        seen: set[int] = set()
        for p in reversed(listed):
            if p not in seen and pend.get(p) == step:
                seen.add(p)
                out.append(p)
        out.reverse()
        return tuple(out)

    # ------------------------------------------------------------------ queries

    def holder_code(self, page_id: int) -> int:
        """FREE, RESERVED, KV, ALIAS or CACHED for one page (O(pages of its request))."""
        x = self.holder[page_id]
        if x >= 0:
            return KV if page_id in self.requests[x].kv else RESERVED
        if x == HOLDER_FREE:
            return FREE
        return CACHED if x == HOLDER_CACHED else ALIAS

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
        for p in self.cached:
            h[p] = CACHED
        return h

    def holder_of(self, page_id: int) -> str:
        """Human-readable holder of a page: ``free``, ``reserved(r)``, ``kv(r)``,
        ``kv({r1,r2})`` (shared), ``alias({s,...})``, ``cached(h)``."""
        kind = self.holder_code(page_id)
        if kind == KV and page_id in self.sharers:
            return "kv({" + ",".join(map(str, self.sharers[page_id])) + "})"
        if kind in (RESERVED, KV):
            return f"{HOLDER_NAMES[kind]}({self.holder[page_id]})"
        if kind == ALIAS:
            return "alias({" + ",".join(map(str, self.snapshot_ids_of(page_id))) + "})"
        if kind == CACHED:
            return f"cached({hash_text(self.page_hash[page_id])})"
        return "free"

    def holders_of(self, page_id: int) -> list[int]:
        """The requests holding a page in KV (R of kv(R); empty when it is not kv)."""
        if page_id in self.sharers:
            return list(self.sharers[page_id])
        return [self.holder[page_id]] if self.holder_code(page_id) == KV else []

    def lookup(self, hashes, tenant: str | None = None) -> int:
        """How many leading blocks of ``hashes`` are cached or held, ready to share (under the
        isolating policies: written by ``tenant``)."""
        n = 0
        hp, marks, targets = self.hash_page, self.marks, self.restore_targets
        isolating = self.policy != "released_aliases"
        if not (marks or targets or isolating):  # (the usual case) every page a hash names is shareable
            for h in hashes:
                if h not in hp:
                    break
                n += 1
            return n
        for h in hashes:
            p = hp.get(h)
            if p is None or p in marks or p in targets or (isolating and self.hash_tenant.get(p) != tenant):
                break
            n += 1
        return n

    def snapshot_ids_of(self, page_id: int) -> list[int]:
        return sorted(s for s, pages in self.snapshots.items() if page_id in pages)

    def is_marked(self, page_id: int) -> bool:
        return page_id in self.marks

    def is_restoring(self, page_id: int) -> bool:
        return page_id in self.restore_targets

    def is_pending(self, page_id: int) -> bool:
        """Listed for an unsealed step's clear list."""
        return page_id in self.pending

    # ------------------------------------------------------------------ canonical form

    def canonical(self, version: int = _canonical.DIGEST_VERSION) -> dict:
        """Every field of the state, independent of hash seed and insertion order (a copy)."""
        return _canonical.canonical(self, version)

    def canonical_bytes(self, version: int = _canonical.DIGEST_VERSION) -> bytes:
        return _canonical.canonical_bytes(self, version)

    def digest(self, version: int = _canonical.DIGEST_VERSION) -> str:
        """BLAKE2b-256 of the canonical encoding, hex. Equal states give equal digests anywhere.

        ``version`` 1 gives the digest an older kvledger computed (for its checkpoints)."""
        return _canonical.digest(self, version)

    @classmethod
    def from_canonical(cls, data: dict) -> LedgerState:
        """Rebuild a state from ``canonical()`` output (a checkpoint)."""
        return _canonical.from_canonical(cls, data)
