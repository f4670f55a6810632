"""vLLM's own KV block zeroer, read from the pinned vLLM files at run time, over kvledger's planes.

``bench_gpu.py`` times it beside kvledger's clear on the same planes and ids. Nothing of
vLLM is committed or restated here: ``vllm/v1/worker/utils.py`` (its Triton kernel
``_zero_kv_blocks_kernel`` and its ``KVBlockZeroer``: the address table its ``__init__``
builds and the launch ``zero_block_ids`` makes) and ``vllm/utils/torch_utils.py``
(``async_tensor_h2d``, which that launch calls to put the ids on the device) are read from
vLLM 0.33.0 as ``tests/support/upstream.py`` fetches it (``$KVLEDGER_UPSTREAM_CACHE``: a
device host with no network gets the two files carried in that cache). Only those three
definitions are taken out of the files (``ast``), compiled with their own line numbers
against the real file name, so Triton reads the kernel's source from the file itself; the
names they use from the rest of vLLM are given: ``triton``/``tl``/``torch``/``np`` (the
packages themselves), ``PIN_MEMORY = True`` (what vLLM computes on a CUDA host) and
``AttentionSpec``, a stand-in class the groups' specs are made of (the zeroer only checks
``isinstance`` and reads ``block_size``).

    zeroer = VllmZeroer.over(planes)      vLLM's __init__ over one attention group whose
                                          layers are the planes ([blocks, bytes] each)
    zeroer.clear(ids)                     vLLM's zero_block_ids(ids): async_tensor_h2d on
                                          torch's current stream, then its kernel launch
"""

from __future__ import annotations

import __future__
import ast
import itertools
import math
import os
import sys
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

__all__ = ["VllmZeroer", "vllm_files"]

UTILS = "vllm/v1/worker/utils.py"
TORCH_UTILS = "vllm/utils/torch_utils.py"
TAKEN = {UTILS: ("_zero_kv_blocks_kernel", "KVBlockZeroer"), TORCH_UTILS: ("async_tensor_h2d",)}


def vllm_files() -> dict[str, str]:
    """The pinned files' paths, by member name (``tests/support/upstream.py``; the repository root
    is put on ``sys.path`` for it). Raises ``UpstreamUnavailable`` where they cannot be had."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.append(root)  # (appended: the mapped kvledger package stays first)
    from tests.support import upstream

    return {member: str(upstream.wheel_file(member)) for member in TAKEN}


class _AttentionSpec:
    """Stands for vLLM's ``AttentionSpec`` in the zeroer's ``isinstance`` check."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size


def _load(paths: dict[str, str]) -> dict[str, Any]:
    """Compile the taken definitions out of the pinned files; their namespace."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    ns: dict[str, Any] = {"__name__": "vllm_pinned", "triton": triton, "tl": tl, "torch": torch, "np": np,
                          "math": math, "iprod": itertools.product, "Iterable": Iterable, "Sequence": Sequence,
                          "Any": Any, "PIN_MEMORY": True, "AttentionSpec": _AttentionSpec}
    for member in (TORCH_UTILS, UTILS):  # async_tensor_h2d first: zero_block_ids calls it
        path = paths[member]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        wanted = TAKEN[member]
        body = [node for node in tree.body
                if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in wanted]
        missing = set(wanted) - {node.name for node in body}
        if missing:
            raise RuntimeError(f"{member} of the pinned vLLM has no {sorted(missing)}")
        code = compile(ast.Module(body=body, type_ignores=[]), path, "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        exec(code, ns)  # noqa: S102  (vLLM's own code, pinned and hash-checked by tests/support/upstream)
    return ns


class VllmZeroer:
    """vLLM's ``KVBlockZeroer`` built by its own ``__init__`` over ``planes`` (module docstring)."""

    def __init__(self, zeroer: Any, kernel: Any, paths: dict[str, str]) -> None:
        self.zeroer, self.kernel, self.paths = zeroer, kernel, paths
        self.clear = zeroer.zero_block_ids

    @classmethod
    def over(cls, planes: Sequence[Any], paths: dict[str, str] | None = None) -> VllmZeroer:
        """One group of layers ``layer.0`` .. over ``planes`` (each ``[num_blocks, ...]``, one block
        a page), block size 16 tokens, kernel blocks = manager blocks."""
        paths = paths or vllm_files()
        ns = _load(paths)
        num_blocks = int(planes[0].shape[0])
        names = [f"layer.{i}" for i in range(len(planes))]
        group = SimpleNamespace(kv_cache_spec=_AttentionSpec(16), kv_cache_group_id=0, layer_names=names,
                                kernel_block_stride=None)
        context = {name: SimpleNamespace(kv_cache=p) for name, p in zip(names, planes, strict=True)}
        zeroer = ns["KVBlockZeroer"](planes[0].device, [group], [16], context, num_blocks)
        return cls(zeroer, ns["_zero_kv_blocks_kernel"], paths)
