"""``--prefix-cache``: each tenant's system prompt, shared through the ledger's prefix cache.

Every prompt is its tenant's system prompt (``DemoConfig.system_prompt_tokens``, drawn
once per tenant) followed by the request's own tokens. The system prompt's full pages
(the prefix: S tokens, S / page_tokens blocks) are what a tenant's requests share:

    admit     hash the prompt's full blocks (``kvledger.core.hashing.block_hashes``, extra
              key: the tenant, so two tenants' blocks never hash alike, under any policy).
              A hit needs every prefix block (``Ledger.lookup``) AND a live snapshot of the
              recurrent state after them; then ``Ledger.share`` appends the prefix pages to
              the request's block table (a cached page leaves the cache, a held one gains a
              sharer), and the snapshot is touched (most recently used) and pinned for the step
    prefill   a hit: the state is read back from the snapshot rows and positions S..P-1 are
              computed: their queries attend over the block table's pages, gathered from
              the planes: the shared prefix pages (K/V another request wrote) and its own.
              A miss: positions 0..S-1 first (the prefix, written into its own pages; the
              state after them is snapshotted and becomes the tenant's prefix state), then
              S..P-1 the same way. Both give bit-identical logits (``RankModel.prefill_span``)
    publish   once the step completed on every rank, a request whose logits were finite
              publishes its full prompt blocks that are not in the cache yet (``Ledger.publish``)
    finish    hashed pages no other request holds become cached; unhashed ones go free
    pressure  a reservation or a snapshot alias that finds too few free pages evicts the least
              recently used cached pages in the same command (the ledger does: PagesEvicted)

Why the state comes from a snapshot instead of recomputing the recurrence over the
prefix: the recurrence of layer l reads the prefix's hidden states at layer l, which
need attention at every layer below, so recomputing the recurrence recomputes the whole
prefix and sharing its KV pages would save memory but no work. The snapshot rows exist
for exactly this: a hybrid model's prefix hit needs the KV pages and the recurrent state
at the same block boundary (as vLLM's hybrid prefix caching keeps it), so without a live
snapshot the lookup is a miss and the cached pages wait for a later request.

Neither a stale page nor another tenant's can be shared: a hashed page is never marked
(the ledger refuses to share one), pages are listed for a clear only when a request
commits them, never when shared, and a tenant's hashes cover its name. The reference run
(no pressure) draws the same prompts and computes both spans itself, sharing nothing:
its logits are the oracle.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from kvledger.core.hashing import block_hashes

from .workload import DemoConfig, RequestSpec

__all__ = ["Admission", "PrefixCache", "alias_counting", "reserve_counting"]


@dataclasses.dataclass
class Admission:
    """What the prefix cache decided for one request: its prompt, its block hashes, the
    prefix blocks it shares (0: a miss) and the prefix state's snapshot pages on a hit."""

    tenant: str
    tokens: torch.Tensor  # the prompt, int64 on the CPU
    token_ids: list  # the same, as ints (what a publish records)
    hashes: list  # one per full prompt block
    hit_blocks: int = 0
    restore: tuple | None = None  # pages of the snapshot holding the state after the prefix
    snapshot: int | None = None


def reserve_counting(ledger: Any, request: int, n: int, tenant: str | None) -> tuple[tuple[int, ...], int]:
    """``Ledger.reserve``, and how many cached pages it evicted to do so (run through ``engine.call``)."""
    before = ledger.cached_count
    pages = ledger.reserve(request, n, tenant=tenant)
    return pages, before - ledger.cached_count


def alias_counting(ledger: Any, snapshot: int, n: int) -> tuple[tuple[int, ...], int]:
    """``Ledger.alias_snapshot``, and how many cached pages it evicted to do so."""
    before = ledger.cached_count
    pages = ledger.alias_snapshot(snapshot, n)
    return pages, before - ledger.cached_count


def _admit_one(ledger: Any, request: int, tenant: str, hashes: Sequence[bytes], live: bool, full: int,
               state_pages: int, avail: int) -> tuple[int, int] | None:
    """One admission decision, in one ledger call: ``(prefix blocks shared, pages it costs)``,
    or ``None`` when it does not fit in ``avail`` (nothing shared then).

    A hit (``live`` prefix state and every prefix block cached or held) costs the request's
    pages less the prefix's, plus the prefix pages that leave the cache (they stop counting
    as free capacity). A miss costs its pages plus ``state_pages``, the snapshot of the state
    after its prefix, which becomes the tenant's prefix state (kept out of what admission
    may count on, so that the tails of running requests never have to evict it)."""
    n = len(hashes)
    hit = live and ledger.lookup(hashes, tenant=tenant) == n
    cost = full + state_pages
    if hit:
        page_of = ledger.state.hash_page
        cost = full - n + sum(1 for h in hashes if not ledger.holders_of(page_of[h]))
    if cost > avail:
        return None
    if hit:
        ledger.share(request, hashes, tenant=tenant)
    return (n if hit else 0), cost


def _publish_blocks(ledger: Any, items: Sequence[tuple[int, str, list, list]], page_tokens: int) -> int:
    """Publish each request's full prompt blocks that are not in the cache yet (own pages
    whose hash no page holds), run by run, each with its parent hash. Returns the pages."""
    total = 0
    for request, tenant, hashes, token_ids in items:
        table = ledger.kv_pages(request)
        todo = [ledger.block_hash(table[i]) is None and ledger.lookup((h,), tenant=tenant) == 0
                for i, h in enumerate(hashes)]
        i = 0
        while i < len(hashes):
            if not todo[i]:
                i += 1
                continue
            j = i
            while j < len(hashes) and todo[j]:
                j += 1
            ledger.publish(request, hashes[i:j], token_ids[i * page_tokens : j * page_tokens], start=i,
                           parent_hash=hashes[i - 1] if i else None)
            total += j - i
            i = j
    return total


class PrefixCache:
    """The serving loop's prefix-cache side (module docstring). ``share=False`` (the
    reference run) draws the same prompts and splits prefill the same way, but never
    looks up, shares or publishes. Counts go to ``res`` (a ``RunResult``)."""

    def __init__(self, config: DemoConfig, vocab: int, res: Any, *, share: bool) -> None:
        self.pt = config.page_tokens
        self.split = config.prefix_tokens()
        self.blocks = self.split // self.pt
        self.system_tokens = config.system_prompt_tokens()
        self.seed = config.seed
        self.vocab = vocab
        self.share = share
        self.res = res
        self.systems: dict[str, torch.Tensor] = {}
        self.admissions: dict[int, Admission] = {}
        self.states: dict[bytes, int] = {}  # last prefix block's hash -> snapshot of the state after it
        self.state_key: dict[int, bytes] = {}
        self.pinned: set[int] = set()  # snapshots a prefill reads this step: not evictable before its graph

    def _system_prompt(self, tenant: str) -> torch.Tensor:
        got = self.systems.get(tenant)
        if got is None:
            g = torch.Generator().manual_seed(self.seed * 7_000_003 + zlib.crc32(tenant.encode()))
            got = self.systems[tenant] = torch.randint(0, self.vocab, (self.system_tokens,), generator=g)
        return got

    def prepare(self, spec: RequestSpec, gen: torch.Generator) -> Admission:
        """The request's prompt (its tenant's system prompt, then its own tokens from ``gen``)
        and block hashes; kept until the request is admitted."""
        got = self.admissions.get(spec.request)
        if got is None:
            own = torch.randint(0, self.vocab, (spec.prompt_tokens - self.system_tokens,), generator=gen)
            tokens = torch.cat([self._system_prompt(spec.tenant), own])
            ids = tokens.tolist()
            got = Admission(tenant=spec.tenant, tokens=tokens, token_ids=ids,
                            hashes=block_hashes(ids, self.pt, extra_keys=(spec.tenant,)) if self.share else [])
            self.admissions[spec.request] = got
        return got

    async def admit(self, engine: Any, spec: RequestSpec, gen: torch.Generator, avail: int,
                    snapshots: Any, snap_pages: int) -> int | None:
        """Decide the head request's admission: share the prefix on a hit. Returns the pages
        it costs, or ``None`` when it does not fit in ``avail`` (nothing changed).
        ``snapshots``: the loop's snapshot cache (an ``OrderedDict``, least recent first)."""
        adm = self.prepare(spec, gen)
        full = spec.pages(self.pt)
        if not self.share:
            return full if full <= avail else None
        sid = self.states.get(adm.hashes[self.blocks - 1])
        live = sid is not None and snapshots[sid].saved[0] is not None  # written by a completed step
        got = await engine.call(_admit_one, spec.request, spec.tenant, adm.hashes[: self.blocks], live, full,
                                snap_pages, avail)
        if got is None:
            return None
        hit, cost = got
        res = self.res
        res.prefix_requests += 1
        res.prefix_tokens_looked += spec.prompt_tokens
        if hit and sid is not None:  # (a hit needs a live prefix state)
            adm.hit_blocks, adm.restore, adm.snapshot = hit, snapshots[sid].pages, sid
            snapshots.move_to_end(sid)
            self.pinned.add(sid)
            res.prefix_hits += 1
            res.prefix_hit_tokens += hit * self.pt
            res.pages_shared += hit
        return cost

    def checkpoints(self, spec: RequestSpec, every: int) -> tuple[int, ...]:
        """The request's snapshot checkpoints: a hit computes nothing up to the prefix, so it
        snapshots only after it."""
        adm = self.admissions[spec.request]
        cps = spec.checkpoints(every, self.split)
        return tuple(c for c in cps if c > self.split) if adm.hit_blocks else cps

    def note_snapshot(self, request: int, tokens: int, sid: int) -> None:
        """A snapshot of the request's state after ``tokens`` tokens was aliased: after the
        prefix, on a miss, it becomes the tenant's prefix state (the newest one wins)."""
        adm = self.admissions[request]
        if not self.share or tokens != self.split or adm.hit_blocks:
            return
        key = adm.hashes[self.blocks - 1]
        old = self.states.get(key)
        if old is not None:
            self.state_key.pop(old, None)
        self.states[key] = sid
        self.state_key[sid] = key

    def forget_snapshot(self, sid: int) -> None:
        """The snapshot was released: a prefix state no more."""
        key = self.state_key.pop(sid, None)
        if key is not None and self.states.get(key) == sid:
            del self.states[key]

    async def publish(self, engine: Any, requests: Sequence[int]) -> None:
        """Publish the full prompt blocks of requests whose prefill step completed with finite logits."""
        if not self.share or not requests:
            return
        adms = [(rid, self.admissions[rid]) for rid in requests]
        items = [(rid, adm.tenant, adm.hashes, adm.token_ids) for rid, adm in adms]
        self.res.pages_published += await engine.call(_publish_blocks, items, self.pt)

    def end_step(self, admitted: Sequence[int]) -> None:
        """The step is over: unpin, and drop the prompts of requests that were admitted."""
        self.pinned.clear()
        for rid in admitted:
            self.admissions.pop(rid, None)
