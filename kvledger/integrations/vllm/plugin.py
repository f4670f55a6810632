"""kvledger as a vLLM plugin: ``vllm serve`` turns it on by configuration, in every process vLLM starts.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes (the API
server, the engine cores, the workers) before it builds anything; kvledger's is
``register``. It does nothing unless configured:

    KVLEDGER_VLLM='{"log": "/var/log/kvledger", "zeroing": true}'   vllm serve MODEL ...
    KVLEDGER_VLLM_CONFIG=/etc/kvledger/vllm.json                    (the same JSON in a file)

Options: ``install()``'s (``log``, ``fsync``, ``policy``, ``zeroing``, ``on_error``,
``check``, ``verify``) and ``zeroer`` (the worker's clear backend: "auto", "triton", "cuda"
or "torch"). When configured, in every process:

    engine core   ``install(...)``: the KV cache manager vLLM builds there runs on
                  ``LedgerBlockPool``; with ``log`` a directory, each engine core (each
                  data-parallel rank) writes its own ``pool-dp<rank>-<pid>-<n>.kvlog``
    workers       with ``zeroing``: vLLM's ``KVBlockZeroer`` is kvledger's
                  ``LedgerBlockZeroer``, which zeroes the listed blocks in every layer's
                  cache, Mamba / linear-attention states included (vLLM's skips them), on
                  the model stream, with kvledger's clear backends

A configuration that cannot be read or used raises ``ConfigurationError`` naming it: vLLM
then fails to start, loudly, rather than run without the ledger it was told to run.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ...core.errors import ConfigurationError

__all__ = ["ENV", "ENV_FILE", "LedgerBlockZeroer", "config", "register"]

ENV = "KVLEDGER_VLLM"
ENV_FILE = "KVLEDGER_VLLM_CONFIG"
_OPTIONS = ("log", "fsync", "policy", "zeroing", "on_error", "check", "verify", "zeroer")
_log = logging.getLogger("kvledger.integrations.vllm")
_state: dict[str, Any] = {}


def config() -> dict | None:
    """The plugin's options from ``$KVLEDGER_VLLM`` (JSON) or the file ``$KVLEDGER_VLLM_CONFIG``
    names; None when neither is set. Raises ``ConfigurationError`` for bad JSON or an unknown option."""
    raw = os.environ.get(ENV)
    where = ENV
    if raw is None:
        path = os.environ.get(ENV_FILE)
        if not path:
            return None
        where = path
        try:
            with open(path, encoding="utf-8") as f:
                raw = f.read()
        except OSError as exc:
            raise ConfigurationError(f"kvledger's vLLM plugin cannot read {ENV_FILE}={path}: {exc}") from None
    try:
        opts = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"kvledger's vLLM plugin: {where} is not JSON: {exc}") from None
    if not isinstance(opts, dict):
        raise ConfigurationError(f"kvledger's vLLM plugin: {where} must hold a JSON object, got {opts!r:.80}")
    unknown = sorted(set(opts) - set(_OPTIONS))
    if unknown:
        raise ConfigurationError(f"kvledger's vLLM plugin: unknown option(s) {unknown} in {where}; "
                                 f"known: {list(_OPTIONS)}")
    return opts


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: install kvledger when configured (module
    docstring); once per process, however often vLLM calls it."""
    opts = config()
    if opts is None or _state.get("installed"):
        return
    from .install import install

    zeroer = opts.pop("zeroer", "auto")
    if zeroer not in ("auto", "triton", "cuda", "torch"):
        raise ConfigurationError(f"kvledger's vLLM plugin: zeroer must be auto, triton, cuda or torch, not {zeroer!r}")
    log = opts.get("log")
    if log is not None and os.path.isdir(log):
        os.environ.setdefault("KVLEDGER_VLLM_LOG_PREFIX", f"pool-dp{os.environ.get('VLLM_DP_RANK', '0')}")
    inst = install(**opts)
    _state["installed"] = inst
    if opts.get("zeroing"):
        _use_ledger_zeroer(inst, zeroer)
    _log.info("kvledger installed in vLLM (pid %d): %s", os.getpid(), opts)


def _use_ledger_zeroer(inst: Any, backend: str) -> None:
    """vLLM's model runners build ``KVBlockZeroer`` by that name: make it kvledger's (both runners)."""
    import importlib
    import sys

    LedgerBlockZeroer.backend_name = backend
    for name in ("vllm.v1.worker.utils", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        module: Any
        try:
            module = importlib.import_module(name)
        except ImportError:  # (a runner this build of vLLM cannot import here: no CUDA, no triton)
            module = sys.modules.get(name)
        if module is not None and hasattr(module, "KVBlockZeroer"):
            inst.patch(module, "KVBlockZeroer", LedgerBlockZeroer)


class LedgerBlockZeroer:
    """vLLM's ``KVBlockZeroer`` made of kvledger's ``KVCacheZeroer``: the same constructor and
    ``zero_block_ids``, over every layer's cache in the forward context (attention views and
    Mamba / linear-attention state tuples alike), on the model stream."""

    backend_name = "auto"

    def __init__(self, device: Any, attn_groups_iter: Any = None, kernel_block_sizes: Any = None,
                 static_forward_context: dict | None = None, num_blocks: int = 0,
                 runner_only_attn_layers: Any = None, **_: Any) -> None:
        from .zeroing import KVCacheZeroer

        caches = {}
        for name, layer in (static_forward_context or {}).items():
            kv = getattr(layer, "kv_cache", None)
            if kv is None or (runner_only_attn_layers and name in runner_only_attn_layers):
                continue
            if isinstance(kv, (list, tuple)) and kv and isinstance(kv[0], (list, tuple)):
                kv = kv[0]  # (a per-virtual-engine list of caches: the first)
            caches[name] = kv
        self.zeroer = KVCacheZeroer(caches, num_blocks, backend=self._backend(device)) if caches else None

    def _backend(self, device: Any) -> str:
        if self.backend_name != "auto":
            return self.backend_name
        if getattr(device, "type", str(device)) != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401

            return "triton"
        except ImportError:
            return "cuda"

    def zero_block_ids(self, block_ids: list[int]) -> None:
        if block_ids and self.zeroer is not None:
            self.zeroer.zero_block_ids(list(block_ids))
