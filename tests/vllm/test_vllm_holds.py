"""PageHolds: vLLM's anonymous block references as ledger requests (no vLLM needed).

Pins the mapping ``LedgerBlockPool`` relies on: references become holds whose
pages the ledger holds in kv(R) with |R| = vLLM's ref_cnt; a named hold is one
vLLM request in one KV cache group (labelled, with its group's tenant), releases
what vLLM frees (``PagesReleased``) and finishes when it holds nothing; pins go
first; a block moves to another group with a clear, back to its own without one;
unhashed touches are pins; duplicate vLLM hashes get distinct ledger hashes; a hash
vLLM drops while a page is held is evicted once it is released; publishes wait for
their step (manager only: seal and complete it; fenced: until ``complete``), a
dropped request's blocks are unwritten and their hashes withdrawn. Also that
``import kvledger.integrations.vllm`` imports neither vLLM nor torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvledger import Geometry, InvalidArgumentError, Ledger, PageNotHeldError
from kvledger.integrations.vllm.holds import NULL_HOLD, PageHolds

G = Geometry(num_pages=16, page_tokens=4)


def holds(policy="released_aliases", **kw):
    ledger = Ledger(G, policy=policy, check=True, record=True)
    return ledger, PageHolds(ledger, **kw)


# (ledger.events are recorded; ``Ledger.kv_pages`` / ``holders_of`` / ``is_marked`` read the state)


def toks(p):
    return [p, p, p, p]


def test_null_block_is_held_for_good():
    ledger, h = holds()
    assert ledger.holder_of(0) == f"kv({NULL_HOLD})"
    assert ledger.free_count == 15


def test_references_are_holds_and_ref_counts_match():
    ledger, h = holds()
    h.allocate([3, 4, 5])
    h.seal()
    h.publish([(3, b"h3", toks(3), None), (4, b"h4", toks(4), 3)])
    h.share([3, 4])  # a prefix hit
    assert (h.refs(3), h.refs(4), h.refs(5)) == (2, 2, 1)
    assert len(ledger.holders_of(3)) == 2
    h.release([5, 4, 3])  # the first request frees (reverse order, as vLLM does)
    assert (h.refs(3), h.refs(4), h.refs(5)) == (1, 1, 0)
    assert ledger.holder_of(5) == "free"
    h.release([4, 3])
    assert ledger.cached_count == 2 and ledger.holder_of(3).startswith("cached(")


def test_a_partial_release_lets_go_of_those_pages_only():
    """A sliding window lets go of one block: ``PagesReleased`` (no split of the hold, no mark under
    released_aliases); the hold keeps the rest."""
    ledger, h = holds()
    h.allocate([1, 2, 3, 4])  # one hold
    h.seal()
    h.publish([(1, b"a", toks(1), None)])
    h.release([2])
    assert ledger.holder_of(2) == "free"
    assert all(h.refs(p) == 1 for p in (1, 3, 4))
    assert not any(ledger.is_marked(p) for p in range(16))
    assert type(ledger.events[-1]).__name__ == "PagesReleased" and ledger.events[-1].page_ids == (2,)


def test_marking_policies_release_without_splits_and_list_reuse():
    ledger, h = holds("all_reused")
    h.allocate([1, 2])
    assert h.take_clear_list() == []  # never used: zero since the cache was allocated
    h.release([2])
    assert ledger.is_marked(2) and not ledger.is_marked(1)
    h.allocate([2])
    assert h.take_clear_list() == [2]


# --------------------------------------------------------------------------- named holds (vLLM requests)

def named(policy="cross_tenant", groups=None, **kw):
    ledger, h = holds(policy, **kw)
    h.set_groups(groups or {0: "g0:full_attention:float16", 1: "g1:mamba:float32"}, {1} if groups is None else ())
    return ledger, h


def test_a_requests_calls_in_one_group_are_one_hold_labelled_and_of_the_groups_tenant():
    ledger, h = named()
    h.allocate([1, 2], ("req-a", 0))
    h.allocate([3], ("req-a", 0))
    h.allocate([4], ("req-a", 1))
    (h0,) = h.holds_of(1)
    assert h.holds_of(3) == (h0,) and h.holds_of(4) != (h0,)
    labels = [e for e in ledger.events if type(e).__name__ == "RequestLabelled"]
    assert [(e.request, e.label) for e in labels] == [(h0, "req-a"), (h.holds_of(4)[0], "req-a")]
    assert ledger.state.requests[h0].tenant == "g0:full_attention:float16"
    assert ledger.kv_pages(h0) == (1, 2, 3)


def test_a_named_hold_releases_what_vllm_frees_and_finishes_when_it_holds_nothing():
    ledger, h = named()
    h.allocate([1, 2, 3], ("r", 0))
    (h0,) = h.holds_of(1)
    h.release([1], [1], ("r", 0))  # a window moved on
    assert type(ledger.events[-1]).__name__ == "PagesReleased" and ledger.kv_pages(h0) == (2, 3)
    h.release([3, 2], [1, 1], ("r", 0))  # the request ends
    assert type(ledger.events[-1]).__name__ == "RequestFinished"
    h.allocate([5], ("r", 0))  # a new incarnation: a new hold, labelled again
    assert h.holds_of(5) != (h0,) and type(ledger.events[-3]).__name__ == "RequestLabelled"


def test_a_named_release_lets_pins_go_first():
    """vLLM counts a reference its manager took itself (a copy-on-write endpoint): the request's
    free drops that one, and the page stays held in the ledger until the last reference goes."""
    ledger, h = named()
    h.allocate([4], ("r", 0))
    h.release([4], [2], ("r", 0))  # two references before the free: one is a pin
    assert h.refs(4) == 1 and ledger.holder_of(4) != "free"
    h.release([4], [1])  # the endpoint's, freed by nobody named
    assert ledger.holder_of(4) == "free"


def test_a_state_groups_page_moving_to_attention_is_listed_and_a_fresh_state_reads_whole():
    ledger, h = named()
    h.allocate([1], ("m", 1), "whole")
    h.seal()
    h.release([1], [1], ("m", 1))  # the state block goes free: marked for other groups than Mamba
    h.allocate([1], ("a", 0))  # attention takes it: another group's bytes under its mask
    assert h.take_clear_list() == [1]
    h.release([1], [1], ("a", 0))
    h.allocate([1], ("a2", 0))  # back to the group that wrote it: nothing to zero
    assert h.take_clear_list() == []
    h.release([1], [1], ("a2", 0))
    h.allocate([1], ("m2", 1), "whole")  # a fresh state reads before it writes: any bytes are zeroed
    assert h.take_clear_list() == [1]
    h.release([1], [1], ("m2", 1))
    h.allocate([1], ("m3", 1), "none")  # a state copied in: written whole first, nothing to zero
    assert h.take_clear_list() == []


# --------------------------------------------------------------------------- the fence (a scheduler drives)

def fenced(**kw):
    ledger, h = named(**kw)
    h.fenced = True
    h.scheduling = True  # (the calls below are a schedule()'s: its steps complete when update_from_output says)
    withdrawn: list[int] = []
    h.withdraw = withdrawn.append
    return ledger, h, withdrawn


def test_fenced_publishes_wait_for_the_step_that_writes_them():
    """Kills: a block published (shareable in the ledger) before the step that writes it ran."""
    ledger, h, _ = fenced()
    h.allocate([1], ("r", 0))
    h.publish([(1, b"x", toks(1), None)])  # vLLM hashes it when it schedules the step that writes it
    assert h.waiting(1) and h.key_of(1) is None and not h.hidden(1)  # attention: vLLM may hit it
    step = ledger.open_step
    h.take_clear_list()  # schedule() seals the step
    assert h.key_of(1) is None
    h.complete(step)  # update_from_output: it ran
    assert h.key_of(1) == b"x" and not h.waiting(1)
    assert [type(e).__name__ for e in ledger.events[-2:]] == ["StepCompleted", "PagesPublished"]


def test_a_state_block_waiting_for_its_step_is_hidden_and_an_attention_hit_is_a_pin_until_then():
    ledger, h, _ = fenced()
    h.allocate([1], ("m", 1), "whole")
    h.allocate([2], ("a", 0))
    h.publish([(1, b"s", toks(1), None), (2, b"k", toks(2), None)])
    assert h.hidden(1) and not h.hidden(2)
    step = ledger.open_step
    h.take_clear_list()
    h.share([2], ("b", 0))  # another request hits the attention block before its step ran
    assert h.refs(2) == 2 and len(ledger.holders_of(2)) == 1  # a pin: the ledger shares published pages only
    h.complete(step)
    assert len(ledger.holders_of(2)) == 2 and h.refs(2) == 2  # the pin became a share


def test_outside_schedule_a_block_publishes_at_once_unless_a_step_is_in_flight():
    """vLLM's tests work a scheduler's manager directly, with no schedule() to complete the step:
    the open step is sealed and completed there and then (kills: a state block hidden for good, its
    prefix hits lost); a step a schedule() sealed and not yet completed still holds the publish."""
    ledger, h, _ = fenced()
    h.scheduling = False
    h.allocate([1], ("m", 1), "whole")
    h.publish([(1, b"s", toks(1), None)])
    assert h.key_of(1) == b"s" and not h.hidden(1) and not h.waiting(1)
    h.scheduling = True
    h.allocate([2], ("a", 0))
    h.take_clear_list()  # a schedule() sealed the step that writes block 2...
    h.scheduling = False
    h.publish([(2, b"k", toks(2), None)])  # ...which is in flight when someone hashes block 2
    assert h.waiting(2) and h.key_of(2) is None


def test_ahead_an_attention_block_written_whole_over_another_groups_bytes_is_hidden_until_its_step():
    """Async scheduling: the writer may drop out of its step; a hit on a block committed "written
    whole" over another group's bytes (its mark taken off without a clear) would read those bytes.
    Kills: such a block visible while it waits (the probe's mixed-precision trace read fp32 bytes as
    fp16); and hiding more than those (vLLM's async prefill dedup hits a fresh block at once)."""
    ledger, h, _ = fenced(groups={0: "g0:full_attention:float16", 2: "g2:full_attention:float32"})
    h.ahead = True
    h.allocate([1], ("w", 2))  # group 2 writes block 1...
    step = ledger.open_step
    h.take_clear_list()
    h.complete(step)
    h.release([1], [1], ("w", 2))  # ...and lets go: its fp32 bytes stay, marked
    assert ledger.state.is_marked(1)
    h.allocate([1], ("x", 0), "none")  # group 0 is to write it whole: no clear
    h.allocate([2], ("x", 0), "none")  # a fresh block
    h.publish([(1, b"a", toks(1), None), (2, b"b", toks(2), None)])
    assert h.hidden(1) and not h.hidden(2)
    step = ledger.open_step
    h.take_clear_list()
    h.complete(step)
    assert not h.hidden(1) and h.key_of(1) == b"a"


def test_a_writer_that_lets_go_before_its_step_completed_keeps_the_block_until_then():
    ledger, h, _ = fenced()
    h.allocate([1], ("r", 0))
    h.publish([(1, b"x", toks(1), None)])
    step = ledger.open_step
    h.take_clear_list()
    h.release([1], [1], ("r", 0))  # preempted (vLLM: a cached block, ref 0)
    assert h.refs(1) == 0 and ledger.holder_of(1) != "free" and h.deferred_count == 1
    h.complete(step)
    assert ledger.holder_of(1).startswith("cached(") and h.deferred_count == 0


def test_a_dropped_requests_blocks_are_unwritten_and_their_hashes_withdrawn():
    """Kills: a dropped request's block published (a later hit would read bytes nobody wrote:
    vLLM PR #56525's mechanism), or its overwrite trusted (its old bytes unmarked)."""
    ledger, h, withdrawn = fenced()
    h.allocate([1], ("old", 0))  # an earlier holder of another group's bytes
    h.take_clear_list()
    h.complete(ledger.open_step - 1)
    h.release([1], [1], ("old", 0))
    h.allocate([1, 2], ("r", 1), "none")  # to be written whole by its step
    h.publish([(1, b"s", toks(1), None)])
    step = ledger.open_step
    h.take_clear_list()
    h.release([2, 1], [1, 1], ("r", 1))  # aborted after it was scheduled; its share is dropped
    h.complete(step, dropped={"r"})
    assert withdrawn == [1] and h.key_of(1) is None and not h.waiting(1)
    unwritten = [e for e in ledger.events if type(e).__name__ == "PagesUnwritten"]
    assert [(e.step, set(e.page_ids)) for e in unwritten] == [(step, {1, 2})]
    assert ledger.state.marks.get(1) == 1  # written whole by nobody: its old bytes, marked for everyone
    assert ledger.state.marks.get(2) == 2  # (never used: zeros, marked as the policy marks a release)
    h.allocate([1], ("m", 1))  # even its own group lists it now
    assert 1 in h.take_clear_list()


def test_a_page_reused_before_its_overwrite_is_confirmed_is_read_whole():
    ledger, h, _ = fenced()
    h.allocate([1], ("a", 0))
    h.take_clear_list()
    h.complete(ledger.open_step - 1)
    h.release([1], [1], ("a", 0))
    h.allocate([1], ("r", 0), "none")  # step N is to write it whole
    h.take_clear_list()
    h.release([1], [1], ("r", 0))  # (async) freed before N's output came back ...
    h.allocate([1], ("s", 0))  # ... and taken at once by the same group: its tail read must not trust N
    assert ledger.events[-1].reads == "whole" and h.take_clear_list() == [1]


def test_unhashed_touch_is_a_pin_and_a_free_one_is_adopted():
    ledger, h = holds()
    h.allocate([6])
    h.share([6])  # a connector pins a held, unhashed block
    assert h.refs(6) == 2 and len(ledger.holders_of(6)) == 1
    h.release([6])
    assert h.refs(6) == 1 and ledger.holder_of(6) != "free"  # the pin went first
    h.release([6])
    assert ledger.holder_of(6) == "free"
    h.share([7])  # a free block handed over as if cached
    assert h.refs(7) == 1 and ledger.holder_of(7).startswith("kv(")


def test_duplicate_vllm_hashes_get_distinct_ledger_hashes():
    ledger, h = holds()
    h.allocate([1])
    h.allocate([2])
    h.seal()
    h.publish([(1, b"same", toks(1), None)])
    h.publish([(2, b"same", toks(2), None)])  # vLLM caches two blocks under one hash
    assert h.key_of(1) == b"same" and h.key_of(2) == b"same" + (2).to_bytes(4, "big")
    assert ledger.block_hash(2) == h.key_of(2)


def test_publish_waits_for_its_step_to_complete():
    ledger, h = holds()
    h.allocate([1])
    step = ledger.open_step
    h.publish([(1, b"x", toks(1), None)])  # committed in the open step: sealed and completed first
    assert ledger.open_step == step + 1
    assert [type(e).__name__ for e in ledger.events[-3:]] == ["StepSealed", "StepCompleted", "PagesPublished"]


def test_a_hash_dropped_while_held_is_evicted_once_released():
    ledger, h = holds()
    h.allocate([1])
    h.seal()
    h.publish([(1, b"x", toks(1), None)])
    h.drop_hashes([1])  # vLLM evicts the hash of a held block
    assert h.key_of(1) == b"x"  # a held page keeps its ledger hash
    h.release([1])
    assert h.key_of(1) is None and ledger.holder_of(1) == "free" and ledger.cached_count == 0


def test_bad_transitions_raise_and_change_nothing():
    ledger, h = holds()
    h.allocate([1])
    seq = ledger.seq
    with pytest.raises(InvalidArgumentError, match="no reference"):
        h.release([5])
    with pytest.raises(InvalidArgumentError):
        h.pin(9)
    assert ledger.seq == seq
    with pytest.raises(PageNotHeldError):  # the ledger refuses a page vLLM hands out twice
        h.allocate([1])
    assert ledger.seq == seq


def test_publish_blocks_is_one_run_with_the_requests_parent():
    ledger, h = holds()
    h.allocate([1])  # the request's first block (one hold) ...
    h.allocate([2, 3])  # ... and its next two (another)
    h.seal()
    h.publish_blocks([1], [b"a"], toks(1), None)
    n = len(ledger.events)
    h.publish_blocks([2, 3], [b"b", b"c"], (*toks(2), *toks(3)), 1)  # parent: block 1, in the other hold
    (ev,) = ledger.events[n:]
    assert type(ev).__name__ == "PagesPublished" and ev.page_ids == (2, 3) and ev.parent_hash == b"a"
    assert h.tokens_of(3) == tuple(toks(3)) and h.tokens_of(9) is None
    n = len(ledger.events)
    h.allocate([4])  # in the open step: its step is sealed and completed first
    h.publish_blocks([3, 4], [b"c", b"c"], (*toks(3), *toks(4)), 2)  # 3 is published; 4 repeats its hash
    kinds = [type(e).__name__ for e in ledger.events[n:]]
    assert kinds == ["PagesReserved", "PagesCommitted", "StepSealed", "StepCompleted", "PagesPublished"]
    assert h.key_of(4) == b"c" + (4).to_bytes(4, "big") and ledger.events[-1].parent_hash == b"c"


def test_release_puts_pages_back_in_vllms_free_queue_order():
    """vLLM frees a request's blocks last first and puts them at the head of its free queue in
    that order; the holds finish so that the ledger's next free pages are the same ones."""
    ledger, h = holds()
    h.allocate([3, 4])
    h.allocate([5])
    h.release([5, 4, 3])
    assert ledger.reserve(99, 3) == (5, 4, 3)


def test_release_adopts_extra_references_and_refuses_unheld_pages_first():
    ledger, h = holds()
    h.allocate([3])
    h.allocate([4])
    seq = ledger.seq
    with pytest.raises(InvalidArgumentError, match="page 9"):
        h.release([3, 9])
    assert ledger.seq == seq and h.refs(3) == 1  # nothing finished
    h.release([4], [2])  # vLLM counted two references (a copy-on-write endpoint): one is a pin
    assert h.refs(4) == 1 and ledger.holder_of(4) != "free"
    h.release([4], [1])
    assert ledger.holder_of(4) == "free"


def test_import_pulls_neither_vllm_nor_torch():
    code = ("import sys, kvledger, kvledger.integrations.vllm as v; "
            "assert callable(v.install); "
            "bad = [m for m in ('vllm', 'torch', 'triton') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_releasing_one_shared_page_finishes_the_latest_hold():
    """One block, two holds (a prefix hit on a held block): the later hold lets go, with or
    without vLLM's counts, as for a longer list (the one-block path takes the same hold)."""
    for counts in (None, [2]):
        ledger, h = holds()
        h.allocate([3])
        h.seal()
        h.publish_blocks([3], [b"h3"], tuple(toks(3)), None)
        (first,) = h.holds_of(3)
        h.share([3])
        assert len(h.holds_of(3)) == 2
        h.release([3], counts)
        assert h.holds_of(3) == (first,) and ledger.holder_of(3) == f"kv({first})"
        h.release([3], None if counts is None else [1])
        assert h.holds_of(3) == () and ledger.holder_of(3).startswith("cached(")
