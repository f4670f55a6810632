"""The serving commands with a sink and nothing watched: the fast paths record each event
before its fold, exactly as the table's path does.

A ledger with only a sink (no record, observer or check) takes the commands' fast paths: with
a ``Journal`` sink (the durable log's case: ``GatedJournal`` moves its ``due`` as the log
does) the lean path appends events to the journal itself and the events at its gates go
through ``put``; with a callable sink every event goes through the sink. A ledger over a state
with its own copy of the transition table takes no fast path (every event through
``_submit``). Driven through the same commands, both sinks must receive the same events with
the same sequence numbers, and both states must end with the same digest. A sink that
refuses an event (raises) refuses it on both: the command raises, that event and everything
after it in the command is not folded, the events before it stand (allocate's reservation
before its commit, an eviction before the allocation it made room for). Every refusal point
of every scenario is tried, with both kinds of sink.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support.journals import GatedJournal
from support.journals import Refused as JournalRefused

from kvledger import Geometry, Ledger, check_invariants, replay
from kvledger.core.events import CacheConfigured, PagesEvicted, PagesReserved
from kvledger.core.state import TRANSITIONS, LedgerState

G = Geometry(num_pages=12, page_tokens=2)


class TableOnly(LedgerState):
    """A state whose table is a copy of the standard one: a ledger over it takes no fast path."""

    transitions = dict(TRANSITIONS)


Refused = JournalRefused


class Sink:
    """Records (seq, event) it accepts; refuses the ``refuse_at``-th event it is offered (0-based)."""

    def __init__(self, refuse_at: int | None = None) -> None:
        self.got: list[tuple[int, object]] = []
        self.offered = 0
        self.refuse_at = refuse_at

    def __call__(self, seq: int, event: object) -> None:
        n = self.offered
        self.offered += 1
        if n == self.refuse_at:
            raise Refused(f"event {n}")
        self.got.append((seq, event))


class JournalSink:
    """A ``GatedJournal`` and its ledger, seen as a ``Sink`` is: ``got`` is [(seq, event)]."""

    def __init__(self, refuse_at: int | None) -> None:
        self.journal = GatedJournal(refuse_at=refuse_at)

    @property
    def got(self) -> list[tuple[int, object]]:
        return list(enumerate(self.journal.events))


SINKS = ("journal", "callable")


def fast_and_table(refuse_at: int | None = None, policy: str = "released_aliases", kind: str = "journal") -> tuple:
    table_sink = Sink()
    at = None if refuse_at is None else refuse_at + 1
    if kind == "journal":
        fast_sink: Sink | JournalSink = JournalSink(at)
        fast = Ledger(G, policy=policy, sink=fast_sink.journal)
        fast_sink.journal.ledger_seq = lambda: fast.seq
    else:
        fast_sink = Sink(at)
        fast = Ledger(G, policy=policy, sink=fast_sink)
    state = TableOnly()
    state.fold(CacheConfigured(geometry=G, policy=policy))
    table = Ledger(G, state=state, sink=table_sink)
    table_sink.refuse_at = at
    table_sink.offered = 1  # (the table ledger's state was configured without its sink)
    return fast, fast_sink, table, table_sink


def _tok(n: int) -> tuple[int, ...]:
    return tuple(range(n * G.page_tokens))


def allocate_one_page_at_a_time(L: Ledger) -> None:
    for r, tenant in ((1, "a"), (2, None), (1, None), (3, "b"), (2, None)):
        L.allocate(r, 0, 1, tenant=tenant)


def allocate_evicting(L: Ledger) -> None:
    """Fill the cache with published pages, use up the free ones, then allocate one page at a
    time (the least recently used cached page is evicted for each) and a run of them."""
    L.allocate(1, 0, 4)
    L.seal_step(0)
    L.complete_step(0, 0)
    L.publish(1, (b"h0", b"h1", b"h2"), _tok(3), start=0)
    L.finish(1)  # three cached, one free (the unpublished one), eight more free
    L.allocate(2, 1, 9)  # the free ones
    L.allocate(3, 1, 1)  # evicts h-least-recently-used
    L.allocate(2, 1, 1)
    L.allocate(4, 1, 1, tenant="t")


def share_and_publish(L: Ledger) -> None:
    L.allocate(1, 0, 3)
    L.allocate(2, 0, 2)
    L.seal_step(0)
    L.complete_step(0, 0)
    L.publish(1, (b"a",), _tok(1), start=0)  # one block
    L.publish(1, (b"b", 7), _tok(2), start=1)  # a run (its parent is b"a")
    L.publish(2, (-3,), _tok(1), start=0)
    L.share(5, (b"a", b"b"))  # a new request shares two held pages
    L.share(2, (b"a",))  # a known one shares a held page
    L.finish(1)  # b"a" and b"b" stay held by 5 (and 2), 7 goes cached
    L.share(2, (7,))  # one cached block into a known request (vLLM's touch)
    L.share(6, (7,))  # a held block into a new request
    L.finish(2)
    L.finish(6)
    L.share(5, (-3,))  # cached again: touch
    L.cancel(5)


def named_pages(L: Ledger) -> None:
    """vLLM's pool: pages its free queue picked, anywhere in the free stack; publish with the
    parent named (the request's previous block, in another ledger request); the cached pages it
    picks evicted by name first."""
    L.allocate(1, 0, pages=(5,))
    L.allocate(1, 0, pages=(0, 9, 3))
    L.allocate(2, 0, pages=(1,), tenant="t")
    L.seal_step(0)
    L.complete_step(0, 0)
    L.publish(1, (b"a",), _tok(1), start=0)
    L.publish(1, (b"b", 7), _tok(2), start=1, parent_hash=b"a")
    L.publish(2, (b"c",), _tok(1), start=0, parent_hash=7)
    L.finish(1)
    L.allocate(3, 1, pages=(8, 4, 11))
    L.evict(pages=(9, 0))
    L.allocate(3, 1, pages=(9, 0, 2))
    L.finish(2)
    L.evict(pages=[1])  # a list of one (vLLM's get_new_blocks evicting the block it picked)


def steps(L: Ledger) -> None:
    L.allocate(1, 0, 2)
    L.reserve(2, 3)
    L.commit(2, 1, 2)
    L.seal_step(0)
    L.complete_step(0, 1)
    L.seal_step(1)
    L.complete_step(1, 1)
    L.complete_step(0, 0)
    L.cancel(2)
    L.finish(1)


SCENARIOS: dict[str, Callable[[Ledger], None]] = {
    "allocate-one-page": allocate_one_page_at_a_time,
    "allocate-evicting": allocate_evicting,
    "share-and-publish": share_and_publish,
    "named-pages": named_pages,
    "steps": steps,
}


@pytest.mark.parametrize("kind", SINKS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_sink_gets_what_the_tables_path_gives_it(scenario, kind):
    fast, fast_sink, table, table_sink = fast_and_table(kind=kind)
    SCENARIOS[scenario](fast)
    SCENARIOS[scenario](table)
    assert fast_sink.got[1:] == table_sink.got and fast_sink.got[0][0] == 0
    assert [seq for seq, _ in fast_sink.got] == list(range(fast.seq))  # one seq each, none skipped
    assert fast.digest() == table.digest()
    check_invariants(fast.state)
    assert replay([ev for _, ev in fast_sink.got], check=True).digest() == fast.digest()


@pytest.mark.parametrize("kind", SINKS)
def test_the_evicting_scenario_evicts_one_page_per_allocation(kind):
    fast, sink, _, _ = fast_and_table(kind=kind)
    allocate_evicting(fast)
    kinds = [type(ev).__name__ for _, ev in sink.got[-9:]]
    assert kinds == ["PagesEvicted", "PagesReserved", "PagesCommitted"] * 3
    assert all(len(ev.page_ids) == 1 for _, ev in sink.got[-9:] if type(ev) in (PagesEvicted, PagesReserved))


@pytest.mark.parametrize("kind", SINKS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_sink_refusing_any_event_leaves_what_the_tables_path_leaves(scenario, kind):
    """Every refusal point: the same command raises on both, the same events stand."""
    fast, fast_sink, _, _ = fast_and_table(kind=kind)
    SCENARIOS[scenario](fast)
    total = len(fast_sink.got) - 1
    for n in range(total):
        fast, fast_sink, table, table_sink = fast_and_table(refuse_at=n, kind=kind)
        outcomes = []
        for L in (fast, table):
            with pytest.raises(Refused):
                SCENARIOS[scenario](L)
            outcomes.append(L.digest())
        assert outcomes[0] == outcomes[1], (scenario, n)
        assert fast_sink.got[1:] == table_sink.got, (scenario, n)
        assert fast.seq == table.seq == len(fast_sink.got), (scenario, n)
        check_invariants(fast.state)


@pytest.mark.parametrize("kind", SINKS)
def test_a_refused_commit_leaves_the_one_page_reservation_standing(kind):
    fast, sink, _, _ = fast_and_table(refuse_at=1, kind=kind)  # the first allocate's PagesCommitted
    with pytest.raises(Refused):
        fast.allocate(1, 0, 1)
    assert [type(ev) for _, ev in sink.got[1:]] == [PagesReserved]
    assert len(fast.reserved_pages(1)) == 1 and fast.kv_pages(1) == ()
    check_invariants(fast.state)
