"""The tagged cache: real CPU tensors whose every written byte says who wrote it, and the checker of reads.

A write fills its bytes with the id (an int32, repeated) of a *record*: the group and
precision it was written under, its content (a token position's KV, or a recurrent
state after n tokens, each named by a hash of the tokens it covers), the request and
the step. Zero bytes are zero; poison bytes (0x7F, TensorRT-LLM's fresh-page fill)
read as ``POISON``. A read looks at the ids in the bytes it takes in:

    attention read of block b by request R (group g, dtype d), token slot p:
        id 0              unmasked: unwritten KV (a hit whose writing step did not run) or WRONG
                          masked (p past R's last token): fine
        POISON            STALE
        record of another group or precision        STALE (reinterpreted bytes: the seed's NaN)
        same group and precision, masked            masked same-group read (finite; counted apart)
        same, unmasked, another content             unwritten KV (its write was dropped) or WRONG
    state read (a Mamba block's state bytes, expecting the state after n tokens, or zeros
    for a request with no state yet):
        another group, POISON                       STALE
        another content (another request's state)   STALE, or unwritten (its write was dropped)

WRONG is an emulator or protocol error (0 in every run). A block's bytes carry a version
bumped by every change; a request re-reads a block only when its version moved (what it
read before it reads again unchanged), so each finding is counted once per (request,
block, version). The zeroing goes through kvledger's ``KVCacheZeroer`` over every layer's
cache (attention views and Mamba state tuples), the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["POISON", "Finding", "TaggedCache"]

POISON = 0x7F7F7F7F  # four 0x7F bytes read as an int32


@dataclass
class Finding:
    """The first stale read of a run, named."""

    step: int
    page: int
    group: int
    reader: str
    found: str  # what the bytes held
    previous: str  # who held the block before (the last write the probe saw there)

    def __str__(self) -> str:
        return (f"step {self.step}: request {self.reader} (group {self.group}) read block {self.page} holding "
                f"{self.found}; its previous holder: {self.previous}")


@dataclass
class Counts:
    stale: int = 0
    unwritten: int = 0  # state reads of a hit whose writing step did not run
    unwritten_kv: int = 0  # attention reads of such a hit (what the block held: zeros, if it was zeroed)
    masked_same: int = 0
    wrong: int = 0
    state_reads: int = 0
    kv_block_reads: int = 0
    first: Finding | None = None
    wrong_examples: list = field(default_factory=list)


class TaggedCache:
    """The layers' caches of one planned config (``configs.allocate``), tagged (module docstring)."""

    def __init__(self, planned: Any, caches: dict[str, Any], *, backend: str = "torch") -> None:
        import torch

        from ..zeroing import KVCacheZeroer

        self.torch = torch
        config = planned.config
        self.num_blocks = config.num_blocks
        self.kinds = planned.kinds
        self.attn: dict[int, Any] = {}  # group -> int32 view [B, H, N, W]
        self.state_bytes: dict[int, Any] = {}  # group -> int32 view of each block's state bytes [B, S]
        self.window: dict[int, int | None] = {}
        for gid, group in enumerate(config.kv_cache_groups):
            layer = group.layer_names[0]
            cache = caches[layer]
            if planned.kinds[gid][0] == "mamba":
                first, last = cache[0], cache[-1]
                nbytes = (last.data_ptr() - first.data_ptr()) + last[0].numel() * last.element_size()
                pages = first.view(torch.uint8).reshape(first.shape[0], -1)
                span = torch.empty(0, dtype=torch.uint8)
                span.set_(first.untyped_storage(), first.data_ptr() - first.untyped_storage().data_ptr(),
                          (self.num_blocks, nbytes), (pages.stride(0), 1))
                self.state_bytes[gid] = span.view(torch.int32)
            else:
                self.attn[gid] = cache.view(torch.int32)
                self.window[gid] = getattr(group.kv_cache_spec, "sliding_window", None)
        self.zeroer = KVCacheZeroer(caches, self.num_blocks, backend=backend)
        self.planes = self.zeroer.planes
        self.page_bytes = sum(int(p.shape[1]) for p in self.planes)  # bytes a block owns, every layer
        self.records: list[tuple] = [("zero",)]  # id -> (group, dtype, content, request, step)
        self.version = [0] * self.num_blocks
        self.last_writer: dict[int, int] = {}  # block -> the last record written into it
        self.counts = Counts()
        self.zeroed_blocks = 0

    # ------------------------------------------------------------------ writes

    def _record(self, gid: int, content: Any, request: str, step: int) -> int:
        self.records.append((gid, self.kinds[gid][1], content, request, step))
        return len(self.records) - 1

    def write_tokens(self, gid: int, block: int, slot0: int, contents: list, request: str, step: int) -> None:
        """Attention KV of consecutive token slots ``slot0...`` of ``block``."""
        torch = self.torch
        ids = [self._record(gid, c, request, step) for c in contents]
        self.attn[gid][block, :, slot0 : slot0 + len(ids), :] = torch.tensor(ids, dtype=torch.int32)[None, :, None]
        self.version[block] += 1
        self.last_writer[block] = ids[-1]

    def write_state(self, gid: int, block: int, content: Any, request: str, step: int) -> None:
        rid = self._record(gid, content, request, step)
        self.state_bytes[gid][block, :] = rid
        self.version[block] += 1
        self.last_writer[block] = rid

    def copy_state(self, gid: int, src: int, dst: int) -> None:
        self.state_bytes[gid][dst, :] = self.state_bytes[gid][src, :]
        self.version[dst] += 1

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """vLLM's copy-on-write copies: every layer's tile of ``src`` into ``dst``."""
        for src, dst in pairs:
            for plane in self.planes:
                plane[dst] = plane[src]
            self.version[dst] += 1

    def zero(self, ids: list[int]) -> None:
        """The step's ``new_block_ids_to_zero``, through ``KVCacheZeroer``."""
        if ids:
            self.zeroer.zero_block_ids(list(ids))
            self.zeroed_blocks += len(ids)
            for b in ids:
                self.version[b] += 1

    def poison(self, ids: list[int]) -> None:
        """Fill released blocks with 0x7F in every layer (the sanitizer)."""
        for b in ids:
            for plane in self.planes:
                plane[b] = 0x7F
            self.version[b] += 1

    # ------------------------------------------------------------------ reads

    def _describe(self, rid: int) -> str:
        if rid == 0:
            return "zeros"
        if rid == POISON:
            return "poison (0x7F)"
        gid, dtype, content, request, step = self.records[rid]
        what = "state" if isinstance(content, tuple) else "KV"
        return f"{what} of request {request}, group {gid} ({self.kinds[gid][0]}, {dtype}), step {step}"

    def _stale(self, step: int, block: int, gid: int, reader: str, rid: int) -> None:
        c = self.counts
        c.stale += 1
        if c.first is None:
            prev = self.last_writer.get(block)
            c.first = Finding(step, block, gid, reader, self._describe(rid),
                              self._describe(prev) if prev is not None else "nobody (never written)")

    def read_kv(self, gid: int, reader: str, step: int, block: int, positions: range, seq_len: int,
                expected: list, dropped: set) -> None:
        """Request ``reader`` reads ``block`` of group ``gid`` holding token ``positions`` (slots in
        order); ``expected[p]`` the KV content (a hash of its tokens) of position p < ``seq_len``."""
        torch = self.torch
        tags = self.attn[gid][block]  # [H, N, W]
        first = tags[:, :, :1]
        uniform = bool((tags == first).all())
        slots = first[0, :, 0].tolist() if uniform else None
        records, dtype = self.records, self.kinds[gid][1]
        c = self.counts
        c.kv_block_reads += 1
        stale = masked = unwritten = wrong = False
        for i, p in enumerate(positions):
            ids = (slots[i],) if slots is not None else tuple(torch.unique(tags[:, i, :]).tolist())
            for rid in ids:
                if p >= seq_len:  # masked: past the reader's last token
                    if rid == 0:
                        continue
                    if rid == POISON:
                        stale = stale or rid
                        continue
                    rec = records[rid]
                    if rec[0] != gid or rec[1] != dtype:
                        stale = stale or rid
                    elif rec[3] != reader:
                        masked = True
                    continue
                if rid == POISON:
                    stale = stale or rid
                    continue
                rec = records[rid] if rid else None
                if rec is not None and (rec[0] != gid or rec[1] != dtype):
                    stale = stale or rid
                elif rec is None or rec[2] != expected[p]:
                    if (gid, expected[p]) in dropped:
                        unwritten = True
                    else:
                        wrong = True
                        if len(c.wrong_examples) < 5:
                            c.wrong_examples.append((step, reader, gid, block, p, self._describe(rid)))
        if stale:
            self._stale(step, block, gid, reader, int(stale))
        c.masked_same += masked
        c.unwritten_kv += unwritten
        c.wrong += wrong

    def read_state(self, gid: int, reader: str, step: int, block: int, expected: Any, dropped: set) -> None:
        """Request ``reader`` reads the state in ``block`` expecting ``expected`` (None: zeros, no state yet)."""
        torch = self.torch
        c = self.counts
        c.state_reads += 1
        ids = torch.unique(self.state_bytes[gid][block]).tolist()
        bad = None
        unwritten = False
        for rid in ids:
            if rid == 0:
                if expected is not None:
                    if (gid, expected) in dropped:
                        unwritten = True
                    else:
                        c.wrong += 1
                continue
            if rid == POISON:
                bad = rid
                continue
            rec = self.records[rid]
            if rec[0] != gid:
                bad = rid
            elif rec[2] != expected:
                if expected is not None and (gid, expected) in dropped:
                    unwritten = True
                else:
                    bad = rid  # another request's state (or one its own history did not write)
        if bad is not None:
            self._stale(step, block, gid, reader, bad)
        c.unwritten += unwritten
