"""kvledger inside vLLM: a block pool vLLM's own KV cache manager runs on.

    from kvledger.integrations.vllm import install

    with install(log="vllm.kvlog") as inst:      # before vLLM builds its KVCacheManager
        ...                                      # vLLM as usual; every block transition is an event
    # kvledger replay vllm.kvlog ; kvledger audit vllm.kvlog --page 7 ; --check

* ``install(...)`` / ``Installation``: every vLLM ``BlockPool`` made afterwards is a
  ``LedgerBlockPool`` (``install.py``).
* ``LedgerBlockPool``: vLLM's ``BlockPool`` with each transition a ledger event;
  ``take_block_ids_to_zero()`` gives the step's clear list in vLLM's block ids
  (``pool.py``; the mapping of references to ledger requests: ``holds.py``).
* ``KVCacheZeroer``: zeroes block ids in vLLM's per-layer KV cache tensors with
  kvledger's clear backends, on the model stream (``zeroing.py``).

Needs vLLM (the ``vllm`` extra, versions in ``VLLM_VERSIONS``) only for the pool;
``import kvledger.integrations.vllm`` itself imports neither vLLM nor torch.
"""

from __future__ import annotations

from .install import VLLM_VERSIONS, Installation, install

_LAZY = {
    "LedgerBlockPool": ("kvledger.integrations.vllm.pool", "LedgerBlockPool"),
    "PoolOptions": ("kvledger.integrations.vllm.pool", "PoolOptions"),
    "KVCacheZeroer": ("kvledger.integrations.vllm.zeroing", "KVCacheZeroer"),
    "kv_cache_planes": ("kvledger.integrations.vllm.zeroing", "kv_cache_planes"),
    "PageHolds": ("kvledger.integrations.vllm.holds", "PageHolds"),
}

__all__ = ["VLLM_VERSIONS", "Installation", "install", *_LAZY]


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value
