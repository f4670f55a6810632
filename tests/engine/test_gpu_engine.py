"""The engine's CUDA step path (issue 21): what only a GPU can show, each test skipping cleanly without one.

    a lone CUDA rank     runs in run_step's own task (InlineRanks: no executor task, no hop),
                         on its model stream, the caller's current stream left as it was
    timings              off (the default): only the completion event, device phases 0.0,
                         host times there; on: every phase timed on the model stream
    two CUDA ranks       dispatched to their executor tasks, both on their own streams
    clear_checked        every backend's zeroes exactly what its clear zeroes

(``bench/bench_steps.py --device cuda``, run by ``scripts/gpu-check``, times the same path.)
"""

from __future__ import annotations

import anyio
import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from kvledger import Geometry  # noqa: E402
from kvledger.engine import RankSpec, StepInputs, open_engine  # noqa: E402

G = Geometry(num_pages=64, page_tokens=4)


def cuda_planes(n: int = 3) -> list:
    return [torch.full((G.num_pages, 512), 0x5A, dtype=torch.uint8, device="cuda") for _ in range(n)]


async def listed(engine, snapshot: int, request: int, step: int, n: int = 3) -> tuple[int, ...]:
    rows = await engine.alias_snapshot(snapshot, n)
    await engine.release_snapshot(snapshot)
    await engine.reserve(request, n)
    assert sorted(await engine.commit(request, step, n)) == sorted(rows)
    return rows


def backends() -> list[str]:
    out = ["torch"]
    try:
        import cuda.bindings.driver  # noqa: F401

        out.append("cuda")
        import triton  # noqa: F401

        out.append("triton")
    except ImportError:
        pass
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("timings", [False, True])
async def test_a_lone_cuda_rank_runs_in_the_callers_task_on_its_stream(backend, timings):
    stream = torch.cuda.Stream()
    planes = cuda_planes()
    host = torch.arange(4096, dtype=torch.float32).pin_memory()
    dev = torch.zeros(4096, device="cuda")
    seen: dict = {}

    def graph(ctx, step, inputs):
        seen["task"] = anyio.get_current_task().id
        seen["stream"] = torch.cuda.current_stream() == ctx.stream
        seen["sum"] = dev.sum()  # enqueued after the copy on the same stream
        seen["pages"] = [plane[list(seen["rows"])].sum() for plane in ctx.planes]
        torch.cuda._sleep(5_000_000)  # completion is awaited, not synchronized

    before = torch.cuda.current_stream()
    spec = RankSpec(planes=planes, graph=graph, stream=stream, backend=backend)
    async with open_engine(G, ranks=[spec], record=True, check=True, timings=timings) as engine:
        for step in range(3):
            seen["rows"] = await listed(engine, 10 + step, 1 + step, step)
            result = await engine.run_step(step, StepInputs(copies=[(host, dev)]))
            assert seen["task"] == anyio.get_current_task().id  # no hop to an executor task
            assert seen["stream"] and torch.cuda.current_stream() == before  # the stream switch undone
            assert float(seen["sum"]) == float(host.sum())
            assert all(int(s) == 0 for s in seen["pages"])  # cleared before the graph read them
            t = result.ranks[0]
            assert t.total_s > 0 and t.clear_host_s > 0
            if timings:
                assert t.graph_s > 1e-4 and t.total_s >= t.graph_s
            else:
                assert t.copies_s == t.clear_s == t.graph_s == t.sanitize_s == 0.0


@pytest.mark.asyncio
async def test_two_cuda_ranks_are_dispatched_and_both_clear_on_their_streams():
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    planes = [cuda_planes(2), cuda_planes(2)]
    tasks: dict = {}

    def graph(ctx, step, inputs):
        tasks[ctx.rank] = anyio.get_current_task().id
        assert torch.cuda.current_stream() == ctx.stream

    specs = [RankSpec(planes=p, graph=graph, stream=s) for p, s in zip(planes, streams, strict=True)]
    async with open_engine(G, ranks=specs, record=True) as engine:
        rows = await listed(engine, 7, 1, 0)
        await engine.run_step(0)
        me = anyio.get_current_task().id
        assert len({tasks[0], tasks[1], me}) == 3  # each rank in its executor task
    torch.cuda.synchronize()
    for rank_planes in planes:
        for plane in rank_planes:
            assert int(plane[list(rows)].count_nonzero()) == 0
            others = [p for p in range(G.num_pages) if p not in rows]
            assert bool((plane[others] == 0x5A).all())


@pytest.mark.parametrize("backend", backends())
def test_clear_checked_zeroes_exactly_what_clear_does(backend):
    from kvledger.executors.backend import make_backend

    a, b = cuda_planes(), cuda_planes()
    ids = (3, 4, 5, 17, 40, 63, 0)
    make_backend(backend, a).clear(list(ids))
    make_backend(backend, b).clear_checked(ids)
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(int(x[list(ids)].count_nonzero()) == 0 for x in a)
