"""``Ledger.allocate``: reserve then commit those pages, two events exactly as the two commands write them."""

from __future__ import annotations

import pytest

from kvledger import Geometry, InvalidArgumentError, Ledger, StepOrderError, replay

G = Geometry(num_pages=16, page_tokens=4)


def twins():
    return Ledger(G, record=True, check=True), Ledger(G, record=True, check=True)


def test_allocate_is_reserve_then_commit_of_those_pages():
    a, b = twins()
    for L in (a, b):
        L.alias_snapshot(9, 2)
        L.release_snapshot(9)  # two marked pages on top of the free stack
    got = a.allocate(1, 0, 3, tenant="t")
    want = b.reserve(1, 3, tenant="t")
    b.commit(1, 0, 3)
    assert got == want and a.kv_pages(1) == b.kv_pages(1) == got and a.reserved_pages(1) == ()
    assert a.events == b.events and a.digest() == b.digest()
    assert a.seal_step(0).clear_list == b.seal_step(0).clear_list != ()
    assert replay(a.events, check=True).digest() == a.digest()


def test_allocate_commits_only_its_own_pages_when_older_ones_are_reserved():
    a, b = twins()
    older = a.reserve(1, 2)
    b.reserve(1, 2)
    got = a.allocate(1, 0, 3)
    assert set(got).isdisjoint(older)
    assert a.kv_pages(1) == got and a.reserved_pages(1) == older
    want = b.reserve(1, 3)
    b.commit(1, 0, pages=want)
    assert a.events == b.events and a.digest() == b.digest()


@pytest.mark.parametrize(("step", "error"), [("0", InvalidArgumentError), (-1, InvalidArgumentError),
                                             (0, StepOrderError)])
def test_a_refused_commit_leaves_the_reservation_standing(step, error):
    L = Ledger(G, record=True, check=True)
    L.seal_step(0)  # step 0 is sealed: committing into it is refused
    n_events = len(L.events)
    with pytest.raises(error):
        L.allocate(1, step, 2)
    assert len(L.events) == n_events + 1  # the reservation, and nothing after it
    assert len(L.reserved_pages(1)) == 2 and L.kv_pages(1) == ()
    assert L.return_reservation(1) and L.reserved_pages(1) == ()


@pytest.mark.parametrize("attached", [False, True], ids=["plain", "recorded"])
def test_allocate_one_marked_page_lists_it_on_every_path(attached):
    """One page at a time (the inline fast path when nothing is attached): a page a released
    snapshot row left is committed, listed for the step's clear list and unmarked."""
    L = Ledger(G, record=attached)
    L.alias_snapshot(9, 1)
    (marked,) = L.snapshot_pages(9)
    L.release_snapshot(9)  # marked, on top of the free stack
    assert L.allocate(1, 0, 1) == (marked,) and not L.is_marked(marked)
    assert L.seal_step(0).clear_list == (marked,)
    assert L.allocate(1, 1, 1) != (marked,) and L.kv_pages(1)[0] == marked


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("attached", ["nothing", "sink"])
def test_allocate_into_a_sealed_step_is_refused_on_every_path(n, attached):
    """The fast paths (one page inline, nothing attached or only a sink) check the step too:
    committing into a sealed step raises ``StepOrderError``, the reservation stands."""
    events: list = []
    L = Ledger(G, sink=(lambda seq, ev: events.append(ev)) if attached == "sink" else None)
    L.allocate(1, 0, 1)
    L.seal_step(0)
    with pytest.raises(StepOrderError):
        L.allocate(2, 0, n)
    assert len(L.reserved_pages(2)) == n and L.kv_pages(2) == ()
    assert L.allocate(3, 1, n) and len(L.kv_pages(3)) == n
