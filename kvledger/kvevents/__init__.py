"""KV events in vLLM's format: what the prefix cache holds, for routers and KV-aware load balancers.

Publishing pages under block hashes and evicting cached pages are effects of the
fold (``BlocksStored`` / ``BlocksRemoved``). This package turns them into the
events vLLM publishes, so existing consumers read kvledger unchanged:

    schema.py     the msgpack structs (BlockStored, BlockRemoved, AllBlocksCleared,
                  KVEventBatch) in vLLM's two layouts, the frame layout, encode / decode
    batcher.py    KVEventBatcher (sans-I/O): (seq, event, effects) in, one batch per step out
    publisher.py  KVEventPublisher: a ZMQ PUB socket and a replay socket, a bounded queue,
                  a background thread; ``publisher.observe`` is a ``Ledger`` observer
    export.py     export_log: the same batches, rebuilt offline by folding a recorded log
    cli.py        ``kvledger events LOG [--jsonl | --zmq ENDPOINT]``

Live::

    pub = KVEventPublisher("tcp://*:5557", replay_endpoint="tcp://*:5558").start()
    ledger = Ledger(geometry, observer=pub.observe)    # a batch leaves at every seal
    ...
    pub.stop()

Matched field by field (our own code) against vLLM's ``vllm/distributed/kv_events.py``:

* ``"array"`` (the default; the layout issue #13 names): positional structs, events
  tagged by class name in the first slot, ``BlockStored(block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name)``: the file
  between vllm-project/vllm#27577 (``lora_name``) and #33304 (``extra_keys``), read
  at commit 92a785cb21e2b2acbd4be1dfd87e799c9c632a37 of 1CatAI/1Cat-vLLM, a vLLM
  fork whose event structs are that upstream state (the upstream snapshots we
  could read are older, b4e69e0af33f, or newer);
* ``"map"``: events as maps tagged under ``"type"`` (vllm-project/vllm#42892), the
  event structs read at vllm-project/vllm 0181ea3173e53eea8cf04a86891488e3dc89bb34,
  the batch kept positional as released vLLM sends it (vLLM 0.26.0 batches read
  ``[ts, [{"type": "BlockStored", ...}], 0]``; that commit's file declares the
  batch without ``array_like``).

The PUB framing, the replay protocol and its end marker are the same in every
version read (publisher.py).

``import kvledger`` does not import this package, and this package imports pyzmq
only when a ``KVEventPublisher`` is made (``pip install kvledger[events]``).
"""

from .batcher import KVEventBatcher, PendingBatch, to_kv_events
from .export import ExportSummary, JsonLinesSink, export_log
from .publisher import KVEventPublisher, PublisherStatistics
from .schema import (
    LAYOUTS,
    MEDIUM_GPU,
    SEQ_END,
    AllBlocksCleared,
    AllBlocksClearedMap,
    BlockRemoved,
    BlockRemovedMap,
    BlockStored,
    BlockStoredMap,
    KVEventBatch,
    KVEventBatchMap,
    decode_batch,
    encode_batch,
    seq_bytes,
    seq_from_bytes,
)

__all__ = [
    "LAYOUTS",
    "MEDIUM_GPU",
    "SEQ_END",
    "AllBlocksCleared",
    "AllBlocksClearedMap",
    "BlockRemoved",
    "BlockRemovedMap",
    "BlockStored",
    "BlockStoredMap",
    "ExportSummary",
    "JsonLinesSink",
    "KVEventBatch",
    "KVEventBatchMap",
    "KVEventBatcher",
    "KVEventPublisher",
    "PendingBatch",
    "PublisherStatistics",
    "decode_batch",
    "encode_batch",
    "export_log",
    "seq_bytes",
    "seq_from_bytes",
    "to_kv_events",
]
