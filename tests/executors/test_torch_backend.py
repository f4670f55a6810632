"""The torch clear backend: exactly the listed pages become zero, in every plane, for every
dtype and both strategies; bad ids and bad planes raise before anything is touched."""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, strategies as st

from kvledger import (
    ConfigurationError,
    DuplicatePageError,
    InvalidArgumentError,
    PageOutOfRangeError,
)
from kvledger.executors.backend import (
    BACKENDS,
    ClearBackend,
    backend_class,
    coalesce_runs,
    make_backend,
)
from kvledger.executors.torch_backend import STRATEGIES, TorchClearBackend

NUM_PAGES = 32


def filled_planes(seed: int = 0, num_pages: int = NUM_PAGES):
    """Three planes of different dtypes and page sizes, every byte non-zero."""
    g = torch.Generator().manual_seed(seed)

    def nonzero_bytes(shape, dtype):
        nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(1, 256, (nbytes,), generator=g, dtype=torch.int32).to(torch.uint8)
        return raw.view(dtype).reshape(shape).clone()

    return [
        nonzero_bytes((num_pages, 4, 2, 8), torch.float8_e4m3fn),  # 64 B pages: int64 rows
        nonzero_bytes((num_pages, 3, 5), torch.bfloat16),  # 30 B pages: int16 rows
        nonzero_bytes((num_pages, 7), torch.uint8),  # 7 B pages: uint8 rows
    ]


def page_bytes(plane, p):
    return plane[p].reshape(-1).view(torch.uint8)


def assert_cleared_exactly(planes, before, listed):
    listed = set(listed)
    for plane, old in zip(planes, before, strict=True):
        for p in range(plane.shape[0]):
            got = page_bytes(plane, p)
            if p in listed:
                assert int(got.count_nonzero()) == 0, f"page {p} not zeroed"
            else:
                assert torch.equal(got, page_bytes(old, p)), f"page {p} changed"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["adjacent", "scattered", "single", "all"])
def test_clears_exactly_the_listed_pages(strategy, kind):
    planes = filled_planes()
    before = [p.clone() for p in planes]
    ids = {
        "adjacent": [5, 6, 7, 8, 20, 21],
        "scattered": random.Random(1).sample(range(NUM_PAGES), 11),
        "single": [NUM_PAGES - 1],
        "all": list(range(NUM_PAGES))[::-1],
    }[kind]
    backend = TorchClearBackend(planes, strategy=strategy)
    backend.clear(ids)
    assert_cleared_exactly(planes, before, ids)
    stats = backend.statistics()
    assert stats["pages"] == len(ids) and stats["calls"] == 1
    assert stats["bytes"] == len(ids) * (64 + 30 + 7)
    if strategy == "runs":
        assert stats["index_fills"] == 0 and stats["slice_fills"] == 3 * len(coalesce_runs(sorted(ids)))
    if strategy == "index":
        assert stats["slice_fills"] == 0 and stats["index_fills"] == 3


@given(st.sets(st.integers(0, NUM_PAGES - 1), max_size=NUM_PAGES), st.sampled_from(STRATEGIES))
def test_clear_property(ids, strategy):
    planes = filled_planes(seed=len(ids))
    before = [p.clone() for p in planes]
    ids = list(ids)
    random.Random(len(ids)).shuffle(ids)
    TorchClearBackend(planes, strategy=strategy).clear(ids)
    assert_cleared_exactly(planes, before, ids)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cpu_runs_longer_and_shorter_than_the_host_chunk_clear_and_poison_exactly(strategy):
    # a run is a slice assignment into the plane's memory up to _HOST_CHUNK bytes, a torch fill
    # beyond it: pages of 48 B, 160 KiB (2 adjacent pages pass the chunk) and 300 KiB (one does)
    from kvledger.executors import torch_backend

    g = torch.Generator().manual_seed(3)
    shapes = [(8, 48), (8, 160 * 1024), (8, 300 * 1024)]
    planes = [torch.randint(1, 255, s, generator=g, dtype=torch.int32).to(torch.uint8) for s in shapes]
    assert max(s[1] for s in shapes) > torch_backend._HOST_CHUNK
    backend = TorchClearBackend(planes, strategy=strategy)
    for ids in ([2, 3], [7], [0, 1, 2, 5]):
        before = [p.clone() for p in planes]
        backend.poison(ids)
        for plane, old in zip(planes, before, strict=True):
            want = old.clone()
            want[ids] = 255
            assert torch.equal(plane, want)
        before = [p.clone() for p in planes]
        backend.clear_checked(tuple(ids))
        assert_cleared_exactly(planes, before, ids)


def test_views_share_storage_with_the_planes():
    planes = filled_planes()
    backend = TorchClearBackend(planes)
    assert backend.plane_page_bytes == (64, 30, 7)
    assert backend.num_pages == NUM_PAGES
    backend.clear((3,))
    # the caller's tensors changed in place (no copies were zeroed)
    assert float(planes[0][3].float().abs().sum()) == 0.0
    assert int(planes[2][3].count_nonzero()) == 0


@pytest.mark.parametrize(
    "ids, error",
    [
        ([1, NUM_PAGES], PageOutOfRangeError),
        ([-1, 2], PageOutOfRangeError),
        ([4, 5, 4], DuplicatePageError),
        ([1.0], InvalidArgumentError),
        ([True], InvalidArgumentError),
        (["3"], InvalidArgumentError),
        (7, InvalidArgumentError),
    ],
)
def test_bad_ids_touch_nothing(ids, error):
    planes = filled_planes()
    before = [p.clone() for p in planes]
    backend = TorchClearBackend(planes)
    with pytest.raises(error) as info:
        backend.clear(ids)
    for plane, old in zip(planes, before, strict=True):
        assert torch.equal(plane.view(torch.uint8), old.view(torch.uint8))
    if error is PageOutOfRangeError:
        assert info.value.page_ids == tuple(p for p in ids if not 0 <= p < NUM_PAGES)
    if error is DuplicatePageError:
        assert info.value.page_ids == (4,)
    assert backend.statistics()["calls"] == 0


class IntLike:
    """An integer scalar type that is not int (like numpy.int64): has __index__."""

    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


def test_integer_scalars_are_page_ids():
    planes = filled_planes()
    before = [p.clone() for p in planes]
    backend = TorchClearBackend(planes)
    twice: list[Any] = [IntLike(3), 3]
    with pytest.raises(DuplicatePageError):
        backend.clear(twice)
    int_likes: list[Any] = [IntLike(3), torch.tensor(4).item(), torch.tensor(5)]
    backend.clear(int_likes)
    assert_cleared_exactly(planes, before, [3, 4, 5])
    assert backend.statistics()["pages"] == 3


def test_coalesce_runs():
    assert coalesce_runs([]) == []
    assert coalesce_runs([7]) == [(7, 8)]
    assert coalesce_runs([3, 4, 5, 9, 11, 12]) == [(3, 6), (9, 10), (11, 13)]


def test_empty_list_is_a_no_op():
    planes = filled_planes()
    before = [p.clone() for p in planes]
    backend = TorchClearBackend(planes)
    backend.clear([])
    assert_cleared_exactly(planes, before, [])
    assert backend.statistics()["calls"] == 0


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: [], "at least one plane"),
        (lambda: [torch.zeros(8, 4)[:, ::2]], "not contiguous"),
        (lambda: [torch.zeros(8, 4), torch.zeros(9, 4)], "same number of pages"),
        (lambda: [torch.zeros(8, 4, requires_grad=True)], "requires grad"),
        (lambda: [torch.tensor(3.0)], "page dimension"),
        (lambda: [torch.zeros(0, 4)], "no pages"),
        (lambda: [[1, 2, 3]], "not a torch.Tensor"),
    ],
)
def test_bad_planes_are_configuration_errors(make, match):
    with pytest.raises(ConfigurationError, match=match):
        TorchClearBackend(make())


def test_stream_on_cpu_and_unknown_strategy_are_refused():
    with pytest.raises(ConfigurationError, match="not CUDA"):
        TorchClearBackend([torch.zeros(4, 4)], stream=object())
    with pytest.raises(ConfigurationError, match="strategy"):
        TorchClearBackend([torch.zeros(4, 4)], strategy="fast")


def test_zero_width_plane_is_skipped():
    planes = [torch.zeros(6, 0), torch.ones(6, 2)]
    backend = TorchClearBackend(planes)
    backend.clear([1, 2])
    assert planes[1][:, 0].tolist() == [1, 0, 0, 1, 1, 1]


def test_registry_is_lazy_and_complete(tmp_path):
    assert BACKENDS == ("bytes", "torch", "cuda", "triton")
    assert backend_class("torch") is TorchClearBackend
    b = make_backend("torch", [torch.ones(4, 2)])
    assert isinstance(b, ClearBackend) and b.name == "torch"
    with pytest.raises(ConfigurationError, match="unknown clear backend"):
        make_backend("opencl", [torch.ones(4, 2)])
    code = (
        "import sys, kvledger, kvledger.engine, kvledger.executors, kvledger.executors.backend, "
        "kvledger.executors.executor; "
        "bad = [m for m in ('torch', 'triton', 'cuda') if m in sys.modules]; "
        "assert not bad, bad"
    )
    # -P and a scratch cwd: import the installed package, never a source folder by accident
    subprocess.run([sys.executable, "-P", "-c", code], check=True, cwd=tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cuda_planes_on_a_side_stream(strategy):
    planes = [p.cuda() for p in filled_planes()]
    before = [p.clone() for p in planes]
    stream = torch.cuda.Stream()
    # Work already queued on the model stream must come first: a fill enqueued there
    # before the clear is overwritten by the clear, not the other way round.
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        planes[2][9].fill_(0x5A)
        before[2][9].fill_(0x5A)
    backend = TorchClearBackend(planes, stream=stream, strategy=strategy)
    ids = [9, 1, 2, 3, 30, 17]
    backend.clear(ids)
    stream.synchronize()
    assert_cleared_exactly([p.cpu() for p in planes], [p.cpu() for p in before], ids)
