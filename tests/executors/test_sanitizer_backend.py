"""The sanitizer's device side on the torch backend (the CPU here): poison, and the check against a
plain per-page reference on random data. (The executor's plumbing of it, on byte planes:
test_executor_sanitize.py.)"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from support.gpu import as_bytes, random_planes, reference_violations  # noqa: E402

from kvledger import PageOutOfRangeError  # noqa: E402
from kvledger.executors.sanitize import POISON, SanitizerCheck, TorchVerifier, Violation  # noqa: E402
from kvledger.executors.torch_backend import TorchClearBackend  # noqa: E402

NUM_PAGES = 24
# page bytes: 64 (8-byte words), 30 (a cut last group), 7 (one short group), 16 (int16 rows)
SPECS = [(torch.float8_e4m3fn, (4, 16)), (torch.bfloat16, (15,)), (torch.uint8, (7,)), (torch.int16, (8,))]


def planes_of(rng: random.Random) -> list:
    """CPU planes of ``SPECS`` holding random bytes, never 0xFF (no poison to start with)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return random_planes(SPECS, NUM_PAGES, lo=0, hi=255, generator=g, device="cpu")


def rows(plane, p):
    return as_bytes(plane)[p]


def plant(planes, rng):
    """Random damage: whole-group poison, near misses (7 of 8 bytes), zeroed and half-zeroed pages."""
    for plane in planes:
        for p in rng.sample(range(NUM_PAGES), 6):
            r = rows(plane, p)
            width = r.numel()
            start = rng.randrange(0, width, 8) if width >= 8 else 0
            kind = rng.choice(["group", "near", "zero", "partial-zero"])
            if kind == "group":
                r[start:start + 8] = 255
            elif kind == "near" and width > 1:
                r[start:min(width, start + 8) - 1] = 255
            elif kind == "zero":
                r.zero_()
            else:
                r[: width // 2] = 0


@pytest.mark.parametrize("seed", range(12))
def test_check_matches_the_reference_on_random_data(seed):
    rng = random.Random(seed)
    planes = planes_of(rng)
    plant(planes, rng)
    cleared = rng.sample(range(NUM_PAGES), rng.randrange(0, NUM_PAGES))
    committed = rng.sample(range(NUM_PAGES), rng.randrange(0, NUM_PAGES))
    backend = TorchClearBackend(planes)
    got = backend.verify(cleared, committed)
    assert got == reference_violations(planes, cleared, committed)
    check = backend.start_verify(cleared, committed)
    assert check.query() and check.result() == got and check.total == len(got)


def test_poison_fills_every_plane_of_exactly_the_listed_pages():
    rng = random.Random(3)
    planes = planes_of(rng)
    before = [p.clone() for p in planes]
    backend = TorchClearBackend(planes)
    listed = [5, 6, 7, 19, 0]
    backend.poison(listed)
    for plane, old in zip(planes, before, strict=True):
        for p in range(NUM_PAGES):
            if p in listed:
                assert bool(rows(plane, p).eq(255).all()), p
            else:
                assert torch.equal(rows(plane, p), rows(old, p))
    # every listed page now holds poison in every plane; clearing it makes it pass
    assert len(backend.verify([], listed)) == len(listed) * len(planes)
    backend.clear(listed)
    assert backend.verify(listed, listed) == ()
    with pytest.raises(PageOutOfRangeError):
        backend.poison([NUM_PAGES])


def test_the_index_strategy_poisons_too():
    planes = planes_of(random.Random(4))
    backend = TorchClearBackend(planes, strategy="index")
    backend.poison([1, 9, 17])
    assert {v.page for v in backend.verify([], [1, 9, 17])} == {1, 9, 17}


def test_a_check_with_nothing_listed_is_done_and_empty():
    planes = planes_of(random.Random(2))
    check = TorchVerifier(planes).start([], [])
    assert check.query() and check.result() == ()
    assert SanitizerCheck.done([Violation(plane=1, page=2, kind=POISON)]).result()[0].page == 2
