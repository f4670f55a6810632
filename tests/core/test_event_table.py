"""SPEC's event table, row by row: every accepted transition and every rejection.

All cases start from one hand-built ledger (``world``) whose pages are named:

    page  holder             mark  restoring   how it got there
    0, 1  free               yes   -           last alias (snapshot 90) released
    2     reserved(1)        -     -           request 1, tenant "a"
    3     reserved(1)        yes   -           released alias, then reserved
    4, 5  kv(1)              -     -           committed for step 1
    6     kv(1)              -     -           released alias committed for step 1: listed, step unsealed
    7     reserved(2)        -     -           request 2, tenant "b"
    8     reserved(2)        -     yes         restore into request 2 in flight
    9     alias({200})       -     yes         restore into snapshot 200 in flight
    10    alias({200,201})   -     -
    11    alias({201})       -     -
    12    free               yes   yes         snapshot 92 released while its restore was writing
    13-15, 17-19 free        -     -
    16    alias({203})       yes   -           released alias aliased again (snapshot reuse)

Step 0 is sealed (empty plan), so step 1 is open. A rejected command must raise
its specific ``KVLedgerError`` subclass, name the ids involved, and leave the
digest, ``seq``, the recorded events and the sink (the log) exactly as they were.
"""

from __future__ import annotations

import re

import pytest

from kvledger import (
    ClearPages,
    ConfigurationError,
    DuplicatePageError,
    Geometry,
    InvalidArgumentError,
    KVLedgerError,
    Ledger,
    LedgerState,
    OutOfPagesError,
    PageNotHeldError,
    PageOutOfRangeError,
    ReplayMismatchError,
    RestoringPageError,
    StepOrderError,
    StepPlan,
    TenantMismatchError,
    UnknownRequestError,
    UnknownSnapshotError,
    check_invariants,
    replay,
)
from kvledger.core.events import (
    PagesMarked,
    CacheConfigured,
    PagesCommitted,
    PagesReserved,
    RequestCancelled,
    RequestFinished,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepSealed,
)

N = 20
GEOMETRY = Geometry(num_pages=N, page_tokens=16)


class World:
    """A ledger in the state of the module docstring, with a recording sink."""

    def __init__(self, check: bool, plain: bool = False) -> None:
        self.sunk: list = []
        if plain:  # nothing attached: the commands' fast paths
            self.L = Ledger(GEOMETRY)
        else:
            self.L = Ledger(GEOMETRY, check=check, record=True, sink=lambda seq, ev: self.sunk.append((seq, ev)))
        sub = self.L.submit
        self.L.seal_step(0)
        sub(SnapshotAliased(snapshot=90, page_ids=(0, 1, 3, 6, 16)))
        sub(SnapshotReleased(snapshot=90))
        sub(PagesReserved(request=1, page_ids=(4, 5, 6), tenant="a"))
        sub(PagesCommitted(request=1, step=1, page_ids=(4, 5, 6)))
        sub(PagesReserved(request=1, page_ids=(2, 3), tenant="a"))
        sub(PagesReserved(request=2, page_ids=(7, 8), tenant="b"))
        sub(RestoreStarted(into="request", target=2, page_ids=(8,)))
        sub(SnapshotAliased(snapshot=200, page_ids=(9, 10)))
        sub(SnapshotAliased(snapshot=201, page_ids=(10, 11)))
        sub(RestoreStarted(into="snapshot", target=200, page_ids=(9,)))
        sub(SnapshotAliased(snapshot=92, page_ids=(12,)))
        sub(RestoreStarted(into="snapshot", target=92, page_ids=(12,)))
        sub(SnapshotReleased(snapshot=92))
        sub(SnapshotAliased(snapshot=203, page_ids=(16,)))


WORLD_PAGES = {
    0: ("free", True, False),
    1: ("free", True, False),
    2: ("reserved(1)", False, False),
    3: ("reserved(1)", True, False),
    4: ("kv(1)", False, False),
    5: ("kv(1)", False, False),
    6: ("kv(1)", False, False),
    7: ("reserved(2)", False, False),
    8: ("reserved(2)", False, True),
    9: ("alias({200})", False, True),
    10: ("alias({200,201})", False, False),
    11: ("alias({201})", False, False),
    12: ("free", True, True),
    13: ("free", False, False),
    14: ("free", False, False),
    15: ("free", False, False),
    16: ("alias({203})", True, False),
    17: ("free", False, False),
    18: ("free", False, False),
    19: ("free", False, False),
}


def view(L: Ledger) -> dict[int, tuple[str, bool, bool]]:
    return {p: (L.holder_of(p), L.is_marked(p), L.is_restoring(p)) for p in range(N)}


@pytest.fixture(params=[False, True], ids=["fast", "check"])
def world(request) -> World:
    return World(check=request.param)


@pytest.fixture(params=[(False, False), (True, False), (False, True)], ids=["fast", "check", "plain"])
def any_world(request) -> World:
    """``world``, and the same world in a ledger with nothing attached (the commands' fast paths)."""
    return World(*request.param)


def test_world_is_what_the_table_assumes(world):
    L = world.L
    assert view(L) == WORLD_PAGES
    assert L.open_step == 1
    assert L.reserved_pages(1) == (2, 3) and L.kv_pages(1) == (4, 5, 6)
    assert L.reserved_pages(2) == (7, 8) and L.kv_pages(2) == ()
    assert L.snapshot_pages(200) == (9, 10) and L.snapshot_pages(201) == (10, 11)
    assert L.free_count == 9 and L.reservable_count == 8
    check_invariants(L.state)


# --------------------------------------------------------------------------- accepted

def _raises(call, exc) -> bool:
    try:
        call()
    except exc:
        return True
    return False


ACCEPTED = [
    # (id, event, page changes {page: (holder, marked, restoring)}, effects, extra check)
    ("reserve-clean", PagesReserved(request=3, page_ids=(13, 14), tenant="c"),
     {13: ("reserved(3)", False, False), 14: ("reserved(3)", False, False)}, (),
     lambda L: L.reserved_pages(3) == (13, 14) and L.state.requests[3].tenant == "c"),
    ("reserve-keeps-mark", PagesReserved(request=3, page_ids=(0, 1)),
     {0: ("reserved(3)", True, False), 1: ("reserved(3)", True, False)}, (), None),
    ("reserve-extends-known-request", PagesReserved(request=1, page_ids=(13,), tenant="a"),
     {13: ("reserved(1)", False, False)}, (), lambda L: L.reserved_pages(1) == (2, 3, 13)),
    ("return-keeps-mark", ReservationReturned(request=1, page_ids=(3,)),
     {3: ("free", True, False)}, (), lambda L: L.reserved_pages(1) == (2,) and L.reservable_count == 9),
    ("return-clean", ReservationReturned(request=1, page_ids=(2,)),
     {2: ("free", False, False)}, (), lambda L: L.reserved_pages(1) == (3,)),
    ("return-restoring-page", ReservationReturned(request=2, page_ids=(8,)),
     {8: ("free", False, True)}, (), lambda L: L.reservable_count == 8 and L.free_count == 10),
    ("commit-lists-marked-in-commit-order", PagesCommitted(request=1, step=1, page_ids=(3, 2)),
     {3: ("kv(1)", False, False), 2: ("kv(1)", False, False)},
     (ClearPages(step=1, page_ids=(3,)),), lambda L: L.kv_pages(1) == (4, 5, 6, 3, 2)),
    ("commit-clean-lists-nothing", PagesCommitted(request=1, step=1, page_ids=(2,)),
     {2: ("kv(1)", False, False)}, (), lambda L: L.kv_pages(1) == (4, 5, 6, 2)),
    ("commit-for-a-later-step", PagesCommitted(request=1, step=4, page_ids=(3,)),
     {3: ("kv(1)", False, False)}, (ClearPages(step=4, page_ids=(3,)),), lambda L: L.open_step == 1),
    ("cancel-frees-keeps-marks", RequestCancelled(request=1),
     {2: ("free", False, False), 3: ("free", True, False), 4: ("free", False, False),
      5: ("free", False, False), 6: ("free", True, False)},  # 6 was listed, never zeroed: marked again
     (PagesMarked(page_ids=(6,)),), lambda L: 1 not in L.state.requests and L.free_count == 14),
    ("finish-frees-keeps-marks", RequestFinished(request=1),
     {2: ("free", False, False), 3: ("free", True, False), 4: ("free", False, False),
      5: ("free", False, False), 6: ("free", True, False)},
     (PagesMarked(page_ids=(6,)),), lambda L: 1 not in L.state.requests),
    ("cancel-mid-restore", RequestCancelled(request=2),
     {7: ("free", False, False), 8: ("free", False, True)}, (),
     lambda L: 2 not in L.state.requests and L.reservable_count == 9),
    ("alias-free", SnapshotAliased(snapshot=300, page_ids=(13,)),
     {13: ("alias({300})", False, False)}, (), lambda L: L.snapshot_pages(300) == (13,)),
    ("alias-keeps-mark", SnapshotAliased(snapshot=300, page_ids=(0,)),
     {0: ("alias({300})", True, False)}, (), None),
    ("alias-shared-page", SnapshotAliased(snapshot=300, page_ids=(10,)),
     {10: ("alias({200,201,300})", False, False)}, (), None),
    ("alias-extends-live-snapshot", SnapshotAliased(snapshot=200, page_ids=(11, 13)),
     {11: ("alias({200,201})", False, False), 13: ("alias({200})", False, False)}, (),
     lambda L: L.snapshot_pages(200) == (9, 10, 11, 13)),
    ("alias-reuses-marked-alias-page", SnapshotAliased(snapshot=300, page_ids=(16,)),
     {16: ("alias({203,300})", True, False)}, (), None),
    ("release-marks-last-alias-only", SnapshotReleased(snapshot=201),
     {10: ("alias({200})", False, False), 11: ("free", True, False)}, (PagesMarked(page_ids=(11,)),),
     lambda L: L.free_count == 10),
    ("release-mid-restore", SnapshotReleased(snapshot=200),
     {9: ("free", True, True), 10: ("alias({201})", False, False)}, (PagesMarked(page_ids=(9,)),),
     lambda L: L.free_count == 10 and L.reservable_count == 8),
    ("release-marked-reused-page", SnapshotReleased(snapshot=203),
     {16: ("free", True, False)}, (PagesMarked(page_ids=(16,)),), None),
    ("restore-into-request-clears-mark", RestoreStarted(into="request", target=1, page_ids=(3, 2)),
     {3: ("reserved(1)", False, True), 2: ("reserved(1)", False, True)}, (), None),
    ("restore-into-snapshot-keeps-mark", RestoreStarted(into="snapshot", target=203, page_ids=(16,)),
     {16: ("alias({203})", True, True)}, (), None),
    ("restore-into-snapshot-shared", RestoreStarted(into="snapshot", target=201, page_ids=(10, 11)),
     {10: ("alias({200,201})", False, True), 11: ("alias({201})", False, True)}, (), None),
    ("restore-completed-request", RestoreCompleted(into="request", target=2, page_ids=(8,)),
     {8: ("reserved(2)", False, False)}, (), None),
    ("restore-completed-snapshot", RestoreCompleted(into="snapshot", target=200, page_ids=(9,)),
     {9: ("alias({200})", False, False)}, (), None),
    ("restore-completed-after-release", RestoreCompleted(into="snapshot", target=92, page_ids=(12,)),
     {12: ("free", True, False)}, (), lambda L: L.reservable_count == 9),
    ("seal-open-step", StepSealed(step=1, clear_list=(6,)),
     {}, (StepPlan(step=1, clear_list=(6,)),),
     lambda L: L.open_step == 2 and (L.cancel(1) or not L.is_marked(6))),  # planned: no mark back
    ("step-completed", StepCompleted(step=0, rank=3),
     {}, (), lambda L: L.state.completed == {3: 0}),
    ("step-aborted-empty-plan", StepAborted(step=0, reason="rank 1 timed out"),
     {}, (), lambda L: L.open_step == 1 and _raises(lambda: L.abort_step(0), StepOrderError)),
]


@pytest.mark.parametrize("event,changes,effects,extra", [r[1:] for r in ACCEPTED], ids=[r[0] for r in ACCEPTED])
def test_accepted_transition(world, event, changes, effects, extra):
    L = world.L
    before = view(L)
    seq, n_events, n_sunk = L.seq, len(L.events), len(world.sunk)
    got = L.submit(event)
    assert got == effects
    assert L.seq == seq + 1
    assert L.events[n_events:] == [event]
    assert world.sunk[n_sunk:] == [(seq, event)]
    expected = dict(before)
    expected.update(changes)
    assert view(L) == expected
    assert L.free_count == sum(1 for h, _, _ in expected.values() if h == "free")
    if extra is not None:
        assert extra(L)
    check_invariants(L.state)
    assert replay(L.events, check=True).digest() == L.digest()


# Commands build exactly the event of their row, and return what SPEC says.
def _alloc(n):
    return lambda L: tuple(L.state.pick_free(n))


COMMANDS = [
    # (id, command, expected event (or a function of the ledger before), expected return)
    ("reserve", lambda L: L.reserve(3, 2, tenant="c"),
     lambda L: PagesReserved(request=3, page_ids=_alloc(2)(L), tenant="c"), lambda L: _alloc(2)(L)),
    ("reserve-inherits-tenant", lambda L: L.reserve(1, 1),
     lambda L: PagesReserved(request=1, page_ids=_alloc(1)(L), tenant="a"), lambda L: _alloc(1)(L)),
    ("return-all", lambda L: L.return_reservation(1), ReservationReturned(request=1, page_ids=(2, 3)), (2, 3)),
    ("return-some", lambda L: L.return_reservation(2, [8]), ReservationReturned(request=2, page_ids=(8,)), (8,)),
    ("commit-n", lambda L: L.commit(1, 1, 2), PagesCommitted(request=1, step=1, page_ids=(2, 3)), (3,)),
    ("commit-pages", lambda L: L.commit(1, 2, pages=[3]), PagesCommitted(request=1, step=2, page_ids=(3,)), (3,)),
    ("commit-clean", lambda L: L.commit(1, 1, pages=(2,)), PagesCommitted(request=1, step=1, page_ids=(2,)), ()),
    ("cancel", lambda L: L.cancel(2), RequestCancelled(request=2), None),
    ("finish", lambda L: L.finish(1), RequestFinished(request=1), None),
    ("alias-n", lambda L: L.alias_snapshot(300, 2),
     lambda L: SnapshotAliased(snapshot=300, page_ids=_alloc(2)(L)), lambda L: _alloc(2)(L)),
    ("alias-pages", lambda L: L.alias_snapshot(300, pages=[10, 0]),
     SnapshotAliased(snapshot=300, page_ids=(10, 0)), (10, 0)),
    ("release", lambda L: L.release_snapshot(201), SnapshotReleased(snapshot=201), None),
    ("restore-started-request", lambda L: L.start_restore([3], request=1),
     RestoreStarted(into="request", target=1, page_ids=(3,)), None),
    ("restore-started-snapshot", lambda L: L.start_restore(iter([10]), snapshot=200),
     RestoreStarted(into="snapshot", target=200, page_ids=(10,)), None),
    ("restore-completed", lambda L: L.complete_restore([9], snapshot=200),
     RestoreCompleted(into="snapshot", target=200, page_ids=(9,)), None),
    ("seal", lambda L: L.seal_step(1), StepSealed(step=1, clear_list=(6,)), StepPlan(step=1, clear_list=(6,))),
    ("step-completed", lambda L: L.complete_step(0, 1), StepCompleted(step=0, rank=1), None),
    ("step-aborted", lambda L: L.abort_step(0, "why"), StepAborted(step=0, reason="why"), None),
]


@pytest.mark.parametrize("command,event,result", [r[1:] for r in COMMANDS], ids=[r[0] for r in COMMANDS])
def test_command_builds_its_event(world, command, event, result):
    L = world.L
    if callable(event):
        event = event(L)
    if callable(result):
        result = result(L)
    n_events = len(L.events)
    got = command(L)
    assert got == result
    assert L.events[n_events:] == [event]
    check_invariants(L.state)


def test_allocator_never_hands_out_restoring_pages(world):
    L = world.L
    got = L.reserve(3, L.reservable_count)
    assert 12 not in got and 8 not in got
    assert L.reservable_count == 0
    with pytest.raises(OutOfPagesError):
        L.alias_snapshot(300, 1)


def test_commit_lists_marked_pages_in_commit_order():
    L = Ledger(GEOMETRY, check=True)
    L.alias_snapshot(1, pages=[5, 2, 9])
    L.release_snapshot(1)
    L.submit(PagesReserved(request=7, page_ids=(9, 3, 5, 4, 2)))
    assert L.commit(7, 0, pages=[2, 3, 9]) == (2, 9)
    assert L.commit(7, 0, pages=[4, 5]) == (5,)
    assert L.seal_step(0).clear_list == (2, 9, 5)
    assert L.kv_pages(7) == (2, 3, 9, 4, 5)


# --------------------------------------------------------------------------- CacheConfigured

@pytest.mark.parametrize("policy", ["released_aliases", "cross_tenant", "all_reused"])
def test_cache_configured_all_free_unmarked(policy):
    L = Ledger(Geometry(num_pages=7, page_tokens=4), policy=policy, record=True)
    assert L.events == [CacheConfigured(geometry=Geometry(num_pages=7, page_tokens=4), policy=policy)]
    assert L.seq == 1 and L.free_count == 7 and L.open_step == 0
    assert all(L.holder_of(p) == "free" and not L.is_marked(p) and not L.is_restoring(p) for p in range(7))
    assert L.state.policy == policy
    st = LedgerState()
    assert st.fold(L.events[0]) == ()
    assert st.digest() == L.digest()


CONFIG_REJECTS = [
    ("zero-pages", CacheConfigured(geometry=Geometry(num_pages=0, page_tokens=16)), ["0"]),
    ("too-many-pages", CacheConfigured(geometry=Geometry(num_pages=(1 << 32) + 1, page_tokens=16)),
     [str((1 << 32) + 1)]),
    ("zero-page-tokens", CacheConfigured(geometry=Geometry(num_pages=4, page_tokens=0)), ["0"]),
    ("str-pages", CacheConfigured(geometry=Geometry(num_pages="4", page_tokens=16)), ["'4'"]),
    ("unknown-policy", CacheConfigured(geometry=GEOMETRY, policy="sometimes"), ["sometimes"]),
]


@pytest.mark.parametrize("event,names", [r[1:] for r in CONFIG_REJECTS], ids=[r[0] for r in CONFIG_REJECTS])
def test_cache_configured_rejections(event, names):
    st = LedgerState()
    before = st.digest()
    with pytest.raises(ConfigurationError) as ei:
        st.fold(event)
    for name in names:
        assert name in str(ei.value)
    assert st.digest() == before and st.seq == 0 and st.geometry is None


def test_cache_configured_only_first(world):
    _assert_rejected(world, lambda L: L.submit(CacheConfigured(geometry=GEOMETRY)), ConfigurationError, [])


@pytest.mark.parametrize("event", [
    PagesReserved(request=1, page_ids=(0,)), SnapshotReleased(snapshot=1), StepSealed(step=0),
], ids=lambda e: type(e).__name__)
def test_events_before_cache_configured_are_refused(event):
    st = LedgerState()
    with pytest.raises(ConfigurationError, match=type(event).__name__):
        st.fold(event)
    assert st.seq == 0


@pytest.mark.parametrize("kwargs,exc", [
    (dict(geometry=Geometry(num_pages=0, page_tokens=1)), ConfigurationError),
    (dict(geometry=(4, 16)), InvalidArgumentError),
    (dict(geometry=GEOMETRY, policy="nope"), ConfigurationError),
], ids=["bad-geometry", "not-a-geometry", "bad-policy"])
def test_ledger_construction_rejections(kwargs, exc):
    with pytest.raises(exc):
        Ledger(**kwargs)


# --------------------------------------------------------------------------- rejections

def _assert_rejected(world: World, action, exc, names):
    L = world.L
    digest, seq = L.digest(), L.seq
    events, sunk = list(L.events or ()), list(world.sunk)
    before = view(L)
    with pytest.raises(exc) as ei:
        action(L)
    assert type(ei.value) is exc or exc is KVLedgerError, (type(ei.value), exc)
    message = str(ei.value)
    for name in names:
        assert re.search(r"(?<![\d\w])" + re.escape(str(name)) + r"(?![\d\w])", message), (name, message)
    assert L.digest() == digest
    assert L.seq == seq
    assert list(L.events or ()) == events
    assert world.sunk == sunk
    assert view(L) == before
    check_invariants(L.state)
    return ei.value


def S(ev):
    return lambda L: L.submit(ev)


R = RestoreStarted
C = RestoreCompleted
REJECTS = [
    # ---- PagesReserved
    ("reserve-kv-page", S(PagesReserved(request=3, page_ids=(4,))), PageNotHeldError, [4, "kv(1)"]),
    ("reserve-reserved-page", S(PagesReserved(request=3, page_ids=(2,))), PageNotHeldError, [2, "reserved(1)"]),
    ("reserve-alias-page", S(PagesReserved(request=3, page_ids=(10,))), PageNotHeldError, [10]),
    ("reserve-all-or-nothing", S(PagesReserved(request=3, page_ids=(13, 14, 5))), PageNotHeldError, [5]),
    ("reserve-restoring-free-page", S(PagesReserved(request=3, page_ids=(13, 12))), RestoringPageError, [12]),
    ("reserve-out-of-range", S(PagesReserved(request=3, page_ids=(13, 20))), PageOutOfRangeError, [20]),
    ("reserve-negative-page", S(PagesReserved(request=3, page_ids=(-1,))), PageOutOfRangeError, [-1]),
    ("reserve-duplicate-page", S(PagesReserved(request=3, page_ids=(13, 14, 13))), DuplicatePageError, [13]),
    ("reserve-empty", S(PagesReserved(request=3, page_ids=())), InvalidArgumentError, []),
    ("reserve-tenant-mismatch", S(PagesReserved(request=1, page_ids=(13,), tenant="b")), TenantMismatchError,
     [1, "a", "b"]),
    ("reserve-cmd-tenant-mismatch", lambda L: L.reserve(1, 1, tenant="b"), TenantMismatchError, [1, "a", "b"]),
    ("reserve-cmd-out-of-pages", lambda L: L.reserve(3, 9), OutOfPagesError, [3, 9, 8]),
    ("allocate-cmd-out-of-pages", lambda L: L.allocate(3, 1, 9), OutOfPagesError, [3, 9, 8]),
    ("allocate-cmd-tenant-mismatch", lambda L: L.allocate(2, 1, 1, tenant="a"), TenantMismatchError, [2, "a", "b"]),
    # ---- ReservationReturned
    ("return-kv-page", S(ReservationReturned(request=1, page_ids=(4,))), PageNotHeldError, [4, "reserved(1)"]),
    ("return-wrong-owner", S(ReservationReturned(request=2, page_ids=(2,))), PageNotHeldError, [2, "reserved(2)"]),
    ("return-free-page", S(ReservationReturned(request=1, page_ids=(13,))), PageNotHeldError, [13]),
    ("return-all-or-nothing", S(ReservationReturned(request=1, page_ids=(2, 3, 7))), PageNotHeldError, [7]),
    ("return-unknown-request", S(ReservationReturned(request=77, page_ids=(2,))), UnknownRequestError, [77]),
    ("return-out-of-range", S(ReservationReturned(request=1, page_ids=(99,))), PageOutOfRangeError, [99]),
    ("return-duplicate", S(ReservationReturned(request=1, page_ids=(2, 2))), DuplicatePageError, [2]),
    ("return-empty", S(ReservationReturned(request=1, page_ids=())), InvalidArgumentError, []),
    ("return-cmd-unknown-request", lambda L: L.return_reservation(77), UnknownRequestError, [77]),
    # ---- PagesCommitted
    ("commit-free-page", S(PagesCommitted(request=1, step=1, page_ids=(13,))), PageNotHeldError, [13, "reserved(1)"]),
    ("commit-wrong-owner", S(PagesCommitted(request=1, step=1, page_ids=(7,))), PageNotHeldError, [7, "reserved(2)"]),
    ("commit-kv-page-again", S(PagesCommitted(request=1, step=1, page_ids=(4,))), PageNotHeldError, [4, "kv(1)"]),
    ("commit-alias-page", S(PagesCommitted(request=1, step=1, page_ids=(10,))), PageNotHeldError, [10]),
    ("commit-all-or-nothing", S(PagesCommitted(request=1, step=1, page_ids=(3, 2, 7))), PageNotHeldError, [7]),
    ("commit-restoring-page", S(PagesCommitted(request=2, step=1, page_ids=(7, 8))), RestoringPageError, [8]),
    ("commit-sealed-step", S(PagesCommitted(request=1, step=0, page_ids=(2,))), StepOrderError, [0, 1]),
    ("commit-unknown-request", S(PagesCommitted(request=77, step=1, page_ids=(2,))), UnknownRequestError, [77]),
    ("commit-out-of-range", S(PagesCommitted(request=1, step=1, page_ids=(2, 25))), PageOutOfRangeError, [25]),
    ("commit-duplicate", S(PagesCommitted(request=1, step=1, page_ids=(3, 3))), DuplicatePageError, [3]),
    ("commit-empty", S(PagesCommitted(request=1, step=1, page_ids=())), InvalidArgumentError, []),
    ("commit-cmd-n-restoring", lambda L: L.commit(2, 1, 2), RestoringPageError, [8]),
    ("commit-cmd-n-sealed-step", lambda L: L.commit(1, 0, 1), StepOrderError, [0, 1]),
    ("commit-cmd-n-too-many", lambda L: L.commit(1, 1, 3), InvalidArgumentError, [1, 2, 3]),
    ("commit-cmd-n-unknown", lambda L: L.commit(77, 1, 1), UnknownRequestError, [77]),
    ("commit-cmd-pages-wrong-owner", lambda L: L.commit(2, 1, pages=[2]), PageNotHeldError, [2]),
    # ---- RequestCancelled / RequestFinished
    ("cancel-unknown", S(RequestCancelled(request=77)), UnknownRequestError, [77]),
    ("finish-unknown", S(RequestFinished(request=77)), UnknownRequestError, [77]),
    ("cancel-cmd-unknown", lambda L: L.cancel(77), UnknownRequestError, [77]),
    ("finish-cmd-unknown", lambda L: L.finish(78), UnknownRequestError, [78]),
    # ---- SnapshotAliased
    ("alias-reserved-page", S(SnapshotAliased(snapshot=300, page_ids=(2,))), PageNotHeldError, [2, "reserved(1)"]),
    ("alias-kv-page", S(SnapshotAliased(snapshot=300, page_ids=(4,))), PageNotHeldError, [4, "kv(1)"]),
    ("alias-all-or-nothing", S(SnapshotAliased(snapshot=300, page_ids=(13, 10, 7))), PageNotHeldError, [7]),
    ("alias-restoring-free-page", S(SnapshotAliased(snapshot=300, page_ids=(12,))), RestoringPageError, [12]),
    ("alias-restoring-alias-page", S(SnapshotAliased(snapshot=300, page_ids=(9,))), RestoringPageError, [9]),
    ("alias-page-already-in-snapshot", S(SnapshotAliased(snapshot=200, page_ids=(13, 10))), DuplicatePageError, [10]),
    ("alias-out-of-range", S(SnapshotAliased(snapshot=300, page_ids=(20,))), PageOutOfRangeError, [20]),
    ("alias-duplicate", S(SnapshotAliased(snapshot=300, page_ids=(13, 13))), DuplicatePageError, [13]),
    ("alias-empty", S(SnapshotAliased(snapshot=300, page_ids=())), InvalidArgumentError, []),
    ("alias-cmd-out-of-pages", lambda L: L.alias_snapshot(300, 9), OutOfPagesError, [300, 9]),
    # ---- SnapshotReleased
    ("release-unknown", S(SnapshotReleased(snapshot=77)), UnknownSnapshotError, [77]),
    ("release-already-released", S(SnapshotReleased(snapshot=90)), UnknownSnapshotError, [90]),
    ("release-cmd-unknown", lambda L: L.release_snapshot(77), UnknownSnapshotError, [77]),
    # ---- RestoreStarted
    ("restore-request-kv-page", S(R(into="request", target=1, page_ids=(4,))), PageNotHeldError, [4, "reserved(1)"]),
    ("restore-request-wrong-owner", S(R(into="request", target=1, page_ids=(2, 7))), PageNotHeldError, [7]),
    ("restore-request-free-page", S(R(into="request", target=1, page_ids=(13,))), PageNotHeldError, [13]),
    ("restore-request-unknown", S(R(into="request", target=77, page_ids=(2,))), UnknownRequestError, [77]),
    ("restore-request-already-restoring", S(R(into="request", target=2, page_ids=(7, 8))), RestoringPageError, [8]),
    ("restore-request-out-of-range", S(R(into="request", target=1, page_ids=(30,))), PageOutOfRangeError, [30]),
    ("restore-request-duplicate", S(R(into="request", target=1, page_ids=(2, 2))), DuplicatePageError, [2]),
    ("restore-request-empty", S(R(into="request", target=1, page_ids=())), InvalidArgumentError, []),
    ("restore-snapshot-unknown", S(R(into="snapshot", target=77, page_ids=(10,))), UnknownSnapshotError, [77]),
    ("restore-snapshot-released", S(R(into="snapshot", target=92, page_ids=(12,))), UnknownSnapshotError, [92]),
    ("restore-snapshot-other-snapshots-page", S(R(into="snapshot", target=200, page_ids=(10, 11))), PageNotHeldError,
     [11, 200]),
    ("restore-snapshot-free-page", S(R(into="snapshot", target=200, page_ids=(13,))), PageNotHeldError, [13, 200]),
    ("restore-snapshot-already-restoring", S(R(into="snapshot", target=200, page_ids=(9,))), RestoringPageError, [9]),
    ("restore-bad-target-kind", S(R(into="disk", target=1, page_ids=(2,))), InvalidArgumentError, ["disk"]),
    ("restore-cmd-both-targets", lambda L: L.start_restore([2], request=1, snapshot=200), InvalidArgumentError, []),
    ("restore-cmd-no-target", lambda L: L.start_restore([2]), InvalidArgumentError, []),
    # ---- RestoreCompleted
    ("completed-not-restoring", S(C(into="request", target=1, page_ids=(2,))), PageNotHeldError, [2]),
    ("completed-other-request", S(C(into="request", target=1, page_ids=(8,))), PageNotHeldError, [8, 1, 2]),
    ("completed-wrong-kind", S(C(into="snapshot", target=2, page_ids=(8,))), PageNotHeldError, [8]),
    ("completed-other-snapshot", S(C(into="snapshot", target=200, page_ids=(12,))), PageNotHeldError, [12, 92]),
    ("completed-all-or-nothing", S(C(into="snapshot", target=200, page_ids=(9, 10))), PageNotHeldError, [10]),
    ("completed-out-of-range", S(C(into="snapshot", target=200, page_ids=(20,))), PageOutOfRangeError, [20]),
    ("completed-duplicate", S(C(into="snapshot", target=200, page_ids=(9, 9))), DuplicatePageError, [9]),
    ("completed-empty", S(C(into="snapshot", target=200, page_ids=())), InvalidArgumentError, []),
    # ---- StepSealed
    ("seal-older-step", S(StepSealed(step=0)), StepOrderError, [0, 1]),
    ("seal-newer-step", S(StepSealed(step=2)), StepOrderError, [2, 1]),
    ("seal-wrong-recorded-clear-list", S(StepSealed(step=1, clear_list=())), ReplayMismatchError, [1, 6]),
    ("seal-cmd-newer-step", lambda L: L.seal_step(3), StepOrderError, [3, 1]),
    # ---- StepCompleted
    ("completed-step-not-sealed", S(StepCompleted(step=1, rank=0)), StepOrderError, [1]),
    ("completed-negative-rank", S(StepCompleted(step=0, rank=-1)), InvalidArgumentError, [-1]),
    ("completed-cmd-future-step", lambda L: L.complete_step(5, 0), StepOrderError, [5]),
    # ---- StepAborted
    ("aborted-open-step", S(StepAborted(step=1)), StepOrderError, [1]),
    ("aborted-unknown-step", S(StepAborted(step=9)), StepOrderError, [9]),
    ("aborted-cmd-open-step", lambda L: L.abort_step(1), StepOrderError, [1]),
    # ---- anything else
    ("submit-not-an-event", lambda L: L.submit(42), InvalidArgumentError, []),
    ("submit-none", lambda L: L.submit(None), InvalidArgumentError, []),
]


@pytest.mark.parametrize("action,exc,names", [r[1:] for r in REJECTS], ids=[r[0] for r in REJECTS])
def test_rejection_changes_nothing(any_world, action, exc, names):
    _assert_rejected(any_world, action, exc, names)


# Wrong argument types and ranges through the Ledger's commands.
WRONG_TYPES = [
    ("reserve-str-request", lambda L: L.reserve("3", 1), ["'3'"]),
    ("reserve-negative-request", lambda L: L.reserve(-1, 1), [-1]),
    ("reserve-huge-request", lambda L: L.reserve(1 << 63, 1), [str(1 << 63)]),
    ("reserve-bool-request", lambda L: L.reserve(True, 1), ["True"]),
    ("reserve-float-request", lambda L: L.reserve(3.0, 1), ["3.0"]),
    ("reserve-zero-n", lambda L: L.reserve(3, 0), [0]),
    ("reserve-negative-n", lambda L: L.reserve(3, -2), [-2]),
    ("reserve-float-n", lambda L: L.reserve(3, 1.0), ["1.0"]),
    ("reserve-bool-n", lambda L: L.reserve(3, True), ["True"]),
    ("reserve-int-tenant", lambda L: L.reserve(3, 1, tenant=5), [5]),
    ("allocate-str-request", lambda L: L.allocate("3", 1, 1), ["'3'"]),
    ("allocate-bool-request", lambda L: L.allocate(True, 1, 1), ["True"]),
    ("allocate-huge-request", lambda L: L.allocate(1 << 63, 1, 1), [str(1 << 63)]),
    ("allocate-float-n", lambda L: L.allocate(3, 1, 1.0), ["1.0"]),
    ("allocate-zero-n", lambda L: L.allocate(3, 1, 0), [0]),
    ("allocate-int-tenant", lambda L: L.allocate(3, 1, 1, tenant=5), [5]),
    ("commit-bool-request", lambda L: L.commit(True, 1, 1), ["True"]),
    ("commit-huge-step", lambda L: L.commit(1, 1 << 63, 1), [str(1 << 63)]),
    ("cancel-bool", lambda L: L.cancel(True), ["True"]),
    ("finish-bool", lambda L: L.finish(True), ["True"]),
    ("seal-bool-step", lambda L: L.seal_step(True), ["True"]),
    ("step-completed-bool-rank", lambda L: L.complete_step(0, True), ["True"]),
    ("step-completed-huge-rank", lambda L: L.complete_step(0, 1 << 63), [str(1 << 63)]),
    ("return-str-request", lambda L: L.return_reservation("1"), ["'1'"]),
    ("return-float-page", lambda L: L.return_reservation(1, [2.0]), ["2.0"]),
    ("return-bool-page", lambda L: L.return_reservation(1, [True]), ["True"]),
    ("return-not-iterable", lambda L: L.return_reservation(1, 7), [7]),
    ("return-empty-list", lambda L: L.return_reservation(1, []), []),
    ("commit-str-request", lambda L: L.commit("1", 1, 1), ["'1'"]),
    ("commit-str-step", lambda L: L.commit(1, "1", 1), ["'1'"]),
    ("commit-negative-step", lambda L: L.commit(1, -1, 1), [-1]),
    ("commit-zero-n", lambda L: L.commit(1, 1, 0), [0]),
    ("commit-float-n", lambda L: L.commit(1, 1, 1.0), ["1.0"]),
    ("commit-bool-n", lambda L: L.commit(1, 1, True), ["True"]),
    ("commit-neither-n-nor-pages", lambda L: L.commit(1, 1), []),
    ("commit-both-n-and-pages", lambda L: L.commit(1, 1, 1, pages=[2]), []),
    ("commit-str-page", lambda L: L.commit(1, 1, pages=["2"]), ["'2'"]),
    ("commit-empty-pages", lambda L: L.commit(1, 1, pages=[]), []),
    ("cancel-str", lambda L: L.cancel("1"), ["'1'"]),
    ("cancel-none", lambda L: L.cancel(None), ["None"]),
    ("finish-float", lambda L: L.finish(1.0), ["1.0"]),
    ("alias-str-snapshot", lambda L: L.alias_snapshot("s", 1), ["'s'"]),
    ("alias-neither", lambda L: L.alias_snapshot(300), []),
    ("alias-both", lambda L: L.alias_snapshot(300, 1, pages=[13]), []),
    ("alias-zero-n", lambda L: L.alias_snapshot(300, 0), [0]),
    ("alias-float-page", lambda L: L.alias_snapshot(300, pages=[13.0]), ["13.0"]),
    ("alias-empty-pages", lambda L: L.alias_snapshot(300, pages=[]), []),
    ("release-str", lambda L: L.release_snapshot("200"), ["'200'"]),
    ("release-negative", lambda L: L.release_snapshot(-200), [-200]),
    ("restore-str-request", lambda L: L.start_restore([2], request="1"), ["'1'"]),
    ("restore-none-pages", lambda L: L.start_restore(None, request=1), ["None"]),
    ("restore-float-page", lambda L: L.start_restore([2.0], request=1), ["2.0"]),
    ("restore-empty-pages", lambda L: L.start_restore([], request=1), []),
    ("completed-both-targets", lambda L: L.complete_restore([8], request=2, snapshot=200), []),
    ("completed-str-snapshot", lambda L: L.complete_restore([9], snapshot="200"), ["'200'"]),
    ("seal-str-step", lambda L: L.seal_step("1"), ["'1'"]),
    ("seal-float-step", lambda L: L.seal_step(1.0), ["1.0"]),
    ("step-completed-str-step", lambda L: L.complete_step("0", 0), ["'0'"]),
    ("step-completed-negative-rank", lambda L: L.complete_step(0, -1), [-1]),
    ("step-completed-float-rank", lambda L: L.complete_step(0, 1.5), ["1.5"]),
    ("step-aborted-str-step", lambda L: L.abort_step("0"), ["'0'"]),
    ("step-aborted-int-reason", lambda L: L.abort_step(0, reason=5), [5]),
]


@pytest.mark.parametrize("action,names", [r[1:] for r in WRONG_TYPES], ids=[r[0] for r in WRONG_TYPES])
def test_command_argument_errors_change_nothing(any_world, action, names):
    _assert_rejected(any_world, action, InvalidArgumentError, names)


# Events built elsewhere (tools, a decoder that skipped type checks) go through
# ``submit``: a wrongly typed field must be a KVLedgerError that changes nothing,
# never a TypeError from deep inside the fold, and never an accepted event that
# puts a non-int id into the state.
ILL_TYPED_EVENTS = [
    ("str-request", PagesReserved(request="x", page_ids=(13,))),
    ("negative-request", PagesReserved(request=-3, page_ids=(13,))),
    ("str-page", PagesReserved(request=3, page_ids=("13",))),
    ("float-page", PagesReserved(request=3, page_ids=(13.0,))),
    ("bool-page", PagesReserved(request=3, page_ids=(True,))),
    ("int-tenant", PagesReserved(request=3, page_ids=(13,), tenant=5)),
    ("str-snapshot", SnapshotAliased(snapshot="s", page_ids=(13,))),
    ("str-step", PagesCommitted(request=1, step="1", page_ids=(2,))),
    ("str-rank", StepCompleted(step=0, rank="0")),
    ("int-reason", StepAborted(step=0, reason=5)),
]


@pytest.mark.parametrize("event", [r[1] for r in ILL_TYPED_EVENTS], ids=[r[0] for r in ILL_TYPED_EVENTS])
def test_submit_rejects_ill_typed_events(world, event):
    _assert_rejected(world, lambda L: L.submit(event), InvalidArgumentError, [])


# --------------------------------------------------------------------------- steps in depth

def _released(L, snapshot, pages):
    L.alias_snapshot(snapshot, pages=pages)
    L.release_snapshot(snapshot)


def test_seal_lists_each_page_once_even_if_listed_twice_in_the_step():
    L = Ledger(Geometry(num_pages=4, page_tokens=16), check=True, record=True)
    _released(L, 9, [0, 1])
    L.submit(PagesReserved(request=1, page_ids=(0, 1)))
    assert L.commit(1, 0, pages=[0, 1]) == (0, 1)
    L.cancel(1)  # listed, never zeroed: marked again
    assert L.is_marked(0) and L.is_marked(1)
    L.submit(PagesReserved(request=2, page_ids=(1, 0)))
    assert L.commit(2, 0, pages=[1, 0]) == (1, 0)
    plan = L.seal_step(0)
    assert sorted(plan.clear_list) == [0, 1] and len(plan.clear_list) == 2
    assert replay(L.events, check=True).digest() == L.digest()


def test_seal_leaves_out_pages_freed_before_it():
    L = Ledger(Geometry(num_pages=4, page_tokens=16), check=True)
    _released(L, 9, [0, 1])
    L.submit(PagesReserved(request=1, page_ids=(0,)))
    L.submit(PagesReserved(request=2, page_ids=(1,)))
    assert L.commit(1, 0, 1) == (0,)
    assert L.commit(2, 0, 1) == (1,)
    L.finish(1)
    assert L.seal_step(0).clear_list == (1,)
    assert L.is_marked(0) and not L.is_marked(1)


def test_seal_plan_holds_only_that_steps_listings():
    """SPEC: the plan of a step is the union of *that step's* clear lists.

    Page 0 is listed for step 1 by request 1, which is cancelled (the listing dies,
    the mark comes back); request 2 then commits it for step 2. The commit's
    effect says step 2, so step 1's plan must not list it and step 2's must.
    """
    L = Ledger(Geometry(num_pages=2, page_tokens=16), check=True, record=True)
    _released(L, 9, [0])
    L.submit(PagesReserved(request=1, page_ids=(0,)))
    assert L.commit(1, 1, 1) == (0,)
    L.cancel(1)
    L.submit(PagesReserved(request=2, page_ids=(0,)))
    effects = L.submit(PagesCommitted(request=2, step=2, page_ids=(0,)))
    assert effects == (ClearPages(step=2, page_ids=(0,)),)
    assert L.seal_step(0).clear_list == ()
    assert L.seal_step(1).clear_list == ()
    assert L.seal_step(2).clear_list == (0,)


def test_step_completed_keeps_the_highest_step_per_rank():
    L = Ledger(Geometry(num_pages=2, page_tokens=16), check=True)
    for step in range(3):
        L.seal_step(step)
    L.complete_step(2, 0)
    L.complete_step(1, 0)
    L.complete_step(0, 1)
    assert L.state.completed == {0: 2, 1: 0}


def _aborted_world():
    L = Ledger(Geometry(num_pages=6, page_tokens=16), check=True, record=True)
    _released(L, 9, [0, 1, 2, 3])
    L.submit(PagesReserved(request=1, page_ids=(0, 1, 2, 3)))
    assert L.commit(1, 0, 4) == (0, 1, 2, 3)
    assert L.seal_step(0).clear_list == (0, 1, 2, 3)
    return L


def test_aborted_step_carries_kv_pages_and_remarks_freed_ones():
    L = _aborted_world()
    L.cancel(1)  # after the seal: pages free and (as far as the ledger knows) zeroed
    assert not any(L.is_marked(p) for p in range(4))
    L.submit(PagesReserved(request=2, page_ids=(0, 1)))
    assert L.commit(2, 1, pages=[0]) == ()  # not marked: the plan was going to zero it
    L.alias_snapshot(5, pages=[2])
    L.abort_step(0, "rank 1 rejected")
    # page 0 is kv(2): nothing zeroed it, so step 1 must; 1 is reserved(2), 2 aliased,
    # 3 free: all marked again.
    assert not L.is_marked(0) and L.is_marked(1) and L.is_marked(2) and L.is_marked(3)
    assert L.commit(2, 1, pages=[1]) == (1,)
    assert L.seal_step(1).clear_list == (0, 1)
    assert replay(L.events, check=True).digest() == L.digest()
    with pytest.raises(StepOrderError):
        L.abort_step(0)  # only the last sealed step, and only once


def test_aborted_step_keeps_restoring_pages_unmarked():
    L = _aborted_world()
    L.cancel(1)
    L.submit(PagesReserved(request=2, page_ids=(0,)))
    L.start_restore([0], request=2)
    L.abort_step(0)
    assert not L.is_marked(0)  # the restore is overwriting it whole
    L.complete_restore([0], request=2)
    assert L.commit(2, 1, 1) == ()


@pytest.mark.parametrize("committed", [False, True], ids=["reserved", "committed"])
def test_aborted_step_does_not_reclear_a_page_a_restore_already_overwrote(committed):
    """After the seal, page 0 went to request 2 and a restore into request 2 overwrote
    it whole. Whether request 2 still holds it reserved or has committed it since,
    zeroing it after the abort would destroy the restored KV: like a restore still
    in flight, it must be neither marked nor carried into the next plan."""
    L = _aborted_world()
    L.cancel(1)
    L.submit(PagesReserved(request=2, page_ids=(0,)))
    L.start_restore([0], request=2)
    L.complete_restore([0], request=2)
    if committed:
        assert L.commit(2, 1, 1) == ()
    L.abort_step(0)
    assert not L.is_marked(0)
    if not committed:
        assert L.commit(2, 1, 1) == ()
    assert 0 not in L.seal_step(1).clear_list
