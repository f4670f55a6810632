"""A seeded random serving workload for the log tests (and its own sanity tests).

``drive(ledger, seed, steps)`` issues only commands that are valid for the
ledger's current state: requests of several tenants reserve, commit (sometimes
partially, returning the rest), finish or are cancelled; snapshots alias fresh
or already-aliased pages and are released; inbound restores write into
requests' reserved pages and into snapshots and complete later; steps are
sealed, completed by every rank or (rarely) aborted. Deterministic given the
seed and the ledger's state, so a log reopened at any point continues the same
way another process would.

The log, tools and crash tests import it (``from support.workload import drive``);
tests/log/test_log_workload.py checks it.
"""

from __future__ import annotations

import random

from kvledger import Geometry, Ledger, OutOfPagesError

__all__ = ["drive", "make_events", "GEOMETRY"]

GEOMETRY = Geometry(num_pages=64, page_tokens=16)


def drive(ledger, seed, steps: int, *, ranks: int = 1, restores: bool = True, aborts: bool = True,
          on_seal=None, tenants: int = 3) -> None:
    """Run ``steps`` scheduler steps of a random workload on ``ledger``.

    ``on_seal(ledger, plan)`` is called right after every sealed step, before
    the step's completions (the crash tests acknowledge durable events there:
    with per-step fsync, ``ledger.seq == durable_seq + 1`` at that point). The RNG is seeded from ``seed`` and
    the ledger's seq, so continuing a reopened ledger is deterministic too.
    """
    rng = random.Random(f"{seed}:{ledger.seq}")
    st = ledger.state
    for _ in range(steps):
        step = ledger.open_step
        # snapshots: alias fresh pages, or reuse pages of a live snapshot
        if rng.random() < 0.5:
            s = rng.randrange(1 << 20)
            if s not in st.snapshots:
                try:
                    if st.snapshots and rng.random() < 0.3:
                        other = rng.choice(sorted(st.snapshots))
                        pages = [p for p in st.snapshots[other] if p not in st.restore_targets]
                        if pages:
                            ledger.alias_snapshot(s, pages=pages[: rng.randint(1, len(pages))])
                    else:
                        ledger.alias_snapshot(s, rng.randint(1, 6))
                except OutOfPagesError:
                    pass
        while st.snapshots and rng.random() < 0.45:
            ledger.release_snapshot(rng.choice(sorted(st.snapshots)))
        # admissions and growth
        for _ in range(rng.randint(1, 3)):
            r = rng.randrange(1 << 16)
            rec = st.requests.get(r)
            tenant = rec.tenant if rec is not None else f"t{rng.randrange(tenants)}"
            try:
                ledger.reserve(r, rng.randint(1, 6), tenant=tenant)
            except OutOfPagesError:
                continue
        # restores into requests' reserved pages and into snapshots
        if restores and rng.random() < 0.3:
            cands = [(r, [p for p in rec.reserved if p not in st.restore_targets])
                     for r, rec in sorted(st.requests.items())]
            cands = [(r, ps) for r, ps in cands if ps]
            if cands:
                r, ps = rng.choice(cands)
                ledger.start_restore(ps[: rng.randint(1, len(ps))], request=r)
        if restores and st.snapshots and rng.random() < 0.2:
            s = rng.choice(sorted(st.snapshots))
            ps = [p for p in st.snapshots[s] if p not in st.restore_targets]
            if ps:
                ledger.start_restore(ps[: rng.randint(1, len(ps))], snapshot=s)
        if st.restore_targets and rng.random() < 0.6:
            by: dict = {}
            for p, t in sorted(st.restore_targets.items()):
                by.setdefault(t, []).append(p)
            (into, target), ps = rng.choice(sorted(by.items()))
            if into == "request":
                ledger.complete_restore(ps, request=target)
            else:
                ledger.complete_restore(ps, snapshot=target)
        # commits (some partial, the rest returned)
        for r, rec in sorted(st.requests.items()):
            ready = [p for p in rec.reserved if p not in st.restore_targets]
            if not ready or rng.random() < 0.2:
                continue
            k = rng.randint(1, len(ready))
            ledger.commit(r, step, pages=ready[:k])
            if rng.random() < 0.1:
                rest = [p for p in rec.reserved if p not in st.restore_targets]
                if rest:
                    ledger.return_reservation(r, rest)
        # finish / cancel
        for r in sorted(st.requests):
            x = rng.random()
            if x < 0.2:
                ledger.finish(r)
            elif x < 0.25:
                ledger.cancel(r)
        plan = ledger.seal_step(step)
        if on_seal is not None:
            on_seal(ledger, plan)
        if aborts and rng.random() < 0.05:
            ledger.abort_step(step, "rank 1 timed out")
        else:
            for rank in range(ranks):
                ledger.complete_step(step, rank)


def make_events(seed, steps: int, *, policy: str = "released_aliases", geometry: Geometry = GEOMETRY, **kw):
    """The events of a workload run on an in-memory recording ledger, and that ledger."""
    led = Ledger(geometry, policy=policy, record=True)
    drive(led, seed, steps, **kw)
    return led.events, led
