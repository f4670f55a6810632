"""The sanitizer's device side on the torch backend (the CPU here): poison, and the check against a
plain per-page reference on random data. (The executor's plumbing of it, on byte planes:
test_executor_sanitize.py.)"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from kvledger import PageOutOfRangeError  # noqa: E402
from kvledger.executors.sanitize import NOT_ZERO, POISON, SanitizerCheck, TorchVerifier, Violation  # noqa: E402
from kvledger.executors.torch_backend import TorchClearBackend  # noqa: E402

NUM_PAGES = 24
# page bytes: 64 (8-byte words), 30 (a cut last group), 7 (one short group), 16 (int16 rows)
SPECS = [((NUM_PAGES, 4, 16), torch.float8_e4m3fn), ((NUM_PAGES, 15), torch.bfloat16),
         ((NUM_PAGES, 7), torch.uint8), ((NUM_PAGES, 8), torch.int16)]


def random_planes(rng: random.Random):
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    out = []
    for shape, dtype in SPECS:
        nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 255, (nbytes,), generator=g, dtype=torch.int32).to(torch.uint8)  # never 0xFF
        out.append(raw.view(dtype).reshape(shape).clone())
    return out


def rows(plane, p):
    return plane[p].reshape(-1).view(torch.uint8)


def reference(planes, cleared, committed):
    """Plain per-page loop: the definition in kvledger.executors.sanitize, spelled out."""
    found = []
    for k, plane in enumerate(planes):
        for p in cleared:
            if bool(rows(plane, p).ne(0).any()):
                found.append(Violation(plane=k, page=p, kind=NOT_ZERO))
        for p in committed:
            b = rows(plane, p).tolist()
            groups = [b[i:i + 8] for i in range(0, len(b), 8)]
            if any(all(x == 255 for x in grp) for grp in groups):
                found.append(Violation(plane=k, page=p, kind=POISON))
    return tuple(sorted(found))


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
    planes = random_planes(rng)
    plant(planes, rng)
    cleared = rng.sample(range(NUM_PAGES), rng.randrange(0, NUM_PAGES))
    committed = rng.sample(range(NUM_PAGES), rng.randrange(0, NUM_PAGES))
    backend = TorchClearBackend(planes)
    got = backend.verify(cleared, committed)
    assert got == reference(planes, cleared, committed)
    check = backend.start_verify(cleared, committed)
    assert check.query() and check.result() == got and check.total == len(got)


def test_poison_fills_every_plane_of_exactly_the_listed_pages():
    rng = random.Random(3)
    planes = random_planes(rng)
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
    planes = random_planes(random.Random(4))
    backend = TorchClearBackend(planes, strategy="index")
    backend.poison([1, 9, 17])
    assert {v.page for v in backend.verify([], [1, 9, 17])} == {1, 9, 17}


def test_a_check_with_nothing_listed_is_done_and_empty():
    planes = random_planes(random.Random(2))
    check = TorchVerifier(planes).start([], [])
    assert check.query() and check.result() == ()
    assert SanitizerCheck.done([Violation(plane=1, page=2, kind=POISON)]).result()[0].page == 2
