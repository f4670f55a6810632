"""``Ledger.allocate``: reserve then commit those pages, two events exactly as the two commands write them."""

from __future__ import annotations

import pytest
from support.journals import GatedJournal

from kvledger import (
    DuplicatePageError,
    Geometry,
    InvalidArgumentError,
    Ledger,
    PageNotHeldError,
    PageOutOfRangeError,
    RestoringPageError,
    StepOrderError,
    TenantMismatchError,
    replay,
)
from kvledger.core.events import CacheConfigured, PagesReserved
from kvledger.core.state import TRANSITIONS, LedgerState

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
@pytest.mark.parametrize("attached", ["nothing", "sink", "journal"])
def test_allocate_into_a_sealed_step_is_refused_on_every_path(n, attached):
    """The fast paths (one page inline, nothing attached, a callable sink or a journal sink) check
    the step too: committing into a sealed step raises ``StepOrderError``, the reservation stands."""
    events: list = []
    sink = {"nothing": None, "sink": lambda seq, ev: events.append(ev), "journal": GatedJournal()}[attached]
    L = Ledger(G, sink=sink)
    L.allocate(1, 0, 1)
    L.seal_step(0)
    with pytest.raises(StepOrderError):
        L.allocate(2, 0, n)
    assert len(L.reserved_pages(2)) == n and L.kv_pages(2) == ()
    assert L.allocate(3, 1, n) and len(L.kv_pages(3)) == n


# ---------------------------------------------------------------------- named pages (vLLM's choice)


class _TableOnly(LedgerState):
    transitions = dict(TRANSITIONS)  # a copy of the table: every command through _submit


def _ledgers():
    """The paths a command can take: nothing attached, a callable sink, a journal sink (the
    durable log's case), recorded with check mode, and the table's path (a state with its own
    table)."""
    sunk: list = []
    table = _TableOnly()
    table.fold(CacheConfigured(geometry=G, policy="released_aliases"))
    return {"plain": Ledger(G), "sink": Ledger(G, sink=lambda seq, ev: sunk.append(ev)),
            "journal": Ledger(G, sink=GatedJournal()),
            "checked": Ledger(G, record=True, check=True), "table": Ledger(G, state=table, record=True)}, sunk


def _setup(L):
    """Pages in every state: 0 cached (published by request 1, which finished), 1 free, 2
    reserved(2), 3 aliased, 1 and 4 marked free (a released snapshot row) on top of the
    stack, 5-15 free."""
    L.allocate(1, 0, 2)
    L.reserve(2, 1)
    L.alias_snapshot(8, 1)
    L.seal_step(0)
    L.complete_step(0, 0)
    L.publish(1, (b"h0",), (1, 2, 3, 4), start=0)
    L.finish(1)
    L.alias_snapshot(9, 2)
    L.release_snapshot(9)


def test_named_allocate_is_reserve_then_commit_of_the_named_pages():
    ledgers, sunk = _ledgers()
    ref = Ledger(G, record=True, check=True)
    for L in (*ledgers.values(), ref):
        _setup(L)
    assert ref.holder_of(0).startswith("cached(") and ref.is_marked(1) and ref.is_marked(4)
    n_sunk = len(sunk)
    # deep in the stack, a marked page among them; one page; a known request; one with older
    # reserved pages (request 2 holds page 2 reserved: it stays reserved); a list of ids
    cases = [(3, (9, 4, 12)), (7, (7,)), (3, (13,)), (2, (1, 14)), (2, [10, 11])]
    for rid, pages in cases:
        for name, L in ledgers.items():
            assert L.allocate(rid, 1, pages=pages) == tuple(pages), name
        ref.submit(PagesReserved(request=rid, page_ids=tuple(pages), tenant=None))
        ref.commit(rid, 1, pages=pages)
    assert ref.kv_pages(3) == (9, 4, 12, 13) and ref.kv_pages(2) == (1, 14, 10, 11)
    assert ref.reserved_pages(2) == (2,)
    digest = ref.digest()
    assert {L.digest() for L in ledgers.values()} == {digest}
    assert ledgers["checked"].events == ref.events and ledgers["table"].events == ref.events[1:]
    assert sunk[n_sunk:] == ref.events[-2 * len(cases):]
    assert {L.seal_step(1).clear_list for L in ledgers.values()} == {(4, 1)}  # listed by their commits
    assert replay(ref.events, check=True).digest() == digest


def _restoring(L):
    """Page 2 goes free while a restore is still writing it (parked beside the stack)."""
    L.start_restore([2], request=2)
    L.return_reservation(2)


REFUSALS = [
    ("cached", (5, 1, (0,)), {}, PageNotHeldError),
    ("reserved", (5, 1, (6, 2)), {}, PageNotHeldError),
    ("aliased", (5, 1, (3,)), {}, PageNotHeldError),
    ("out of range", (5, 1, (6, 16)), {}, PageOutOfRangeError),
    ("negative", (5, 1, (-1,)), {}, PageOutOfRangeError),
    ("duplicate", (5, 1, (6, 6)), {}, DuplicatePageError),
    ("empty", (5, 1, ()), {}, InvalidArgumentError),
    ("bool page", (5, 1, (True,)), {}, InvalidArgumentError),
    ("str page", (5, 1, ("6",)), {}, InvalidArgumentError),
    ("n and pages", (5, 1, (6,)), {"n": 1}, InvalidArgumentError),
    ("sealed step", (5, 0, (6,)), {}, StepOrderError),
    ("bad step", (5, -1, (6,)), {}, InvalidArgumentError),
    ("bad request", (1 << 63, 1, (6,)), {}, InvalidArgumentError),
    ("bad tenant", (5, 1, (6,)), {"tenant": 7}, InvalidArgumentError),
    ("other tenant", (2, 1, (6,)), {"tenant": "b"}, TenantMismatchError),
    ("restoring", (5, 1, (2,)), {}, RestoringPageError),
]


@pytest.mark.parametrize(("case", "args", "kw", "error"), REFUSALS, ids=[c[0] for c in REFUSALS])
def test_a_refused_named_allocate_changes_nothing_on_any_path(case, args, kw, error):
    ledgers, sunk = _ledgers()
    rid, step, pages = args
    for name, L in ledgers.items():
        _setup(L)
        if case == "restoring":
            _restoring(L)
        digest, seq, n_sunk = L.digest(), L.seq, len(sunk)
        n_events = len(L.events) if L.events is not None else 0
        with pytest.raises(error) as got:
            L.allocate(rid, step, pages=pages, **kw)
        assert type(got.value) is error, (name, got.value)
        assert (L.digest(), L.seq, len(sunk)) == (digest, seq, n_sunk), name
        assert (len(L.events) if L.events is not None else 0) == n_events, name
