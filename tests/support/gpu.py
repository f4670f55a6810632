"""What the GPU tests share (each skips cleanly without CUDA; importing this imports no torch).

    cuda_available()    whether torch is installed and sees a CUDA device (asked when a test is set up)
    REQUIRES_CUDA       the marks of a module that needs one (``pytestmark = REQUIRES_CUDA``): ``gpu``
                        and the ``needs_cuda`` fixture (tests/conftest.py), which skips naming what is
                        missing
    requires_cuda       the same for one test (a decorator)
    as_bytes(t)         a plane as raw page rows: a uint8 view ``[num_pages, bytes_per_page]``
    random_planes(specs, num_pages, ...)
                        planes of random bytes (``specs``: (dtype, page shape) per plane), on the card
                        or the CPU, optionally misaligned by ``offset`` bytes
    reference_clear(planes, ids)
                        the plain torch reference of a clear: CPU copies with the listed pages zeroed
    reference_violations(planes, cleared, committed)
                        the sanitizer's definition (kvledger.executors.sanitize) as a plain per-page loop
    gpu_backend(name, planes, stream=None)
                        a clear backend by the tests' names for it: "torch", "cuda", "cuda-per-page",
                        "triton" and its variants, "triton-graph" (graph_clear), "triton-staged" (staged())
    GraphClear          the triton backend driven through its CUDA-graph path: stage(ids) + one replay
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import pytest

__all__ = ["REQUIRES_CUDA", "GraphClear", "as_bytes", "cuda_available", "gpu_backend", "random_planes",
           "reference_clear", "reference_violations", "requires_cuda"]

F = TypeVar("F", bound=Callable)


def cuda_available() -> bool:
    """Whether torch is installed here and sees a CUDA device (False without torch)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


REQUIRES_CUDA = [pytest.mark.gpu, pytest.mark.usefixtures("needs_cuda")]


def requires_cuda(fn: F) -> F:
    """Mark one test as needing a CUDA device (``REQUIRES_CUDA``)."""
    for mark in REQUIRES_CUDA:
        fn = mark(fn)
    return fn


def as_bytes(t: Any) -> Any:
    """A uint8 view ``[num_pages, bytes_per_page]`` of a contiguous plane (no copy)."""
    import torch

    return t.reshape(t.shape[0], -1).view(torch.uint8)


def random_planes(specs: Iterable[tuple[Any, tuple[int, ...]]], num_pages: int, *, offset: int = 0, lo: int = 1,
                  hi: int = 256, generator: Any = None, device: str = "cuda") -> list:
    """Planes of random bytes in ``[lo, hi)`` (default: never zero). ``specs``: (dtype, page shape)
    per plane. With a ``generator`` (a CPU ``torch.Generator``) the bytes are drawn on the CPU and
    moved to ``device``; without one, on ``device`` itself. ``offset`` > 0 places each plane
    ``offset`` bytes into its allocation (misaligned planes exercise the byte-wise kernels)."""
    import torch

    planes = []
    for dtype, shape in specs:
        per_page = torch.empty((), dtype=dtype).element_size()
        for d in shape:
            per_page *= d
        n = num_pages * per_page + offset
        if generator is None:
            raw = torch.randint(lo, hi, (n,), dtype=torch.uint8, device=device)
        else:
            raw = torch.randint(lo, hi, (n,), generator=generator, dtype=torch.int32).to(torch.uint8).to(device)
        planes.append(raw[offset:].view(dtype).view(num_pages, *shape))
    return planes


def reference_clear(planes: Sequence[Any], ids: Sequence[int]) -> list:
    """The plain torch reference: CPU copies of the planes with the listed pages zeroed."""
    import torch

    out = [as_bytes(p).cpu().clone() for p in planes]
    if ids:
        idx = torch.tensor(list(ids), dtype=torch.long)
        for o in out:
            o[idx] = 0
    return out


def reference_violations(planes: Sequence[Any], cleared: Iterable[int], committed: Iterable[int]) -> tuple:
    """Plain per-page loop: the definition in kvledger.executors.sanitize, spelled out (a listed
    page must be zero; a committed page must hold no 8-byte group, cut at the page's end, of 0xFF)."""
    from kvledger.executors.sanitize import NOT_ZERO, POISON, Violation

    cleared, committed = list(cleared), list(committed)
    found = []
    for k, plane in enumerate(planes):
        rows = as_bytes(plane).cpu()
        for p in cleared:
            if bool(rows[p].ne(0).any()):
                found.append(Violation(plane=k, page=p, kind=NOT_ZERO))
        for p in committed:
            b = rows[p].tolist()
            groups = [b[i:i + 8] for i in range(0, len(b), 8)]
            if any(all(x == 255 for x in grp) for grp in groups):
                found.append(Violation(plane=k, page=p, kind=POISON))
    return tuple(sorted(found))


class GraphClear:
    """The triton backend driven through its CUDA-graph path: stage(ids) + one graph replay."""

    name = "triton-graph"

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        backend.graph_clear([])  # capture the clear graph now, outside the measured sequence

    def clear(self, page_ids: Sequence[int]) -> None:
        self.backend.graph_clear(page_ids)


def gpu_backend(name: str, planes: Sequence[Any], stream: Any = None) -> Any:
    """A clear backend by the GPU tests' name for it (skips when its stack is missing here)."""
    if name == "torch":
        mod = pytest.importorskip("kvledger.executors.torch_backend")
        return mod.TorchClearBackend(planes, stream=stream)
    pytest.importorskip("cuda.bindings")
    if name.startswith("cuda"):
        from kvledger.executors.cuda_backend import CudaClearBackend

        return CudaClearBackend(planes, stream=stream, mode="per_page" if name == "cuda-per-page" else "coalesced")
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
    if name == "triton-graph":
        return GraphClear(backend)
    if name == "triton-staged":
        return backend.staged()
    return backend
