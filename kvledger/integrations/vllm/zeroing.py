"""Zero vLLM block ids in vLLM's per-layer KV cache tensors with kvledger's clear backends.

vLLM 0.33 allocates one zeroed backing buffer and views it per layer as
``[B, H, N, C]`` (blocks at dim 0; the physical order is the KV cache layout's:
layer-compact ``LBHNC`` / ``LBNHC`` / ``LHBNC``, or block-outermost ``BLHNC`` /
``BLNHC`` / ``BHLNC``, where one block's tile holds every layer). Dim 0 may count
*kernel* blocks, a multiple of the manager's blocks (virtual block splitting).
Block ids are global pool indices: a block handed to a request owns its whole
tile in every layer of its group.

Recurrent layers (Mamba, linear attention) keep a tuple of states per layer (vLLM's
``MambaBase.bind_kv_cache``: conv, SSM / recurrent state, ... packed from the start of
the block's page, each ``[B, *shape]``); a tuple is taken as its states' views, so the
state groups' blocks are zeroed too (vLLM's own ``KVBlockZeroer`` skips them).

``kv_cache_planes`` turns those views into the planes a clear backend takes
(contiguous ``[num_blocks, page_bytes]`` byte tensors over the same memory, no
copy), one per contiguous run of a block's bytes:

    view [B, H, N, C] ─► bytes of block b in that view: outer dims (physically
    outside the block dim: heads under LHBNC) each start a segment; inner dims
    span  el + sum((shape_d - 1) * stride_d)  bytes from  base + b * block_stride
    each segment lies in its block's tile: block_stride bytes aligned to the storage's
    start ─► one plane [num_blocks, block_stride] per tile start (layer-compact
    layouts: each layer is its own; block-outermost ones: every layer's segment
    lies in one; a Mamba layer's states share their layer's), zeroed whole

``KVCacheZeroer(kv_caches, num_blocks, backend=...)`` builds the backend once
(``torch`` on any device, ``cuda`` or ``triton`` on CUDA; kvledger's registry)
and ``zero_block_ids(ids)`` enqueues the zeroing on the model stream: the same
call vLLM's ``KVBlockZeroer`` offers, fed with ``LedgerBlockPool``'s clear list.
Needs torch (imported when used), not vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import product
from typing import Any

from ...core.errors import ConfigurationError
from ...executors.backend import make_backend

__all__ = ["KVCacheZeroer", "kv_cache_planes"]


def _segments(t: Any, num_blocks: int) -> list[tuple[int, int, int]]:
    """(base address, manager-block stride, bytes of one block from its first byte) of each
    segment of one view; raises ``ConfigurationError`` for a view that does not index blocks at dim 0."""
    if t.dim() < 1 or t.shape[0] == 0 or t.shape[0] % num_blocks:
        raise ConfigurationError(f"a KV cache view of shape {tuple(t.shape)} does not index a multiple of "
                                 f"{num_blocks} blocks at dim 0")
    el = t.element_size()
    ratio = t.shape[0] // num_blocks
    s0 = t.stride(0) * el
    outer = [d for d in range(1, t.dim()) if t.stride(d) * el > s0 and t.shape[d] > 1]
    inner = [d for d in range(1, t.dim()) if d not in outer]
    span = el + sum((t.shape[d] - 1) * t.stride(d) * el for d in inner) + (ratio - 1) * s0
    stride = s0 * ratio
    if span > stride:
        raise ConfigurationError(f"a KV cache view of shape {tuple(t.shape)} and strides {t.stride()} overlaps "
                                 "its own blocks")
    base = t.data_ptr()
    out = []
    for idx in product(*(range(t.shape[d]) for d in outer)):
        out.append((base + sum(i * t.stride(d) * el for i, d in zip(idx, outer, strict=True)), stride, span))
    return out


def _views(kv_caches: Mapping[str, Any] | Iterable[Any]) -> list[Any]:
    """Every tensor among ``kv_caches``' values: a layer's view, or each state of a recurrent
    layer's tuple (Mamba: conv, SSM / recurrent state, ...)."""
    out: list[Any] = []
    for v in (kv_caches.values() if isinstance(kv_caches, Mapping) else kv_caches):
        if isinstance(v, (tuple, list)):
            out.extend(v)
        else:
            out.append(v)
    return out


def kv_cache_planes(kv_caches: Mapping[str, Any] | Iterable[Any], num_blocks: int) -> list[Any]:
    """Planes (contiguous uint8 ``[num_blocks, bytes]`` views, no copy) covering every block's tile in
    every given KV cache view; views that share a tile (layers of overlaid groups, a block-outermost
    block holding every layer, a Mamba layer's states) give one plane.

    A block's *tile* in a view is its block stride's run of bytes, aligned to the storage's start:
    block ``b`` owns all of it (vLLM's rule, "a newly allocated block owns its whole tile"), so a
    tile the views cover only in part (a Mamba state's padding, a block-outermost tile given only
    some layers) is zeroed whole. Raises ``ConfigurationError`` for a view that does not index
    blocks at dim 0, one whose bytes of a block leave its tile, tiles that run past their storage,
    or planes that overlap without being the same (an overlay whose block numbering differs).
    """
    import torch

    views = _views(kv_caches)
    if type(num_blocks) is not int or num_blocks < 1:
        raise ConfigurationError(f"num_blocks must be a positive int, got {num_blocks!r}")
    if not views:
        raise ConfigurationError("no KV cache views to zero")
    planes: dict[tuple[int, int, int], Any] = {}  # (storage, tile start, stride) -> a tensor of that storage
    seen: set[int] = set()
    for t in views:
        if not isinstance(t, torch.Tensor):
            raise ConfigurationError(f"a KV cache view must be a torch.Tensor, got {type(t).__name__}")
        if id(t) in seen:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        sbase = storage.data_ptr()
        for base, stride, span in _segments(t, num_blocks):
            start = sbase + (base - sbase) // stride * stride
            if base - start + span > stride:
                raise ConfigurationError(f"a KV cache view of shape {tuple(t.shape)} holds {span} bytes of a block "
                                         f"from offset {base - start} of its {stride}-byte tile: past the tile")
            if start - sbase + num_blocks * stride > storage.nbytes():
                raise ConfigurationError(f"{num_blocks} blocks of {stride} bytes run past their storage")
            planes.setdefault((sbase, start, stride), t)
    spans = sorted((start, start + num_blocks * stride, stride, sbase) for sbase, start, stride in planes)
    for (a0, a1, s0, _), (b0, _b1, s1, _) in zip(spans, spans[1:], strict=False):
        if b0 < a1:
            raise ConfigurationError(f"KV cache views overlap without sharing their block tiles ({s0}-byte tiles "
                                     f"from {a0:#x}, {s1}-byte tiles from {b0:#x}): an overlay kvledger cannot map "
                                     "to block ids")
    out: list[Any] = []
    for (sbase, start, stride), t in sorted(planes.items(), key=lambda kv: kv[0][1]):
        plane = torch.empty(0, dtype=torch.uint8, device=t.device)
        plane.set_(t.untyped_storage(), start - sbase, (num_blocks, stride), (stride, 1))
        out.append(plane)
    return out


class KVCacheZeroer:
    """Zeroes vLLM block ids in every layer of vLLM's KV cache views, with a kvledger clear backend.

    ``kv_caches``: vLLM's per-layer views (a ``{layer_name: tensor}`` mapping or a
    sequence), ``num_blocks``: the pool's blocks. ``backend``: ``torch``, ``cuda``
    or ``triton`` (``kvledger.executors.backend``); ``stream``: the model stream
    (CUDA; None: the current stream). Raises ``ConfigurationError`` for views it
    cannot cover and what ``make_backend`` raises for the backend.
    """

    def __init__(self, kv_caches: Mapping[str, Any] | Sequence[Any], num_blocks: int, *, backend: str = "torch",
                 stream: Any = None) -> None:
        self.num_blocks = num_blocks
        self.planes = kv_cache_planes(kv_caches, num_blocks)
        self.backend = make_backend(backend, self.planes, stream=stream)

    def zero_block_ids(self, block_ids: Sequence[int]) -> None:
        """Enqueue zeroing of every listed block in every plane (on the CPU: done on return).

        Raises ``PageOutOfRangeError`` / ``DuplicatePageError`` before touching any
        plane; an empty list does nothing.
        """
        if block_ids:
            self.backend.clear(block_ids)
