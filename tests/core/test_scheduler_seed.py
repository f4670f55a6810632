"""The seed's scheduler rules (helios PR #181), pinned on the ledger."""

import pytest

from kvledger import (
    Geometry,
    Ledger,
    PageNotHeldError,
    RestoringPageError,
    replay,
)


def make(num_pages=16, **kw):
    return Ledger(Geometry(num_pages=num_pages, page_tokens=16), check=True, record=True, **kw)


def released_alias(L, snapshot=100, n=4):
    pages = L.alias_snapshot(snapshot, n)
    L.release_snapshot(snapshot)
    return pages


def test_released_alias_page_listed_once_when_first_committed():
    L = make()
    pages = released_alias(L)
    assert all(L.is_marked(p) for p in pages)
    got = L.reserve(1, 4)
    assert set(got) == set(pages)  # LIFO reuse hands the stale pages out first
    assert L.commit(1, 0, 2) == got[:2]
    assert L.commit(1, 0, 2) == got[2:]
    plan = L.seal_step(0)
    assert sorted(plan.clear_list) == sorted(pages)
    assert not any(L.is_marked(p) for p in pages)
    # committed pages are never listed again, in later steps or commits
    L.reserve(1, 2)
    assert L.commit(1, 1, 2) == ()
    assert L.seal_step(1).clear_list == ()


def test_pages_not_listed_at_release_or_reservation():
    L = make()
    released_alias(L)
    assert L.seal_step(0).clear_list == ()  # release lists nothing
    L.reserve(1, 4)
    assert L.seal_step(1).clear_list == ()  # reservation lists nothing


def test_mark_survives_returned_reservation_cancel_and_snapshot_reuse():
    L = make(num_pages=4)
    pages = released_alias(L, n=4)
    # returned reservation keeps the mark
    L.reserve(1, 4)
    L.return_reservation(1)
    assert all(L.is_marked(p) for p in pages)
    # cancellation of a request that only reserved keeps the mark
    L.reserve(2, 4)
    L.cancel(2)
    assert all(L.is_marked(p) for p in pages)
    # snapshot reuse (alias a marked free page again) keeps it
    L.alias_snapshot(200, pages=pages[:2])
    assert all(L.is_marked(p) for p in pages)
    L.release_snapshot(200)
    # finally a commit lists each page exactly once
    L.reserve(3, 4)
    listed = L.commit(3, 0, 4)
    assert sorted(listed) == sorted(pages)
    assert sorted(L.seal_step(0).clear_list) == sorted(pages)


def test_restore_into_request_never_enters_a_clear_list():
    L = make(num_pages=4)
    released_alias(L, n=4)
    got = L.reserve(1, 4)
    L.start_restore(got[:2], request=1)
    assert not L.is_marked(got[0]) and not L.is_marked(got[1])
    with pytest.raises(RestoringPageError):
        L.commit(1, 0, pages=got[:2])
    L.complete_restore(got[:2], request=1)
    listed = L.commit(1, 0, 4)
    assert sorted(listed) == sorted(got[2:])  # only the pages no restore overwrote
    assert sorted(L.seal_step(0).clear_list) == sorted(got[2:])


def test_restoring_page_cannot_be_reserved_or_committed():
    L = make(num_pages=4)
    snap = L.alias_snapshot(7, 2)
    L.start_restore(snap, snapshot=7)
    L.release_snapshot(7)  # released mid-restore: free, marked, still restoring
    assert all(L.holder_of(p) == "free" for p in snap)
    assert all(L.is_marked(p) and L.is_restoring(p) for p in snap)
    got = L.reserve(1, 2)  # the allocator skips restoring pages
    assert not set(got) & set(snap)
    from kvledger import OutOfPagesError

    with pytest.raises(OutOfPagesError):
        L.reserve(2, 1)
    before = L.digest()
    with pytest.raises(RestoringPageError):
        L.alias_snapshot(9, pages=snap)
    with pytest.raises(PageNotHeldError):
        L.commit(1, 0, pages=snap)  # not reserved(1), and restoring
    assert L.digest() == before
    L.complete_restore(snap, snapshot=7)
    assert all(L.is_marked(p) and not L.is_restoring(p) for p in snap)
    got2 = L.reserve(2, 2)
    assert set(got2) == set(snap)
    assert sorted(L.commit(2, 0, 2)) == sorted(snap)


def test_listed_page_freed_before_its_step_is_sealed_gets_its_mark_back():
    L = make(num_pages=2)
    pages = released_alias(L, n=2)
    L.reserve(1, 2)
    assert sorted(L.commit(1, 0, 2)) == sorted(pages)
    L.cancel(1)  # nothing has zeroed the pages yet
    assert all(L.is_marked(p) for p in pages)
    assert L.seal_step(0).clear_list == ()  # freed pages are not cleared for nobody
    L.reserve(2, 2)
    assert sorted(L.commit(2, 1, 2)) == sorted(pages)
    assert sorted(L.seal_step(1).clear_list) == sorted(pages)


def test_aborted_step_carries_its_clear_list_into_the_next():
    L = make(num_pages=2)
    pages = released_alias(L, n=2)
    L.reserve(1, 2)
    L.commit(1, 0, 2)
    plan = L.seal_step(0)
    assert sorted(plan.clear_list) == sorted(pages)
    L.abort_step(0, "rank 1 failed")
    assert L.seal_step(1).clear_list == plan.clear_list


def test_replay_of_recorded_events_gives_same_digest():
    L = make()
    released_alias(L)
    L.reserve(1, 6)
    L.commit(1, 0, 3)
    L.seal_step(0)
    L.finish(1)
    st = replay(L.events, check=True)
    assert st.digest() == L.digest()
