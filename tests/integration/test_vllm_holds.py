"""PageHolds: vLLM's anonymous block references as ledger requests (no vLLM needed).

Pins the mapping ``LedgerBlockPool`` relies on: references become holds whose
pages the ledger holds in kv(R) with |R| = vLLM's ref_cnt; a partial release
splits a hold without a page ever being marked under released_aliases; the
marking policies get one page per hold; unhashed touches are pins; duplicate
vLLM hashes get distinct ledger hashes; a hash vLLM drops while a page is held
is evicted once it is released; publishes wait for their step to complete.
Also that ``import kvledger.integrations.vllm`` imports neither vLLM nor torch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvledger import ConfigurationError, Geometry, InvalidArgumentError, Ledger, PageNotHeldError
from kvledger.integrations.vllm.holds import NULL_HOLD, PageHolds

G = Geometry(num_pages=16, page_tokens=4)


def holds(policy="released_aliases", **kw):
    ledger = Ledger(G, policy=policy, check=True, record=True)
    return ledger, PageHolds(ledger, **kw)


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


def test_partial_release_splits_a_hold_without_a_mark():
    ledger, h = holds()
    h.allocate([1, 2, 3, 4])  # one hold
    h.seal()
    h.publish([(1, b"a", toks(1), None)])
    h.release([2])  # a sliding window lets go of one block
    assert h.splits == 1
    assert ledger.holder_of(2) == "free"
    assert all(h.refs(p) == 1 for p in (1, 3, 4))
    assert not any(ledger.is_marked(p) for p in range(16))
    kinds = [type(e).__name__ for e in ledger.events[-4:]]
    assert kinds == ["RequestFinished", "PagesShared", "PagesReserved", "PagesCommitted"]


def test_marking_policies_take_one_page_per_hold_and_list_reuse():
    ledger, h = holds("all_reused")
    assert h.per_page
    h.allocate([1, 2])
    assert h.take_clear_list() == []  # never used: zero since the cache was allocated
    h.release([2])  # no split: page 2 was its own hold
    assert h.splits == 0 and ledger.is_marked(2) and not ledger.is_marked(1)
    h.allocate([2])
    assert h.take_clear_list() == [2]
    with pytest.raises(ConfigurationError, match="per_page=True"):
        PageHolds(Ledger(G, policy="all_reused"), per_page=False)


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
