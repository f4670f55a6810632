"""The sanitizer in the engine (``open_engine(..., sanitize=True)``, kvledger/engine/sanitizer.py), CPU ranks.

Pins: over a pressured workload (snapshots released into reused pages, restores into
requests and snapshots, returns, cancels, finishes; every clear policy) the sanitizer
finds nothing while the clears work, though it poisons and checks real pages; with
clears skipped on every rank it names the first page the workload reads unzeroed (the
first page of the first non-empty clear list of a reference run, rank 0, plane 0) at
that step, with its request, the policy and its lifecycle, and records every violation
and the abort in the ledger; the same seed gives the same error text; a backend that
skips one plane on one rank is named by exactly that plane and rank; poison goes to
marked pages (also when reserved again) and never to a page a restore is writing or
rewrote; an engine without sanitize never calls poison or the check and puts no
observer on the ledger.
"""

from __future__ import annotations

import random

import pytest

from support.gpu import requires_cuda
from support.planes import ROW, fill_pages, filled_planes, page, write_rows

from kvledger import (
    ConfigurationError,
    Geometry,
    OutOfPagesError,
    SanitizerError,
    StepFailedError,
    check_invariants,
    replay,
)
from kvledger.engine import ExtraOptions
from kvledger.core.events import SanitizerViolation, StepAborted, StepCompleted
from kvledger.engine import RankSpec, StepInputs, open_engine
from kvledger.executors.backend import ClearBackendBase, default_backend, make_backend
from kvledger.core.journal import Ring

G = Geometry(num_pages=24, page_tokens=4)
RESTORED = 0x22


def rank_planes():
    """K (32 B pages, as fp8 [4, 8]), V (64 B, bf16 [4, 8]) and scales (6 B): three planes with
    different page sizes, zero."""
    return filled_planes(G.num_pages, [32, 64, 6], 0)


def write(all_planes, pages, byte):
    """Bytes written into pages on every rank (a snapshot row through its alias, a restore)."""
    for planes in all_planes:
        write_rows(planes, pages, byte)


class Counting(ClearBackendBase):
    """The backend the planes get by default (bytes; torch for a GPU test's), counting the pages
    it poisoned and checked."""

    can_sanitize = True

    def __init__(self, planes):
        self.inner = make_backend(default_backend(planes), planes)
        self.num_pages = self.inner.num_pages
        self.poisoned = self.checked = 0

    def clear(self, page_ids):
        self.inner.clear(page_ids)

    def clear_checked(self, page_ids):
        self.inner.clear_checked(page_ids)

    def poison(self, page_ids):
        self.poisoned += len(page_ids)
        self.inner.poison(page_ids)

    def start_verify(self, cleared, committed):
        self.checked += len(cleared) + len(committed)
        return self.inner.start_verify(cleared, committed)


class NoClear(Counting):
    """A broken backend: its clear does nothing (poison and the check are real)."""

    def clear(self, page_ids):
        pass

    def clear_checked(self, page_ids):  # (the engine's path: a sealed plan's list)
        pass


class SkipsPlane(Counting):
    """A broken backend: its clear zeroes every plane but one."""

    def __init__(self, planes, skip):
        super().__init__(planes)
        rest = [p for i, p in enumerate(planes) if i != skip]
        self.partial = make_backend(default_backend(rest), rest)

    def clear(self, page_ids):
        self.partial.clear(page_ids)

    def clear_checked(self, page_ids):  # (the engine's path: a sealed plan's list)
        self.partial.clear(page_ids)


def recorded(engine) -> list:
    """The events of an engine opened with ``record=True``."""
    events = engine.ledger.events
    assert events is not None
    return events


def kv_graph(ctx, step, inputs):
    """The step writes its requests' KV into the pages committed for it (never 0x00 or 0xFF)."""
    for p, byte in inputs.data or ():
        for plane in ctx.planes:
            fill_pages(plane, [p], byte)


class Workload:
    """A seeded serving session under page pressure (24 pages): snapshots aliased, written and
    released, requests admitted and grown a page a step, restores into requests and snapshots
    (one released mid-restore), returns, cancels and finishes. ``record`` keeps, per step, the
    clear list and the holder of its first page (the reference run)."""

    def __init__(self, seed, all_planes, tenants=False):
        self.rng = random.Random(seed)
        self.planes = all_planes
        self.tenants = tenants
        self.next_id = 0
        self.snapshots: dict[int, tuple] = {}
        self.live: list[int] = []
        self.seen: list[tuple[int, tuple, str | None]] = []

    def _id(self):
        self.next_id += 1
        return self.next_id

    async def step(self, engine, step):
        rng, committed = self.rng, []
        await self._snapshots(engine)
        for _ in range(rng.randint(1, 3)):
            r = self._id()
            try:
                pages = await engine.reserve(r, rng.randint(1, 3),
                                             tenant=f"t{r % 2}" if self.tenants else None)
            except OutOfPagesError:
                continue
            if rng.random() < 0.25:  # a host restore writes the first page whole
                await engine.start_restore(pages[:1], request=r)
                write(self.planes, pages[:1], RESTORED)
                await engine.complete_restore(pages[:1], request=r)
            if rng.random() < 0.2 and len(pages) > 1:
                await engine.return_reservation(r, pages[-1:])
                pages = pages[:-1]
            committed += [(p, r) for p in await self._commit(engine, r, step, len(pages))]
            self.live.append(r)
        for r in list(self.live):  # decode: the tail page of a running request
            if rng.random() < 0.5:
                try:
                    await engine.reserve(r, 1)
                except OutOfPagesError:
                    continue
                committed += [(p, r) for p in await self._commit(engine, r, step, 1)]
        for r in list(self.live):
            if rng.random() < 0.3:
                self.live.remove(r)
                await (engine.finish(r) if rng.random() < 0.7 else engine.cancel(r))
        inputs = StepInputs(data=[(p, 1 + r % 200) for p, r in committed if r in self.live])  # (not the gone)
        return await engine.run_step(step, inputs)

    async def _commit(self, engine, r, step, n):
        before = set(engine.ledger.kv_pages(r))
        await engine.commit(r, step, n)
        return [p for p in engine.ledger.kv_pages(r) if p not in before]

    async def _snapshots(self, engine):
        rng = self.rng
        if rng.random() < 0.6:
            s = self._id()
            try:
                pages = await engine.alias_snapshot(s, rng.randint(1, 4))
            except OutOfPagesError:
                pages = ()
            if pages:
                write(self.planes, pages, ROW)
                self.snapshots[s] = pages
                if rng.random() < 0.3:  # its rows come back from the host
                    await engine.start_restore(pages, snapshot=s)
                    write(self.planes, pages, ROW)
                    if rng.random() < 0.3:  # released while the restore still writes
                        del self.snapshots[s]
                        await engine.release_snapshot(s)
                    await engine.complete_restore(pages, snapshot=s)
        for s in list(self.snapshots):
            if rng.random() < 0.4:
                del self.snapshots[s]
                await engine.release_snapshot(s)


def specs_for(all_planes, make_backend):
    return [RankSpec(planes=p, graph=kv_graph, backend=make_backend(rank, p)) for rank, p in enumerate(all_planes)]


async def reference_run(seed, policy, steps, tenants=False):
    """The same session with clears working and the sanitizer off: each step's clear list."""
    all_planes = [rank_planes(), rank_planes()]
    work = Workload(seed, all_planes, tenants)
    out = []
    async with open_engine(G, ranks=specs_for(all_planes, lambda r, p: None), policy=policy) as engine:
        for step in range(steps):
            result = await work.step(engine, step)
            first = result.clear_list[0] if result.clear_list else None
            out.append((result.clear_list, None if first is None else engine.ledger.holder_of(first)))
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["released_aliases", "cross_tenant", "all_reused"])
async def test_with_clears_working_the_sanitizer_finds_nothing_under_pressure(policy):
    all_planes = [rank_planes(), rank_planes()]
    backends = {}

    def make(rank, planes):
        backends[rank] = Counting(planes)
        return backends[rank]

    work = Workload(11, all_planes, tenants=policy == "cross_tenant")
    cleared = 0
    async with open_engine(G, ranks=specs_for(all_planes, make), policy=policy, record=True, check=True,
                           extras=ExtraOptions(sanitize=True)) as engine:
        assert engine.sanitize
        for step in range(60):
            result = await work.step(engine, step)
            cleared += len(result.clear_list)
            assert all(t.sanitize_s > 0 for t in result.ranks)
        events = recorded(engine)
        assert not any(type(e) in (SanitizerViolation, StepAborted) for e in events)
        assert replay(events, check=True).digest() == engine.ledger.digest()
        check_invariants(engine.ledger.state)
    # the run was under pressure and the sanitizer did real work on every rank
    assert cleared > 20 and work.next_id > 100
    for b in backends.values():
        assert b.poisoned >= cleared // 2 and b.checked > cleared


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["released_aliases", "all_reused"])
async def test_with_clears_skipped_the_first_bad_page_is_named_at_the_first_step_that_reads_it(policy):
    ref = await reference_run(5, policy, 60)
    bad_step = next(i for i, (clear, _) in enumerate(ref) if clear)
    clear_list, holder = ref[bad_step]

    async def broken_run():
        all_planes = [rank_planes(), rank_planes()]
        work = Workload(5, all_planes)
        async with open_engine(G, ranks=specs_for(all_planes, lambda r, p: NoClear(p)), policy=policy, record=True,
                               extras=ExtraOptions(sanitize=True)) as engine:
            for step in range(bad_step):
                await work.step(engine, step)  # nothing listed, nothing to miss: these pass
            with pytest.raises(SanitizerError) as info:
                await work.step(engine, bad_step)
            events = list(recorded(engine))
            assert replay(events, check=True).digest() == engine.ledger.digest()
        return info.value, events

    err, events = await broken_run()
    first = clear_list[0]
    assert (err.step, err.rank, err.plane, err.page_id, err.kind) == (bad_step, 0, 0, first, "not_zero")
    assert holder == f"kv({err.request})" and err.policy == policy
    assert isinstance(err.__cause__, StepFailedError) and err.__cause__.rank == 0
    # rank 0 found every listed page unzeroed in every plane, poison in each; rank 1 never ran
    assert {(r, page) for r, _, page, _ in err.violations} == {(0, p) for p in clear_list}
    assert {(plane, kind) for _, plane, _, kind in err.violations} == \
        {(k, kind) for k in range(3) for kind in ("not_zero", "poison")}
    # the ledger (and its log) holds every violation, then the abort; nothing completed the step
    tail = events[events.index(next(e for e in events if type(e) is SanitizerViolation)):]
    assert [(e.rank, e.plane, e.page_id, e.kind) for e in tail[:-1]] == list(err.violations)
    assert type(tail[-1]) is StepAborted and tail[-1].step == bad_step
    assert StepCompleted(step=bad_step, rank=0) not in events
    # the lifecycle: marked, poisoned before a clear, and the verdict naming the step
    text = str(err)
    assert f"page {first} (request {err.request})" in text and f"step {bad_step}, rank 0, plane 0" in text
    assert any(", marked" in line for line in err.lifecycle), err.lifecycle
    assert any("poisoned before step" in line for line in err.lifecycle), err.lifecycle
    assert err.lifecycle[-1].endswith(f"step {bad_step}'s clear should have zeroed it on every rank and plane")
    found = [line for line in err.lifecycle if "the sanitizer found" in line]
    assert len(found) == 1 and "not_zero on rank 0 in planes 0, 1, 2; poison on rank 0 in planes 0, 1, 2" in found[0]
    again, _ = await broken_run()
    assert str(again) == text and again.violations == err.violations  # deterministic


@pytest.mark.asyncio
@pytest.mark.parametrize(("bad_rank", "skip"), [(1, 2), (0, 1)])
async def test_a_backend_that_skips_one_plane_on_one_rank_is_named_exactly(bad_rank, skip):
    all_planes = [rank_planes(), rank_planes()]

    def make(rank, planes):
        return SkipsPlane(planes, skip) if rank == bad_rank else Counting(planes)

    work = Workload(3, all_planes)
    async with open_engine(G, ranks=specs_for(all_planes, make), record=True,
                           extras=ExtraOptions(sanitize=True)) as engine:
        with pytest.raises(SanitizerError) as info:
            for step in range(60):
                await work.step(engine, step)
        err = info.value
        assert (err.rank, err.plane) == (bad_rank, skip)
        assert {(r, plane) for r, plane, _, _ in err.violations} == {(bad_rank, skip)}
        step = err.step
        if bad_rank == 1:  # rank 0 ran its part: recorded as completed after the abort
            assert StepCompleted(step=step, rank=0) in recorded(engine)
        # the aborted step's clear list is carried: the next step clears it on the good planes,
        # and the bad plane is caught again
        with pytest.raises(SanitizerError) as again:
            await engine.run_step(step + 1)
        assert (again.value.rank, again.value.plane) == (bad_rank, skip)


@pytest.mark.asyncio
async def test_poison_goes_to_marked_pages_never_to_restored_or_restoring_ones():
    planes = rank_planes()
    async with open_engine(G, ranks=[RankSpec(planes=planes)], extras=ExtraOptions(sanitize=True)) as engine:
        a = await engine.alias_snapshot(1, 2)  # released, then reserved again: poisoned all the same
        b = await engine.alias_snapshot(2, 1)  # released into a request that a restore rewrites
        c = await engine.alias_snapshot(3, 1)  # released while its restore still writes
        await engine.start_restore(c, snapshot=3)
        for s in (1, 2, 3):
            await engine.release_snapshot(s)
        taken = await engine.reserve(10, 3)
        assert set(taken) == set(a) | set(b)
        await engine.start_restore(b, request=10)
        write([planes], b, RESTORED)
        await engine.complete_restore(b, request=10)
        await engine.run_step(0)

        def holds(p, byte):
            return all(page(plane, p) == bytes([byte]) * page(plane, p).nbytes for plane in planes)

        assert all(holds(p, 0xFF) for p in a)
        assert holds(b[0], RESTORED) and holds(c[0], 0)
        await engine.complete_restore(c, snapshot=3)  # done writing: poisoned by the next plan
        await engine.run_step(1)
        assert holds(c[0], 0xFF)
        await engine.commit(10, 2, pages=a)  # listed, cleared, checked: zero again
        result = await engine.run_step(2)
        assert sorted(result.clear_list) == sorted(a) and all(holds(p, 0) for p in a)


class Refuses(Counting):
    """Poison and the check fail: an engine without sanitize must never call them."""

    def poison(self, page_ids):
        raise AssertionError("poison called with the sanitizer off")

    def start_verify(self, cleared, committed):
        raise AssertionError("check called with the sanitizer off")


@pytest.mark.asyncio
async def test_without_sanitize_nothing_of_it_runs_and_the_ledger_has_no_observer():
    all_planes = [rank_planes(), rank_planes()]
    work = Workload(7, all_planes)
    async with open_engine(G, ranks=specs_for(all_planes, lambda r, p: Refuses(p))) as engine:
        assert not engine.sanitize and engine.ledger.observer is None and isinstance(engine.ledger.journal, Ring)
        for step in range(20):
            result = await work.step(engine, step)
            assert all(t.sanitize_s == 0.0 for t in result.ranks)


@pytest.mark.asyncio
async def test_sanitize_needs_backends_that_poison_and_check():
    class ClearOnly:
        name = "clear-only"
        num_pages = G.num_pages

        def clear(self, page_ids):
            pass

    with pytest.raises(ConfigurationError, match="poison"):
        async with open_engine(G, ranks=[RankSpec(planes=rank_planes(), backend=ClearOnly())],
                               extras=ExtraOptions(sanitize=True)):
            pass


def cuda_rank_planes():
    """``rank_planes`` on the card: fp8 K, bf16 V, uint8 scales."""
    import torch

    return [torch.zeros((G.num_pages, 4, 8), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn),
            torch.zeros((G.num_pages, 4, 8), dtype=torch.bfloat16, device="cuda"),
            torch.zeros((G.num_pages, 6), dtype=torch.uint8, device="cuda")]


@requires_cuda
@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["torch", "cuda", "triton"])
async def test_on_the_gpu_the_sanitizer_finds_nothing_when_clears_work(backend):
    pytest.importorskip({"torch": "torch", "cuda": "cuda.bindings.driver", "triton": "triton"}[backend])
    all_planes = [cuda_rank_planes(), cuda_rank_planes()]
    work = Workload(11, all_planes)
    cleared = 0
    async with open_engine(G, ranks=specs_for(all_planes, lambda r, p: backend), record=True, check=True,
                           extras=ExtraOptions(sanitize=True)) as engine:
        for step in range(40):
            cleared += len((await work.step(engine, step)).clear_list)
        events = recorded(engine)
    assert cleared > 10
    assert not any(type(e) in (SanitizerViolation, StepAborted) for e in events)


@requires_cuda
@pytest.mark.asyncio
async def test_on_the_gpu_a_skipped_clear_is_named_at_the_first_step_that_reads_it():
    ref = await reference_run(5, "released_aliases", 60)
    bad_step = next(i for i, (clear, _) in enumerate(ref) if clear)
    all_planes = [cuda_rank_planes(), cuda_rank_planes()]
    work = Workload(5, all_planes)
    async with open_engine(G, ranks=specs_for(all_planes, lambda r, p: NoClear(p)), record=True,
                           extras=ExtraOptions(sanitize=True)) as engine:
        for step in range(bad_step):
            await work.step(engine, step)
        with pytest.raises(SanitizerError) as info:
            await work.step(engine, bad_step)
    err = info.value
    assert (err.step, err.rank, err.plane, err.page_id) == (bad_step, 0, 0, ref[bad_step][0][0])
