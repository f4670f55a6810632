"""The transition table (core/state/transitions.py) against SPEC's event table.

Pins three things: every row of SPEC's table has a row in ``TRANSITIONS`` with
SPEC's words; every event type has exactly one row; and the table is what runs
(``LedgerState`` dispatches through it and nothing else: a row replaced in one
state's table changes that state's fold, and an event with no row is refused
naming its type). What each row does is pinned case by case in
tests/core/test_event_table.py.
"""

from __future__ import annotations

import re

import pytest

from kvledger import Geometry, InvalidArgumentError, Ledger, LedgerState
from kvledger.core.events import EVENT_TYPES, CacheConfigured, PagesReserved, RequestFinished
from kvledger.core.state import TRANSITIONS

# SPEC.md, "Events and their rules" and "Prefix-shared pages", copied verbatim (update both together).
SPEC_TABLE = """
| `CacheConfigured(geometry)` | first event of a log | all `free` | none | — |
| `PagesReserved(r, pages)` | each page `free`, not `restoring` | → `reserved(r)` | kept | — |
| `ReservationReturned(r, pages)` | each page `reserved(r)` | → `free` | kept | — |
| `PagesCommitted(r, step, pages)` | each page `reserved(r)`, not `restoring`; step not older than the open step | → `kv(r)`, appended in order | cleared | the page ids that were marked, in commit order: the clear list of `step` |
| `RequestCancelled(r)` / `RequestFinished(r)` | r known | reserved and kv pages → `free` | kept | — |
| `SnapshotAliased(s, pages)` | each page `free` or `alias(S)`, not `restoring` | → `alias(S ∪ {s})` | kept (snapshot reuse keeps the mark) | — |
| `SnapshotReleased(s)` | s live | s leaves each page's S; a page whose S becomes empty → `free` | **set** on every page whose last alias was released | — |
| `RestoreStarted(target, pages)` | target is r with pages `reserved(r)`, or s with pages in `alias(S∋s)` | unchanged | into a request: cleared (overwritten whole); into a snapshot: unchanged | `restoring` set |
| `RestoreCompleted(target, pages)` | pages `restoring` | unchanged (a page may be `free` now if its snapshot was released mid-restore) | unchanged | `restoring` cleared |
| `StepSealed(step)` | step open | — | — | the step plan: the union of that step's clear lists, each id once |
| `PagesPublished(r, pages, hashes, parent_hash, token_ids)` | each page `kv(r)` written by r, full, committed in a step that has completed; hash not already published | gain their hash | — | KV event `BlockStored` |
| `PagesShared(r, pages)` | each page hashed, `kv(R)` or `cached(h)`, not `stale`, not `restoring`; under `cross_tenant` / `all_reused` same tenant as r | → `kv(R ∪ {r})`, appended to r's block table in order | unchanged (a hashed page holds the KV r wants: never listed) | — |
| `PagesEvicted(pages)` | each page `cached(h)` | → `free`, hash dropped | as for a request's page going free under the policy | KV event `BlockRemoved` |
"""  # noqa: E501

BY_NAME = {t.__name__: t for t in EVENT_TYPES}


def _plain(cell: str) -> str:
    return re.sub(r"\s+", " ", cell.replace("`", "").replace("**", "")).strip()


def spec_rows():
    for line in SPEC_TABLE.strip().splitlines():
        cells = [_plain(c) for c in line.strip().strip("|").split("|")]
        event_cell, rule = cells[0], cells[1:]
        for name in re.findall(r"([A-Za-z]+)\(", event_cell):
            yield name, rule


@pytest.mark.parametrize(("name", "rule"), list(spec_rows()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_spec_row_is_a_table_row_in_specs_words(name, rule):
    row = TRANSITIONS[BY_NAME[name]]
    assert [row.precondition, row.pages, row.mark, row.effect] == rule


def test_every_event_type_has_one_row_and_every_row_an_event_type():
    assert set(TRANSITIONS) == set(EVENT_TYPES)
    assert {name for name, _ in spec_rows()} <= {t.__name__ for t in TRANSITIONS}


def test_the_state_folds_through_its_table_and_nothing_else():
    seen = []

    def recorded(row):
        def validate(st, e):
            seen.append(("validate", type(e).__name__))
            return row.validate(st, e)

        def apply(st, e):
            seen.append(("apply", type(e).__name__))
            return row.apply(st, e)

        return row._replace(validate=validate, apply=apply)

    class Recorded(LedgerState):
        transitions = {t: recorded(row) for t, row in TRANSITIONS.items()}

    g = Geometry(num_pages=8, page_tokens=4)
    st = Recorded()
    st.fold(CacheConfigured(geometry=g))
    L = Ledger(g, state=st)
    L.reserve(1, 2)
    L.commit(1, 0, 1)
    L.seal_step(0)
    L.finish(1)
    names = ["CacheConfigured", "PagesReserved", "PagesCommitted", "StepSealed", "RequestFinished"]
    assert seen == [(k, n) for n in names for k in ("validate", "apply")]


def test_a_broken_row_breaks_only_its_state():
    def leave_pages_reserved(st, e):  # a RequestFinished that forgets the request's pages
        st.requests.pop(e.request)
        st.seq += 1
        return ()

    class Broken(LedgerState):
        transitions = {**TRANSITIONS,
                       RequestFinished: TRANSITIONS[RequestFinished]._replace(apply=leave_pages_reserved)}

    g = Geometry(num_pages=4, page_tokens=4)
    good, bad = LedgerState(), Broken()
    for st in (good, bad):
        st.fold(CacheConfigured(geometry=g))
        st.fold(PagesReserved(request=1, page_ids=(0, 1)))
        st.fold(RequestFinished(request=1))
    assert good.free_count == 4 and bad.free_count == 2


def test_an_event_without_a_row_is_refused_by_name():
    class NotAnEvent:
        pass

    st = LedgerState()
    with pytest.raises(InvalidArgumentError, match="NotAnEvent"):
        st.validate(NotAnEvent())


# ---------------------------------------------------------------------- the table as data (issue 30, item 4)


def test_docs_transitions_md_is_the_table_rendered():
    """docs/TRANSITIONS.md is generated from the rows (``python scripts/transitions``)."""
    from pathlib import Path

    from kvledger.core.state import transitions

    doc = Path(__file__).resolve().parents[2] / "docs" / "TRANSITIONS.md"
    assert doc.read_text() == transitions.document(), "regenerate it: python scripts/transitions"
    for t in TRANSITIONS:
        assert f"`{transitions.event_cell(t)}`" in doc.read_text()


def test_the_spec_cells_are_rendered_from_the_structured_columns():
    """Change a column, the cell changes: the words are derived, not stored beside the data."""
    from kvledger.core.state.transitions import Requires, spec_rows

    row = TRANSITIONS[PagesReserved]
    assert row.requires.holders == ("free",) and row.requires.flags == ("not restoring",)
    changed = row._replace(requires=row.requires._replace(flags=("not restoring", "not stale")))
    assert changed.precondition == "each page free, not restoring, not stale"
    either = changed._replace(requires=Requires(holders=("free", "alias(S)")))
    assert either.precondition == "each page free or alias(S)"
    assert changed._replace(moves=row.moves._replace(to="kv(r)")).pages == "→ kv(r)"
    cells = {cell[0]: cell[1:] for cell in spec_rows()}
    assert cells["PagesReserved(r, pages)"] == (row.precondition, row.pages, row.mark, row.effect)
    assert set(cells) == {f"{t.__name__}({', '.join(r.names)})" for t, r in TRANSITIONS.items()}


def test_touched_follows_the_rows_touches_column():
    from kvledger.core.events import SnapshotReleased, StepSealed
    from kvledger.core.state.transitions import touched

    g = Geometry(num_pages=8, page_tokens=4)
    L = Ledger(g)
    L.allocate(1, 0, 3)
    L.alias_snapshot(5, 2)
    st = L.state
    assert touched(st, PagesReserved(request=2, page_ids=(6, 7))) == (6, 7)
    assert touched(st, RequestFinished(request=1)) == L.kv_pages(1)
    assert touched(st, SnapshotReleased(snapshot=5)) == L.snapshot_pages(5)
    assert touched(st, StepSealed(step=0, clear_list=(4,))) == (4,)
    assert touched(st, CacheConfigured(geometry=g)) == ()
    kinds = {row.touches for row in TRANSITIONS.values()}
    assert kinds <= {"page_ids", "page_id", "clear_list", "request", "snapshot", "plans", ""}


def test_handlers_are_built_from_the_table_and_a_missing_one_fails_where_it_is_built():
    from kvledger.core.state.transitions import event_name, handlers

    names = {f"on_{event_name(t)}": (lambda t=t: t) for t in TRANSITIONS}
    got = handlers(names, "on_")
    assert set(got) == set(TRANSITIONS) and all(got[t]() is t for t in TRANSITIONS)
    del names["on_pages_evicted"]
    with pytest.raises(TypeError, match="on_pages_evicted .PagesEvicted."):
        handlers(names, "on_")

    class Partial:
        def on_pages_reserved(self):
            pass

    with pytest.raises(TypeError, match="Partial has no handler for .*on_cache_configured"):
        handlers(Partial, "on_")
