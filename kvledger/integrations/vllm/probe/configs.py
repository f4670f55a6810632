"""The probe's hybrid configurations, planned and allocated by vLLM's own code, and the scheduler over them.

    align   a full-attention group (fp16) + a Mamba group (fp32 states, mamba_cache_mode="align"),
            prefix caching on: Mamba states are cached at block boundaries and copied block to block
    none    the same groups, mamba_cache_mode="none" (one state block per request), no prefix caching
    mixed   a full-attention group in fp16 + a sliding-window group in fp32: two precisions over
            one pool (``KVCacheConfig.has_mixed_precision_kv_cache``), prefix caching on

Every group has one layer (each layer index of an overlaid model repeats the same byte
picture), all pages the same size (vLLM pads the Mamba page to the attention page).
``kv_cache_config`` plans the ``KVCacheTensor``s with vLLM's ``get_kv_cache_config_from_groups``
(layer-compact ``LBHNC``: the groups alias from byte 0); ``allocate`` views one CPU buffer per
layer with vLLM's ``allocate_kv_cache``, and splits each Mamba layer's page into its states as
vLLM's ``MambaBase.bind_kv_cache`` does (packed from the page's start).

``scheduler`` builds vLLM's ``Scheduler`` with vLLM's own ``create_scheduler`` (tests/v1/core/utils.py):
that utility makes a one-group ``KVCacheConfig`` and a ``CacheConfig`` without a Mamba mode, so
for the duration of the call its module's two names are bound to callables that return the
hybrid config and add the Mamba mode and layout. Everything else is vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

__all__ = ["BLOCK_SIZE", "PAGE_BYTES", "Planned", "allocate", "kv_cache_config", "scheduler"]

BLOCK_SIZE = 16  # tokens per block, every group
PAGE_BYTES = 4096  # bytes per block per layer: 2 heads x 16 tokens x (K + V: 2 x 32) x fp16
LAYOUT = "LBHNC"
MAX_MODEL_LEN = 2048


@dataclass
class Planned:
    """A configuration: vLLM's ``KVCacheConfig``, each group's (kind, dtype name), the Mamba mode."""

    name: str
    config: Any  # vllm.v1.kv_cache_interface.KVCacheConfig
    kinds: list[tuple[str, str]]  # per group: ("attention" | "mamba", dtype name)
    mamba_mode: str | None
    caching: bool


def _specs(name: str) -> tuple[dict[str, Any], list[list[str]], str | None]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    attn16 = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float16)
    assert attn16.page_size_bytes == PAGE_BYTES
    if name == "mixed":
        swa32 = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=32, dtype=torch.float32,
                                  sliding_window=96)
        assert swa32.page_size_bytes == PAGE_BYTES
        return {"attn.0": attn16, "swa.0": swa32}, [["attn.0"], ["swa.0"]], None
    mode = "align" if name == "align" else "none"
    # "none": one state block per request (vLLM sizes a Mamba block to max_model_len there)
    mamba = MambaSpec(block_size=BLOCK_SIZE if mode == "align" else MAX_MODEL_LEN, shapes=((3, 64), (2, 16, 16)),
                      dtypes=(torch.float32, torch.float32), page_size_padded=PAGE_BYTES, mamba_cache_mode=mode,
                      num_speculative_blocks=0)
    return {"attn.0": attn16, "mamba.0": mamba}, [["attn.0"], ["mamba.0"]], mode


def kv_cache_config(utils: Any, name: str, num_blocks: int) -> Planned:
    """Plan configuration ``name`` over ``num_blocks`` blocks with vLLM's planner (no kvledger
    pool is made: the scheduler this builds to get a ``VllmConfig`` is dropped before it returns)."""
    from vllm.v1.core.kv_cache_planning import create_kv_cache_group_specs, get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import MambaSpec

    specs, grouped, mode = _specs(name)
    groups = create_kv_cache_group_specs(specs, grouped)
    vllm_config = _vllm_config(utils, num_blocks, mode)
    config = get_kv_cache_config_from_groups(vllm_config, groups, available_memory=1 << 40)
    config.kv_cache_layout = LAYOUT
    kinds = [("mamba" if isinstance(g.kv_cache_spec, MambaSpec) else "attention",
              _dtype_name(g.kv_cache_spec)) for g in groups]
    return Planned(name, config, kinds, mode, caching=name != "none")


def _dtype_name(spec: Any) -> str:
    dtype = getattr(spec, "dtype", None) or spec.dtypes[0]
    return str(dtype).removeprefix("torch.")


def _vllm_config(utils: Any, num_blocks: int, mode: str | None) -> Any:
    with _patched(utils, None, mode, num_blocks):
        sched = utils.create_scheduler(num_blocks=num_blocks, block_size=BLOCK_SIZE)
    return sched.vllm_config


class _patched:
    """``create_scheduler`` with its module's ``KVCacheConfig`` / ``CacheConfig`` names bound for one call."""

    def __init__(self, utils: Any, config: Any, mode: str | None, num_blocks: int) -> None:
        self.utils, self.config, self.mode, self.num_blocks = utils, config, mode, num_blocks

    def __enter__(self) -> None:
        utils, config, mode, n = self.utils, self.config, self.mode, self.num_blocks
        self.saved = utils.KVCacheConfig, utils.CacheConfig
        cache_config_cls = utils.CacheConfig

        def cache_config(**kwargs: Any) -> Any:
            if mode is not None:
                kwargs["mamba_cache_mode"] = mode
            cc = cache_config_cls(**kwargs)
            cc.num_gpu_blocks_override = n
            cc.kv_cache_layout = LAYOUT
            return cc

        utils.CacheConfig = cache_config
        if config is not None:
            utils.KVCacheConfig = lambda **kwargs: config

    def __exit__(self, *exc: object) -> None:
        self.utils.KVCacheConfig, self.utils.CacheConfig = self.saved


def scheduler(utils: Any, planned: Planned, *, async_scheduling: bool, max_num_seqs: int = 24,
              max_num_batched_tokens: int = 384, max_model_len: int = MAX_MODEL_LEN) -> Any:
    """vLLM's ``Scheduler`` (``AsyncScheduler`` with ``async_scheduling``) over ``planned``'s config,
    built by vLLM's ``create_scheduler``. With kvledger installed, its pool is a ledger pool."""
    # the scheduler's block size is its granularity, a multiple of every group's (a "none" Mamba block
    # spans max_model_len tokens)
    block = max(g.kv_cache_spec.block_size for g in planned.config.kv_cache_groups)
    with _patched(utils, planned.config, planned.mamba_mode, planned.config.num_blocks):
        return utils.create_scheduler(num_blocks=planned.config.num_blocks, block_size=block,
                                      enable_prefix_caching=planned.caching, async_scheduling=async_scheduling,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len)


def allocate(planned: Planned) -> tuple[Any, dict[str, Any]]:
    """One zeroed CPU buffer for the config's tensors (vLLM's ``allocate_kv_cache``) and every layer's
    cache: a ``[B, H, N, C]`` view for attention, a tuple of state views for Mamba (as
    ``MambaBase.bind_kv_cache`` splits the page). Returns (the raw buffer, {layer: cache})."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    config = planned.config
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[LAYOUT])
    caches: dict[str, Any] = {}
    raw = None
    for gid, group in enumerate(config.kv_cache_groups):
        for layer in group.layer_names:
            view = views[layer]
            raw = view.untyped_storage()
            if planned.kinds[gid][0] == "mamba":
                spec = group.kv_cache_spec
                pages = view.view(torch.uint8)[:, 0, 0, :]  # [B, 1, 1, C] int8 -> [B, C]
                states, offset = [], 0
                for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
                    nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
                    states.append(pages[:, offset : offset + nbytes].view(dtype).view(-1, *shape))
                    offset += nbytes
                caches[layer] = tuple(states)
            else:
                caches[layer] = view
    return raw, caches
