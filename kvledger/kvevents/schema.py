"""KV events on the wire, in vLLM's msgpack format: the structs, the framing, encode and decode.

Matched field by field against vLLM's ``vllm/distributed/kv_events.py`` (our own code;
the package docstring names what was read; the conformance tests decode our bytes
with vLLM 0.33.0's own file). Two layouts, one per vLLM era:

``"map"`` (the default: what vLLM 0.26 and later, 0.33 included, send and decode):
the batch is an array, each event a msgpack map of its named fields with the tag
under ``"type"``::

    EventBatch        [ts: float64, events: [event, ...], data_parallel_rank: int]
    BlockStored       {"type": "BlockStored", "block_hashes": [u64, ...], "parent_block_hash": u64 | nil,
                       "token_ids": [int, ...], "block_size": int, "lora_id": int | nil,
                       "medium": str | nil, "lora_name": str | nil,
                       "extra_keys": [[key, ...] | nil, ...]}      (only when some block has keys)
    BlockRemoved      {"type": "BlockRemoved", "block_hashes": [u64, ...], "medium": str | nil}
    AllBlocksCleared  {"type": "AllBlocksCleared"}

``extra_keys`` (vLLM 0.33's field) holds, per block, what separates equal token
prefixes: the LoRA name, the tenant, the caller's cache salt (``batcher``). A vLLM
pool's blocks (``integrations.vllm``) carry the cache-spec fields both 0.33 and 0.34
define instead of a tenant key::
                      "group_idx": int, "kv_cache_spec_kind": str,      (the KV cache group that
                      "kv_cache_spec_sliding_window": int,               wrote them; the window
                      "session_id": str                                  only for one; the vLLM
                                                                         request's id)
Fields left None are omitted (``omit_defaults``), as is ``extra_keys`` when no block has
any; ``locality``, ``ownership`` and ``lookahead_token_ids`` are never sent, and a
``BlockRemoved`` carries no ``group_idx`` (an eviction does not name the group).

``"array"`` (``layout="array"``, for consumers of the vLLM releases before 0.26):
every struct is ``array_like``, so a struct is a msgpack array of its fields in
declaration order, and an event is tagged by its class name in the first slot::

    BlockStored       ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                       lora_id, medium, lora_name]
    BlockRemoved      ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared  ["AllBlocksCleared"]

(no ``extra_keys``: that era's decoders read 8 slots). Hashes are u64 ints by default
(``batcher``: ``core.hashing.to_u64``, vLLM's fold), or the ledger's own ints / bytes
(``hashes="raw"``); decoding accepts any msgpack int or bytes. Fields are tuples here
(frozen structs); msgpack arrays either way. A ``data_parallel_rank`` of None is nil.

A batch travels on a ZMQ PUB socket as three frames; a replay answer as three
(vLLM 0.33, the default) or two (``replay_format="legacy"``, vLLM before 0.26)::

    PUB       [topic (utf-8, "" by default), seq (8 bytes, big-endian), payload (msgpack EventBatch)]
    replay    request: [seq (8 bytes, big-endian)]   (on a DEALER / REQ socket; ROUTER sees [id, b"", seq])
      "vllm"    answer:  [topic, seq, payload] for every buffered batch with seq >= the requested one,
                         then [b"", SEQ_END, b""]
      "legacy"  answer:  [seq, payload] ..., then [SEQ_END, b""]
              (SEQ_END = -1 as 8 signed big-endian bytes: ff ff ff ff ff ff ff ff)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from kvledger.core.errors import InvalidArgumentError

__all__ = [
    "HASH_FORMS",
    "LAYOUTS",
    "REPLAY_FORMATS",
    "MEDIUM_GPU",
    "SEQ_END",
    "AllBlocksCleared",
    "AllBlocksClearedMap",
    "BlockRemoved",
    "BlockRemovedMap",
    "BlockStored",
    "BlockStoredMap",
    "KVEventBatch",
    "KVEventBatchMap",
    "Layout",
    "check_choice",
    "decode_batch",
    "encode_batch",
    "get_layout",
    "seq_bytes",
    "seq_from_bytes",
]

MEDIUM_GPU = "GPU"  # vLLM's MEDIUM_GPU: where the blocks live
HASH_FORMS = ("u64", "raw")  # block hashes on the wire: vLLM's u64 fold (default), or the ledger's own
REPLAY_FORMATS = ("vllm", "legacy")  # replay answers: [topic, seq, payload] (vLLM >= 0.26), or [seq, payload]
SEQ_END = (-1).to_bytes(8, "big", signed=True)  # the replay answer's end marker

WireHash = int | bytes  # vLLM's ExternalBlockHash (bytes | int); unbounded int so vLLM's u64 hashes decode


# ---------------------------------------------------------------------- "array": positional (vLLM < 0.26)


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    pass


class BlockStored(_ArrayEvent, frozen=True, tag="BlockStored"):
    """Full blocks entered the prefix cache (a ``BlocksStored`` effect; ``block_size`` = page_tokens)."""

    block_hashes: tuple[WireHash, ...]
    parent_block_hash: WireHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_ArrayEvent, frozen=True, tag="BlockRemoved"):
    """Blocks left the prefix cache (a ``BlocksRemoved`` effect: cached pages evicted)."""

    block_hashes: tuple[WireHash, ...]
    medium: str | None


class AllBlocksCleared(_ArrayEvent, frozen=True, tag="AllBlocksCleared"):
    """Every block of this publisher is gone (kvledger: a new cache was configured)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """vLLM's ``EventBatch`` / ``KVEventBatch``: the events of one step, stamped with ``ts`` (seconds)."""

    ts: float
    events: tuple[BlockStored | BlockRemoved | AllBlocksCleared, ...]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------------- "map": named fields (vLLM >= 0.26)


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, frozen=True, tag_field="type"):
    pass


class BlockStoredMap(_MapEvent, frozen=True, tag="BlockStored"):
    """``BlockStored`` as a tagged map (``BlockStored``'s fields in order, then vLLM 0.33's
    ``extra_keys``: one entry per block, a tuple of keys or None; None (left out) when no
    block has keys)."""

    block_hashes: tuple[WireHash, ...]
    parent_block_hash: WireHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    # vLLM's cache-spec metadata (its 0.33 and 0.34 decoders read them; left out when unknown):
    # the KV cache group that wrote the blocks, its kind and window, and the request's id
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    session_id: str | None = None


class BlockRemovedMap(_MapEvent, frozen=True, tag="BlockRemoved"):
    block_hashes: tuple[WireHash, ...]
    medium: str | None


class AllBlocksClearedMap(_MapEvent, frozen=True, tag="AllBlocksCleared"):
    pass


class KVEventBatchMap(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The batch of the map layout: still positional, its events maps."""

    ts: float
    events: tuple[BlockStoredMap | BlockRemovedMap | AllBlocksClearedMap, ...]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------------- layouts, framing, codec


class Layout(NamedTuple):
    """The struct classes of one layout and a decoder for its batches."""

    name: str
    stored: type
    removed: type
    cleared: type
    batch: type
    decoder: msgspec.msgpack.Decoder


LAYOUTS: dict[str, Layout] = {
    "map": Layout("map", BlockStoredMap, BlockRemovedMap, AllBlocksClearedMap, KVEventBatchMap,
                  msgspec.msgpack.Decoder(KVEventBatchMap)),
    "array": Layout("array", BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch,
                    msgspec.msgpack.Decoder(KVEventBatch)),
}

_encoder = msgspec.msgpack.Encoder()


def get_layout(name: str) -> Layout:
    """The layout called ``name`` (``"map"`` or ``"array"``); ``InvalidArgumentError`` otherwise."""
    got = LAYOUTS.get(name) if type(name) is str else None
    if got is None:
        raise InvalidArgumentError(f"KV event layout must be one of {tuple(LAYOUTS)}, got {name!r}")
    return got


def encode_batch(batch) -> bytes:
    """The msgpack payload of a batch (either layout). Raises ``InvalidArgumentError`` for
    something that is not a batch or holds values msgpack cannot carry (an int past 64 bits)."""
    if type(batch) is not KVEventBatch and type(batch) is not KVEventBatchMap:
        raise InvalidArgumentError(f"not a KV event batch: {type(batch).__name__}")
    try:
        return _encoder.encode(batch)
    except (TypeError, OverflowError) as exc:
        raise InvalidArgumentError(f"cannot encode KV event batch: {exc}") from None


def decode_batch(payload: bytes, layout: str = "map"):
    """Decode a payload into a batch of ``layout``'s structs, checking every field's type.

    Untrusted bytes raise only ``InvalidArgumentError`` (naming the problem); nothing else.
    """
    decoder = get_layout(layout).decoder
    try:
        return decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise InvalidArgumentError(f"not a {layout!r} KV event batch: {exc}") from None


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number as its frame: 8 bytes, big-endian, unsigned."""
    return seq.to_bytes(8, "big")


def seq_from_bytes(frame: bytes) -> int:
    """The sequence number of a seq frame (``SEQ_END`` reads as -1); ``InvalidArgumentError``
    unless it is 8 bytes."""
    if len(frame) != 8:
        raise InvalidArgumentError(f"a seq frame is 8 bytes, got {len(frame)}")
    if frame == SEQ_END:
        return -1
    return int.from_bytes(frame, "big")


def check_choice(value, choices: tuple[str, ...], what: str) -> str:
    """``value`` if it is one of ``choices``; ``InvalidArgumentError`` naming them otherwise."""
    if type(value) is not str or value not in choices:
        raise InvalidArgumentError(f"{what} must be one of {choices}, got {value!r}")
    return value
