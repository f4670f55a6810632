"""The clear inside the model's own CUDA graph (issue #15): a toy model step captured once with
``TritonClearBackend.clear_staged()`` at its head, replayed 1,000 times with changing lists.

    per step, on the model stream:  stage(ids) [H2D copy] + the model's input copies -> replay
    the graph:  clear kernel over the staged list -> count := 0 -> the model: the pages it is
                about to write must read zero (else it counts them), then it writes its KV byte

Checks: no listed page was ever seen non-zero by the model, every page holds exactly what a
host mirror says (listed pages the step's KV byte, the others untouched), the host launched no
kernel of its own (backend counter, and the profiler over a few steps sees graph launches and
the clear kernel running inside them, but no kernel launch call).
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_PAGES = 256
CAP = 48  # the toy model writes at most this many pages a step
PAGE_SPECS = [(torch.uint8, (4096,)), (torch.bfloat16, (1024,)), (torch.float8_e4m3fn, (8, 256))]


def as_bytes(t):
    return t.reshape(t.shape[0], -1).view(torch.uint8)


class ToyStep:
    """Static inputs and the model step the graph holds (reads write_ids / n_write / kv)."""

    def __init__(self, big_planes):
        dev = big_planes[0].device
        self.rows = [as_bytes(p) for p in big_planes]  # NUM_PAGES + 1 rows: the last is scratch
        self.write_ids = torch.full((CAP,), NUM_PAGES, dtype=torch.int64, device=dev)
        self.n_write = torch.zeros(1, dtype=torch.int64, device=dev)
        self.kv = torch.zeros(1, dtype=torch.uint8, device=dev)
        self.bad = torch.zeros(1, dtype=torch.int64, device=dev)
        self.slots = torch.arange(CAP, device=dev)

    def __call__(self):
        valid = self.slots < self.n_write
        ids = torch.where(valid, self.write_ids, NUM_PAGES)  # invalid slots hit the scratch row
        for rows in self.rows:
            self.bad += ((rows.index_select(0, ids) != 0).any(1) & valid).sum()
            rows.index_copy_(0, ids, self.kv.expand(CAP, rows.shape[1]).contiguous())  # scratch: same bytes

    def set_inputs(self, ids, kv, stream):
        """The model's input copies (fresh pinned buffers: the GPU may still be reading older ones)."""
        h = torch.full((CAP + 2,), NUM_PAGES, dtype=torch.int64)
        h[0] = len(ids)
        h[1] = kv
        if ids:
            h[2:2 + len(ids)] = torch.tensor(ids)
        h = h.pin_memory()
        with torch.cuda.stream(stream):
            self.n_write.copy_(h[0:1], non_blocking=True)
            self.kv.copy_(h[1:2].to(torch.uint8).pin_memory(), non_blocking=True)
            self.write_ids.copy_(h[2:], non_blocking=True)


def make_planes():
    big = []
    for dtype, shape in PAGE_SPECS:
        page_bytes = dtype.itemsize
        for d in shape:
            page_bytes *= d
        raw = torch.randint(1, 256, ((NUM_PAGES + 1) * page_bytes,), dtype=torch.int32, device="cuda")
        big.append(raw.to(torch.uint8).view(dtype).view(NUM_PAGES + 1, *shape))
    return big, [p[:NUM_PAGES] for p in big]


def test_clear_inside_the_model_graph_1000_replays():
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("triton")
    from kvledger.executors.triton_backend import TritonClearBackend

    big, planes = make_planes()
    stream = torch.cuda.Stream()
    backend = TritonClearBackend(planes, stream=stream)
    step = ToyStep(big)
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph (CUDA graph rules)
        step.bad.zero_()
    stream.synchronize()
    mirror = [r[:NUM_PAGES].cpu().clone() for r in step.rows]
    backend.warmup()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        backend.clear_staged()
        step()
    launches = backend.statistics()["kernel_launches"]
    rng = random.Random(15)
    for i in range(1000):
        ids = [] if i % 97 == 5 else rng.sample(range(NUM_PAGES), rng.randrange(1, CAP + 1))
        kv = 1 + i % 250
        if ids:
            backend.stage(ids)
        step.set_inputs(ids, kv, stream)
        with torch.cuda.stream(stream):
            graph.replay()
        for m in mirror:
            if ids:
                m[torch.tensor(ids)] = kv
        if i % 250 == 249:
            stream.synchronize()
            assert int(step.bad.item()) == 0, f"a listed page read non-zero before step {i}"
            for k, (r, m) in enumerate(zip(step.rows, mirror, strict=True)):
                diff = (r[:NUM_PAGES].cpu() != m).any(1).nonzero().flatten().tolist()
                assert not diff, f"step {i}: plane {k} pages {diff[:8]} differ from the mirror"
    assert backend.statistics()["kernel_launches"] == launches  # the host launched no clear kernel
    _profile_a_few_steps(backend, step, graph, stream, rng)


def _profile_a_few_steps(backend, step, graph, stream, rng):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            backend.stage(rng.sample(range(NUM_PAGES), 8))
            step.set_inputs([], 1, stream)
            with torch.cuda.stream(stream):
                graph.replay()
        stream.synchronize()
    names = [e.name for e in prof.events()]
    assert sum("GraphLaunch" in n for n in names) == 5
    assert sum("LaunchKernel" in n for n in names) == 0, [n for n in names if "LaunchKernel" in n][:5]
    assert sum("fill_pages_kernel" in n for n in names) >= 5  # the clear ran inside the replays


def test_graph_clear_and_the_eager_ring_never_wait_for_the_device():
    """With the GPU held by a long sleep, 36 eager clears (by value and copied) and 32 graph clears
    return at once: the list ring grows, and graph_clear stages its lists once its rows are all
    in use (its graphs were all captured at its first call)."""
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("triton")
    import time

    from kvledger.executors.triton_backend import TritonClearBackend

    _, planes = make_planes()
    stream = torch.cuda.Stream()
    backend = TritonClearBackend(planes, stream=stream)
    long = backend.ids.param_max + 1  # a list that is copied, not passed by value
    backend.clear([1])
    backend.clear(list(range(40, 40 + long)))
    backend.graph_clear([2])
    stream.synchronize()
    before = backend.statistics()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s
    t0 = time.perf_counter()
    for i in range(32):
        backend.clear([i, 100 + i])
        if i % 8 == 0:
            backend.clear(list(range(40, 40 + long)))
        backend.graph_clear([200 + i])
    host = time.perf_counter() - t0
    assert not stream.query(), f"the GPU finished a 0.5 s sleep during {host * 1e3:.1f} ms of enqueuing"
    after = backend.statistics()
    assert after["ring_slots"] > before["ring_slots"]  # the ring grew instead of waiting
    assert after["graphs_captured"] == before["graphs_captured"] > 0  # nothing captured meanwhile
    assert after["list_copies"] > before["list_copies"] + 4  # graph rows in use: staged instead
    assert after["by_value_launches"] >= before["by_value_launches"] + 32
    stream.synchronize()
    listed = torch.tensor(list(range(32)) + list(range(100, 132)) + list(range(200, 232)) + list(range(40, 40 + long)),
                          device="cuda")
    for p in planes:
        assert as_bytes(p).index_select(0, listed).count_nonzero().item() == 0


def test_graph_clear_rows_and_size_classes_zero_exactly_the_listed_pages():
    """graph_clear over lists of every size class, rows reused many times with the device busy, a
    page rewritten after its clear on the same stream: every plane ends as a host mirror says, the
    host launched no kernel, and a replay never re-clears an older list."""
    pytest.importorskip("cuda.bindings")
    pytest.importorskip("triton")
    from kvledger.executors.triton_backend import TritonClearBackend

    _, planes = make_planes()
    stream = torch.cuda.Stream()
    backend = TritonClearBackend(planes, stream=stream)
    backend.graph_clear([0])
    stream.synchronize()
    launches = backend.statistics()["kernel_launches"]
    mirror = [as_bytes(p).cpu().clone() for p in planes]
    rng = random.Random(31)
    for i in range(400):
        n = rng.choice([1, 2, 15, 16, 17, 31, 33, 100, NUM_PAGES])
        ids = rng.sample(range(NUM_PAGES), n)
        if i % 50 == 0:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(2_000_000)
        backend.graph_clear(ids)
        for m in mirror:
            m[torch.tensor(ids)] = 0
        if i % 3 == 0:  # rewrite a page after its clear, on the model stream
            page = rng.randrange(NUM_PAGES)
            with torch.cuda.stream(stream):
                for p, m in zip(planes, mirror, strict=True):
                    as_bytes(p)[page].fill_(1 + i % 250)
                    m[page] = 1 + i % 250
    stream.synchronize()
    for k, (p, m) in enumerate(zip(planes, mirror, strict=True)):
        diff = (as_bytes(p).cpu() != m).any(1).nonzero().flatten().tolist()
        assert not diff, f"plane {k} pages {diff[:8]} differ from the mirror"
    stats = backend.statistics()
    assert stats["kernel_launches"] == launches
    assert stats["graphs_captured"] >= 5  # the per-row graphs (a busy row: the staged graph)
