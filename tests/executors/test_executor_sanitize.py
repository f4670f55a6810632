"""The executor's plumbing of the sanitizer, on byte planes (no torch): a backend that skips one
plane is named by plane, a poisoned page missing from the clear list by page in every plane;
sanitize off never calls poison or the check; a backend that cannot poison and check is refused,
a duck-typed one that can is adapted; a job's lists default to empty. (The torch backend's own
poison and check: test_sanitizer_backend.py; the bytes backend's: test_bytes_backend.py.)"""

from __future__ import annotations

import random

import anyio
import pytest
from support.planes import filled_planes, page

from kvledger import ConfigurationError, InvariantViolation, StepPlan
from kvledger.executors.backend import ClearBackendBase
from kvledger.executors.bytes_backend import BytesClearBackend
from kvledger.executors.executor import RankExecutor, StepInputs, StepJob, StepReplies
from kvledger.executors.sanitize import NOT_ZERO, POISON, Violation

NUM_PAGES = 24
WIDTHS = (64, 30, 7, 16)  # bytes a page: whole 8-byte groups, a cut last group, one short group


def random_planes_of(rng: random.Random) -> list[memoryview]:
    """Planes of ``WIDTHS`` holding random bytes, never 0xFF (no poison to start with)."""
    planes = filled_planes(NUM_PAGES, WIDTHS, 0)
    for plane in planes:
        for p in range(NUM_PAGES):
            view = page(plane, p)
            view[:] = bytes(rng.randrange(0, 255) for _ in range(len(view)))
    return planes


class SkipsOnePlane(ClearBackendBase):
    """A broken backend: its clear zeroes every plane but one; poison and check see them all."""

    name = "skips-one-plane"
    can_sanitize = True

    def __init__(self, planes, skip):
        self.full = BytesClearBackend(planes)
        self.partial = BytesClearBackend([p for i, p in enumerate(planes) if i != skip])
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
    planes = random_planes_of(random.Random(skip))
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
    planes = random_planes_of(random.Random(9))
    ex = RankExecutor(0, num_pages=NUM_PAGES, backend=BytesClearBackend(planes), planes=planes, sanitize=True)
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
        self.inner = BytesClearBackend(planes)
        self.num_pages = self.inner.num_pages

    def clear(self, page_ids):
        self.inner.clear(page_ids)

    def poison(self, page_ids):
        raise AssertionError("poison called with the sanitizer off")

    def start_verify(self, cleared, committed):
        raise AssertionError("start_verify called with the sanitizer off")


def test_sanitize_off_never_touches_poison_or_the_check():
    planes = random_planes_of(random.Random(1))
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
    planes = random_planes_of(random.Random(4))
    full = BytesClearBackend(planes)
    partial = BytesClearBackend(planes[:1] + planes[2:])  # skips plane 1

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
