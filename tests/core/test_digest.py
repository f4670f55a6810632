"""The state digest: independent of hash seed and dict insertion order, and a
canonical form that round-trips into a state that keeps working identically."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec
import pytest

from kvledger import ConfigurationError, Geometry, Ledger, LedgerState, check_invariants, replay
from kvledger.core.events import PagesReserved

GEOMETRY = Geometry(num_pages=32, page_tokens=16)

# One command sequence touching every part of the state: string tenants, large
# request ids, shared snapshots, restores of both kinds, marks of every policy,
# clear lists of several unsealed steps, a last plan, completions of two ranks.
SCRIPT = r"""
import json, sys
from kvledger import Geometry, Ledger

def run(policy):
    L = Ledger(Geometry(num_pages=32, page_tokens=16), policy=policy)
    tenants = ["tenant-%d" % i for i in range(5)]
    L.alias_snapshot(2**40, 6)
    L.alias_snapshot(17, pages=list(L.snapshot_pages(2**40))[:3])
    L.release_snapshot(2**40)
    for i, r in enumerate([2**62, 5, 999_999_937, 3, 2**33 + 1]):
        L.reserve(r, 2 + i % 3, tenant=tenants[(i * 3) % 5])
    L.commit(5, 0, 1)
    L.commit(2**62, 2, 2)
    L.start_restore(L.reserved_pages(999_999_937)[:1], request=999_999_937)
    L.start_restore(L.snapshot_pages(17)[:2], snapshot=17)
    L.commit(3, 1, pages=list(L.reserved_pages(3)))
    L.seal_step(0)
    L.complete_step(0, 1)
    L.complete_step(0, 0)
    L.finish(5)
    L.complete_restore(L.snapshot_pages(17)[:1], snapshot=17)
    L.release_snapshot(17)
    L.cancel(2**33 + 1)
    L.reserve(44, 3, tenant="zz")
    L.seal_step(1)
    return L.digest()

print(json.dumps({p: run(p) for p in ("released_aliases", "cross_tenant", "all_reused")}))
"""


def run_script(hash_seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_digest_is_independent_of_the_hash_seed():
    runs = {seed: run_script(seed) for seed in ("0", "1", "2718281828", "random")}
    here = {}
    exec(compile(SCRIPT.replace("print(json.dumps(", "here.update(("), "<script>", "exec"), {"here": here})
    first = runs["0"]
    assert len(set(first.values())) == 3  # the policies give different states
    for seed, digests in runs.items():
        assert digests == first, seed
    assert here == first  # and this process agrees


# --------------------------------------------------------------------------- insertion order

def _world(order: str) -> Ledger:
    """The same content, reached with unrelated requests/snapshots/restores/steps/ranks in
    either order. Pages are named and deep in the free stack (or its exact top), so the
    free stack ends up identical too: it is part of the state (it decides the allocator's
    next picks)."""
    L = Ledger(GEOMETRY, policy="cross_tenant", record=True)
    L.alias_snapshot(90, pages=[20, 21, 22])
    L.release_snapshot(90)  # marked pages 20-22, pushed on the stack in this order
    ops = {
        "requests": [
            lambda: L.submit(PagesReserved(request=7, page_ids=(20, 10, 11), tenant="x")),
            lambda: L.submit(PagesReserved(request=3, page_ids=(21, 12), tenant="y")),
        ],
        "snapshots": [
            lambda: L.alias_snapshot(11, pages=[25, 26]),
            lambda: L.alias_snapshot(2, pages=[26, 27]),
        ],
        "commits": [
            lambda: L.commit(7, 2, pages=[20, 10]),
            lambda: L.commit(3, 1, pages=[21]),
        ],
        "restores": [
            lambda: L.start_restore([11], request=7),
            lambda: L.start_restore([27], snapshot=2),
        ],
    }
    for group in ("requests", "snapshots", "commits", "restores"):
        for op in (ops[group] if order == "ab" else ops[group][::-1]):
            op()
    L.seal_step(0)
    for rank in ((0, 1) if order == "ab" else (1, 0)):
        L.complete_step(0, rank)
    return L


def _continue(L: Ledger) -> list:
    """The same commands on each ledger; everything they return, and digests along the way."""
    out = []
    out.append(L.reserve(50, 4, tenant="x"))
    out.append(L.commit(3, 1, 1))
    out.append(L.reserve(7, 1))
    out.append(L.commit(50, 1, pages=list(L.reserved_pages(50))))
    out.append(L.seal_step(1))
    L.complete_restore([27], snapshot=2)
    L.release_snapshot(11)
    L.cancel(7)
    out.append(L.alias_snapshot(12, 3))
    L.complete_restore([11], request=7)
    out.append(L.reserve(8, 5, tenant="y"))
    out.append(L.commit(8, 2, 5))
    out.append(L.seal_step(2))
    out.append(L.digest())
    check_invariants(L.state)
    return out


def test_digest_is_independent_of_insertion_order():
    a, b = _world("ab"), _world("ba")
    # the dicts really were filled in different orders ...
    assert list(a.state.requests) == [7, 3] and list(b.state.requests) == [3, 7]
    assert list(a.state.snapshots) == [11, 2] and list(b.state.snapshots) == [2, 11]
    assert a.events != b.events
    # ... yet the content is equal, and so are the digests
    assert a.state.canonical_bytes() == b.state.canonical_bytes()
    assert a.digest() == b.digest()
    assert _continue(a) == _continue(b)
    assert replay(a.events).digest() == replay(b.events).digest() == a.digest() == b.digest()


def test_free_stack_order_is_part_of_the_digest():
    """The control: equal holders, marks and requests, but pages freed in another order.
    The allocator would pick differently, so the digests must differ."""
    def freed(order):
        L = Ledger(GEOMETRY)
        L.submit(PagesReserved(request=1, page_ids=(0,)))
        L.submit(PagesReserved(request=2, page_ids=(1,)))
        for r in order:
            L.finish(r)
        return L

    a, b = freed((1, 2)), freed((2, 1))
    assert [a.holder_of(p) for p in range(32)] == [b.holder_of(p) for p in range(32)]
    assert a.digest() != b.digest()
    assert a.reserve(9, 1) != b.reserve(9, 1)


# --------------------------------------------------------------------------- canonical round trip

def _rich(policy: str) -> Ledger:
    L = Ledger(GEOMETRY, policy=policy, record=True)
    L.alias_snapshot(1, 5)
    L.alias_snapshot(2, pages=list(L.snapshot_pages(1))[:2])
    L.release_snapshot(1)
    L.reserve(10, 4, tenant="a")
    L.reserve(11, 3, tenant="b")
    L.commit(10, 0, 2)
    L.commit(11, 1, 1)  # a clear list for a later step
    L.start_restore(L.reserved_pages(10)[:1], request=10)
    L.start_restore(L.snapshot_pages(2)[:1], snapshot=2)
    L.seal_step(0)
    L.complete_step(0, 3)
    L.finish(11)
    L.reserve(12, 2, tenant="a")
    L.commit(12, 1, 1)
    return L


@pytest.mark.parametrize("policy", ["released_aliases", "cross_tenant", "all_reused"])
@pytest.mark.parametrize("via", ["dict", "msgpack"])
def test_canonical_round_trip_keeps_digest_and_behaviour(policy, via):
    L = _rich(policy)
    data = L.state.canonical() if via == "dict" else msgspec.msgpack.decode(L.state.canonical_bytes())
    st = LedgerState.from_canonical(data)
    assert st.digest() == L.digest()
    assert st.seq == L.seq and st.policy == policy
    check_invariants(st)
    L2 = Ledger(GEOMETRY, state=st)
    def pages(X):
        return [(X.holder_of(p), X.is_marked(p), X.is_restoring(p)) for p in range(GEOMETRY.num_pages)]

    assert pages(L2) == pages(L)
    # the restored state keeps working identically (and independently of the original)
    steps = [
        lambda X: X.commit(10, 1, pages=list(X.reserved_pages(10))[1:]),
        lambda X: X.seal_step(1),
        lambda X: X.complete_restore(X.reserved_pages(10)[:1], request=10),
        lambda X: X.commit(10, 2, 1),
        lambda X: X.release_snapshot(2),
        lambda X: X.reserve(13, 6, tenant="b"),
        lambda X: X.abort_step(1),
        lambda X: X.commit(13, 2, 6),
        lambda X: X.cancel(10),
        lambda X: X.seal_step(2),
        lambda X: X.alias_snapshot(3, 4),
    ]
    for step in steps:
        assert step(L) == step(L2)
        assert L.digest() == L2.digest()
        check_invariants(L2.state)
    assert replay(L.events, check=True).digest() == L2.digest()


def test_canonical_is_a_snapshot_not_a_view():
    """A checkpoint taken with ``canonical()`` must describe the state at that seq,
    whatever the ledger does afterwards (the log may encode it later)."""
    L = _rich("cross_tenant")
    data = L.state.canonical()
    digest = L.digest()
    L.reserve(20, 3, tenant="c")
    L.commit(12, 1, 1)
    L.release_snapshot(2)
    L.cancel(10)
    assert LedgerState.from_canonical(data).digest() == digest


def test_from_canonical_refuses_an_unknown_version():
    data = _rich("released_aliases").state.canonical()
    data = dict(data, v=999)
    with pytest.raises(ConfigurationError, match="999"):
        LedgerState.from_canonical(data)


def test_unconfigured_state_round_trips():
    st = LedgerState()
    assert LedgerState.from_canonical(st.canonical()).digest() == st.digest()
