"""What the CUDA backends share about a rank's planes and its stream (``cuda``, ``triton``, and
the Triton check ``triton_verify``): the planes as device pointers and page sizes, checked
once (``describe_planes``), and a stream's raw handle (``stream_handle``).

A module of its own so that the backends and the check import it, and not each other
(``cuda_backend`` loads ``triton_verify`` for its sanitizer; ``triton_verify`` needs only
this). It imports torch at import time, as the backends do; ``import kvledger`` never
imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..core.errors import ConfigurationError

__all__ = ["PlaneLayout", "describe_planes", "stream_handle"]


class PlaneLayout(NamedTuple):
    """Where the cache planes of one rank live: one device, one page count, per-plane bytes."""

    device: int  # CUDA device ordinal
    num_pages: int
    ptrs: tuple[int, ...]  # base address of each plane
    page_bytes: tuple[int, ...]  # bytes of one page in each plane (= the page stride)


def describe_planes(planes: Sequence[torch.Tensor]) -> PlaneLayout:
    """Check that ``planes`` are usable cache planes and describe them.

    Each plane must be a contiguous CUDA tensor of shape ``[num_pages, ...]``
    (any dtype, at least one byte per page); all planes must share one device
    and ``num_pages``. Raises ConfigurationError naming the first bad plane;
    nothing is allocated or enqueued.
    """
    try:
        planes = tuple(planes)
    except TypeError:
        raise ConfigurationError(f"planes must be a sequence of CUDA tensors, got {planes!r}") from None
    if not planes:
        raise ConfigurationError("at least one cache plane is needed")
    device, num_pages = _check_plane(0, planes[0])
    ptrs = []
    page_bytes = []
    for i, t in enumerate(planes):
        dev, n = _check_plane(i, t)
        if dev != device:
            raise ConfigurationError(f"plane {i} is on cuda:{dev}, plane 0 on cuda:{device}")
        if n != num_pages:
            raise ConfigurationError(f"plane {i} has {n} pages, plane 0 has {num_pages}")
        pb = t[0].numel() * t.element_size()
        if pb < 1:
            raise ConfigurationError(f"plane {i} has zero bytes per page (shape {tuple(t.shape)})")
        ptrs.append(int(t.data_ptr()))
        page_bytes.append(int(pb))
    if num_pages >= 1 << 31:
        raise ConfigurationError(f"num_pages {num_pages} does not fit a 32-bit page id")
    return PlaneLayout(device, num_pages, tuple(ptrs), tuple(page_bytes))


def _check_plane(i: int, t: Any) -> tuple[int, int]:
    """``(device ordinal, num_pages)`` of plane ``i``: a contiguous CUDA tensor ``[num_pages >= 1, ...]``."""
    if not isinstance(t, torch.Tensor):
        raise ConfigurationError(f"plane {i} is a {type(t).__name__}, not a torch.Tensor")
    if t.device.type != "cuda":
        raise ConfigurationError(f"plane {i} is on {t.device}; the cuda and triton backends need CUDA planes")
    if t.dim() < 1 or t.shape[0] < 1:
        raise ConfigurationError(
            f"plane {i} has shape {tuple(t.shape)}; expected [num_pages, ...] with num_pages >= 1"
        )
    if not t.is_contiguous():
        raise ConfigurationError(f"plane {i} is not contiguous (strides {t.stride()})")
    return int(t.device.index or 0), int(t.shape[0])


def stream_handle(stream: Any) -> int:
    """The raw CUstream handle (int) of a torch stream, a ``__cuda_stream__`` object, a CUstream or an int."""
    if isinstance(stream, torch.cuda.Stream):
        return int(stream.cuda_stream)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    try:
        return int(stream)  # cuda.bindings CUstream
    except (TypeError, ValueError):
        raise ConfigurationError(
            f"stream must be a torch.cuda.Stream, a CUstream or a raw handle, got {stream!r}"
        ) from None
