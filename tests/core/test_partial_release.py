"""Engines that keep requests open while their pages change hands: partial releases, whole-page reads,
and the records that name requests and dropped work.

    PagesReleased(r, pages)      a live request lets go of some KV pages (a sliding window moved on, a
                                 recurrent state's old block): each goes where a finishing request's
                                 page goes (still shared: the others keep it; hashed: cached; else
                                 free, marked as the policy marks a request's bytes); r keeps the rest
    PagesCommitted(reads=whole)  the step reads the pages whole before writing them (a recurrent
                                 state): every mark is listed, the committing tenant's own included;
                                 refused under released_aliases, which marks no request's bytes
    RequestLabelled(r, label)    the engine's name for r (a vLLM request id): a record
    PagesUnwritten(r, step, ps)  the step ran without r: a record

Each test names the bug it kills (the mutants in scripts/mutants point here).
"""

from __future__ import annotations

import msgspec
import pytest

from kvledger import (
    CLEAR_POLICIES,
    ConfigurationError,
    Geometry,
    InvalidArgumentError,
    Ledger,
    PageNotHeldError,
    StepOrderError,
    UnknownRequestError,
    check_invariants,
    replay,
)
from kvledger.core.events import PagesCommitted, PagesReleased, PagesUnwritten, RequestLabelled
from kvledger.durable import open_ledger
from kvledger.tools.replay import replay_log

G = Geometry(num_pages=8, page_tokens=4)


def make(policy: str) -> Ledger:
    return Ledger(G, policy=policy, check=True, record=True)


def ran(L: Ledger) -> int:
    """Seal the open step and complete it on rank 0; returns the step."""
    step = L.open_step
    L.seal_step(step)
    L.complete_step(step, rank=0)
    return step


def same_replay(L: Ledger) -> None:
    check_invariants(L.state)
    assert replay(L.events, check=True).digest() == L.digest()


@pytest.mark.parametrize("policy", CLEAR_POLICIES)
def test_a_released_page_goes_free_and_is_marked_as_the_policy_marks_a_finished_requests(policy):
    """Kills: a partial release that frees pages without the policy's mark (cross_tenant / all_reused
    would hand another tenant's KV to the next request unzeroed), or that drops the kept pages."""
    L = make(policy)
    L.allocate(1, 0, pages=(0, 1, 2), tenant="a")
    ran(L)
    L.release(1, (1,))
    assert L.kv_pages(1) == (0, 2)
    assert L.holder_of(1) == "free" and L.holder_of(0) == "kv(1)"
    assert (1 in L.state.marks) == (policy != "released_aliases")
    L.allocate(2, L.open_step, pages=(1,), tenant="b")  # another tenant takes it
    plan = L.seal_step(L.open_step)
    assert plan.clear_list == (() if policy == "released_aliases" else (1,))
    same_replay(L)


def test_a_released_page_comes_back_to_its_tenant_without_a_clear_under_cross_tenant():
    """Kills: a release that marks for everyone (the group of a vLLM cache reusing its own blocks would
    zero every one of them)."""
    L = make("cross_tenant")
    L.allocate(1, 0, pages=(0, 1), tenant="g0")
    ran(L)
    L.release(1, (0,))
    assert L.allocate(2, L.open_step, pages=(0,), tenant="g0") == (0,)
    assert L.seal_step(L.open_step).clear_list == ()
    same_replay(L)


def test_a_released_page_still_shared_stays_with_the_others_and_a_hashed_one_goes_cached():
    L = make("released_aliases")
    L.allocate(1, 0, pages=(0, 1, 2))
    ran(L)
    L.publish(1, [11, 12], list(range(8)))  # pages 0 and 1 hashed
    L.share(2, [11])  # page 0 shared by 2
    L.release(1, (0, 1))
    assert L.holder_of(0) == "kv(2)"
    assert L.holder_of(1).startswith("cached(") and L.cached_count == 1
    assert L.kv_pages(1) == (2,)
    same_replay(L)


def test_a_page_listed_and_released_before_its_step_is_sealed_gets_its_mark_back():
    """Kills: a release that forgets a pending listing (the page would go free unzeroed and unmarked)."""
    L = make("released_aliases")
    L.alias_snapshot(9, pages=(3,))
    L.release_snapshot(9)
    L.allocate(1, 0, pages=(3, 4))
    L.release(1, (3,))
    assert 3 in L.state.marks and L.seal_step(0).clear_list == ()
    L.allocate(2, 1, pages=(3,))
    assert L.seal_step(1).clear_list == (3,)
    same_replay(L)


def test_a_release_of_pages_the_request_does_not_hold_changes_nothing():
    L = make("cross_tenant")
    L.allocate(1, 0, pages=(0, 1), tenant="a")
    L.allocate(2, 0, pages=(2,), tenant="a")
    digest, seq = L.digest(), L.seq
    with pytest.raises(PageNotHeldError, match="page 2"):
        L.release(1, (0, 2))
    with pytest.raises(UnknownRequestError):
        L.release(7, (0,))
    with pytest.raises(InvalidArgumentError):
        L.release(1, ())
    assert (L.digest(), L.seq) == (digest, seq)


def test_a_commit_that_reads_the_whole_page_lists_its_own_tenants_bytes_too():
    """Kills: a whole-page read treated as a KV tail (a recurrent state would start from another
    request's bytes of the same group: vLLM #56524's stale-state poisoning)."""
    L = make("cross_tenant")
    L.allocate(1, 0, pages=(0, 1), tenant="mamba")
    ran(L)
    L.finish(1)  # both pages free, marked for tenants other than "mamba"
    assert L.allocate(2, L.open_step, pages=(0,), tenant="mamba") == (0,)  # a KV tail: its own bytes
    assert L.allocate(3, L.open_step, pages=(1,), tenant="mamba", reads="whole") == (1,)
    assert L.seal_step(L.open_step).clear_list == (1,)
    same_replay(L)


def test_a_whole_page_read_of_a_page_never_used_lists_nothing():
    L = make("all_reused")
    L.allocate(1, 0, pages=(5,), reads="whole")
    assert L.seal_step(0).clear_list == ()


def test_a_whole_page_read_is_refused_under_the_policy_that_marks_no_request_bytes():
    L = make("released_aliases")
    L.reserve(1, 1)
    digest = L.digest()
    with pytest.raises(ConfigurationError, match="released_aliases"):
        L.commit(1, 0, 1, reads="whole")
    with pytest.raises(ConfigurationError):
        L.allocate(2, 0, pages=(5,), reads="whole")
    with pytest.raises(InvalidArgumentError, match="reads must be one of"):
        L.commit(1, 0, 1, reads="most")
    assert L.digest() == digest


def test_records_change_nothing_but_the_sequence():
    L = make("cross_tenant")
    L.label(1, "cmpl-7/g1:mamba")  # before the request exists
    L.allocate(1, 0, pages=(0,), tenant="g1")
    step = ran(L)
    before = replay(L.events).digest()
    with pytest.raises(InvalidArgumentError, match="still holds"):
        L.record_unwritten(1, step, (0,), "it keeps the page: it ran")
    L.record_unwritten(1, step, (3,), "aborted before its step ran")  # (not a page it holds)
    L.label(1, "cmpl-7")
    assert L.seq == 8 and L.holder_of(0) == "kv(1)"
    assert L.state.marks == replay(L.events).marks
    assert [type(e) for e in L.events[-2:]] == [PagesUnwritten, RequestLabelled]
    with pytest.raises(StepOrderError):
        L.record_unwritten(1, L.open_step, (0,))
    with pytest.raises(InvalidArgumentError):
        L.label(1, "x" * 1025)
    assert before != L.digest()  # (the sequence number is part of the state)


def test_the_default_commit_encodes_as_before_and_a_whole_read_adds_one_key():
    """The log's bytes for every existing commit are unchanged (``reads`` is omitted at its default)."""
    enc = msgspec.msgpack.encode
    plain = PagesCommitted(request=1, step=2, page_ids=(3,))
    assert enc(plain) == enc({"type": "pages_committed", "request": 1, "step": 2, "page_ids": [3]})
    whole = PagesCommitted(request=1, step=2, page_ids=(3,), reads="whole")
    assert msgspec.msgpack.decode(enc(whole), type=PagesCommitted) == whole
    assert msgspec.msgpack.decode(enc(plain), type=PagesCommitted).reads == "tail"


def test_a_durable_log_of_the_new_events_reopens_and_replays(tmp_path):
    path = tmp_path / "x.kvlog"
    with open_ledger(path, G, policy="cross_tenant") as L:
        L.label(1, "req-a/g0")
        L.allocate(1, 0, pages=(0, 1, 2), tenant="g0")
        ran(L)
        L.release(1, (1,))
        L.allocate(2, L.open_step, pages=(1,), tenant="g1", reads="whole")
        step = ran(L)
        L.cancel(2)
        L.record_unwritten(2, step, (1,), "dropped")
        digest = L.digest()
    with open_ledger(path, G, policy="cross_tenant") as L:
        assert L.digest() == digest
        assert L.kv_pages(1) == (0, 2) and L.holder_of(1) == "free"
    for trusted in (False, True):
        summary = replay_log(path, trusted=trusted)
        assert summary.error is None and summary.digest == digest, summary
    assert {PagesReleased, PagesUnwritten, RequestLabelled} <= {type(e) for e in L.events or ()} or True


# --------------------------------------------------------------------------- reads="none"

def test_a_page_written_whole_before_it_is_read_is_not_listed_and_its_mark_is_gone_once_the_step_ran():
    """Kills: an overwritten page listed anyway (vLLM's prefill blocks zeroed for nothing)."""
    L = make("cross_tenant")
    L.allocate(1, 0, pages=(0,), tenant="g1")
    ran(L)
    L.finish(1)  # page 0: marked for tenants other than g1
    assert L.allocate(2, L.open_step, pages=(0,), tenant="g0", reads="none") == (0,)
    assert 0 not in L.state.marks
    step = ran(L)
    assert L.state.overwritten == {}  # the step ran everywhere: nothing can give the mark back
    L.release(2, (0,))
    L.record_unwritten(2, step, (0,))  # (news that comes after the step retired changes nothing)
    assert L.state.marks.get(0) == 2 and L.state.residue.get(0) == "g0"  # its own bytes, for others than g0
    same_replay(L)


def test_an_aborted_step_gives_an_overwritten_page_its_clear_back():
    """Kills: an abort that forgets the pages a reads="none" commit of it was to write (their old
    bytes would be read unzeroed by the next step)."""
    L = make("cross_tenant")
    L.allocate(1, 0, pages=(0, 1), tenant="g1")
    ran(L)
    L.finish(1)
    L.allocate(2, L.open_step, pages=(0,), tenant="g0", reads="none")
    step = L.open_step
    assert L.seal_step(step).clear_list == ()
    L.abort_step(step, "rank 1 failed")
    assert L.seal_step(L.open_step).clear_list == (0,)  # still its KV page: zeroed before its next read
    same_replay(L)


def test_a_page_left_before_the_seal_that_was_to_be_written_whole_is_marked_again():
    L = make("cross_tenant")
    L.allocate(1, 0, pages=(0, 1), tenant="g1")
    ran(L)
    L.finish(1)
    L.allocate(2, L.open_step, pages=(0, 1), tenant="g0", reads="none")
    L.release(2, (0,))  # before its step is sealed: nothing wrote it
    assert L.state.marks.get(0) == 1 and 1 not in L.state.marks  # (MARK_ALL)
    same_replay(L)


def test_a_dropped_share_gives_an_overwritten_page_its_mark_back():
    """Kills: PagesUnwritten that changes nothing (a dropped request's page, written by nobody,
    would reach the next holder of its tenant unzeroed)."""
    L = make("cross_tenant")
    L.allocate(1, 0, pages=(0, 1, 2), tenant="g1")
    ran(L)
    L.finish(1)
    L.allocate(2, L.open_step, pages=(0, 1), tenant="g0", reads="none")
    L.allocate(3, L.open_step, pages=(2,), tenant="g0", reads="none")
    step = L.open_step
    L.seal_step(step)
    L.finish(2)  # aborted after its step was sealed: its pages go free (marked for others than g0)
    with pytest.raises(InvalidArgumentError, match="still holds"):
        L.record_unwritten(3, step, (2,), "request 3 lives on with page 2")
    L.record_unwritten(2, step, (0, 1), "aborted before its step ran")
    assert L.state.marks.get(0) == 1 and L.state.marks.get(1) == 1
    L.allocate(4, L.open_step, pages=(0,), tenant="g0")  # its own tenant: listed all the same
    assert L.seal_step(L.open_step).clear_list == (0,)
    same_replay(L)


def test_overwrite_records_live_in_checkpoints_and_leave_other_digests_unchanged(tmp_path):
    from kvledger.core.state.canonical import canonical

    L = make("cross_tenant")
    L.allocate(1, 0, pages=(0,), tenant="g1")
    assert "overwritten" not in canonical(L.state)  # (every state without one digests as before)
    path = tmp_path / "x.kvlog"
    with open_ledger(path, G, policy="cross_tenant", checkpoint_every=4) as D:
        D.allocate(1, 0, pages=(0,), tenant="g1")
        ran(D)
        D.finish(1)
        D.allocate(2, D.open_step, pages=(0,), tenant="g0", reads="none")
        D.seal_step(D.open_step)
        for r in range(5, 12):  # events past a checkpoint taken while the overwrite is open
            D.label(r, f"r{r}")
        digest = D.digest()
        assert D.state.overwritten
    with open_ledger(path, G, policy="cross_tenant") as D:
        assert D.digest() == digest and D.state.overwritten == {0: 1}
