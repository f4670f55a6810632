"""From the fold's effects to KV event batches: sans-I/O, shared by the live publisher and the export.

    Ledger._submit ─► observer(seq, event, effects) ─► KVEventBatcher.observe: collect
                        effects   BlocksStored, BlocksRemoved (the objects, as they are)
                        event     CacheConfigured ─► AllBlocksCleared (a new cache starts empty)
                                  StepSealed ─► close the batch (auto_flush), stamped clock()
                    ─► build: BlocksStored ─► BlockStored (block_size = page_tokens, medium)
                              BlocksRemoved ─► BlockRemoved (medium)
                    ─► sink(KVEventBatch(ts, events, data_parallel_rank))
                       (deferred: sink(PendingBatch(ts, effects)); the consumer builds it)

One batch per step, as vLLM publishes one per scheduler step: the events folded
since the previous seal (the publishes of the step that just completed, the
evictions made while scheduling the next one) close when the next step is
sealed, i.e. before it runs. A batch is never empty. ``flush()`` closes one
early (and ``stop()`` of the publisher closes the last one). The boundaries at
seals come from the log, so exporting a recorded log yields the same batches
the live run sent when nothing else flushed; an explicit ``flush()`` is not in
the log and moves a boundary, never an event.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from kvledger.core.errors import InvalidArgumentError
from kvledger.core.events.events import BlocksRemoved, BlocksStored, CacheConfigured, StepSealed

from .schema import MEDIUM_GPU, Layout, get_layout

__all__ = ["KVEventBatcher", "PendingBatch", "to_kv_events"]


def _check_medium(medium) -> None:
    if medium is not None and type(medium) is not str:
        raise InvalidArgumentError(f"medium must be a str or None, got {medium!r}")


def to_kv_events(effects: Iterable, *, medium: str | None = MEDIUM_GPU, layout: str = "array") -> list:
    """The KV events of some effects, in order: ``BlocksStored`` -> ``BlockStored``,
    ``BlocksRemoved`` -> ``BlockRemoved``; every other effect (``ClearPages``,
    ``StepPlan``) has none. Raises ``InvalidArgumentError`` for a bad layout or medium."""
    _check_medium(medium)
    lay = get_layout(layout)
    out: list = []
    _convert(effects, lay, medium, out)
    return out


_CLEARED = object()  # collected for a CacheConfigured: AllBlocksCleared


def _convert(effects: Iterable, lay: Layout, medium: str | None, out: list) -> None:
    stored, removed, cleared = lay.stored, lay.removed, lay.cleared
    append = out.append
    for eff in effects:
        t = type(eff)
        if t is BlocksStored:
            append(stored(eff.hashes, eff.parent_hash, eff.token_ids, eff.page_tokens,
                          eff.lora_id, medium, eff.lora_name))
        elif t is BlocksRemoved:
            append(removed(eff.hashes, medium))
        elif eff is _CLEARED:
            append(cleared())


class PendingBatch(NamedTuple):
    """A closed batch not yet converted (``deferred`` batchers): its ``ts`` and its effects."""

    ts: float
    events: tuple  # BlocksStored / BlocksRemoved effects (and AllBlocksCleared markers), one per KV event


class KVEventBatcher:
    """Collects the KV events of folded events and hands each closed batch to ``sink``.

    ``observe(seq, event, effects)`` is a ``Ledger`` observer. ``layout``: ``"array"``
    or ``"map"`` (``schema``); ``medium``: the events' medium (``"GPU"``; None
    allowed); ``data_parallel_rank``: stamped on every batch (None leaves it out);
    ``clock``: the batch timestamp in seconds (``time.time``); ``auto_flush``:
    close a batch when a ``StepSealed`` is observed; ``deferred``: hand the sink a
    ``PendingBatch`` (stamped, not converted) and let a consumer thread ``build`` it,
    so that the folding thread only collects effect objects. Not thread-safe: call
    ``observe`` / ``flush`` from the thread that folds (``build`` from any). ``sink``
    raising propagates out of ``observe`` / ``flush`` (that batch is then gone from here).
    """

    def __init__(self, sink: Callable[[Any], object], *, layout: str = "array", medium: str | None = MEDIUM_GPU,
                 data_parallel_rank: int | None = 0, clock: Callable[[], float] = time.time,
                 auto_flush: bool = True, deferred: bool = False) -> None:
        _check_medium(medium)
        if data_parallel_rank is not None and (type(data_parallel_rank) is not int or data_parallel_rank < 0):
            raise InvalidArgumentError(f"data_parallel_rank must be an int >= 0 or None, got {data_parallel_rank!r}")
        self._layout = get_layout(layout)
        self._sink = sink
        self._medium = medium
        self._rank = data_parallel_rank
        self._clock = clock
        self._auto = bool(auto_flush)
        self._deferred = bool(deferred)
        self._pending: list = []
        self.batches = 0  # batches handed to the sink
        self.events = 0  # KV events in them

    @property
    def layout(self) -> str:
        return self._layout.name

    @property
    def pending(self) -> int:
        """KV events collected and not yet in a batch."""
        return len(self._pending)

    def observe(self, seq: int, event, effects: tuple) -> None:
        """Collect the KV effects of one folded event (the ``Ledger`` observer signature).

        Only the effect objects are kept; they become structs when a batch is built."""
        if effects:
            for eff in effects:
                t = type(eff)
                if t is BlocksStored or t is BlocksRemoved:
                    self._pending.append(eff)
        t = type(event)
        if t is StepSealed:
            if self._auto and self._pending:
                self.flush()
        elif t is CacheConfigured:
            self._pending.append(_CLEARED)

    def flush(self):
        """Close the pending events into a batch (stamped ``clock()``) and hand it to the sink;
        returns what the sink got (None, and nothing handed over, when nothing is pending)."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        ts = self._clock()
        self.batches += 1
        self.events += len(pending)
        out = PendingBatch(ts, tuple(pending)) if self._deferred else self.build(ts, pending)
        self._sink(out)
        return out

    def build(self, ts: float, effects: Iterable):
        """The batch (this batcher's layout, medium and rank) of collected effects, stamped ``ts``."""
        events: list = []
        _convert(effects, self._layout, self._medium, events)
        return self._layout.batch(ts, tuple(events), self._rank)
