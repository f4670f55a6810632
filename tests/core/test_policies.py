"""The three clear policies.

    released_aliases (default, the seed's rule): only pages whose last snapshot
        alias was released are marked.
    cross_tenant: also, a page a request wrote (KV or an inbound restore) is
        marked when the request lets go of it, for every tenant but the writer's.
    all_reused: every page that held anything is marked when it is let go, for
        everyone.

In every policy a released alias row is marked for everyone, a mark is listed
exactly once (by the first commit that takes it), and a page a request only
reserved (never wrote) carries nothing new.
"""

from __future__ import annotations

import pytest

from kvledger import CLEAR_POLICIES, Geometry, Ledger, check_invariants, replay
from kvledger.core.events import PagesReserved


def make(policy, num_pages=8):
    return Ledger(Geometry(num_pages=num_pages, page_tokens=16), policy=policy, check=True, record=True)


def take(L, request, pages, tenant=None):
    """Reserve exactly ``pages`` for ``request`` (an explicit PagesReserved)."""
    L.submit(PagesReserved(request=request, page_ids=tuple(pages), tenant=tenant))


def written(L, request, pages, tenant, step=None):
    """``request`` reserves ``pages``, commits them and the step runs: the request wrote them."""
    take(L, request, pages, tenant)
    step = L.open_step if step is None else step
    listed = L.commit(request, step, pages=pages)
    L.seal_step(step)
    return listed


def released_rows(L, snapshot, pages):
    L.alias_snapshot(snapshot, pages=pages)
    L.release_snapshot(snapshot)


def listed_on_commit(L, request, pages, tenant):
    take(L, request, pages, tenant)
    return L.commit(request, L.open_step, pages=pages)


def finish_checks(L):
    check_invariants(L.state)
    assert replay(L.events, check=True).digest() == L.digest()


# --------------------------------------------------------------------------- every policy

@pytest.mark.parametrize("policy", CLEAR_POLICIES)
@pytest.mark.parametrize("tenant", ["a", "b", None])
def test_released_alias_rows_are_marked_for_everyone(policy, tenant):
    L = make(policy)
    released_rows(L, 1, [2, 3])
    assert L.is_marked(2) and L.is_marked(3)
    assert listed_on_commit(L, 5, [3, 2], tenant) == (3, 2)
    assert L.seal_step(0).clear_list == (3, 2)
    # exactly once: the request's later commits list nothing
    take(L, 5, [4], tenant)
    assert L.commit(5, 1, pages=[4]) == ()
    finish_checks(L)


@pytest.mark.parametrize("policy", CLEAR_POLICIES)
def test_reserved_but_unwritten_pages_carry_nothing_new(policy):
    L = make(policy)
    take(L, 1, [0, 1, 2], "a")
    L.return_reservation(1, [0])
    L.cancel(1)
    assert not any(L.is_marked(p) for p in range(3))
    assert listed_on_commit(L, 2, [0, 1, 2], "b") == ()
    finish_checks(L)


@pytest.mark.parametrize("policy", CLEAR_POLICIES)
def test_listed_page_freed_before_its_step_is_marked_for_everyone(policy):
    L = make(policy)
    released_rows(L, 1, [4])
    assert listed_on_commit(L, 1, [4], "a") == (4,)
    L.cancel(1)  # nothing zeroed it: row bytes still there, even for tenant a
    assert L.is_marked(4)
    assert listed_on_commit(L, 2, [4], "a") == (4,)
    assert L.seal_step(0).clear_list == (4,)
    finish_checks(L)


@pytest.mark.parametrize("policy", CLEAR_POLICIES)
def test_policy_is_recorded_and_replayed(policy):
    L = make(policy)
    written(L, 1, [0, 1], "a")
    L.finish(1)
    released_rows(L, 2, [5])
    st = replay(L.events, check=True)
    assert st.policy == policy
    assert st.digest() == L.digest()


def test_default_policy_is_the_seeds_rule():
    L = Ledger(Geometry(num_pages=4, page_tokens=16))
    assert L.state.policy == "released_aliases"


# --------------------------------------------------------------------------- released_aliases

@pytest.mark.parametrize("end", ["finish", "cancel"])
def test_released_aliases_ignores_bytes_requests_leave(end):
    L = make("released_aliases")
    written(L, 1, [0, 1], "a")
    getattr(L, end)(1)
    assert not L.is_marked(0) and not L.is_marked(1)
    assert listed_on_commit(L, 2, [0, 1], "b") == ()
    finish_checks(L)


def test_released_aliases_restore_into_request_then_cancel():
    L = make("released_aliases")
    released_rows(L, 1, [0, 1])
    take(L, 1, [0, 1], "a")
    L.start_restore([0], request=1)  # overwrites page 0 whole: its mark goes
    L.cancel(1)  # mid-restore
    L.complete_restore([0], request=1)
    assert not L.is_marked(0) and L.is_marked(1)
    assert listed_on_commit(L, 2, [0, 1], "b") == (1,)
    finish_checks(L)


# --------------------------------------------------------------------------- cross_tenant

@pytest.mark.parametrize("end", ["finish", "cancel"])
def test_cross_tenant_marks_for_other_tenants_only(end):
    L = make("cross_tenant")
    written(L, 1, [0, 1, 2], "a")
    getattr(L, end)(1)
    assert all(L.is_marked(p) for p in (0, 1, 2))
    assert listed_on_commit(L, 2, [0], "a") == ()  # the same tenant's own bytes
    assert listed_on_commit(L, 3, [1], "b") == (1,)  # another tenant's: zeroed first
    assert listed_on_commit(L, 4, [2], None) == (2,)  # no tenant is another tenant too
    assert L.seal_step(L.open_step).clear_list == (1, 2)
    finish_checks(L)


def test_cross_tenant_mark_survives_other_tenants_reservations():
    L = make("cross_tenant")
    written(L, 1, [0], "a")
    L.finish(1)
    take(L, 2, [0], "b")
    L.return_reservation(2)  # b never wrote it: still a's bytes
    take(L, 3, [0], "b")
    L.cancel(3)
    assert L.is_marked(0)
    assert listed_on_commit(L, 4, [0], "a") == ()
    finish_checks(L)


def test_cross_tenant_residue_follows_the_last_writer():
    L = make("cross_tenant")
    written(L, 1, [0], "a")
    L.finish(1)
    assert written(L, 2, [0], "b") == (0,)  # a's bytes, zeroed for b
    L.finish(2)  # now b's bytes
    assert listed_on_commit(L, 3, [0], "a") == (0,)
    finish_checks(L)


def test_cross_tenant_same_tenant_reuse_keeps_the_residue():
    L = make("cross_tenant")
    written(L, 1, [0], "a")
    L.finish(1)
    assert written(L, 2, [0], "a") == ()
    L.finish(2)
    assert listed_on_commit(L, 3, [0], "b") == (0,)
    finish_checks(L)


def test_cross_tenant_freed_page_aliased_and_released_is_marked_for_everyone():
    L = make("cross_tenant")
    written(L, 1, [0], "a")
    L.finish(1)
    released_rows(L, 7, [0])  # row bytes now
    assert listed_on_commit(L, 2, [0], "a") == (0,)
    finish_checks(L)


@pytest.mark.parametrize("end", ["return", "cancel", "cancel-mid-restore"])
def test_cross_tenant_restore_into_request_then_let_go(end):
    L = make("cross_tenant")
    take(L, 1, [0, 1], "a")
    L.start_restore([0], request=1)
    if end != "cancel-mid-restore":
        L.complete_restore([0], request=1)
    if end == "return":
        L.return_reservation(1)
    else:
        L.cancel(1)
    if end == "cancel-mid-restore":
        assert L.is_restoring(0)
        L.complete_restore([0], request=1)
    assert L.is_marked(0)  # tenant a's restored KV
    assert not L.is_marked(1)  # reserved, never written
    L2 = make("cross_tenant")  # the same history, read by the other tenant
    for ev in L.events[1:]:
        L2.submit(ev)
    assert listed_on_commit(L, 2, [0, 1], "a") == ()
    assert listed_on_commit(L2, 2, [0, 1], "b") == (0,)
    finish_checks(L)
    finish_checks(L2)


def test_cross_tenant_restore_over_a_released_row_then_cancel():
    L = make("cross_tenant")
    released_rows(L, 1, [0])
    take(L, 1, [0], "a")
    L.start_restore([0], request=1)  # overwrites the row: mark gone
    assert not L.is_marked(0)
    L.complete_restore([0], request=1)
    L.cancel(1)  # now a's bytes
    assert L.is_marked(0)
    assert listed_on_commit(L, 2, [0], "a") == ()
    finish_checks(L)


# --------------------------------------------------------------------------- all_reused

@pytest.mark.parametrize("end", ["finish", "cancel"])
def test_all_reused_lists_every_reused_page_once(end):
    L = make("all_reused")
    written(L, 1, [0, 1], "a")
    getattr(L, end)(1)
    assert L.is_marked(0) and L.is_marked(1)
    assert written(L, 1, [1, 0], "a") == (1, 0)  # the same tenant, even the same request id
    take(L, 1, [2], "a")
    assert L.commit(1, L.open_step, pages=[2]) == ()  # exactly once
    L.finish(1)
    assert listed_on_commit(L, 2, [0, 1, 2], "a") == (0, 1, 2)
    finish_checks(L)


@pytest.mark.parametrize("end", ["return", "cancel"])
def test_all_reused_restore_into_request_then_let_go(end):
    L = make("all_reused")
    take(L, 1, [0, 1], "a")
    L.start_restore([0], request=1)
    L.complete_restore([0], request=1)
    if end == "return":
        L.return_reservation(1)
    else:
        L.cancel(1)
    assert L.is_marked(0) and not L.is_marked(1)
    assert listed_on_commit(L, 2, [0, 1], "a") == (0,)
    finish_checks(L)


def test_all_reused_restore_then_commit_is_not_listed():
    L = make("all_reused")
    released_rows(L, 1, [0])
    take(L, 1, [0], "a")
    L.start_restore([0], request=1)
    L.complete_restore([0], request=1)
    assert L.commit(1, 0, 1) == ()  # the restore wrote it whole: nothing to zero
    L.finish(1)
    assert L.is_marked(0)
    finish_checks(L)
