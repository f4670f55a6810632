"""Steps in flight together: the ledger keeps the plans an abort may still reach.

An engine seals step k+1 while step k still runs. If step k fails, step k and
every later sealed step abort (one ``StepAborted(k)``), and nothing of any of
their plans may be assumed zeroed: pages still in KV are listed again for the
open step (the oldest plan's first), the others get their mark back, except a
page a restore into a request rewrote after that plan was sealed. Kills: an
abort that carries only the last plan, a carried page listed twice, a restore
skip keyed to the wrong seal, an unbounded list of plans in flight.
"""

from __future__ import annotations

import pytest

from kvledger import Geometry, Ledger, StepOrderError, check_invariants, replay
from kvledger.core.state import MAX_IN_FLIGHT


def marked_pages(L: Ledger, n: int) -> tuple[int, ...]:
    """Alias n pages for a snapshot and release it: they come back free and marked."""
    sid = 10_000 + L.seq
    pages = L.alias_snapshot(sid, n)
    L.release_snapshot(sid)
    return pages


def make(policy: str = "released_aliases") -> Ledger:
    return Ledger(Geometry(num_pages=32, page_tokens=4), policy=policy, check=True, record=True)


def test_aborting_an_older_step_aborts_every_later_one_and_carries_all_their_pages():
    L = make()
    a = marked_pages(L, 2)
    L.reserve(1, 2)
    L.commit(1, 0, 2)
    p0 = L.seal_step(0)
    assert sorted(p0.clear_list) == sorted(a)
    b = marked_pages(L, 3)
    L.reserve(2, 3)
    L.commit(2, 1, 3)
    p1 = L.seal_step(1)
    assert sorted(p1.clear_list) == sorted(b)
    assert [p.step for p in L.state.in_flight] == [0, 1]
    L.abort_step(0, "rank 1 failed step 0; step 1 was in flight")
    assert L.state.in_flight == [] and {0, 1} <= L.state.aborted_steps
    plan = L.seal_step(2)
    assert plan.clear_list == p0.clear_list + p1.clear_list  # the oldest plan's pages first, each once
    check_invariants(L.state)
    assert replay(L.events, check=True).digest() == L.digest()


def test_aborting_the_last_step_leaves_the_earlier_one_in_flight():
    L = make()
    marked_pages(L, 2)
    L.reserve(1, 2)
    L.commit(1, 0, 2)
    p0 = L.seal_step(0)
    L.seal_step(1)
    L.abort_step(1)
    assert [p.step for p in L.state.in_flight] == [0]
    with pytest.raises(StepOrderError):
        L.abort_step(1)  # already aborted
    L.abort_step(0)  # still reachable
    assert L.seal_step(2).clear_list == p0.clear_list


def test_a_page_in_two_plans_is_carried_once():
    L = make("all_reused")  # every page a request lets go of is marked
    marked_pages(L, 1)
    (p,) = L.reserve(1, 1)
    L.commit(1, 0, 1)
    assert L.seal_step(0).clear_list == (p,)
    L.finish(1)  # page p is free again, marked for everyone (its bytes are request 1's)
    assert L.reserve(2, 1) == (p,)
    L.commit(2, 1, 1)
    assert L.seal_step(1).clear_list == (p,)
    L.abort_step(0)
    assert L.seal_step(2).clear_list == (p,)
    check_invariants(L.state)


def test_a_restore_after_the_seal_is_not_zeroed_a_restore_before_it_is():
    L = make("all_reused")
    marked_pages(L, 2)
    (x, y) = L.reserve(1, 2)
    L.commit(1, 0, 2)
    assert sorted(L.seal_step(0).clear_list) == sorted((x, y))
    L.finish(1)  # x, y free and marked again
    got = L.reserve(2, 2)
    assert sorted(got) == sorted((x, y))
    L.start_restore([x], request=2)  # after step 0's seal: x is rewritten whole
    L.complete_restore([x], request=2)
    L.seal_step(1)
    L.abort_step(0)
    assert x not in L.state.pending and not L.is_marked(x)  # the restore's bytes are not zeroed
    assert L.is_marked(y)  # y was not restored: it needs its clear
    check_invariants(L.state)


def test_only_the_last_max_in_flight_plans_can_be_aborted():
    L = make()
    for step in range(MAX_IN_FLIGHT + 1):
        L.seal_step(step)
    assert len(L.state.in_flight) == MAX_IN_FLIGHT
    with pytest.raises(StepOrderError):
        L.abort_step(0)
    L.abort_step(1)
    assert L.state.in_flight == []
    assert replay(L.events, check=True).digest() == L.digest()


def test_a_carried_page_sits_where_the_abort_put_it_not_where_a_stale_listing_was():
    """Found by the heavy R8 profile: pages listed for a future step by a request that then left
    keep stale entries in that step's list; an abort that carries the same pages into it (now the
    open step) must put them in the aborted plan's order, not the stale entries' order."""
    L = Ledger(Geometry(num_pages=16, page_tokens=4), check=True, record=True)
    rows = L.alias_snapshot(9, 3)
    L.release_snapshot(9)
    x, y, z = L.reserve(1, 3)
    assert {x, y, z} == set(rows)
    L.commit(1, 2, pages=(x, y, z))  # listed for step 2, two steps ahead
    L.finish(1)  # the listing is withdrawn: stale entries stay in step 2's list
    L.seal_step(0)
    L.reserve(3, 3)
    L.commit(3, 1, pages=(z, y, x))  # the same pages, marked again, listed for step 1
    assert L.seal_step(1).clear_list == (z, y, x)
    L.abort_step(1, "rank failed")  # step 2 is open now: they are carried into it
    assert L.seal_step(2).clear_list == (z, y, x)
    assert replay(L.events, check=True).digest() == L.digest()


@pytest.mark.parametrize("journal", ["quiet", "checked"])
def test_a_step_every_rank_completed_leaves_the_steps_in_flight(journal):
    """A completion on every reporting rank retires the step (and the older ones): it can no longer
    be aborted. Both roads of ``complete_step``: the lean path of a quiet ledger (``fold_steps.completed``)
    and the table's applier under check mode."""
    L = Ledger(Geometry(num_pages=32, page_tokens=4)) if journal == "quiet" else make()
    for step in range(3):
        L.allocate(step + 1, step, 1)
        L.seal_step(step)
    assert [plan.step for plan in L.state.in_flight] == [0, 1, 2]
    L.complete_step(1, 0)
    L.complete_step(1, 1)  # steps 0 and 1 ran on both reporting ranks
    assert [plan.step for plan in L.state.in_flight] == [2]
    with pytest.raises(StepOrderError):
        L.abort_step(1)
    L.complete_step(2, 0)
    assert [plan.step for plan in L.state.in_flight] == [2]  # rank 1 has not completed step 2
    L.abort_step(2)
    assert not L.state.in_flight


def test_an_abort_carries_overwritten_pages_in_an_order_a_checkpoint_keeps():
    """Pages a ``reads="none"`` commit took the mark off come back on an abort of their step; the
    order they are carried in is part of the next plan, so it must not depend on the order they
    were committed in (a checkpoint keeps ``overwritten`` sorted). Kills: carrying them in the
    dict's insertion order, which a state rebuilt from a checkpoint does not have (a replay from a
    middle segment then derived another clear list than the live run recorded)."""
    from kvledger import LedgerState

    L = Ledger(Geometry(num_pages=32, page_tokens=4))
    pages = marked_pages(L, 4)
    L.reserve(1, 4)
    for p in sorted(L.reserved_pages(1), reverse=True):  # committed against page order, one at a time
        L.commit(1, 0, pages=(p,), reads="none")
    assert not any(L.is_marked(p) for p in pages)
    L.seal_step(0)
    twin = Ledger(L.geometry, state=LedgerState.from_canonical(L.state.canonical()))
    for led in (L, twin):
        led.abort_step(0)
    assert L.seal_step(1).clear_list == twin.seal_step(1).clear_list == tuple(sorted(pages))
    assert L.digest() == twin.digest()
