"""R14 soak: request lifecycles with cancels and snapshot churn on one ledger.

Quick profile (CI): 100,000 lifecycles on a 1,024-page cache (small enough that KV
pressure preempts and refuses requests). Heavy profile:
``KVLEDGER_SOAK_LIFECYCLES=10000000 python -m pytest -s tests/core/test_soak.py``.
Check mode is off (the hot path); the full invariant checker runs every 10,000
lifecycles and at the end, a cheap partition count every 1,000.

Besides "holders always partition the pages" and "the free count returns to its
baseline after drain", the soak keeps a ledger of marks (exactly once, at scale):

    marks set by releases == pages cleared by plans + marks removed by restores
                             + pages still marked after the drain

so a mark that vanished without a clear, or a page cleared twice, shows up as a
difference. Prints lifecycles, events, pages cleared and leaked pages.
"""

from __future__ import annotations

import os
import random
import time

from kvledger import Geometry, Ledger, OutOfPagesError, check_invariants

NUM_PAGES = 1024
LIFECYCLES = int(os.environ.get("KVLEDGER_SOAK_LIFECYCLES", "100000"))
SEED = int(os.environ.get("KVLEDGER_SOAK_SEED", "20240611"))
CHECK_EVERY = 10_000
COUNT_EVERY = 1_000
MAX_LIVE = 48
TENANTS = ("a", "b", "c")


class Soak:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.L = Ledger(Geometry(num_pages=NUM_PAGES, page_tokens=16))
        self.live: dict[int, list] = {}  # request -> [pages wanted, pages committed, chunk, tenant]
        self.snapshots: list[int] = []
        self.restoring: dict[tuple[str, int], list[int]] = {}
        self.next_request = 0
        self.next_snapshot = 0
        self.c = dict.fromkeys(
            ("lifecycles", "finished", "cancelled", "preempted", "refused", "returned", "snapshots",
             "shared aliases", "released", "restores into requests", "restores into snapshots",
             "marks set", "marks removed by restores", "pages listed", "pages cleared", "steps"),
            0,
        )

    # ---------------------------------------------------------------- accounting helpers

    def release(self, sid: int) -> None:
        L = self.L
        pages = L.snapshot_pages(sid)
        last = [p for p in pages if L.state.snapshot_ids_of(p) == [sid]]  # freed by this release
        self.c["marks set"] += sum(1 for p in last if not L.is_marked(p))
        L.release_snapshot(sid)
        self.c["released"] += 1

    def restore_into_request(self, r: int, pages) -> None:
        L = self.L
        self.c["marks removed by restores"] += sum(1 for p in pages if L.is_marked(p))
        L.start_restore(pages, request=r)
        self.restoring[("request", r)] = list(pages)
        self.c["restores into requests"] += 1

    def complete_restores(self) -> None:
        for (into, target), pages in self.restoring.items():
            self.L.complete_restore(pages, **{into: target})
        self.restoring.clear()

    def seal(self) -> None:
        plan = self.L.seal_step(self.L.open_step)
        self.c["pages cleared"] += len(plan.clear_list)
        self.c["steps"] += 1

    def end(self, r: int, cancel: bool) -> None:
        (self.L.cancel if cancel else self.L.finish)(r)
        del self.live[r]
        self.c["cancelled" if cancel else "finished"] += 1
        pages = self.restoring.pop(("request", r), None)
        if pages is not None:  # cancelled mid-restore: the restore completes after the fact
            self.L.complete_restore(pages, request=r)

    # ---------------------------------------------------------------- the workload

    def reserve(self, r: int, n: int, tenant: str) -> bool:
        """Reserve under KV pressure: preempt (cancel) another request once, else refuse."""
        for attempt in range(2):
            try:
                self.L.reserve(r, n, tenant=tenant)
                return True
            except OutOfPagesError:
                victims = [v for v in self.live if v != r and v in self.L.state.requests]
                if attempt or not victims:
                    break
                self.end(self.rng.choice(victims), cancel=True)
                self.c["preempted"] += 1
        self.c["refused"] += 1
        return False

    def start(self) -> None:
        rng = self.rng
        r = self.next_request
        self.next_request += 1
        self.c["lifecycles"] += 1
        self.live[r] = [rng.randint(1, 64), 0, rng.randint(1, 16), rng.choice(TENANTS)]
        self.advance(r)

    def advance(self, r: int) -> None:
        rng, L = self.rng, self.L
        want, done, chunk, tenant = self.live[r]
        if done and rng.random() < 0.05:  # aborted by the client
            self.end(r, cancel=True)
            return
        n = min(chunk, want - done)
        if not self.reserve(r, n, tenant):
            if r in self.live:
                if r in L.state.requests:
                    self.end(r, cancel=True)
                else:
                    del self.live[r]  # refused before it held anything
            return
        reserved = L.reserved_pages(r)
        if rng.random() < 0.02 and ("request", r) not in self.restoring:
            self.restore_into_request(r, reserved[: max(1, len(reserved) // 2)])
            return  # committed on a later advance, once the restore completes
        restoring = self.restoring.pop(("request", r), None)
        if restoring is not None:
            L.complete_restore(restoring, request=r)
        if rng.random() < 0.05 and len(reserved) > 1:  # speculative pages not needed after all
            L.return_reservation(r, reserved[-1:])
            self.c["returned"] += 1
            reserved = reserved[:-1]
        step = L.open_step + (1 if rng.random() < 0.1 else 0)
        listed = L.commit(r, step, len(reserved)) if rng.random() < 0.5 else L.commit(r, step, pages=reserved)
        self.c["pages listed"] += len(listed)
        self.live[r][1] = done = len(L.kv_pages(r))
        if done >= want:
            self.end(r, cancel=False)

    def churn_snapshots(self) -> None:
        rng, L = self.rng, self.L
        x = rng.random()
        if x < 0.25:
            s = self.next_snapshot
            try:
                if self.snapshots and rng.random() < 0.3:  # snapshot reuse: share another's pages
                    other = L.snapshot_pages(rng.choice(self.snapshots))
                    pages = [p for p in other[: rng.randint(1, len(other))] if not L.is_restoring(p)]
                    if not pages:
                        return
                    L.alias_snapshot(s, pages=pages)
                    self.c["shared aliases"] += 1
                else:
                    L.alias_snapshot(s, rng.randint(1, 8))
            except OutOfPagesError:
                self.c["refused"] += 1
                return
            self.next_snapshot += 1
            self.snapshots.append(s)
            self.c["snapshots"] += 1
            if rng.random() < 0.1:
                L.start_restore(L.snapshot_pages(s), snapshot=s)
                self.restoring[("snapshot", s)] = list(L.snapshot_pages(s))
                self.c["restores into snapshots"] += 1
        elif x < 0.5 and self.snapshots:
            s = self.snapshots.pop(rng.randrange(len(self.snapshots)))
            self.release(s)  # possibly while its restore is still writing
            pages = self.restoring.pop(("snapshot", s), None)
            if pages is not None and rng.random() < 0.5:
                L.complete_restore(pages, snapshot=s)
            elif pages is not None:
                self.restoring[("snapshot", s)] = pages  # completes after the release

    def partition_count(self) -> int:
        st = self.L.state
        held = sum(len(rec.reserved) + len(rec.kv) for rec in st.requests.values())
        aliased = len(set().union(*st.snapshots.values()))
        return self.L.free_count + held + aliased

    def run(self, lifecycles: int) -> None:
        rng = self.rng
        checked = 0
        while self.c["lifecycles"] < lifecycles:
            if len(self.live) < MAX_LIVE:
                self.start()
            for r in rng.sample(list(self.live), min(3, len(self.live))):
                if r in self.live:
                    self.advance(r)
            self.churn_snapshots()
            if rng.random() < 0.3:
                self.seal()
            if rng.random() < 0.05 and self.restoring:
                key = rng.choice(list(self.restoring))
                into, target = key
                if into == "snapshot":
                    self.L.complete_restore(self.restoring.pop(key), snapshot=target)
            n = self.c["lifecycles"]
            if n % COUNT_EVERY == 0 and n != checked:
                checked = n
                assert self.partition_count() == NUM_PAGES, n
                if n % CHECK_EVERY == 0:
                    check_invariants(self.L.state)

    def drain(self) -> None:
        self.complete_restores()
        for r in list(self.live):
            self.end(r, cancel=self.rng.random() < 0.5)
        for s in self.snapshots:
            self.release(s)
        self.snapshots.clear()
        self.complete_restores()
        self.seal()


def test_soak_lifecycles_partition_and_drain():
    t0 = time.perf_counter()
    soak = Soak(SEED)
    L = soak.L
    baseline = L.free_count
    assert baseline == NUM_PAGES
    soak.run(LIFECYCLES)
    check_invariants(L.state)
    assert soak.partition_count() == NUM_PAGES
    soak.drain()
    check_invariants(L.state)
    c = soak.c
    leaked = baseline - L.free_count
    still_marked = sum(1 for p in range(NUM_PAGES) if L.is_marked(p))
    elapsed = time.perf_counter() - t0
    print(
        f"\nR14 soak: lifecycles={c['lifecycles']} events={L.seq} pages cleared={c['pages cleared']} "
        f"leaked pages={leaked} | finished={c['finished']} cancelled={c['cancelled']} "
        f"(preempted {c['preempted']}) refused={c['refused']} returned={c['returned']} "
        f"snapshots={c['snapshots']} (shared {c['shared aliases']}) released={c['released']} "
        f"restores(req/snap)={c['restores into requests']}/{c['restores into snapshots']} "
        f"marks set={c['marks set']} removed by restores={c['marks removed by restores']} "
        f"still marked={still_marked} listed={c['pages listed']} steps={c['steps']} | {elapsed:.1f} s"
    )
    assert c["lifecycles"] == LIFECYCLES
    assert leaked == 0
    assert L.free_count == L.reservable_count == NUM_PAGES
    assert not L.state.requests and not L.state.snapshots
    # every mark removed exactly once: by one clear-list entry or one restore, or still there
    assert c["marks set"] == c["pages cleared"] + c["marks removed by restores"] + still_marked
    # the soak exercised what it claims to
    assert c["pages cleared"] > 0 and c["cancelled"] > 0 and c["released"] > 0
    assert c["restores into requests"] > 0 and c["restores into snapshots"] > 0 and c["shared aliases"] > 0
