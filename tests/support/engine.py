"""What the engine tests share: the ledger's events however it records them, the consistency
check every test ends with, the last abort, and the page setup that lists pages for a step.

    events_of(engine)           the ledger's events: recorded in memory, or read back from its log
    assert_consistent(engine)   the invariants hold and a replay of the events has the ledger's digest
    step_events(engine)         the step records in log order: ("sealed", k), ("aborted", k), ("completed", k, rank)
    last_abort(events)          the last StepAborted (only completions may follow it), or None
    released_then_committed(engine, all_planes, ...)
                                a snapshot writes ROW bytes into n pages of every rank's planes and
                                is released; a request reserves and commits them: they are listed
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvledger import check_invariants, replay
from kvledger.core.events import StepAborted, StepCompleted, StepSealed
from kvledger.core.log import open_view
from kvledger.durable import DurableLedger

from .planes import write_rows

__all__ = ["assert_consistent", "events_of", "last_abort", "released_then_committed", "step_events"]


def events_of(engine) -> list:
    """The ledger's events: recorded in memory (``record=True``), or read back from its log."""
    ledger = engine.ledger
    if not isinstance(ledger, DurableLedger):
        return ledger.events
    ledger.sync()
    with open_view(ledger.log.path) as view:
        return [e for _, e, _ in view.iter_events()]


def step_events(engine) -> list[tuple]:
    """The step records in log order: ("sealed", k), ("aborted", k), ("completed", k, rank)."""
    out: list[tuple] = []
    for e in events_of(engine):
        t = type(e)
        if t is StepSealed:
            out.append(("sealed", e.step))
        elif t is StepAborted:
            out.append(("aborted", e.step))
        elif t is StepCompleted:
            out.append(("completed", e.step, e.rank))
    return out


def assert_consistent(engine) -> None:
    """The invariants hold, and a replay of the ledger's events has the ledger's digest."""
    check_invariants(engine.ledger.state)
    assert replay(events_of(engine), check=True).digest() == engine.ledger.digest()


def last_abort(events: Sequence) -> StepAborted | None:
    """The last StepAborted, provided nothing but completions of the ranks that ran follows it
    (a failed step is aborted first, then the ranks that did run their part are recorded)."""
    i = max((i for i, e in enumerate(events) if type(e) is StepAborted), default=None)
    if i is None:
        return None
    assert all(type(e) is StepCompleted for e in events[i + 1:]), events[i + 1:]
    return events[i]


async def released_then_committed(engine, all_planes: Iterable, *, snapshot: int = 7, request: int = 1,
                                  n: int = 3, step: int = 0) -> tuple[int, ...]:
    """A snapshot writes row bytes into n pages (of every rank's planes) and is released; a
    request reserves and commits them for ``step``: the pages it returns are on its clear list."""
    rows = await engine.alias_snapshot(snapshot, n)
    for planes in all_planes:
        write_rows(planes, rows)
    await engine.release_snapshot(snapshot)
    pages = await engine.reserve(request, n)
    assert sorted(pages) == sorted(rows)  # LIFO reuse hands the row pages out first
    listed = await engine.commit(request, step, n)
    assert sorted(listed) == sorted(rows)
    return rows
