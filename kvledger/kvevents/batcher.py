"""From the fold's effects to KV event batches: sans-I/O, shared by the live publisher and the export.

    Ledger._submit ─► observer(seq, event, effects) ─► KVEventBatcher.observe: collect
                        effects   BlocksStored (with its request's extra keys), BlocksRemoved
                        event     CacheConfigured ─► AllBlocksCleared (a new cache starts empty)
                                  PagesReserved / PagesShared ─► the request's tenant
                                  RequestFinished / RequestCancelled ─► forget its keys
                                  StepSealed ─► close the batch (auto_flush), stamped clock()
                    ─► build: BlocksStored ─► BlockStored (block_size = page_tokens, medium,
                                             hashes folded to u64, extra_keys)
                              BlocksRemoved ─► BlockRemoved (medium, hashes folded to u64)
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

Hashes (``hashes=``): ``"u64"`` (the default) folds every block hash and parent
hash the way vLLM 0.33 folds its own (``core.hashing.to_u64``), what Dynamo's
indexer and vLLM's own consumers expect; ``"raw"`` sends the ledger's hashes as
they are (16-byte bytes from ``core.hashing.block_hashes``).

Extra keys (the map layout's ``extra_keys``, one entry per block): what separates
equal token prefixes in a router's index. A block's entry is, in order, the
publish's LoRA name (when set), the tenant of the request that wrote it (the
ledger's, from the ``PagesReserved`` / ``PagesShared`` that created the request)
and the cache salt the caller set for that request (``set_cache_salt``); None when
it has none of them, and the field is left out when no block of the event has
any. Every block of a publish carries the same entry (``core.hashing`` applies the
extra keys to every block too). The log records tenants but not salts: an export
carries the tenant only, unless its caller passes the salts again.

Leaving data out (``omit=``): ``"token_ids"`` sends every ``BlockStored`` with an
empty ``token_ids`` list (a router that only matches hashes needs none; one that
hashes tokens itself cannot work without them); ``"tenant"`` and ``"salt"`` keep
those out of ``extra_keys`` (hashes computed with them as extra keys still differ,
so prefixes stay apart; the consumer just cannot read who they belong to).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain
from typing import Any, NamedTuple

from kvledger.core.errors import InvalidArgumentError
from kvledger.core.events.events import (
    BlocksRemoved,
    BlocksStored,
    CacheConfigured,
    PagesReserved,
    PagesShared,
    RequestCancelled,
    RequestFinished,
    StepSealed,
)
from kvledger.core.hashing import to_u64, to_u64_all

from .schema import HASH_FORMS, MEDIUM_GPU, Layout, check_choice, get_layout

__all__ = ["OMITTABLE", "KVEventBatcher", "PendingBatch", "check_omit", "to_kv_events"]

OMITTABLE = ("token_ids", "tenant", "salt")  # what ``omit=`` may leave out of the events


def check_omit(omit: Iterable[str]) -> frozenset[str]:
    """``omit`` as a set of names from ``OMITTABLE``; ``InvalidArgumentError`` otherwise."""
    if isinstance(omit, str):
        omit = (omit,)
    try:
        names = frozenset(omit)
    except TypeError:
        raise InvalidArgumentError(f"omit must be names from {OMITTABLE}, got {omit!r}") from None
    bad = sorted(n for n in names if n not in OMITTABLE)
    if bad:
        raise InvalidArgumentError(f"omit: {bad} are not fields an event can leave out ({', '.join(OMITTABLE)})")
    return names


def _check_medium(medium) -> None:
    if medium is not None and type(medium) is not str:
        raise InvalidArgumentError(f"medium must be a str or None, got {medium!r}")


def to_kv_events(effects: Iterable, *, medium: str | None = MEDIUM_GPU, layout: str = "map",
                 hashes: str = "u64") -> list:
    """The KV events of some effects, in order: ``BlocksStored`` -> ``BlockStored``,
    ``BlocksRemoved`` -> ``BlockRemoved``; every other effect (``ClearPages``,
    ``StepPlan``) has none. Raises ``InvalidArgumentError`` for a bad layout, hash form or medium."""
    _check_medium(medium)
    lay = get_layout(layout)
    out: list = []
    kv = [e for e in effects if type(e) is BlocksStored or type(e) is BlocksRemoved]
    _convert(kv, lay, medium, check_choice(hashes, HASH_FORMS, "hashes") == "u64", out)
    return out


class _Cleared:
    """Collected for a ``CacheConfigured``: an ``AllBlocksCleared`` (no hashes)."""

    __slots__ = ()
    hashes: tuple = ()


_CLEARED = _Cleared()


class _Keyed(NamedTuple):
    """A ``BlocksStored`` collected with the extra keys of the request that published it."""

    effect: BlocksStored
    keys: tuple
    hashes: tuple  # the effect's own


_UNPACK16 = [struct.Struct(">" + "8xQ" * k).unpack for k in range(17)]  # k 16-byte hashes: their last 8 bytes
_NOT_16 = (struct.error, IndexError)  # the joined bytes are not 16 x k (k <= 16) long
_NOT_COMMON = (TypeError, *_NOT_16)  # ... or not all bytes


def _convert(effects: Sequence, lay: Layout, medium: str | None, fold: bool, out: list, tokens: bool = True) -> None:
    """Append the KV event of each effect to ``out``; ``fold``: hashes as u64.

    Two loops, because every batch takes this path and a Python op per event is what it
    costs (bench/bench_kvevents.py): ``_convert_common`` takes the shape nearly every
    event has when folding (16-byte hashes, no extra keys), and hands the first effect it
    cannot take, with the rest, to ``_convert_any``, which takes every shape. Int hashes
    go there at once (the common loop would stop at the first, at the cost of an exception).
    ``tokens`` False: every ``BlockStored`` with empty ``token_ids`` (``omit``)."""
    it = iter(effects)
    prev: tuple = (None, 0)
    if fold and not (effects and effects[0].hashes and type(effects[0].hashes[0]) is int):
        first, prev = _convert_common(it, lay, medium, out, tokens)
        if first is None:
            return
        it = chain((first,), it)
    _convert_any(it, lay, medium, fold, out, prev, tokens)


def _convert_common(it: Iterator, lay: Layout, medium: str | None, out: list, tokens: bool = True
                    ) -> tuple[Any, tuple]:
    """Fold and convert effects from ``it`` while they are ``BlocksRemoved`` or ``BlocksStored``
    (no LoRA name) with one or more hashes of 16 bytes (``core.hashing.block_hash``'s): k of
    them in one ``struct`` call over their joined bytes, which raises unless they are bytes
    adding up to 16 x k; lengths that only add up are told apart by checking all but one
    (k <= 3: the first and the last). Returns the first effect not taken (None at the
    end) and the latest publish's last hash with its u64 form (a publish's parent is
    usually it: folded already)."""
    stored, removed = lay.stored, lay.removed
    append = out.append
    unpack, join, not_common = _UNPACK16, b"".join, _NOT_COMMON
    prev_raw: object = None
    prev_u64 = 0
    for eff in it:
        hs = eff.hashes  # no hashes (_Cleared, an empty event): IndexError below, handed over
        k = len(hs)
        try:
            folded = unpack[k](join(hs))
            if len(hs[0]) != 16 or k > 2 and (len(hs[-1]) != 16 or k > 3 and (
                    len(hs[1]) != 16 or k > 4 and min(map(len, hs)) != 16)):
                return eff, (prev_raw, prev_u64)
        except not_common:
            return eff, (prev_raw, prev_u64)
        t = type(eff)
        if t is BlocksRemoved:
            append(removed(folded, medium))
            continue
        if t is not BlocksStored or eff.lora_name is not None:
            return eff, (prev_raw, prev_u64)
        parent = eff.parent_hash
        if parent is not None:
            parent = prev_u64 if parent is prev_raw else to_u64(parent)
        prev_raw, prev_u64 = hs[-1], folded[-1]
        append(stored(folded, parent, eff.token_ids if tokens else (), eff.page_tokens, eff.lora_id, medium, None))
    return None, (prev_raw, prev_u64)


def _convert_any(it: Iterable, lay: Layout, medium: str | None, fold: bool, out: list, prev: tuple,
                 tokens: bool = True) -> None:
    """Convert every effect of ``it`` (``prev``: ``_convert_common``'s last publish). Folds:
    16-byte hashes as there, ints >= 0 to themselves (the ledger's are signed 64-bit),
    anything else by ``core.hashing.to_u64_all``."""
    stored, removed, cleared = lay.stored, lay.removed, lay.cleared
    with_keys = lay.name == "map"
    append = out.append
    unpack, join, not16 = _UNPACK16, b"".join, _NOT_16
    prev_raw, prev_u64 = prev  # the last block hash of the latest publish, and its u64 form
    for eff in it:
        raw = hs = eff.hashes  # _Cleared: ()
        if fold and hs:
            h = hs[0]
            if type(h) is bytes:
                k = len(hs)
                try:
                    hs = unpack[k](join(hs))
                except not16:
                    hs = to_u64_all(raw)
                except TypeError:  # bytes and ints mixed
                    hs = to_u64_all(raw)
                else:
                    if k > 1 and (len(h) != 16 or k > 2 and (len(raw[-1]) != 16 or k > 3 and (
                            len(raw[1]) != 16 or k > 4 and min(map(len, raw)) != 16))):
                        hs = to_u64_all(raw)
            elif type(h) is not int:
                hs = to_u64_all(raw)  # raises
            else:
                try:
                    if min(hs) < 0:
                        hs = to_u64_all(raw)
                except TypeError:  # ints and bytes mixed
                    hs = to_u64_all(raw)
        t = type(eff)
        if t is BlocksRemoved:
            append(removed(hs, medium))
            continue
        if t is BlocksStored:
            keys = None
        elif t is _Keyed:
            eff, keys = eff.effect, eff.keys
        else:
            append(cleared())
            continue
        parent = eff.parent_hash
        if fold:
            if parent is not None:
                parent = prev_u64 if parent is prev_raw else to_u64(parent)
            if raw:
                prev_raw, prev_u64 = raw[-1], hs[-1]
        lora = eff.lora_name
        if lora is not None:
            keys = (lora, *keys) if keys else (lora,)
        token_ids = eff.token_ids if tokens else ()
        if with_keys:
            append(stored(hs, parent, token_ids, eff.page_tokens, eff.lora_id, medium, lora,
                          (keys,) * len(hs) if keys else None))
        else:
            append(stored(hs, parent, token_ids, eff.page_tokens, eff.lora_id, medium, lora))


class PendingBatch(NamedTuple):
    """A closed batch not yet converted (``deferred`` batchers): its ``ts`` and its effects."""

    ts: float
    events: tuple  # BlocksStored / BlocksRemoved effects (and AllBlocksCleared markers), one per KV event


class KVEventBatcher:
    """Collects the KV events of folded events and hands each closed batch to ``sink``.

    ``observe(seq, event, effects)`` is a ``Ledger`` observer. ``layout``: ``"map"``
    (vLLM 0.33's) or ``"array"`` (``schema``); ``hashes``: ``"u64"`` or ``"raw"``
    (module docstring); ``medium``: the events' medium (``"GPU"``; None
    allowed); ``data_parallel_rank``: stamped on every batch (None: nil);
    ``clock``: the batch timestamp in seconds (``time.time``); ``auto_flush``:
    close a batch when a ``StepSealed`` is observed; ``deferred``: hand the sink a
    ``PendingBatch`` (stamped, not converted) and let a consumer thread ``build`` it,
    so that the folding thread only collects effect objects; ``omit``: names from
    ``OMITTABLE`` to leave out of every event (module docstring). Not thread-safe: call
    ``observe`` / ``flush`` from the thread that folds (``build`` from any). ``sink``
    raising propagates out of ``observe`` / ``flush`` (that batch is then gone from here).
    """

    def __init__(self, sink: Callable[[Any], object], *, layout: str = "map", medium: str | None = MEDIUM_GPU,
                 data_parallel_rank: int | None = 0, clock: Callable[[], float] = time.time,
                 auto_flush: bool = True, deferred: bool = False, hashes: str = "u64",
                 omit: Iterable[str] = ()) -> None:
        _check_medium(medium)
        self.omit = check_omit(omit)
        self._tokens = "token_ids" not in self.omit
        if data_parallel_rank is not None and (type(data_parallel_rank) is not int or data_parallel_rank < 0):
            raise InvalidArgumentError(f"data_parallel_rank must be an int >= 0 or None, got {data_parallel_rank!r}")
        self._layout = get_layout(layout)
        self._fold = check_choice(hashes, HASH_FORMS, "hashes") == "u64"
        self._tenants: dict[int, str] = {}  # request -> its tenant (requests that have one)
        self._salts: dict[int, str] = {}  # request -> the cache salt its caller set
        self._hooks: dict[type, Callable[[Any], None]] = {
            StepSealed: self._sealed, PagesReserved: self._tenant, PagesShared: self._tenant,
            RequestFinished: self._gone, RequestCancelled: self._gone, CacheConfigured: self._configured}
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
    def hashes(self) -> str:
        return "u64" if self._fold else "raw"

    def set_cache_salt(self, request: int, salt: str | None) -> None:
        """Publish ``salt`` in the extra keys of the blocks ``request`` publishes from now on
        (None: none), until it finishes or is cancelled. ``InvalidArgumentError`` for a
        request that is not an int or a salt that is not a str."""
        if type(request) is not int:
            raise InvalidArgumentError(f"request must be an int, got {request!r}")
        if salt is not None and type(salt) is not str:
            raise InvalidArgumentError(f"a cache salt is a str, got {salt!r}")
        if salt is None or "salt" in self.omit:
            self._salts.pop(request, None)
        else:
            self._salts[request] = salt

    def set_tenants(self, tenants: dict[int, str | None]) -> None:
        """Know these requests' tenants (``request -> tenant``; None entries skipped): an
        export that starts at a checkpoint seeds them from the checkpoint's state."""
        if "tenant" not in self.omit:
            self._tenants.update({r: t for r, t in tenants.items() if t is not None})

    def _keys_of(self, request: int) -> tuple | None:
        tenant, salt = self._tenants.get(request), self._salts.get(request)
        if tenant is None:
            return None if salt is None else (salt,)
        return (tenant,) if salt is None else (tenant, salt)

    @property
    def pending(self) -> int:
        """KV events collected and not yet in a batch."""
        return len(self._pending)

    def observe(self, seq: int, event, effects: tuple) -> None:
        """Collect the KV effects of one folded event (the ``Ledger`` observer signature).

        Only the effect objects are kept (a publish's with its request's extra keys); they
        become structs when a batch is built."""
        if effects:
            for eff in effects:
                t = type(eff)
                if t is BlocksRemoved:
                    self._pending.append(eff)
                elif t is BlocksStored:
                    if self._tenants or self._salts:
                        keys = self._keys_of(event.request)
                        if keys is not None:
                            eff = _Keyed(eff, keys, eff.hashes)
                    self._pending.append(eff)
        if type(event) in self._hooks:  # most events have no hook: one lookup for them
            self._hooks[type(event)](event)

    def _sealed(self, event) -> None:
        if self._auto and self._pending:
            self.flush()

    def _tenant(self, event) -> None:
        if event.tenant is not None and "tenant" not in self.omit:
            self._tenants[event.request] = event.tenant

    def _gone(self, event) -> None:
        if self._tenants or self._salts:
            self._tenants.pop(event.request, None)
            self._salts.pop(event.request, None)

    def _configured(self, event) -> None:
        self._pending.append(_CLEARED)
        self._tenants.clear()

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
        _convert(tuple(effects), self._layout, self._medium, self._fold, events, self._tokens)
        return self._layout.batch(ts, tuple(events), self._rank)
