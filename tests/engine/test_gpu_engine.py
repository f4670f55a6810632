"""The engine's CUDA step path (issue 21): what only a GPU can show, each test skipping cleanly without one.

    a lone CUDA rank     runs in run_step's own task (InlineRanks: no executor task, no hop),
                         on its model stream, the caller's current stream left as it was
    timings              off (the default): only the completion event, device phases 0.0,
                         host times there; on: every phase timed on the model stream
    two CUDA ranks       dispatched to their executor tasks, both on their own streams
    clear_checked        every backend's zeroes exactly what its clear zeroes
    input copies         the driver's copies (plain pairs) and torch's (the rest) give what copy_ gives
    the stream switch    the model stream current inside, the caller's streams as they were after
    short lists          the triton backend's kernel reads them from pinned memory: many in a row
                         through the ring's slots zero exactly what the CPU reference zeroes

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


def test_input_copies_by_the_driver_and_by_torch_give_what_copy_gives():
    from kvledger.executors.cuda_rank import CudaRank

    pytest.importorskip("cuda.bindings")
    rank = CudaRank(torch.device("cuda", 0), torch.cuda.Stream(), sanitize=False, timings=False)
    g = torch.Generator().manual_seed(7)
    pinned = torch.randn(1000, generator=g).pin_memory()
    pageable = torch.randint(0, 255, (333,), generator=g, dtype=torch.uint8)
    on_device = torch.randn(64, 8, generator=g).cuda()
    wide = torch.randn(4, 6, generator=g)
    pairs = [
        (pinned, torch.zeros(1000, device="cuda")),  # driver: host to device
        (pageable, torch.zeros(333, dtype=torch.uint8, device="cuda")),  # driver (pageable: staged by it)
        (on_device, torch.zeros(64, 8, device="cuda")),  # driver: device to device
        (pinned, torch.zeros(1000, dtype=torch.float64, device="cuda")),  # torch: a dtype conversion
        (wide.t(), torch.zeros(6, 4, device="cuda")),  # torch: a source that is not contiguous
        (pinned[:8], torch.zeros(5, 8, device="cuda")),  # torch: a broadcast
        (torch.empty(0), torch.empty(0, device="cuda")),  # nothing to copy
    ]
    torch.cuda.synchronize()
    with rank.switch:
        rank.copy_all(pairs)
    rank.stream.synchronize()
    assert rank.driver_copies == 3
    for src, dst in pairs:
        want = torch.empty_like(dst)
        want.copy_(src)
        assert torch.equal(dst, want)


def test_the_stream_switch_makes_the_model_stream_current_and_restores_the_callers():
    from kvledger.executors.cuda_rank import StreamSwitch

    model, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(other):
        switch = StreamSwitch(torch, model)
        for _ in range(2):  # one object, used again
            with switch:
                assert torch.cuda.current_stream() == model
            assert torch.cuda.current_stream() == other
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_lists_by_value_and_copied_zero_exactly_what_the_reference_zeroes():
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("triton")
    import random

    from kvledger.executors.triton_backend import TritonClearBackend

    rng = random.Random(11)
    pages = 256
    planes = [torch.randint(1, 255, (pages, 96), dtype=torch.uint8, device="cuda") for _ in range(3)]
    want = [p.cpu() for p in planes]
    stream = torch.cuda.Stream()
    b = TritonClearBackend(planes, stream=stream)
    most = b.ids.param_max  # lists up to it travel by value
    assert most > 0
    short = long = 0
    for i in range(300):  # many in a row: every slot of the ring reused many times, the device busy meanwhile
        n = rng.choice([1, 2, 3, most]) if i % 50 else most + 1  # a few copied lists too
        ids = tuple(rng.sample(range(pages), n))
        b.clear_checked(ids)
        for w in want:
            w[list(ids)] = 0
        if i % 7 == 0:
            with torch.cuda.stream(stream):  # rewrite a page after the clear, on the same stream
                page = rng.randrange(pages)
                for p, w in zip(planes, want, strict=True):
                    p[page].fill_(i % 250 + 1)
                    w[page] = i % 250 + 1
        short += n <= most
        long += n > most
    torch.cuda.synchronize()
    assert all(torch.equal(p.cpu(), w) for p, w in zip(planes, want, strict=True))
    stats = b.statistics()
    assert stats["list_copies"] == long and stats["by_value_launches"] == short and short > 250
