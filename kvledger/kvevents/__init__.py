"""KV events in vLLM's format: what the prefix cache holds, for routers and KV-aware load balancers.

Publishing pages under block hashes and evicting cached pages are effects of the
fold (``BlocksStored`` / ``BlocksRemoved``). This package turns them into the
events vLLM publishes, so existing consumers read kvledger unchanged:

    schema.py     the msgpack structs (BlockStored, BlockRemoved, AllBlocksCleared,
                  KVEventBatch) in vLLM's two layouts, the frame layout, encode / decode
    batcher.py    KVEventBatcher (sans-I/O): (seq, event, effects) in, one batch per step out;
                  u64 hashes, extra keys (tenant, cache salt)
    endpoints.py  vLLM's endpoint rules: bind or connect, DP-rank offset, a dialable endpoint;
                  a bind other hosts can reach only with allow_remote (the events name tenants)
    replay.py     ReplayService: the replay buffer and the answers owed, served a bounded
                  amount per turn
    publisher.py  KVEventPublisher: a ZMQ PUB socket and a replay socket, a bounded queue,
                  a background thread; ``publisher.observe`` is a ``Ledger`` observer
    config.py     make_publisher: an endpoint, vLLM's --kv-events-config JSON or a mapping
    export.py     export_log: the same batches, rebuilt offline by folding a recorded log
    cli.py        ``kvledger events LOG [--jsonl | --zmq ENDPOINT]``

Live::

    pub = KVEventPublisher(replay_endpoint="tcp://127.0.0.1:5558").start()   # binds 127.0.0.1:5557
    ledger = Ledger(geometry, observer=pub.observe)    # a batch leaves at every seal
    ...
    pub.stop()

The defaults are what vLLM 0.33 sends and its own decoder (``vllm/distributed/
kv_events.py``: ``msgspec.msgpack.Decoder(type=KVEventBatch)``) accepts; the test
suite decodes the live stream, the CLI's and a full replay with that file, taken
from vLLM 0.33.0's wheel. Per consumer:

    consumer                   settings                         what it reads
    vLLM >= 0.26 (0.33 incl.)  the defaults                     map events, u64 hashes, extra_keys,
                                                                replay [topic, seq, payload] + [b"", -1, b""]
    vLLM < 0.26 consumers      layout="array",                  positional events, replay [seq, payload]
                               replay_format="legacy"           + [-1, b""]
    Dynamo's KV indexer        the defaults (replay_format=     3 frames, 8-byte seq, i64/u64 hashes (it
      (ZMQ relay)              "legacy" where its replay        drops bytes hashes: keep hashes="u64"),
                               reader expects [seq, payload])   map or positional events
    llm-d's KV-cache indexer   topic="kv@<pod>@<model>"; the    the topic names pod and model; replays
                               defaults otherwise               carry the topic frame; token ids by block

``hashes="raw"`` sends the ledger's own hashes (16-byte bytes from
``core.hashing.block_hashes``) for a consumer that wants them; ``bind=True`` /
``False`` overrides vLLM's bind/connect rule (llm-d's centralized mode: every
publisher connects to one indexer that binds).

``import kvledger`` does not import this package, and this package imports pyzmq
only when a ``KVEventPublisher`` is made (``pip install kvledger[events]``).
"""

from .batcher import OMITTABLE, KVEventBatcher, PendingBatch, to_kv_events
from .config import make_publisher, publisher_options
from .endpoints import DEFAULT_ENDPOINT, binds, check_exposure, dialable, local_bind, offset_endpoint
from .export import ExportSummary, JsonLinesSink, export_log
from .publisher import KVEventPublisher, PublisherStatistics
from .schema import (
    HASH_FORMS,
    LAYOUTS,
    MEDIUM_GPU,
    REPLAY_FORMATS,
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
    "DEFAULT_ENDPOINT",
    "HASH_FORMS",
    "LAYOUTS",
    "OMITTABLE",
    "MEDIUM_GPU",
    "REPLAY_FORMATS",
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
    "binds",
    "check_exposure",
    "decode_batch",
    "dialable",
    "encode_batch",
    "export_log",
    "local_bind",
    "make_publisher",
    "offset_endpoint",
    "publisher_options",
    "seq_bytes",
    "seq_from_bytes",
    "to_kv_events",
]
