"""vLLM's KV cache groups in the ledger's terms: each group's tenant, and which groups hold recurrent states.

vLLM's hybrid KV cache overlays its groups on the same bytes (``KVCacheTensor``:
"a block ID is owned by one group at a time"). A block's bytes mean something only
to the group, and the precision, that wrote them: fp32 Mamba state read as fp16 KV,
or fp32 KV read as fp16, is the seed's failure (NaN under a mask). So every hold a
group makes carries the group as its ledger *tenant*, and the ``groups`` policy
(the ledger's ``cross_tenant``) lists a block for a clear exactly when it moves to
another tenant:

    tenant  "g<id>:<kind>:<dtype>"      e.g. "g0:full_attention:float16", "g1:mamba:float32"

A recurrent state's group (Mamba, linear attention: a ``MambaSpec``) also reads a
request's first state block before it writes it, so those commits read the whole
page (``PagesCommitted.reads="whole"``).

A group whose kind the policy cannot reason about is refused, naming it: its bytes
might be read in ways the tenant rule does not cover. Pure; needs no vLLM (specs
are judged by their class names and fields).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...core.errors import ConfigurationError

__all__ = ["KINDS", "STATE_KINDS", "group_tenants", "spec_kind"]

# vLLM's KVCacheSpec classes (most specific first along a class's MRO) -> the kind the ledger names
KINDS = {
    "SlidingWindowMLASpec": "sliding_window_mla",
    "HiddenStateCacheSpec": "hidden_state",
    "MLAAttentionSpec": "mla_attention",
    "SinkFullAttentionSpec": "sink_full_attention",
    "RSWASpec": "rswa",
    "FullAttentionSpec": "full_attention",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
    "CircularBufferSpec": "circular_buffer",
    "SlidingWindowSpec": "sliding_window",
    "EncoderOnlyAttentionSpec": "encoder_only_attention",
    "CrossAttentionSpec": "cross_attention",
    "MambaSpec": "mamba",
    # HiSparse's device-side copies of host-resident KV (hot pages, resident pages): KV bytes, read as KV
    "HiSparseHotSpec": "hisparse_hot",
    "HiSparseResidentSpec": "hisparse_resident",
}
STATE_KINDS = frozenset({"mamba"})  # a request reads its first state block before it writes it


def spec_kind(spec: Any) -> str:
    """The kind of one layer's spec (``KINDS``); a uniform-type group's, when all its layers agree.
    Raises ``ConfigurationError`` naming a spec class no kind is known for."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:  # UniformTypeKVCacheSpecs: one spec per layer
        kinds = {spec_kind(s) for s in inner.values()}
        if len(kinds) != 1:
            raise ConfigurationError(f"a KV cache group mixes layer kinds {sorted(kinds)}: kvledger's clear "
                                     "policy cannot tell which bytes each layer reads")
        return kinds.pop()
    for cls in type(spec).__mro__:
        kind = KINDS.get(cls.__name__)
        if kind is not None:
            return kind
    raise ConfigurationError(f"kvledger's clear policy does not know the KV cache spec {type(spec).__name__} "
                             f"({spec!r:.200}): refusing to guess which of its blocks must be zeroed")


def _dtype(spec: Any) -> str:
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        names = sorted({_dtype(s) for s in inner.values()})
        return "+".join(names)
    dtype = getattr(spec, "dtype", None)
    if dtype is None:
        dtypes = getattr(spec, "dtypes", None) or ()
        return "+".join(sorted({str(d).removeprefix("torch.") for d in dtypes})) or "?"
    quant = getattr(spec, "kv_quant_mode", None)
    name = str(dtype).removeprefix("torch.")
    qname = getattr(quant, "name", None)
    return f"{name}/{qname.lower()}" if qname not in (None, "NONE") else name


def group_tenants(kv_cache_groups: Iterable[Any]) -> tuple[dict[int, str], set[int]]:
    """``({group id: tenant}, {ids of the groups that hold recurrent states})`` for vLLM's
    ``KVCacheConfig.kv_cache_groups``. Raises ``ConfigurationError`` naming a group of a kind
    the policy does not know."""
    tenants: dict[int, str] = {}
    states: set[int] = set()
    for gid, group in enumerate(kv_cache_groups):
        spec = group.kv_cache_spec
        try:
            kind = spec_kind(spec)
        except ConfigurationError as exc:
            raise ConfigurationError(f"KV cache group {gid} (layers {list(group.layer_names)[:4]}): {exc}") from None
        tenants[gid] = f"g{gid}:{kind}:{_dtype(spec)}"
        if kind in STATE_KINDS:
            states.add(gid)
    return tenants, states
