"""Offline export: the KV events a recorded log's run published, rebuilt by folding the log.

    open_view (verified records) ─► fold_records(apply) from seq 0 ─► apply(seq, event):
        state.fold(event) ─► effects ─► KVEventBatcher.observe ─► sink(batch) at every seal
    ─► flush the rest at the end of the log (or at ``until``)

The batches are the ones a live ``KVEventPublisher`` observing the same ledger
sent (same events, same boundaries, same seqs when it dropped none); only
``ts`` differs, because the log records no wall-clock time (the export stamps
``clock()``). ``JsonLinesSink`` writes one JSON object per batch::

    {"seq": 0, "ts": 1767225600.0, "data_parallel_rank": 0,
     "events": [{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": null,
                 "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
                 "lora_name": null}, ...]}

(field names as in the map layout; a bytes hash is a base64 string).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO, Any

import msgspec

from kvledger.core.errors import CorruptLogError, KVLedgerError
from kvledger.core.log import fold_records, open_view
from kvledger.core.state import LedgerState

from .batcher import KVEventBatcher
from .schema import MEDIUM_GPU

__all__ = ["ExportSummary", "JsonLinesSink", "export_log"]


class ExportSummary(msgspec.Struct, kw_only=True, gc=False):
    """What ``export_log`` read and produced."""

    path: str
    events: int = 0  # log events folded
    last_seq: int = -1
    batches: int = 0  # batches handed to the sink
    kv_events: int = 0  # KV events in them
    torn_at: int | None = None  # a torn tail (not exported: what a crash leaves)
    seconds: float = 0.0


class _JsonBatch(msgspec.Struct, gc=False):
    seq: int
    ts: float
    data_parallel_rank: int | None
    events: tuple[Any, ...]


class JsonLinesSink:
    """A sink writing each batch as one JSON line to ``out`` (a binary file), numbering them from 0.

    Use it with ``layout="map"`` batches so that events carry their field names.
    """

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._encode = msgspec.json.Encoder().encode
        self.seq = 0

    def __call__(self, batch) -> None:
        line = self._encode(_JsonBatch(self.seq, batch.ts, batch.data_parallel_rank, batch.events))
        self._out.write(line + b"\n")
        self.seq += 1


def export_log(path, sink: Callable[[Any], object], *, layout: str = "array", medium: str | None = MEDIUM_GPU,
               data_parallel_rank: int | None = 0, until: int | None = None,
               clock: Callable[[], float] = time.time, layer=None) -> ExportSummary:
    """Fold the log at ``path`` from seq 0 (up to seq ``until``) and hand every KV event batch to ``sink``.

    ``layout``, ``medium``, ``data_parallel_rank``, ``clock``: as for ``KVEventBatcher``.
    Raises ``LogError`` for an unreadable file, ``CorruptLogError`` for a bad header, a
    corrupt record before ``until`` (before anything reaches the sink) or an event the fold
    rejects (naming its offset and seq; the batches before it were handed over), and what
    ``sink`` raises. A torn tail is left out and reported in the summary.
    """
    t0 = time.perf_counter()
    batcher = KVEventBatcher(sink, layout=layout, medium=medium, data_parallel_rank=data_parallel_rank,
                             clock=clock, auto_flush=True)
    with open_view(path, layer=layer, until=until) as view:
        bad = view.scan.error
        if bad is not None and (until is None or bad.seq is None or until >= bad.seq):
            raise bad
        recs = view.records
        st = LedgerState()
        done = [0]  # records handled so far: recs[done[0]] holds the event being applied

        def apply(seq: int, event) -> None:
            try:
                effects = st.fold(event)
            except KVLedgerError as exc:
                rec = recs[done[0]]
                raise CorruptLogError(view.path, rec.offset, seq, f"{type(event).__name__} at seq {seq} is "
                                      f"rejected by the fold: {exc}") from exc
            batcher.observe(seq, event, effects)

        def on_record(_rec) -> None:
            done[0] += 1

        folded = fold_records(view, st, 0, until=until, apply=apply, on_record=on_record)
        batcher.flush()
        return ExportSummary(path=view.path, events=folded, last_seq=st.seq - 1, batches=batcher.batches,
                             kv_events=batcher.events, torn_at=view.scan.torn_at,
                             seconds=time.perf_counter() - t0)
