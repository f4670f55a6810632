"""Offline export: the KV events a recorded log's run published, rebuilt by folding the log.

    open_view (verified records; a file, a log directory, one of its segments)
      ─► start_state: seq 0, or the checkpoint the view's first segment opens with
         (retention deleted the earlier ones, or the view starts at a later segment)
      ─► fold_records(apply) ─► apply(seq, event): state.fold(event) ─► effects
           ─► KVEventBatcher.observe ─► sink(batch) at every seal
      ─► flush the rest at the end of the log (or at ``until``)

The batches are the ones a live ``KVEventPublisher`` observing the same ledger
sent (same events, same boundaries, same seqs when it dropped none); only
``ts`` differs, because the log records no wall-clock time (the export stamps
``clock()``). An export that starts at a checkpoint has no batch for what came
before it (a consumer may then see a block removed that it never saw stored);
the tenants of the requests alive at the checkpoint come from its state, so
their blocks carry the same extra keys as live.

``JsonLinesSink`` writes one batch per line in vLLM's subscriber shape (what
``msgspec.json.Decoder(type=KVEventBatch)`` of vLLM's own structs decodes)::

    [1767225600.0, [{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": null,
                     "token_ids": [...], "block_size": 16, "lora_id": null, "medium": "GPU",
                     "lora_name": null}, ...], 0]

or, with ``objects=True``, a richer object per line that also numbers the batches::

    {"seq": 0, "ts": 1767225600.0, "data_parallel_rank": 0, "events": [...]}

(events as in the map layout; a bytes hash, with ``hashes="raw"``, is a base64 string).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import IO, Any

import msgspec

from kvledger.core.errors import CorruptLogError, InvalidArgumentError, KVLedgerError
from kvledger.core.log import LogView, fold_records, open_view, start_state
from kvledger.core.state import LedgerState

from .batcher import KVEventBatcher
from .schema import MEDIUM_GPU

__all__ = ["ExportSummary", "JsonLinesSink", "export_log"]


class ExportSummary(msgspec.Struct, kw_only=True, gc=False):
    """What ``export_log`` read and produced."""

    path: str
    events: int = 0  # log events folded
    first_seq: int = 0  # the first event folded (after the starting checkpoint, if any)
    from_checkpoint: int | None = None  # the checkpoint the fold started from (None: seq 0)
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
    """A sink writing each batch as one JSON line to ``out`` (a binary file), in vLLM's
    subscriber shape ``[ts, [events], data_parallel_rank]``, or (``objects``) as an object
    with its ``seq`` (numbered from 0). Use it with ``layout="map"`` batches, whose events
    carry their field names."""

    def __init__(self, out: IO[bytes], *, objects: bool = False) -> None:
        self._out = out
        self._encode = msgspec.json.Encoder().encode
        self._objects = bool(objects)
        self.seq = 0

    def __call__(self, batch) -> None:
        doc = _JsonBatch(self.seq, batch.ts, batch.data_parallel_rank, batch.events) if self._objects else batch
        self._out.write(self._encode(doc) + b"\n")
        self.seq += 1


def _start(view: LogView, until: int | None):
    """Where the fold starts: ``(state, record index, checkpoint seq or None)``."""
    first = view.first_seq
    if until is not None and until < first:
        raise InvalidArgumentError(f"until {until} is before the first event of {view.paths[0]} "
                                   f"(seq {first}): export from an earlier segment")
    if first == 0:
        return LedgerState(), 0, None
    st, start, ck = start_state(view, at=first)
    if ck is None:
        raise CorruptLogError(view.paths[0], view.header.size, first, f"the view starts at seq {first} but "
                              "holds no checkpoint at or before it to start from")
    return st, start, ck.seq


def export_log(path, sink: Callable[[Any], object], *, layout: str = "map", medium: str | None = MEDIUM_GPU,
               data_parallel_rank: int | None = 0, until: int | None = None, hashes: str = "u64",
               clock: Callable[[], float] = time.time, layer=None, omit: Iterable[str] = ()) -> ExportSummary:
    """Fold the log at ``path`` (a file, a log directory, or one segment of one) and hand every KV
    event batch to ``sink``, up to seq ``until``.

    ``layout``, ``hashes``, ``medium``, ``data_parallel_rank``, ``clock``, ``omit``: as for
    ``KVEventBatcher``. Raises ``LogError`` for an unreadable file, ``CorruptLogError`` for a
    bad header, a corrupt record before ``until`` (before anything reaches the sink) or an
    event the fold rejects (naming its offset and seq; the batches before it were handed
    over), ``InvalidArgumentError`` for an ``until`` before the view's first event, and what
    ``sink`` raises. A torn tail is left out and reported in the summary.
    """
    t0 = time.perf_counter()
    batcher = KVEventBatcher(sink, layout=layout, medium=medium, data_parallel_rank=data_parallel_rank,
                             clock=clock, auto_flush=True, hashes=hashes, omit=omit)
    with open_view(path, layer=layer, until=until) as view:
        bad = view.scan.error
        if bad is not None and (until is None or bad.seq is None or until >= bad.seq):
            raise bad
        recs = view.records
        st, start, cp = _start(view, until)
        batcher.set_tenants({r: rec.tenant for r, rec in st.requests.items()})
        first = st.seq
        done = [start]  # records handled so far: recs[done[0]] holds the event being applied

        def apply(seq: int, event) -> None:
            try:
                effects = st.fold(event)
            except KVLedgerError as exc:
                rec = recs[done[0]]
                raise CorruptLogError(view.paths[rec.segment], rec.offset, seq, f"{type(event).__name__} at seq "
                                      f"{seq} is rejected by the fold: {exc}") from exc
            batcher.observe(seq, event, effects)

        def on_record(_rec) -> None:
            done[0] += 1

        folded = fold_records(view, st, start, until=until, apply=apply, on_record=on_record)
        batcher.flush()
        return ExportSummary(path=view.path, events=folded, first_seq=first, from_checkpoint=cp,
                             last_seq=st.seq - 1, batches=batcher.batches, kv_events=batcher.events,
                             torn_at=view.scan.torn_at, seconds=time.perf_counter() - t0)
