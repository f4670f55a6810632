"""``LedgerBlockPool``: vLLM's ``BlockPool`` with every block transition recorded in a kvledger ``Ledger``.

One piece (past 500 lines): ``LedgerBlockPool`` is one class, vLLM's ``BlockPool``
with each public method overridden the same way (run vLLM's, then hand the pages to
``PageHolds``, detach on a ledger error). The overrides share the call's holder
(``who``, ``reads``), the detach state and the page lookups; the bookkeeping itself is
already its own object (``holds.py``), and splitting the overrides across modules
would only make them borrow each other's privates.

vLLM's KV cache manager (``KVCacheManager`` -> ``KVCacheCoordinator`` -> one
``SingleTypeKVCacheManager`` per KV cache group) and its tests read the pool's
own structures directly: the ``KVCacheBlock`` objects (``ref_cnt``, the block
hash, the null block), the free queue whose order is vLLM's eviction order, the
hash map with its duplicates. So this pool keeps them exactly as vLLM's code
keeps them (it is a ``BlockPool``, and vLLM's methods decide which block goes
where), and mirrors each transition into the ledger through ``PageHolds``
(``holds.py``: which events, and why), naming the pages vLLM chose:

    get_new_blocks ─► PagesEvicted? + PagesReserved + PagesCommitted (open step)
    touch          ─► PagesShared               free_blocks ─► PagesReleased / RequestFinished
    cache_full_blocks / cache_partial_block / move_block_hashes ─► PagesPublished
    evict_blocks / reset_prefix_cache / eviction on reuse        ─► PagesEvicted
    take_block_ids_to_zero() ─► StepSealed: the pages to zero

Who calls: the manager wrappers ``install`` puts on vLLM's single-type managers set
``who`` (the vLLM request id and KV cache group) and ``reads`` around each of their
calls, so holds are vLLM's requests per group (``set_groups`` gives each group its
tenant and says which groups hold recurrent states). Calls nobody names (vLLM's
tests working the pool, the scheduler freeing copy-on-write endpoints) get holds of
their own. ``drive()`` (the scheduler wrapper) turns the fence on: one ledger step
per ``schedule()``, completed by ``completed()`` from ``update_from_output``; a state
group's block vLLM hashes is hidden from ``get_cached_block`` until then.

The ledger checks each transition against its own rules and raises a
``KVLedgerError`` naming the page when vLLM's call sequence breaks one. vLLM's
state has then already changed (the pool is the mirror, not the gate), so by
default (``on_error="detach"``) the pool *detaches*: it logs one ERROR naming the
error, counts it (``kvledger_vllm_detached_total``), closes its log (what it
acknowledged stays) and from then on is vLLM's own pool, recording nothing; the
clear list falls back to vLLM's own. A failing log disk (``LogError``) detaches the
same way. ``on_error="fail"`` raises instead (tests). ``verify()`` compares the two
sides page by page.

KV events: ``take_events`` is vLLM's (the events its methods built for these
calls); the ledger's own ``BlocksStored`` / ``BlocksRemoved`` effects record the
same hashes, and ``kvledger events LOG`` exports them from a durable log.

Importing this module imports vLLM (``kvledger.integrations.vllm`` loads it on
first use). Tested with the versions in ``VLLM_VERSIONS``.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass
from operator import is_
from typing import Any

from vllm.v1.core.block_pool import BlockPool

from ...core.errors import ConfigurationError, InvalidArgumentError, InvariantViolation, KVLedgerError
from ...core.events import Geometry
from ...core.ledger import Ledger
from ...logs import get_logger
from .groups import group_tenants
from .holds import PageHolds, Who

__all__ = ["LedgerBlockPool", "PoolOptions", "POLICIES"]

_log = logging.getLogger("kvledger.integrations.vllm")

# The clear policies in vLLM's terms -> the ledger's policy (holds carry their group as the tenant).
POLICIES = {
    "groups": "cross_tenant",  # a block moving to another group, or a state read before it is written
    "all_reused": "all_reused",  # every block handed out again
    "released_aliases": "released_aliases",  # records only: nothing in vLLM is a released snapshot row
}


@dataclass(frozen=True)
class PoolOptions:
    """How each ``LedgerBlockPool`` records (``install`` passes these; see its docstring).

    ``log``: None (an in-memory ledger), a log file path, or an existing directory
    (each pool then writes ``pool-<pid>-<n>.kvlog`` in it; a file that exists
    starts a new epoch in it). ``fsync``: the durable log's policy ("background" by
    default: appends never wait for the disk). ``policy``: one of ``POLICIES``.
    ``on_error``: "detach" (default: a ledger or log error never stops vLLM) or
    "fail". ``check``: every ledger invariant after every event; ``verify``:
    ``verify()`` after every pool call (both for tests: O(pages) each). ``layer``:
    the durable log's file layer (tests inject faults with it).
    """

    log: str | os.PathLike | None = None
    fsync: str = "background"
    policy: str = "groups"
    on_error: str = "detach"
    check: bool = False
    verify: bool = False
    layer: Any = None  # the durable log's file layer (fault injection in tests)


def _detach_counter() -> Any:
    """``kvledger_vllm_detached_total`` on prometheus_client's default registry (vLLM serves it), once."""
    global _DETACHED
    if _DETACHED is None:
        try:
            from prometheus_client import Counter
        except ImportError:  # (vLLM depends on it; without it there is no metric to keep)
            _DETACHED = False
        else:
            try:
                _DETACHED = Counter("kvledger_vllm_detached", "kvledger ledger pools that stopped recording "
                                    "after an error (the log, or a transition the ledger refused)", ["reason"])
            except ValueError:  # (registered by an earlier import in this process)
                _DETACHED = False
    return _DETACHED or None


_DETACHED: Any = None


class LedgerBlockPool(BlockPool):
    """A vLLM ``BlockPool`` whose block transitions are kvledger events (see the module docstring).

    Takes ``BlockPool``'s arguments, plus ``ledger_options`` (a ``PoolOptions``;
    the class attribute ``options`` when None, which ``install`` sets). The
    ledger's geometry is ``num_gpu_blocks`` pages of ``hash_block_size`` tokens.
    Raises ``ConfigurationError`` for bad options, and what ``open_ledger`` raises
    for a log it cannot open.
    """

    options = PoolOptions()
    _opened = 0  # pools that opened a log in a directory (file names)

    def __init__(self, *args: Any, ledger_options: PoolOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        opts = ledger_options if ledger_options is not None else self.options
        if opts.policy not in POLICIES:
            raise ConfigurationError(f"unknown vLLM clear policy {opts.policy!r}; one of {sorted(POLICIES)}")
        if opts.on_error not in ("detach", "fail"):
            raise ConfigurationError(f"on_error must be 'detach' or 'fail', got {opts.on_error!r}")
        geometry = Geometry(num_pages=self.num_gpu_blocks, page_tokens=self.hash_block_size)
        self._verify = opts.verify
        self._fail = opts.on_error == "fail"
        self._in_alloc = False
        self._hashing = 0  # inside one of this pool's own hashing calls (their _insert_block_hash is theirs)
        self.detached: str | None = None  # why the pool stopped recording (None: it records)
        self.ledger: Any = None
        self.log_path: pathlib.Path | None = None
        try:
            self.ledger, self.log_path = _open(opts, geometry)
        except (KVLedgerError, OSError) as exc:  # (a log that cannot be opened: vLLM runs on, unrecorded)
            if isinstance(exc, ConfigurationError):
                raise
            self._detach(exc)
        self.who: Who | None = None  # set around a manager's calls (install's wrappers)
        self.reads = "tail"  # how the step reads the blocks the next allocation hands out
        self.whole_blocks = 0  # how many of them, first, the step writes whole (reads="none")
        self.last_block_ids_to_zero: list[int] = []  # what the last scheduler step's seal listed
        self.last_sealed_step: int | None = None
        self._steps: dict[int, int] = {}  # id(SchedulerOutput) -> the ledger step its schedule() sealed
        self.holds: Any = None
        if self.ledger is not None:
            try:
                self.holds = PageHolds(self.ledger, null_page=self.null_block.block_id)
            except Exception:
                self.close()
                raise
            self.holds.withdraw = self._withdraw
        peers = getattr(type(self), "peers", None)
        if peers is not None:
            peers.add(self)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the durable log (flushes it); an in-memory ledger has nothing to close. Idempotent.
        A log error the close meets (a write the writer thread had not reached when the last gate
        passed: a full disk found at the end) detaches the pool as anywhere else, once."""
        close = getattr(self.ledger, "close", None) if self.ledger is not None else None
        if close is None:
            return
        if self.detached is not None:
            close()
            return
        try:
            close()
        except KVLedgerError as exc:
            self._detach(exc)

    def set_groups(self, kv_cache_groups: list) -> None:
        """vLLM's KV cache groups (the coordinator's config): each group's holds get its tenant, and
        a recurrent state's groups read their first block whole. Raises ``ConfigurationError``
        naming a group whose kind the policy cannot reason about (nothing recorded yet then)."""
        tenants, states = group_tenants(kv_cache_groups)
        if self.holds is not None:
            self.holds.set_groups(tenants, states)

    def hold_copies(self) -> None:
        """This pool holds copies of another pool's blocks (vLLM's simple CPU offload): a copy
        serves every KV cache group that shares the original's bytes, so its holds carry no group
        (no tenant: shares across groups are the point) and nothing is read from it before a full
        write, so it lists nothing to zero."""
        if self.holds is not None:
            self.holds.set_groups({}, ())

    def drive(self, async_scheduling: bool = False) -> None:
        """A vLLM ``Scheduler`` drives this pool: the fence is on (holds.py's "fenced");
        ``async_scheduling``: a scheduled step may run without a request (holds.py's "ahead")."""
        if self.holds is not None:
            self.holds.fenced = True
            self.holds.ahead = async_scheduling

    # ------------------------------------------------------------------ the clear list and the fence

    def take_block_ids_to_zero(self) -> list[int]:
        """The block ids to zero before the next forward pass (vLLM's ``new_block_ids_to_zero``).

        Seals the ledger's open step and returns the clear lists of every step
        sealed since the last call: blocks the policy marked (under ``groups``, a
        block another group or a state's other request left) that a request
        committed since. Detached: an empty list (the caller falls back to vLLM's).
        """
        if self.detached is not None:
            return []
        try:
            ids = self.holds.take_clear_list()
        except KVLedgerError as exc:
            self._detach(exc)
            return []
        if self.holds.fenced:
            self.last_sealed_step = self.ledger.open_step - 1
        return ids

    def scheduling(self, inside: bool) -> None:
        """The scheduler enters (``True``) or leaves its ``schedule()``: blocks hashed outside it
        (code working the manager directly) are published at once when no step is in flight."""
        if self.holds is not None:
            self.holds.scheduling = inside

    def scheduled(self, scheduler_output: Any) -> None:
        """``schedule()`` returned ``scheduler_output``: its ledger step is the one sealed for it."""
        if self.detached is None and self.last_sealed_step is not None:
            self._steps[id(scheduler_output)] = self.last_sealed_step
            self.last_sealed_step = None

    def completed(self, scheduler_output: Any, model_runner_output: Any, live: Any) -> None:
        """``update_from_output`` for ``scheduler_output``: its step ran. A scheduled request the output
        omits and the scheduler no longer has (``live``: its requests) was dropped from the step."""
        step = self._steps.pop(id(scheduler_output), None)
        if step is None or self.detached is not None:
            return
        ran = getattr(model_runner_output, "req_ids", None)
        dropped: set[str] = set()
        if ran is not None:
            ran = set(ran)
            dropped = {r for r in scheduler_output.num_scheduled_tokens if r not in ran and r not in live}
        try:
            self.holds.complete(step, dropped)
        except KVLedgerError as exc:
            self._detach(exc)

    # ------------------------------------------------------------------ transitions
    #
    # Each method runs vLLM's own, then hands ``PageHolds`` the pages it touched in one call
    # (the scheduler calls these on every step: no per-call verification unless asked).

    def get_new_blocks(self, num_blocks: int) -> list:
        self._in_alloc = True
        try:
            blocks = super().get_new_blocks(num_blocks)
        finally:
            self._in_alloc = False
        if self.detached is None and blocks:
            # (the pool's own blocks, from its free queue; the cached ones among them vLLM just evicted,
            # which holds.allocate evicts in the ledger first, in one event)
            ids = [b.block_id for b in blocks]
            try:
                k = self.whole_blocks
                if k:
                    self.whole_blocks = 0
                    self.holds.allocate(ids[:k], self.who, "none")
                    if len(ids) > k:
                        self.holds.allocate(ids[k:], self.who, self.reads)
                else:
                    self.holds.allocate(ids, self.who, self.reads)
            except KVLedgerError as exc:
                self._detach(exc)
            if self._verify:
                self.verify()
        return blocks

    def touch(self, blocks) -> None:
        blocks = list(blocks)
        super().touch(blocks)
        if self.detached is None:
            pages = self._own(blocks)
            try:
                self.holds.share(self._pages(blocks) if pages is None else pages, self.who)
            except KVLedgerError as exc:
                self._detach(exc)
            if self._verify:
                self.verify()

    def free_blocks(self, ordered_blocks: Iterable, *args: Any, **kwargs: Any) -> None:
        blocks = list(ordered_blocks)
        if self.detached is not None:
            super().free_blocks(blocks, *args, **kwargs)
            return
        pages, counts = self._pages_and_refs(blocks)
        super().free_blocks(blocks, *args, **kwargs)
        try:
            self.holds.release(pages, counts, self.who)
        except KVLedgerError as exc:
            self._detach(exc)
        if self._verify:
            self.verify()

    def unpin_blocks(self, blocks, on_reuse) -> None:
        blocks = list(blocks)
        if self.detached is not None:
            super().unpin_blocks(blocks, on_reuse)
            return
        pages, counts = self._pages_and_refs(blocks)
        super().unpin_blocks(blocks, on_reuse)
        try:
            self.holds.release(pages, counts, self.who)
        except KVLedgerError as exc:
            self._detach(exc)
        if self._verify:
            self.verify()

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        blocks = super().get_cached_block(block_hash, kv_cache_group_ids)
        if blocks and self.detached is None and self.holds.fenced:
            hidden = self.holds.hidden
            for blk in blocks:
                if hidden(blk.block_id):
                    return None  # (a state block whose writing step has not completed: not a hit yet)
        return blocks

    def cache_full_blocks(self, request, blocks, num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask: list[bool] | None = None) -> None:
        self._hashing += 1
        try:
            super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                      kv_cache_group_id, block_mask)
        finally:
            self._hashing -= 1
        if self.detached is not None:
            return
        try:
            self._publish_full(request, blocks, num_cached_blocks, num_full_blocks, block_size, block_mask)
        except KVLedgerError as exc:
            self._detach(exc)
        if self._verify:
            self.verify()

    def _publish_full(self, request, blocks, num_cached_blocks: int, num_full_blocks: int, block_size: int,
                      block_mask: list[bool] | None) -> None:
        end = min(num_full_blocks, len(blocks))
        k = self.hash_block_size
        if num_cached_blocks >= end:
            return
        new = blocks[num_cached_blocks:end]
        pages = self._own(new)
        keys = [b.block_hash for b in new]
        if pages is not None and None not in keys and block_size == k and block_mask is None:
            # (the usual case: the pool's own blocks, all hashed now, of the hash block size)
            prev = blocks[num_cached_blocks - 1] if num_cached_blocks else None
            ids = request.all_token_ids
            self.holds.publish_blocks(pages, keys, tuple(ids[num_cached_blocks * k : end * k]),
                                      prev.block_id if prev is not None and self._mine(prev) else None)
        else:
            self._publish_each(request, blocks, num_cached_blocks, end, block_size)

    def _publish_each(self, request, blocks, start: int, end: int, block_size: int) -> None:
        """``cache_full_blocks``' publish block by block: blocks of the pool's own that vLLM hashed,
        each with the ``hash_block_size`` tokens its hash ends with."""
        items = []
        prev = blocks[start - 1] if start > 0 else None
        for i in range(start, end):
            blk = blocks[i]
            if blk.block_hash is not None and self._mine(blk):
                n = blk.block_hash_num_tokens or (i + 1) * block_size
                parent = prev.block_id if prev is not None and self._mine(prev) else None
                items.append((blk.block_id, blk.block_hash, self._tokens(request, n), parent))
            prev = blk
        if items:
            self.holds.publish(items)

    def cache_partial_block(self, request, block, num_tokens: int, kv_cache_group_id: int, block_size: int,
                            replace_existing_hashes: bool = False):
        self._hashing += 1
        try:
            key = super().cache_partial_block(request, block, num_tokens, kv_cache_group_id, block_size,
                                              replace_existing_hashes)
        finally:
            self._hashing -= 1
        if self.detached is None and block.block_hash is not None and self._mine(block):
            n = block.block_hash_num_tokens or num_tokens
            try:
                self.holds.publish([(block.block_id, block.block_hash, self._tokens(request, n), None)])
            except KVLedgerError as exc:
                self._detach(exc)
            if self._verify:
                self.verify()
        return key

    def move_block_hashes(self, src_block, dst_block) -> None:
        if self.detached is not None:
            super().move_block_hashes(src_block, dst_block)
            return
        tokens = self.holds.tokens_of(src_block.block_id) if self._mine(src_block) else None
        self._hashing += 1
        try:
            super().move_block_hashes(src_block, dst_block)
        finally:
            self._hashing -= 1
        try:
            if dst_block.block_hash is not None and tokens is not None and self._mine(dst_block):
                self.holds.publish([(dst_block.block_id, dst_block.block_hash, tokens, None)])
            self.holds.drop_hashes(self._pages([src_block]))
        except KVLedgerError as exc:
            self._detach(exc)
        if self._verify:
            self.verify()

    def _insert_block_hash(self, block_hash_with_group_id, block, num_tokens) -> None:
        """vLLM's own hashing calls use it inside (mirrored by them); a caller outside is vLLM's
        simple CPU offload registering a block it copied from the GPU pool in this (CPU) pool's
        prefix cache: the block's first (primary) hash is published in the ledger, with the
        tokens the GPU pool's ledger published that block with (``tokens_for``)."""
        primary = block.block_hash is None
        super()._insert_block_hash(block_hash_with_group_id, block, num_tokens)
        if self._hashing or not primary or self.detached is not None or block.block_hash is None:
            return
        if not self._mine(block):
            return
        try:
            tokens = self._tokens_elsewhere(block.block_hash)
            if tokens is None:
                raise InvalidArgumentError(
                    f"block {block.block_id} was hashed by a caller outside the pool's own hashing calls and no "
                    "ledger pool of this installation knows the hash's tokens (vLLM's simple CPU offload copies a "
                    "block another pool published; nothing else can be mirrored)")
            self.holds.publish([(block.block_id, block.block_hash, tokens, None)])
        except KVLedgerError as exc:
            self._detach(exc)
        if self._verify:
            self.verify()

    def tokens_for(self, raw_hash) -> tuple[int, ...] | None:
        """The tokens this pool's ledger published (or is about to publish) the block vLLM caches
        under ``raw_hash`` with (found through vLLM's own hash map, so a block whose ledger hash
        differs from vLLM's, a second block under one hash, is found too); None when this pool
        caches no such block or does not record."""
        if self.detached is not None or self.holds is None:
            return None
        block = self.cached_block_hash_to_block.get_one_block(raw_hash)
        if block is None or not self._mine(block):
            return None
        return self.holds.tokens_of(block.block_id)

    def _tokens_elsewhere(self, raw_hash) -> tuple[int, ...] | None:
        for peer in list(getattr(type(self), "peers", ())):
            if peer is not self:
                tokens = peer.tokens_for(raw_hash)
                if tokens is not None and len(tokens) == self.hash_block_size:
                    return tokens
        return None

    def _maybe_evict_cached_block(self, block) -> bool:
        # (vLLM's Mamba manager calls it directly, for a checkpoint block it overwrites)
        evicted = super()._maybe_evict_cached_block(block)
        if evicted and not self._in_alloc and self.detached is None:  # (get_new_blocks mirrors its own)
            try:
                self.holds.drop_hashes(self._pages([block]))
            except KVLedgerError as exc:
                self._detach(exc)
            if self._verify:
                self.verify()
        return evicted

    def _withdraw(self, page: int) -> None:
        """``PageHolds``: the step that writes ``page`` ran without its request: vLLM forgets its hash."""
        BlockPool._maybe_evict_cached_block(self, self.blocks[page])

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        if self.detached is None:
            try:
                self.holds.drop_hashes([i for i in block_ids if self.blocks[i].block_hash is None])
            except KVLedgerError as exc:
                self._detach(exc)
            if self._verify:
                self.verify()

    def reset_prefix_cache(self) -> bool:
        ok = super().reset_prefix_cache()
        if ok and self.detached is None:
            try:
                self.holds.evict_all()
            except KVLedgerError as exc:
                self._detach(exc)
            if self._verify:
                self.verify()
        return ok

    # ------------------------------------------------------------------ errors

    def _detach(self, exc: Exception) -> None:
        """Stop recording (``on_error="detach"``) or raise (``"fail"``); see the module docstring."""
        if self._fail:
            raise exc
        self.detached = f"{type(exc).__name__}: {exc}"
        _log.error("kvledger's ledger pool stopped recording and vLLM goes on with its own pool: %s "
                   "(the log keeps everything it acknowledged before; log: %s)", self.detached, self.log_path)
        counter = _detach_counter()
        if counter is not None:
            counter.labels(reason=type(exc).__name__).inc()
        try:
            self.close()
        except Exception as close_exc:  # noqa: BLE001  (the disk that failed may fail the close too)
            _log.error("closing the detached ledger's log failed too: %s", close_exc)

    # ------------------------------------------------------------------ checks

    def verify(self) -> None:
        """Compare vLLM's blocks with the ledger page by page; raise ``InvariantViolation`` naming
        the first page where they disagree. O(num_gpu_blocks). A detached pool verifies nothing."""
        if self.detached is not None:
            return
        holds, ledger = self.holds, self.ledger
        holds.adopt(*self._pages_and_refs(self.blocks))
        for blk in self.blocks:
            p = blk.block_id
            if blk.is_null:
                continue
            refs = holds.refs(p)
            if blk.ref_cnt != refs:
                raise InvariantViolation(1, f"block {p}: vLLM ref_cnt {blk.ref_cnt}, ledger holds {refs} "
                                            f"({ledger.holder_of(p)})")
            if blk.block_hash is not None and holds.key_of(p) is None and not holds.waiting(p):
                raise InvariantViolation(1, f"block {p} is hashed in vLLM but not published in the ledger")
            if refs == 0 and holds.key_of(p) is not None and blk.block_hash is None:
                raise InvariantViolation(1, f"block {p} is free in vLLM but cached in the ledger")
        # (vLLM's free blocks: the ledger's free and cached pages, and those kept for a waiting publish,
        # less the cached ones vLLM took a reference on by itself)
        free = ledger.free_count + ledger.cached_count + holds.deferred_idle - holds.pinned_unheld
        if free != self.get_num_free_blocks():
            odd = [b.block_id for b in self.blocks if not b.is_null
                   and (b.ref_cnt == 0) != (holds.refs(b.block_id) == 0
                                            and (ledger.holder_of(b.block_id) == "free"
                                                 or ledger.holder_of(b.block_id).startswith("cached(")
                                                 or holds.waiting(b.block_id)))]
            named = ", ".join(f"block {p}: vLLM ref_cnt {self.blocks[p].ref_cnt}, ledger {ledger.holder_of(p)} "
                              f"(holds {list(holds.holds_of(p))}, {holds.refs(p)} reference(s))" for p in odd[:3])
            raise InvariantViolation(1, f"vLLM has {self.get_num_free_blocks()} free blocks, the ledger {free} "
                                        f"free or cached pages (or kept for a waiting publish)"
                                        + (f"; {named}" if named else ""))

    # ------------------------------------------------------------------ internals

    def _mine(self, block) -> bool:
        """``block`` is one of this pool's own blocks, not the null block. vLLM's code may hand
        the pool blocks it made itself (tests do) or another pool's (deferred frees): vLLM's
        methods treat those as they do, and the ledger, which holds this pool's pages, ignores them."""
        i = block.block_id
        return not block.is_null and 0 <= i < len(self.blocks) and self.blocks[i] is block

    def _pages(self, blocks) -> list[int]:
        mine = self.blocks
        n = len(mine)
        return [b.block_id for b in blocks if not b.is_null and 0 <= b.block_id < n and mine[b.block_id] is b]

    def _tokens(self, request, n: int) -> tuple[int, ...]:
        """The ``hash_block_size`` tokens that end at prefix length ``n`` (a published page's
        tokens in the ledger; the whole block when the group's blocks are that size)."""
        k = self.hash_block_size
        return tuple(request.all_token_ids[n - k : n])

    def _own(self, blocks) -> list[int] | None:
        """The ids of ``blocks`` when every one is the pool's own and none is the null block (the
        usual case, checked with C-level passes), else None."""
        pages = [b.block_id for b in blocks]
        if self.null_block.block_id in pages:
            return None
        try:
            if all(map(is_, map(self.blocks.__getitem__, pages), blocks)):
                return pages
        except IndexError:  # (another pool's block, past the end of ours)
            pass
        return None

    def _pages_and_refs(self, blocks) -> tuple[list[int], list[int]]:
        """The pool's own blocks among ``blocks`` (``_mine``): their ids and vLLM's ``ref_cnt``."""
        if len(blocks) == 1:
            blk = blocks[0]
            return ([blk.block_id], [blk.ref_cnt]) if self._mine(blk) else ([], [])
        pages = self._own(blocks)
        if pages is not None:
            return pages, [b.ref_cnt for b in blocks]
        mine = [b for b in blocks if self._mine(b)]
        return [b.block_id for b in mine], [b.ref_cnt for b in mine]


def _open(opts: PoolOptions, geometry: Geometry) -> tuple[Any, pathlib.Path | None]:
    """The pool's ledger (in memory, or durable) and its log's path."""
    if not isinstance(opts, PoolOptions):
        raise ConfigurationError(f"ledger_options must be a PoolOptions, got {opts!r}")
    policy = POLICIES.get(opts.policy, opts.policy)
    if opts.log is None:
        return Ledger(geometry, policy=policy, check=opts.check), None
    from ...durable import open_ledger

    path = pathlib.Path(opts.log)
    if path.is_dir():
        prefix = os.environ.get("KVLEDGER_VLLM_LOG_PREFIX", "pool")
        while True:  # (a new process may get an old pid: a name no log has yet)
            LedgerBlockPool._opened += 1
            name = path / f"{prefix}-{os.getpid()}-{LedgerBlockPool._opened}.kvlog"
            if not name.exists():
                break
        path = name
    ledger = open_ledger(path, geometry, policy=policy, fsync=opts.fsync, check=opts.check, layer=opts.layer,
                         logger=_DemotedErrors(get_logger("kvledger.integrations.vllm.log")))
    try:
        _new_epoch(ledger)
    except BaseException:
        ledger.close()
        raise
    return ledger, path


class _DemotedErrors:
    """A pool's durable log reports on this logger: its errors come as warnings, because the pool
    says the one thing that matters to vLLM's operator, once, at ERROR (it detached)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def bind(self, **fields: Any) -> _DemotedErrors:
        return _DemotedErrors(self._inner.bind(**fields))

    def error(self, event: str, **fields: Any) -> None:
        self._inner.warning(event, **fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _new_epoch(ledger: Any) -> None:
    """A log that already holds a run (a restart with the same ``log``): vLLM's cache starts empty, so
    the ledger's does too, in the same log: every step still in flight is aborted (the process that
    sealed it is gone), every request the log left open is cancelled and every cached page evicted.
    What the earlier run left marked stays marked (zeroed once, when first reused)."""
    st = ledger.state
    if not (st.requests or st.cached or st.in_flight):
        return
    if st.in_flight:
        ledger.abort_step(st.in_flight[0].step, "a new epoch: the process that sealed it is gone")
    for r in sorted(st.requests):
        ledger.cancel(r)
    if ledger.cached_count:
        ledger.evict(ledger.cached_count)
