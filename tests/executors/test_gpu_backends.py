"""GPU clear backends (cuda, triton, and the torch backend on CUDA) against a plain torch reference.

Every test needs a CUDA device and skips cleanly without one; backends whose
package is missing (cuda-python, triton) skip on their own. Nothing here runs
on the CPU-only CI machine beyond collection.

    reference:  planes copied, ``plane[ids] = 0`` with torch indexing, compared byte for byte
    stream:     sleep -> fill listed pages (row bytes) -> input copy -> clear -> check kernel,
                all enqueued on the model stream; a clear on any other stream fails the check
    graph:      stage(ids) + replay of one captured graph [clear kernel -> check kernel]
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from kvledger import (
    ConfigurationError,
    DuplicatePageError,
    InvalidArgumentError,
    PageOutOfRangeError,
)

BACKENDS = ["torch", "cuda", "cuda-per-page", "triton", "triton-jit", "triton-launcher", "triton-chunked",
            "triton-graph", "triton-by-value", "triton-copied", "triton-on-stream", "triton-mapped"]
SLEEP_CYCLES = 40_000_000  # ~20 ms at ~2 GHz: long enough for the host to enqueue everything after it


class _GraphClear:
    """The triton backend driven through its CUDA-graph path: stage(ids) + one graph replay."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.name = "triton-graph"
        backend.graph_clear([])  # capture the clear graph now, outside the measured sequence

    def clear(self, page_ids) -> None:
        self.backend.graph_clear(page_ids)


def make_backend(name, planes, stream=None):
    if name == "torch":
        mod = pytest.importorskip("kvledger.executors.torch_backend")
        return mod.TorchClearBackend(planes, stream=stream)
    if name.startswith("cuda"):
        pytest.importorskip("cuda.bindings")
        from kvledger.executors.cuda_backend import CudaClearBackend

        return CudaClearBackend(planes, stream=stream, mode="per_page" if name == "cuda-per-page" else "coalesced")
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("triton")
    from kvledger.executors.triton_backend import FillConfig, IdsPlan, TritonClearBackend

    knobs: dict = {
        "triton-jit": {"fast_launch": False},  # Triton's JIT launch, list copied on the model stream
        "triton-launcher": {"launch": "triton", "prefetch": False},  # the compiled kernel's own launcher
        "triton-chunked": {"config": FillConfig(block_bytes=2048, chunked=True, plane_major=True, programs_per_sm=2)},
        "triton-by-value": {"ids": IdsPlan(128, "side")},  # every list up to 128 ids in the parameters
        "triton-copied": {"ids": IdsPlan(0, "side")},  # every list copied on the side stream
        "triton-on-stream": {"ids": IdsPlan(0, "stream")},  # every list copied on the model stream
        "triton-mapped": {"ids": IdsPlan(0, "mapped")},  # the kernel reads the pinned row (measured only)
    }.get(name, {})
    backend = TritonClearBackend(planes, stream=stream, **knobs)
    return _GraphClear(backend) if name == "triton-graph" else backend


def as_bytes(t):
    """A uint8 view ``[num_pages, bytes_per_page]`` of a contiguous plane."""
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def random_planes(specs, num_pages, *, offset=0, lo=1, hi=256):
    """Planes of random non-zero bytes. ``specs``: (dtype, page shape) per plane.

    ``offset`` > 0 places each plane ``offset`` bytes into its allocation
    (misaligned planes exercise the byte-wise kernel).
    """
    planes = []
    for dtype, shape in specs:
        elem = torch.empty((), dtype=dtype).element_size()
        per_page = elem
        for d in shape:
            per_page *= d
        raw = torch.randint(lo, hi, (num_pages * per_page + offset,), dtype=torch.uint8, device="cuda")
        planes.append(raw[offset:].view(dtype).view(num_pages, *shape))
    return planes


def reference(planes, ids):
    """The plain torch reference: CPU copies of the planes with the listed pages zeroed."""
    out = [as_bytes(p).cpu().clone() for p in planes]
    if ids:
        idx = torch.tensor(list(ids), dtype=torch.long)
        for o in out:
            o[idx] = 0
    return out


def assert_planes_equal(planes, expected):
    for k, (p, e) in enumerate(zip(planes, expected, strict=True)):
        got = as_bytes(p).cpu()
        diff = (got != e).nonzero()
        assert diff.numel() == 0, f"plane {k} differs at (page, byte) {diff[:8].tolist()}"


LAYOUTS = {
    # K, V (fp8) and scales (bf16): 2048, 1024 and 4096 bytes per page
    "fp8-kv-scales": (64, [(torch.float8_e4m3fn, (16, 128)), (torch.float8_e4m3fn, (8, 128)),
                           (torch.bfloat16, (16, 128))], 0),
    # 16 KiB pages in every plane: the production shape (unmasked 16-byte stores)
    "16k": (40, [(torch.uint8, (16384,)), (torch.float8_e4m3fn, (16384,)), (torch.uint8, (16384,))], 0),
    # 100 and 36 bytes per page: 4-byte units, masked stores
    "small-odd": (50, [(torch.uint8, (100,)), (torch.float32, (9,))], 0),
    # misaligned planes, 7 and 13 bytes per page: byte-wise stores
    "misaligned": (30, [(torch.uint8, (7,)), (torch.uint8, (13,))], 3),
}


def id_lists(num_pages, rng):
    ids = list(range(num_pages))
    start = rng.randrange(num_pages // 2)
    return [
        [],
        [rng.randrange(num_pages)],
        list(range(start, start + num_pages // 3)),  # one adjacent run
        rng.sample(ids, num_pages // 4),  # scattered, unsorted
        rng.sample(ids, num_pages),  # every page, shuffled
        sorted(rng.sample(ids, num_pages // 2), reverse=True),
    ]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", BACKENDS)
def test_clear_matches_torch_reference_on_random_data(name, layout):
    num_pages, specs, offset = LAYOUTS[layout]
    rng = random.Random(f"{name}/{layout}")
    torch.manual_seed(rng.randrange(1 << 30))
    planes = random_planes(specs, num_pages, offset=offset)
    backend = make_backend(name, planes)
    for ids in id_lists(num_pages, rng):
        for p in planes:  # fresh random bytes for every list
            as_bytes(p).copy_(torch.randint(1, 256, as_bytes(p).shape, dtype=torch.uint8, device="cuda"))
        expected = reference(planes, ids)
        backend.clear(ids)
        torch.cuda.synchronize()
        assert_planes_equal(planes, expected)


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_page_ids_raise_before_anything_is_touched(name):
    num_pages = 32
    planes = random_planes([(torch.uint8, (4096,)), (torch.bfloat16, (512,))], num_pages)
    backend = make_backend(name, planes)
    before = reference(planes, [])
    cases = [  # every backend checks its ids with kvledger.core.checks.page_ids
        ([1, 2, num_pages], PageOutOfRangeError),
        ([-1, 3], PageOutOfRangeError),
        ([5, 6, 5], DuplicatePageError),
        ([1, "2"], InvalidArgumentError),
        ([1, 2.0], InvalidArgumentError),
        ([True, 3], InvalidArgumentError),
        (5, InvalidArgumentError),
    ]
    for ids, err in cases:
        with pytest.raises(err):
            backend.clear(ids)
    torch.cuda.synchronize()
    assert_planes_equal(planes, before)
    with pytest.raises(PageOutOfRangeError) as info:
        backend.clear([0, num_pages + 5, 1])
    assert num_pages + 5 in info.value.page_ids
    with pytest.raises(DuplicatePageError) as twice:
        backend.clear([9, 9])
    assert twice.value.page_ids == (9,)


@pytest.mark.parametrize("cls_name", ["cuda", "triton"])
def test_bad_planes_are_configuration_errors(cls_name):
    pytest.importorskip("cuda.bindings")
    cls: type
    if cls_name == "triton":
        pytest.importorskip("triton")
        from kvledger.executors.triton_backend import TritonClearBackend

        cls = TritonClearBackend
    else:
        from kvledger.executors.cuda_backend import CudaClearBackend

        cls = CudaClearBackend
    good = torch.zeros(8, 64, dtype=torch.uint8, device="cuda")
    bad = [
        [],
        [torch.zeros(8, 64, dtype=torch.uint8)],  # CPU tensor
        [torch.zeros(64, 8, dtype=torch.uint8, device="cuda").t()],  # not contiguous
        [good, torch.zeros(9, 64, dtype=torch.uint8, device="cuda")],  # page counts differ
        [torch.zeros((), dtype=torch.uint8, device="cuda")],  # no page dimension
        [good, "plane"],
    ]
    for planes in bad:
        with pytest.raises(ConfigurationError):
            cls(planes)


def _stream_arg(kind, s):
    return {"torch": s, "raw": s.cuda_stream, "current": None}[kind]


@pytest.mark.parametrize("stream_kind", ["torch", "raw", "current"])
@pytest.mark.parametrize("name", BACKENDS)
def test_stream_order_input_copies_then_clear_then_graph(name, stream_kind):
    """Input copies -> clear -> the step's kernel, all on the model stream.

    The GPU is held by a sleep kernel at the head of the model stream; behind it
    the previous step writes row bytes (0x7F) into the listed pages, the step's
    inputs are copied in, the backend clears, and a check kernel records
    whether the listed pages read zero and the inputs are present. A clear
    enqueued on any other stream runs during the sleep, before the row bytes
    land, and the check sees 0x7F.
    """
    if name == "torch" and stream_kind == "raw":
        pytest.skip("the torch backend takes torch streams; raw handles are tested on cuda/triton")
    num_pages = 96
    planes = random_planes([(torch.float8_e4m3fn, (8, 256)), (torch.uint8, (1024,)),
                            (torch.bfloat16, (4, 512))], num_pages)
    s = torch.cuda.Stream()
    backend = make_backend(name, planes, _stream_arg(stream_kind, s))
    rng = random.Random(name + stream_kind)
    listed = rng.sample(range(88), 17) + [90, 91, 92]  # scattered ids and one adjacent run
    idx = torch.tensor(listed, device="cuda")
    host_in = torch.randint(0, 1 << 40, (8192,), dtype=torch.int64).pin_memory()
    want_in = host_in.to("cuda")
    dev_in = torch.zeros(8192, dtype=torch.int64, device="cuda")
    flag = torch.zeros(2, dtype=torch.int32, device="cuda")
    before = reference(planes, listed)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for p in planes:  # the previous step's row bytes land in the listed pages
            as_bytes(p).index_fill_(0, idx, 0x7F)
        dev_in.copy_(host_in, non_blocking=True)  # the step's input copies
        backend.clear(listed)  # the clear
        zero = torch.stack([(as_bytes(p).index_select(0, idx) == 0).all() for p in planes]).all()
        flag[0] = zero.to(torch.int32)  # the step's kernel: reads the pages and the inputs
        flag[1] = (dev_in == want_in).all().to(torch.int32)
    s.synchronize()
    assert flag.tolist() == [1, 1], f"pages zero / inputs present: {flag.tolist()}"
    assert_planes_equal(planes, before)


def _graph_step(planes, page_list, capacity, dev_in, seen, flag):
    """The step graph: pages in ``page_list`` must read zero; it copies out what inputs it saw."""
    slots = torch.arange(capacity, device="cuda")

    def step():
        valid = slots < page_list[0]
        ids = torch.where(valid, page_list[1:].long(), 0)
        ok = torch.ones((), dtype=torch.bool, device="cuda")
        for p in planes:
            rows_zero = (as_bytes(p).index_select(0, ids) == 0).all(dim=1)
            ok = ok & (rows_zero | ~valid).all()
        flag.copy_(ok.to(torch.int32).reshape(1))
        seen.copy_(dev_in)

    return step


def _fresh_bytes_row_bytes_listed(planes, ids):
    """Random non-zero bytes in every page, row bytes (0x7F) in the listed ones; the expected planes."""
    for p in planes:
        as_bytes(p).copy_(torch.randint(1, 256, as_bytes(p).shape, dtype=torch.uint8, device="cuda"))
    if ids:
        idx = torch.tensor(ids, device="cuda")
        for p in planes:
            as_bytes(p).index_fill_(0, idx, 0x7F)
    return reference(planes, ids)


def test_triton_graph_clears_whatever_the_step_lists_without_host_launches():
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("triton")
    from kvledger.executors.triton_backend import TritonClearBackend

    num_pages = 128
    planes = random_planes([(torch.float8_e4m3fn, (16, 128)), (torch.uint8, (16384,)),
                            (torch.bfloat16, (8, 128))], num_pages)
    s = torch.cuda.Stream()
    backend = TritonClearBackend(planes, stream=s)
    meta = backend.page_list
    dev_in = torch.zeros(1024, dtype=torch.int64, device="cuda")
    seen = torch.zeros_like(dev_in)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    step = _graph_step(planes, meta, backend.capacity, dev_in, seen, flag)
    with torch.cuda.stream(s):
        step()  # warm-up outside the graph
    s.synchronize()
    graph = backend.capture(step)
    launches = backend.statistics()["kernel_launches"]
    rng = random.Random(5)
    lists = [rng.sample(range(num_pages), 9), [], list(range(num_pages)), list(range(40, 72)),
             rng.sample(range(num_pages), 50)]
    for ids in lists:
        host_in = torch.randint(0, 1 << 40, (1024,), dtype=torch.int64).pin_memory()
        expected = _fresh_bytes_row_bytes_listed(planes, ids)
        flag.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            dev_in.copy_(host_in, non_blocking=True)
        backend.stage(ids)  # the page list travels with the inputs
        with torch.cuda.stream(s):
            graph.replay()
        s.synchronize()
        assert flag.item() == 1, f"the step graph saw a listed page that was not zero (ids {ids[:8]})"
        assert torch.equal(seen.cpu(), host_in)
        assert_planes_equal(planes, expected)
    # every replay cleared its own list; the backend launched no kernel from the host
    assert backend.statistics()["kernel_launches"] == launches
    # each replay consumed its list: replaying with nothing staged zeroes nothing
    assert int(meta[0].item()) == 0
    before = reference(planes, [])
    with torch.cuda.stream(s):
        graph.replay()
    s.synchronize()
    assert flag.item() == 1
    assert_planes_equal(planes, before)


def _check_listed_zero_and_inputs(planes, idx, dev_in, want_in, flag):
    """The step's kernel: do the listed pages read zero, are the copied inputs there?"""
    zero = torch.stack([(as_bytes(p).index_select(0, idx) == 0).all() for p in planes]).all()
    flag[0] = zero.to(torch.int32)
    flag[1] = (dev_in == want_in).all().to(torch.int32)


@pytest.mark.asyncio
@pytest.mark.parametrize("checked", [False, True], ids=["user-list", "sealed-plan"])
@pytest.mark.parametrize("name", ["cuda", "triton", "triton-graph"])
async def test_rank_executor_runs_copies_clear_graph_in_stream_order(name, checked):
    """The engine's RankExecutor with the GPU backends: copies -> clear -> graph on the model stream."""
    ex_mod = pytest.importorskip("kvledger.executors.executor")
    import anyio

    from kvledger import StepPlan

    num_pages = 64
    planes = random_planes([(torch.float8_e4m3fn, (4, 512)), (torch.bfloat16, (1024,))], num_pages)
    s = torch.cuda.Stream()
    listed = [2, 3, 4, 30, 61, 7]
    idx = torch.tensor(listed, device="cuda")
    host_in = torch.randint(0, 1 << 40, (4096,), dtype=torch.int64).pin_memory()
    want_in = host_in.to("cuda")
    dev_in = torch.zeros_like(want_in)
    flag = torch.zeros(2, dtype=torch.int32, device="cuda")
    if name == "triton-graph":
        pytest.importorskip("cuda.bindings")
        pytest.importorskip("triton")
        from kvledger.executors.triton_backend import TritonClearBackend

        tb = TritonClearBackend(planes, stream=s)
        with torch.cuda.stream(s):
            _check_listed_zero_and_inputs(planes, idx, dev_in, want_in, flag)  # warm-up
        s.synchronize()
        captured = tb.capture(lambda: _check_listed_zero_and_inputs(planes, idx, dev_in, want_in, flag))
        backend = tb.staged()

        def graph(ctx, step, inputs):
            captured.replay()
    else:
        backend = make_backend(name, planes, s)

        def graph(ctx, step, inputs):
            _check_listed_zero_and_inputs(planes, idx, dev_in, want_in, flag)

    ex = ex_mod.RankExecutor(0, num_pages=num_pages, backend=backend, graph=graph, planes=planes,
                             device=planes[0].device, stream=s)
    before = reference(planes, listed)
    flag.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(SLEEP_CYCLES)
        for p in planes:  # the previous step's row bytes land in the listed pages
            as_bytes(p).index_fill_(0, idx, 0x7F)
    replies = ex_mod.StepReplies(1)
    job = ex_mod.StepJob(StepPlan(step=0, clear_list=tuple(listed)),
                         ex_mod.StepInputs(copies=[(host_in, dev_in)]), anyio.CancelScope(), replies,
                         checked=checked)  # sealed plan: the backend's clear_checked (triton-graph: stage_checked)
    outcome = await ex.run_job(job)
    assert outcome.status == "ok", outcome.error
    s.synchronize()
    assert flag.tolist() == [1, 1]
    assert_planes_equal(planes, before)


def test_registry_builds_gpu_backends_by_name():
    mod = pytest.importorskip("kvledger.executors.backend")
    pytest.importorskip("cuda.bindings")
    planes = random_planes([(torch.uint8, (256,))], 8)
    from kvledger.executors.cuda_backend import CudaClearBackend

    assert isinstance(mod.make_backend("cuda", planes), CudaClearBackend)
    pytest.importorskip("triton")
    from kvledger.executors.triton_backend import TritonClearBackend

    backend = mod.make_backend("triton", planes)
    assert isinstance(backend, TritonClearBackend)
    backend.clear([1, 2])
    torch.cuda.synchronize()
    assert as_bytes(planes[0])[1:3].count_nonzero().item() == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_triton_clear_checked_zeroes_exactly_what_clear_does(layout):
    """The engine's no-recheck path (a sealed plan's tuple) writes the same bytes as ``clear``."""
    num_pages, specs, offset = LAYOUTS[layout]
    rng = random.Random(f"checked/{layout}")
    torch.manual_seed(rng.randrange(1 << 30))
    planes = random_planes(specs, num_pages, offset=offset)
    backend = make_backend("triton", planes)
    for ids in id_lists(num_pages, rng):
        for p in planes:
            as_bytes(p).copy_(torch.randint(1, 256, as_bytes(p).shape, dtype=torch.uint8, device="cuda"))
        expected = reference(planes, ids)
        backend.clear_checked(tuple(ids))
        torch.cuda.synchronize()
        assert_planes_equal(planes, expected)
