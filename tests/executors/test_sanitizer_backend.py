"""The sanitizer's device side on the torch backend (the CPU here): poison, the check against a
plain per-page reference on random data, and the executor's plumbing (a backend that skips one
plane is named by plane; a poisoned page missing from the clear list is named by page)."""

from __future__ import annotations

import random

import anyio
import pytest

torch = pytest.importorskip("torch")

from kvledger import ConfigurationError, InvariantViolation, PageOutOfRangeError, StepPlan  # noqa: E402
from kvledger.executors.backend import ClearBackendBase  # noqa: E402
from kvledger.executors.executor import RankExecutor, StepInputs, StepJob, StepReplies  # noqa: E402
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


class SkipsOnePlane(ClearBackendBase):
    """A broken backend: its clear zeroes every plane but one; poison and check see them all."""

    name = "skips-one-plane"
    can_sanitize = True

    def __init__(self, planes, skip):
        self.full = TorchClearBackend(planes)
        self.partial = TorchClearBackend([p for i, p in enumerate(planes) if i != skip])
        self.num_pages = self.full.num_pages

    def poison(self, page_ids):
        self.full.poison(page_ids)

    def start_verify(self, cleared, committed):
        return self.full.start_verify(cleared, committed)

    def clear(self, page_ids):
        self.partial.clear(page_ids)


def run(ex, step, clear_list, poison=(), committed=()):
    async def one():
        j = StepJob(StepPlan(step=step, clear_list=tuple(clear_list)), StepInputs(), anyio.CancelScope(),
                    StepReplies(1), poison=poison, committed=committed)
        return await ex.run_job(j)

    return anyio.run(one)


@pytest.mark.parametrize("skip", [0, 2, 3])
def test_verify_names_exactly_the_plane_a_backend_skipped(skip):
    planes = random_planes(random.Random(skip))
    graph_ran = []
    ex = RankExecutor(0, num_pages=NUM_PAGES, backend=SkipsOnePlane(planes, skip), planes=planes, sanitize=True,
                      graph=lambda ctx, step, inputs: graph_ran.append(step))
    # step 0: pages 3, 4, 11 are released and poisoned; step 1 commits and lists them
    assert run(ex, 0, [], poison=[3, 4, 11]).status == "ok"
    out = run(ex, 1, [3, 4, 11], committed=[3, 4, 11, 20])
    assert out.status == "failed" and isinstance(out.error, InvariantViolation)
    assert out.violations == tuple(Violation(plane=skip, page=p, kind=kind)
                                   for p in (3, 4, 11) for kind in (NOT_ZERO, POISON))
    assert f"plane {skip} page 3 not_zero" in str(out.error)
    assert graph_ran == [0]  # the graph never ran on the bad pages
    assert out.timing is not None and out.timing.sanitize_s > 0
    assert ex.statistics()["sanitizer_violations"] == 6


def test_a_poisoned_page_missing_from_the_clear_list_is_named_in_every_plane():
    planes = random_planes(random.Random(9))
    ex = RankExecutor(0, num_pages=NUM_PAGES, backend=TorchClearBackend(planes), planes=planes, sanitize=True)
    assert run(ex, 0, [], poison=[2, 8]).status == "ok"
    ok = run(ex, 1, [2], committed=[2, 8])  # the ledger forgot page 8
    assert ok.status == "failed"
    assert ok.violations == tuple(Violation(plane=k, page=8, kind=POISON) for k in range(len(planes)))
    good = run(ex, 2, [8], committed=[8])
    assert good.status == "ok" and good.violations == ()


class Refuses:
    """A backend whose sanitizer calls fail: proves an executor with sanitize off never makes them."""

    name = "refuses"

    def __init__(self, planes):
        self.inner = TorchClearBackend(planes)
        self.num_pages = self.inner.num_pages

    def clear(self, page_ids):
        self.inner.clear(page_ids)

    def poison(self, page_ids):
        raise AssertionError("poison called with the sanitizer off")

    def start_verify(self, cleared, committed):
        raise AssertionError("start_verify called with the sanitizer off")


def test_sanitize_off_never_touches_poison_or_the_check():
    planes = random_planes(random.Random(1))
    ex = RankExecutor(0, num_pages=NUM_PAGES, backend=Refuses(planes), planes=planes)
    out = run(ex, 0, [1, 2], poison=[5], committed=[1, 2])
    assert out.status == "ok" and out.timing is not None and out.timing.sanitize_s == 0.0
    assert out.timing.clear_host_s > 0


def test_sanitize_needs_a_backend_that_can_poison_and_check():
    class ClearOnly:
        name = "clear-only"

        def clear(self, page_ids):
            pass

    with pytest.raises(ConfigurationError, match="poison"):
        RankExecutor(0, num_pages=4, backend=ClearOnly(), sanitize=True)


def test_a_duck_typed_backend_with_poison_and_check_can_sanitize():
    """An object that is no ClearBackend (no ``clear_checked``, no ``can_sanitize``) but has
    ``clear``, ``poison`` and ``start_verify`` sanitizes through them (``as_clear_backend``)."""
    planes = random_planes(random.Random(4))
    full = TorchClearBackend(planes)
    partial = TorchClearBackend(planes[:1] + planes[2:])  # skips plane 1

    class SkipsPlaneOne:
        def __init__(self):
            self.name, self.num_pages = "skips-plane-1", NUM_PAGES
            self.poison, self.start_verify = full.poison, full.start_verify
            self.clear = partial.clear

    ex = RankExecutor(0, num_pages=NUM_PAGES, backend=SkipsPlaneOne(), planes=planes, sanitize=True)
    assert ex.backend is not None and ex.backend.can_sanitize
    assert run(ex, 0, [], poison=[5, 6]).status == "ok"
    out = run(ex, 1, [5, 6], committed=[5, 6])
    assert out.status == "failed" and isinstance(out.error, InvariantViolation)
    assert {v.plane for v in out.violations} == {1}
    assert {v.page for v in out.violations} == {5, 6}


@pytest.mark.asyncio
async def test_job_lists_default_to_empty():
    plan = StepPlan(step=0, clear_list=(1,))
    j = StepJob(plan, StepInputs(), anyio.CancelScope(), StepReplies(1))
    assert (j.poison, j.committed) == ((), ())
    j2 = StepJob(plan, StepInputs(), None, StepReplies(1), poison=(4,), committed=(1, 2))
    assert (j2.poison, j2.committed) == ((4,), (1, 2))


def test_a_check_with_nothing_listed_is_done_and_empty():
    planes = random_planes(random.Random(2))
    check = TorchVerifier(planes).start([], [])
    assert check.query() and check.result() == ()
    assert SanitizerCheck.done([Violation(plane=1, page=2, kind=POISON)]).result()[0].page == 2
