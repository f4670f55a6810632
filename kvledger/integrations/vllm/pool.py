"""``LedgerBlockPool``: vLLM's ``BlockPool`` with every block transition recorded in a kvledger ``Ledger``.

vLLM's KV cache manager (``KVCacheManager`` -> ``KVCacheCoordinator`` -> one
``SingleTypeKVCacheManager`` per KV cache group) and its tests read the pool's
own structures directly: the ``KVCacheBlock`` objects (``ref_cnt``, the block
hash, the null block), the free queue whose order is vLLM's eviction order, the
hash map with its duplicates. So this pool keeps them exactly as vLLM's code
keeps them (it is a ``BlockPool``, and vLLM's methods decide which block goes
where), and mirrors each transition into the ledger through ``PageHolds``
(``holds.py``: which events, and why), naming the pages vLLM chose:

    get_new_blocks ─► PagesEvicted? + PagesReserved + PagesCommitted (open step)
    touch          ─► PagesShared                      free_blocks ─► RequestFinished
    cache_full_blocks / cache_partial_block / move_block_hashes ─► PagesPublished
    evict_blocks / reset_prefix_cache / eviction on reuse        ─► PagesEvicted
    take_block_ids_to_zero() ─► StepSealed + StepCompleted: the pages to zero

The ledger checks each transition against its own rules (a page is handed out
only when free or cached, released only by a holder, shared only when hashed
and not stale, ...) and raises a ``KVLedgerError`` naming the page when vLLM's
call sequence breaks one; vLLM's state has then already changed (the pool is
the mirror, not the gate). ``verify()`` compares the two sides page by page.

KV events: ``take_events`` is vLLM's (the events its methods built for these
calls, with every field vLLM's consumers read); the ledger's own
``BlocksStored`` / ``BlocksRemoved`` effects record the same hashes, and
``kvledger events LOG`` exports them from a durable log.

Importing this module imports vLLM (``kvledger.integrations.vllm`` loads it on
first use). Tested with the versions in ``VLLM_VERSIONS``.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable
from operator import is_
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.block_pool import BlockPool

from ...core.errors import ConfigurationError, InvariantViolation
from ...core.events import Geometry
from ...core.ledger import Ledger
from .holds import PageHolds

__all__ = ["LedgerBlockPool", "PoolOptions"]


@dataclass(frozen=True)
class PoolOptions:
    """How each ``LedgerBlockPool`` records (``install`` passes these; see its docstring).

    ``log``: None (an in-memory ledger), a log file path, or an existing directory
    (each pool then writes ``pool-<n>.kvlog`` in it). ``fsync``: the durable log's
    policy ("background" by default: appends never wait for the disk).
    ``policy``: the ledger's clear policy. ``per_page``: one page per hold (None:
    as the policy needs). ``check``: every ledger invariant after every event;
    ``verify``: ``verify()`` after every pool call (both for tests: O(pages) each).
    """

    log: str | os.PathLike | None = None
    fsync: str = "background"
    policy: str = "released_aliases"
    per_page: bool | None = None
    check: bool = False
    verify: bool = False


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
        geometry = Geometry(num_pages=self.num_gpu_blocks, page_tokens=self.hash_block_size)
        self.ledger, self.log_path = _open(opts, geometry)
        self._verify = opts.verify
        self._in_alloc = False
        self.last_block_ids_to_zero: list[int] = []  # what the last scheduler step's seal listed
        try:
            self.holds = PageHolds(self.ledger, null_page=self.null_block.block_id, per_page=opts.per_page)
        except Exception:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the durable log (flushes it); an in-memory ledger has nothing to close. Idempotent."""
        close = getattr(self.ledger, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ the clear list

    def take_block_ids_to_zero(self) -> list[int]:
        """The block ids to zero before the next forward pass (vLLM's ``new_block_ids_to_zero``).

        Seals the ledger's open step and returns the clear lists of every step
        sealed since the last call: pages the policy marked (a released snapshot
        row, another tenant's bytes, any reuse under ``all_reused``) that a
        request committed since. Under ``released_aliases`` nothing in vLLM marks
        a page, and the list is empty.
        """
        return self.holds.take_clear_list()

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
        # (the pool's own blocks, from its free queue; the cached ones among them vLLM just evicted,
        # which holds.allocate evicts in the ledger first, in one event)
        self.holds.allocate([b.block_id for b in blocks])
        if self._verify:
            self.verify()
        return blocks

    def touch(self, blocks) -> None:
        blocks = list(blocks)
        super().touch(blocks)
        pages = self._own(blocks)
        self.holds.share(self._pages(blocks) if pages is None else pages)
        if self._verify:
            self.verify()

    def free_blocks(self, ordered_blocks: Iterable) -> None:
        blocks = list(ordered_blocks)
        pages, counts = self._pages_and_refs(blocks)
        super().free_blocks(blocks)
        self.holds.release(pages, counts)
        if self._verify:
            self.verify()

    def unpin_blocks(self, blocks, on_reuse) -> None:
        blocks = list(blocks)
        pages, counts = self._pages_and_refs(blocks)
        super().unpin_blocks(blocks, on_reuse)
        self.holds.release(pages, counts)
        if self._verify:
            self.verify()

    def cache_full_blocks(self, request, blocks, num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask: list[bool] | None = None) -> None:
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size,
                                  kv_cache_group_id, block_mask)
        end = min(num_full_blocks, len(blocks))
        k = self.hash_block_size
        if end - num_cached_blocks == 1 and block_size == k and block_mask is None:
            # (the commonest call: the one block a decode step filled, the pool's own, hashed now)
            blk = blocks[num_cached_blocks]
            key = blk.block_hash
            if key is not None and self._mine(blk):
                prev = blocks[num_cached_blocks - 1] if num_cached_blocks else None
                self.holds.publish_blocks([blk.block_id], [key],
                                          tuple(request.all_token_ids[num_cached_blocks * k : end * k]),
                                          prev.block_id if prev is not None and self._mine(prev) else None)
                if self._verify:
                    self.verify()
                return
        if num_cached_blocks < end:
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
        if self._verify:
            self.verify()

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
        key = super().cache_partial_block(request, block, num_tokens, kv_cache_group_id, block_size,
                                          replace_existing_hashes)
        if block.block_hash is not None and self._mine(block):
            n = block.block_hash_num_tokens or num_tokens
            self.holds.publish([(block.block_id, block.block_hash, self._tokens(request, n), None)])
        if self._verify:
            self.verify()
        return key

    def move_block_hashes(self, src_block, dst_block) -> None:
        tokens = self.holds.tokens_of(src_block.block_id) if self._mine(src_block) else None
        super().move_block_hashes(src_block, dst_block)
        if dst_block.block_hash is not None and tokens is not None and self._mine(dst_block):
            self.holds.publish([(dst_block.block_id, dst_block.block_hash, tokens, None)])
        self.holds.drop_hashes(self._pages([src_block]))
        if self._verify:
            self.verify()

    def _maybe_evict_cached_block(self, block) -> bool:
        # (vLLM's Mamba manager calls it directly, for a checkpoint block it overwrites)
        evicted = super()._maybe_evict_cached_block(block)
        if evicted and not self._in_alloc:  # (get_new_blocks mirrors its own evictions at once)
            self.holds.drop_hashes(self._pages([block]))
            if self._verify:
                self.verify()
        return evicted

    def evict_blocks(self, block_ids: set[int]) -> None:
        super().evict_blocks(block_ids)
        self.holds.drop_hashes([i for i in block_ids if self.blocks[i].block_hash is None])
        if self._verify:
            self.verify()

    def reset_prefix_cache(self) -> bool:
        ok = super().reset_prefix_cache()
        if ok:
            self.holds.evict_all()
            if self._verify:
                self.verify()
        return ok

    # ------------------------------------------------------------------ checks

    def verify(self) -> None:
        """Compare vLLM's blocks with the ledger page by page; raise ``InvariantViolation`` naming
        the first page where they disagree. O(num_gpu_blocks)."""
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
            if blk.block_hash is not None and holds.key_of(p) is None:
                raise InvariantViolation(1, f"block {p} is hashed in vLLM but not published in the ledger")
            if refs == 0 and holds.key_of(p) is not None and blk.block_hash is None:
                raise InvariantViolation(1, f"block {p} is free in vLLM but cached in the ledger")
        free = ledger.free_count + ledger.cached_count
        if free != self.get_num_free_blocks():
            raise InvariantViolation(1, f"vLLM has {self.get_num_free_blocks()} free blocks, the ledger {free} "
                                        f"free or cached pages")

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
    if opts.log is None:
        return Ledger(geometry, policy=opts.policy, check=opts.check), None
    from ...durable import open_ledger

    path = pathlib.Path(opts.log)
    if path.is_dir():
        LedgerBlockPool._opened += 1
        path = path / f"pool-{os.getpid()}-{LedgerBlockPool._opened}.kvlog"
    return open_ledger(path, geometry, policy=opts.policy, fsync=opts.fsync, check=opts.check), path
