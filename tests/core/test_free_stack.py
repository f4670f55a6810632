"""The free stack's lazy deletion against the plain list it replaces.

Taking a free page from the middle of the stack (a snapshot aliasing named free
pages, the allocator skipping pages a restore is still writing) leaves a stale
entry instead of a ``list.remove``. The oracle is the old representation, a list
with in-place removal: after every command the live stack, the allocator's next
choice, ``free_count`` and the digest (which holds the live stack) must agree
with it, across compactions. Kills: a stale entry taken as live (a page handed
out twice), a compaction that reorders the stack, a miscounted ``stale_entries``.
"""

from __future__ import annotations

import random

import pytest

from kvledger import Geometry, Ledger, check_invariants


class ListModel:
    """The free stack as a plain list with in-place removal (the reference)."""

    def __init__(self, n: int) -> None:
        self.stack = list(range(n - 1, -1, -1))
        self.restoring: set[int] = set()

    def pick(self, k: int) -> list[int] | None:
        out = [p for p in reversed(self.stack) if p not in self.restoring][:k]
        return out if len(out) == k else None

    def take(self, pages) -> None:
        for p in pages:
            self.stack.remove(p)

    def free(self, pages) -> None:
        self.stack.extend(pages)


@pytest.mark.parametrize("seed", range(12))
def test_lazy_deletion_matches_in_place_removal(seed):
    rng = random.Random(seed)
    n = 96
    L = Ledger(Geometry(num_pages=n, page_tokens=4), check=seed % 3 == 0)
    m = ListModel(n)
    requests: list[int] = []
    snapshots: dict[int, list[int]] = {}
    restoring: dict[int, list[int]] = {}  # snapshot -> pages a restore into it is writing
    next_id = 0
    stale_seen = parked_seen = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.30:
            k = rng.randint(1, 8)
            want = m.pick(k)
            if want is None:
                continue
            next_id += 1
            assert list(L.reserve(next_id, k)) == want
            m.take(want)
            requests.append(next_id)
        elif op < 0.50 and m.stack:
            # alias named free pages (deep in the stack as often as not) and maybe restore into them
            free_now = [p for p in m.stack if p not in m.restoring]
            if not free_now:
                continue
            pages = rng.sample(free_now, min(len(free_now), rng.randint(1, 6)))
            next_id += 1
            L.alias_snapshot(next_id, pages=pages)
            m.take(pages)
            snapshots[next_id] = pages
            if rng.random() < 0.5:
                L.start_restore(pages, snapshot=next_id)
                restoring[next_id] = pages
        elif op < 0.70 and snapshots:
            s = rng.choice(sorted(snapshots))
            pages = snapshots.pop(s)
            L.release_snapshot(s)
            m.free(pages)
            if s in restoring:
                m.restoring.update(pages)  # freed while its restore still writes: unreservable
        elif op < 0.80 and restoring:
            s = rng.choice(sorted(restoring))
            pages = restoring.pop(s)
            L.complete_restore(pages, snapshot=s)
            m.restoring.difference_update(pages)
        elif requests:
            r = requests.pop(rng.randrange(len(requests)))
            pages = list(L.reserved_pages(r))
            L.finish(r)
            m.free(pages)
        st = L.state
        assert st.live_free_stack() == m.stack
        assert st.free_count == len(m.stack)
        got = st.pick_free(3)
        assert (None if got is None else list(got)) == m.pick(3)
        stale_seen = max(stale_seen, st.stale_entries)
        parked_seen = max(parked_seen, st.parked_count)
    check_invariants(L.state)
    assert stale_seen > 0, "the trace never left a stale entry: it tests nothing"
    assert parked_seen > 0, "the trace never freed a page mid-restore: it tests nothing"


def test_compaction_keeps_the_order_and_the_digest():
    n = 400
    a = Ledger(Geometry(num_pages=n, page_tokens=4))
    pages = list(range(0, n, 2))[:150]  # deep in the stack: 150 stale entries, more than half compacts
    a.alias_snapshot(1, pages=pages)
    assert a.state.stale_entries < 150  # compacted on the way (a lazily deleted stack never grows unbounded)
    digest = a.digest()
    a.state.compact_free_stack()
    assert a.state.stale_entries == 0 and a.digest() == digest
    check_invariants(a.state)


def test_parked_pages_cost_the_allocator_nothing_and_come_back_in_place():
    """4,096 pages released while a restore writes them sit on top of the free stack: the
    allocator takes the pages below them (they are parked beside the stack, never scanned),
    and when the restore completes they are back where they were freed: above the pages
    freed before them, below the pages freed after (the list model's order)."""
    n = 8192
    L = Ledger(Geometry(num_pages=n, page_tokens=4))
    m = ListModel(n)
    rows = list(L.alias_snapshot(1, 4096))
    m.take(rows)
    L.start_restore(rows, snapshot=1)
    L.release_snapshot(1)  # free, marked, still restoring: on top of the stack, unreservable
    m.free(rows)
    m.restoring.update(rows)
    assert L.state.parked_count == 4096 and L.free_count == n and L.reservable_count == n - 4096
    for r in range(20):
        want = m.pick(16)
        assert list(L.reserve(r, 16)) == want and not set(want) & set(rows)
        m.take(want)
    for r in (3, 11):  # freed after the rows: above them
        m.free(list(L.reserved_pages(r)))
        L.finish(r)
    assert L.state.live_free_stack() == m.stack
    L.complete_restore(rows[:100] + rows[-100:], snapshot=1)  # some of them, from both ends of the run
    m.restoring.difference_update(rows[:100] + rows[-100:])
    assert L.state.live_free_stack() == m.stack and L.state.parked_count == 3896
    got = L.reserve(40, 64)
    assert list(got) == m.pick(64)  # 32 pages freed last, then the completed top of the rows
    m.take(got)
    L.complete_restore(rows[100:-100], snapshot=1)
    m.restoring.clear()
    assert L.state.live_free_stack() == m.stack and L.state.parked_count == 0
    assert list(L.reserve(41, 200)) == m.pick(200)
    check_invariants(L.state)
