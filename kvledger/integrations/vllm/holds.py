"""vLLM's block references as ledger requests ("holds"): the mirror under ``LedgerBlockPool``.

One piece: ``PageHolds`` is one class whose maps (holds, writers, keys, pins) every
transition updates together; the one-block fast paths sit beside the general calls.

vLLM's ``BlockPool`` counts references to a block (``ref_cnt``) without saying
who holds them: ``get_new_blocks(n)`` and ``touch(blocks)`` add references,
``free_blocks(blocks)`` drops one per listed block, in any grouping. The ledger
names a holder for every page. ``PageHolds`` bridges the two: each call that
adds references creates one *hold*, a ledger request id, and every reference is
one (hold, page) pair, so a block's ``ref_cnt`` is the number of holds whose
KV pages hold it (``kv(R)``, ``|R| == ref_cnt``):

    vLLM call                         ledger events (pages named as vLLM chose them)
    get_new_blocks(n)  ─► [PagesEvicted(cached pages vLLM evicted)]
                          PagesReserved(h, pages) ─► PagesCommitted(h, open step, pages)
                          (one command: Ledger.allocate(h, step, pages=...))
    touch(blocks)      ─► PagesShared(h, pages)             (prefix hits: hashed pages)
    free_blocks(...)   ─► RequestFinished(h) per hold whose every page is released
    cache_full_blocks  ─► [StepSealed + StepCompleted] ─► PagesPublished(writer hold, run)
    eviction / reset   ─► PagesEvicted(pages)

A reference the ledger cannot name is a *pin*: a ``touch`` of an unhashed held
block (a connector keeping it while it copies it: the ledger shares hashed pages
only) or a reference vLLM's managers take by bumping ``ref_cnt`` themselves
(copy-on-write endpoints; ``pin``). Pins are counted, not recorded; they are
released first, so the page stays held in the ledger while vLLM counts any
reference. A ``touch`` of a free unhashed block (vLLM's tests hand such blocks
over as cache hits) is recorded like an allocation.

A hold is released whole (``RequestFinished``). When vLLM drops only some pages
of a hold (a sliding-window group freeing blocks that left its window), the
hold is *split*: it finishes, and the pages it keeps are shared (hashed ones)
or reserved and committed again (the others) by a new hold in the same
command. That is exact under ``released_aliases``, where a page going free
carries no mark; under the policies that mark a page when its holder lets go
(``cross_tenant``, ``all_reused``) a split would list kept KV for a clear, so
there every hold is one page (``per_page=True``), which never splits. A ledger
event for "release these pages of a live request" would make splits
unnecessary (see docs/VLLM.md).

Steps. Pages are committed into the ledger's open step, always by a new hold
(hold ids grow, so the holds made since the last seal are exactly those whose
pages the open step holds); ``seal`` seals it and records rank 0's completion
at once: vLLM runs every reader of a block after
its writer on the model stream, which is what the ledger's rule "publish only
pages whose step completed" protects. A publish of pages committed in the open
step seals it first, so one vLLM scheduler step may span several ledger steps;
``take_clear_list`` seals and returns the union of their clear lists.

Ledger block hashes are vLLM's ``BlockHashWithGroupId`` bytes. vLLM may cache
two blocks under one hash (it never de-duplicates); the ledger's hashes are
unique, so the second block is published as that hash plus its page id. A
block whose hash vLLM drops while it is held keeps its ledger hash until it is
released, then is evicted in the ledger (a held page cannot lose its hash).

Pure bookkeeping over a ``Ledger``'s public commands: no vLLM, no torch. Every
method raises what the ledger raises when vLLM's transition breaks a ledger
precondition (a ``KVLedgerError``), and then the ledger is unchanged by that
event; the mirror is only as consistent as vLLM's call sequence. The common
calls (``allocate``, ``release`` of distinct pages, ``publish`` of one
request's new full blocks) take one pass over their pages with C-level set
operations: the scheduler calls them on every step. A call of one block (a decode
step's ``get_new_blocks(1)``, the block that just filled, one block freed) skips even
those passes: the same events and holds, from a path of its own.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from operator import gt
from typing import cast

from ...core.errors import ConfigurationError, InvalidArgumentError

__all__ = ["NULL_HOLD", "PageHolds", "Publish"]

NULL_HOLD = 0  # the ledger request that holds vLLM's null block, for good
_MAX_KEY = 60  # bytes of a ledger block hash before a page id is appended (the ledger takes 1-64)

# A block to publish: (page, vLLM hash key, its tokens, the page of the block before it in the
# request, or None at the start of the sequence)
Publish = tuple[int, bytes, Sequence[int], "int | None"]


def _key(raw: bytes) -> bytes:
    return raw if len(raw) <= _MAX_KEY else hashlib.blake2b(raw, digest_size=32).digest()


class PageHolds:
    """Holds of vLLM block references as ledger requests, over ``ledger``.

    ``null_page``: vLLM's null block, held by ``NULL_HOLD`` from the start (never
    free). ``per_page``: one page per hold (required by the marking policies).
    Raises ``ConfigurationError`` for ``per_page=False`` under a marking policy.
    """

    def __init__(self, ledger, *, null_page: int | None = 0, per_page: bool | None = None) -> None:
        policy = ledger.state.policy
        if per_page is None:
            per_page = policy != "released_aliases"
        if not per_page and policy != "released_aliases":
            raise ConfigurationError(f"holds of several pages split by release and re-commit, which under the "
                                     f"{policy!r} policy would list kept KV for a clear: use per_page=True")
        self.ledger = ledger
        self.per_page = bool(per_page)
        self._refs: dict[int, list[int]] = {}  # page -> holds holding it (acquisition order)
        self._pages: dict[int, list[int]] = {}  # hold -> its pages, in its ledger block-table order
        self._writer: dict[int, int] = {}  # page -> the hold that reserved and committed it (it may publish it)
        self._key_of: dict[int, bytes] = {}  # page -> its ledger block hash
        self._page_of: dict[bytes, int] = {}  # ledger block hash -> page
        self._stale: set[int] = set()  # held pages whose hash vLLM dropped: evicted once released
        self._tokens: dict[int, tuple[tuple, int]] = {}  # page -> (its publish's tokens, its offset in them)
        self._pins: dict[int, int] = {}  # page -> references to an unhashed held page the ledger cannot record
        self._next = NULL_HOLD + 1
        self._sealed_below = NULL_HOLD  # holds below this committed in a step sealed and completed
        self._dirty = False  # pages were committed in the open step
        self._clear: list[int] = []  # clear lists sealed since take_clear_list
        self._k = ledger.geometry.page_tokens
        self.splits = 0  # holds split by a partial release (statistics)
        if null_page is not None:
            self._reserve_commit(NULL_HOLD, (null_page,))

    # ------------------------------------------------------------------ queries

    def refs(self, page: int) -> int:
        """References on ``page``: the holds holding it plus its pins (vLLM's ``ref_cnt``)."""
        return len(self._refs.get(page, ())) + self._pins.get(page, 0)

    def holds_of(self, page: int) -> tuple[int, ...]:
        return tuple(self._refs.get(page, ()))

    def key_of(self, page: int) -> bytes | None:
        """The page's ledger block hash (None: not published)."""
        return self._key_of.get(page)

    def tokens_of(self, page: int) -> tuple[int, ...] | None:
        """The tokens ``page`` was published with (None: not published)."""
        tokens, at = self._tokens.get(page, ((), 0))
        return tokens[at : at + self._k] if tokens else None

    # ------------------------------------------------------------------ transitions

    def allocate(self, pages: Sequence[int]) -> None:
        """vLLM's ``get_new_blocks`` handed out ``pages`` (free blocks, evicting cached ones)."""
        key_of = self._key_of
        if len(pages) == 1:  # (the commonest call: a decode step's next block, often a cached one)
            p = pages[0]
            if p in key_of:
                self._evict([p])
            h = self._next
            self._next = h + 1
            ledger = self.ledger
            ledger.allocate(h, ledger.open_step, pages=(p,))
            self._pages[h] = [p]
            self._refs[p] = [h]
            self._writer[p] = h
            self._dirty = True
            return
        if key_of and not key_of.keys().isdisjoint(pages):
            self._evict([p for p in pages if p in key_of])
        if self.per_page:
            for p in pages:
                self._reserve_commit(self._new_hold(), (p,))
        elif pages:
            h = self._next
            self._next = h + 1
            self._reserve_commit(h, tuple(pages))

    def share(self, pages: Sequence[int]) -> None:
        """vLLM's ``touch`` added a reference to each page.

        A hashed page (a prefix hit) is shared by a new hold. An unhashed page
        (a connector pinning a held block while it copies it) cannot be shared in
        the ledger, which shares hashed pages only: the reference is a *pin*,
        counted here and not recorded; the page stays held by its holds until
        its last reference, pins included, is released.
        """
        key_of, refs = self._key_of, self._refs
        hashed: list[int] = []
        adopted: list[int] = []
        for p in pages:
            if p in key_of:
                hashed.append(p)
            elif p in refs:
                self._pins[p] = self._pins.get(p, 0) + 1
            else:
                adopted.append(p)  # a free block handed over as if cached: it changes holder like an allocation
        if hashed:
            for group in self._groups(hashed):
                h = self._new_hold()
                self.ledger.share(h, tuple(map(key_of.__getitem__, group)))
                self._add(h, group)
        if adopted:
            for group in self._groups(adopted):
                self._reserve_commit(self._new_hold(), tuple(group))

    def pin(self, page: int, n: int = 1) -> None:
        """``n`` references vLLM's code took on a held page outside the pool (a manager bumping
        ``ref_cnt`` for a pending copy): counted as pins, not recorded. Raises
        ``InvalidArgumentError`` for a page the ledger does not hold (nothing changed)."""
        if page not in self._refs:
            raise InvalidArgumentError(f"a reference to page {page}, which the ledger holds as "
                                       f"{self.ledger.holder_of(page)}")
        self._pins[page] = self._pins.get(page, 0) + n

    def adopt(self, pages: Sequence[int], ref_counts: Sequence[int]) -> None:
        """vLLM counts ``ref_counts[i]`` references on ``pages[i]``: those beyond the holds' and
        pins' become pins (references vLLM's managers took by bumping ``ref_cnt`` themselves,
        copy-on-write endpoints). Raises as ``pin`` does (earlier pages stay adopted)."""
        refs, pins = self._refs, self._pins
        for p, n in zip(pages, ref_counts, strict=True):
            extra = n - len(refs.get(p, ())) - pins.get(p, 0)
            if extra > 0:
                self.pin(p, extra)

    def release(self, pages: Sequence[int], ref_counts: Sequence[int] | None = None) -> None:
        """vLLM dropped one reference per listed page (``free_blocks``, ``unpin_blocks``);
        ``ref_counts``: vLLM's counts before the release (``adopt`` them first).

        Whole holds finish; a hold losing only some pages is split (see the module
        docstring). Pages left unheld whose hash vLLM dropped are evicted. Raises
        ``InvalidArgumentError`` before any change when a page has no reference.
        """
        if not pages:
            return
        if len(pages) == 1 and not self._pins:  # (the commonest call: one block of its own hold)
            held1 = self._refs.get(pages[0])
            if held1 is not None and len(held1) == 1 and (ref_counts is None or ref_counts[0] <= 1):
                h = held1[0]
                if len(self._pages[h]) == 1:
                    self._finish(h)
                    if self._stale:
                        self._evict_stale()
                    return
        found = list(map(self._refs.get, pages))
        if None in found:
            if ref_counts is not None:
                self.adopt(pages, ref_counts)  # (raises for the page vLLM holds and the ledger does not)
            bad = pages[found.index(None)]
            raise InvalidArgumentError(f"release of page {bad}, which the ledger holds no reference to")
        held = cast("list[list[int]]", found)
        sizes = list(map(len, held))
        if ref_counts is not None and any(map(gt, ref_counts, sizes)):
            self.adopt(pages, ref_counts)
        left = set(pages)
        if self._pins or len(left) != len(pages):
            self._release_counted(Counter(pages))
            return
        # Holds finish in the reverse of the order their pages are listed: vLLM lists a request's
        # blocks last first and puts them back at the head of its free queue in that order, and
        # each finished hold pushes its pages onto the ledger's free stack in block-table order,
        # so the stack's top is the head of vLLM's queue again (its next choice is the ledger's).
        own = self._pages
        order = list(dict.fromkeys([hs[0] for hs in held] if max(sizes) == 1 else chain.from_iterable(held)))
        order.reverse()
        if max(sizes) > 1:  # (shared pages: the larger holds first, so a smaller one does not take
            order.sort(key=lambda h: -len(own[h]))  # a page the larger one needs to finish whole)
        partial: list[int] = []
        for h in order:
            hp = own[h]
            if left.issuperset(hp):
                left.difference_update(hp)
                self._finish(h)
            else:
                partial.append(h)
        for h in partial:
            drop = [q for q in own[h] if q in left]
            if drop:
                left.difference_update(drop)
                self._split(h, drop)
        if self._stale:
            self._evict_stale()

    def publish_blocks(self, pages: list[int], keys: list[bytes], tokens: tuple, parent: int | None) -> None:
        """``publish`` of consecutive blocks of one vLLM request (``cache_full_blocks``): ``pages``
        with their vLLM hash keys, ``tokens`` theirs (``page_tokens`` each, in order), ``parent``
        the page before them in the request (None at its start). One ``PagesPublished`` when
        they are a run of one hold, none published yet and every key new (the usual case);
        otherwise block by block, as ``publish``."""
        k = len(pages)
        key_of, page_of, writer = self._key_of, self._page_of, self._writer
        h = writer.get(pages[0])
        if k == 1:  # (the commonest call: a decode step's block that just filled)
            p, key = pages[0], keys[0]
            if h is not None and p not in key_of and key not in page_of and len(key) <= _MAX_KEY:
                hp = self._pages[h]
                start = 0 if hp[0] == p else hp.index(p)  # (a hold's writer is in its pages)
                if h >= self._sealed_below:
                    self.seal()  # (committed in the open step: its step completes first)
                self.ledger.publish(h, (key,), tokens, start=start,
                                    parent_hash=None if parent is None else key_of.get(parent))
                key_of[p] = key
                page_of[key] = p
                self._tokens[p] = (tokens, 0)
                return
        if (h is not None and key_of.keys().isdisjoint(pages) and max(map(len, keys)) <= _MAX_KEY
                and page_of.keys().isdisjoint(keys) and (k == 1 or len(set(keys)) == k)):
            hp = self._pages[h]
            start = hp.index(pages[0])
            if hp[start : start + k] == pages:
                if h >= self._sealed_below:
                    self.seal()  # (pages committed in the open step: their step completes first)
                lkeys = tuple(keys)
                self.ledger.publish(h, lkeys, tokens, start=start,
                                    parent_hash=None if parent is None else key_of.get(parent))
                key_of.update(zip(pages, lkeys, strict=True))
                page_of.update(zip(lkeys, pages, strict=True))
                at = range(0, k * self._k, self._k)
                self._tokens.update(zip(pages, zip(repeat(tokens), at, strict=False), strict=True))
                return
        step = self._k
        self.publish([(p, key, tokens[i * step : (i + 1) * step], parent if i == 0 else pages[i - 1])
                      for i, (p, key) in enumerate(zip(pages, keys, strict=True))])

    def publish(self, blocks: Sequence[Publish]) -> None:
        """vLLM cached these blocks (gave them a primary hash): publish them in the ledger.

        A page the ledger has already published keeps its ledger hash (a held
        page's hash cannot change); it is no longer stale. Runs of pages written
        by one hold, in its block-table order, go in one ``PagesPublished``; a
        run's parent is the ledger hash of the block before it in vLLM's request.
        """
        key_of, page_of, writer, own = self._key_of, self._page_of, self._writer, self._pages
        runs: list[list] = []  # [hold, start, pages, keys, tokens, parent key]
        fresh: dict[bytes, int] = {}  # keys of this call (a page's key is recorded once it is published)
        for page, raw, tokens, parent in blocks:
            if page in key_of:
                self._stale.discard(page)
                continue
            key = _key(raw)
            if key in page_of or key in fresh:
                key = _key(raw + page.to_bytes(4, "big"))
            fresh[key] = page
            h = writer.get(page)
            if h is None:
                raise InvalidArgumentError(f"page {page} is cached by vLLM but no hold the ledger knows wrote it")
            run = runs[-1] if runs else None
            if run is not None and run[0] == h:
                i = run[1] + len(run[2])
                hp = own[h]
                if i < len(hp) and hp[i] == page:
                    run[2].append(page)
                    run[3].append(key)
                    run[4].append(tokens)
                    continue
            pkey = None if parent is None else key_of.get(parent)
            if pkey is None and run is not None and run[2][-1] == parent:  # (published by this call)
                pkey = run[3][-1]
            runs.append([h, own[h].index(page), [page], [key], [tokens], pkey])
        if not runs:
            return
        if any(run[0] >= self._sealed_below for run in runs):
            self.seal()  # (pages committed in the open step: their step completes first)
        ledger, keep, k = self.ledger, self._tokens, self._k
        for h, start, pages, keys, toks, pkey in runs:
            tokens = tuple(chain.from_iterable(toks))
            ledger.publish(h, tuple(keys), tokens, start=start, parent_hash=pkey)
            key_of.update(zip(pages, keys, strict=True))
            page_of.update(zip(keys, pages, strict=True))
            keep.update(zip(pages, zip(repeat(tokens), range(0, len(pages) * k, k), strict=False), strict=True))

    def drop_hashes(self, pages: Iterable[int]) -> None:
        """vLLM removed the hash of these pages: unheld ones are evicted now, held ones once released."""
        cached = []
        for p in pages:
            if p not in self._key_of:
                continue
            if p in self._refs:
                self._stale.add(p)
            else:
                cached.append(p)
        if cached:
            self._evict(cached)

    def evict_all(self) -> tuple[int, ...]:
        """Every cached page goes free (vLLM's ``reset_prefix_cache``). Returns the pages."""
        pages = tuple(p for p in self._key_of if not self._refs.get(p))
        if pages:
            self._evict(list(pages))
        return pages

    # ------------------------------------------------------------------ steps

    def seal(self) -> tuple[int, ...]:
        """Seal the open step if pages were committed in it, record rank 0's completion, and
        return its clear list (also kept for ``take_clear_list``)."""
        if not self._dirty:
            return ()
        ledger = self.ledger
        step = ledger.open_step
        plan = ledger.seal_step(step)
        ledger.complete_step(step, 0)
        self._sealed_below = self._next
        self._dirty = False
        if plan.clear_list:
            self._clear.extend(plan.clear_list)
        return plan.clear_list

    def take_clear_list(self) -> list[int]:
        """Seal, and return the pages to zero before the next forward pass: the clear lists of
        every step sealed since the last call, each page once, in listing order."""
        if self._dirty:
            self.seal()
        if not self._clear:
            return []
        out = list(dict.fromkeys(self._clear))
        self._clear.clear()
        return out

    # ------------------------------------------------------------------ internals

    def _new_hold(self) -> int:
        h = self._next
        self._next = h + 1
        return h

    def _groups(self, pages: Sequence[int]) -> list[list[int]]:
        """``pages`` cut into holds: one page each (per_page), else runs without a repeated page."""
        if self.per_page:
            return [[p] for p in pages]
        if len(set(pages)) == len(pages):
            return [list(pages)]
        groups: list[list[int]] = [[]]
        seen: set[int] = set()
        for p in pages:
            if p in seen:
                groups.append([])
                seen = set()
            groups[-1].append(p)
            seen.add(p)
        return [g for g in groups if g]

    def _add(self, h: int, pages: Sequence[int]) -> None:
        """Hold ``h`` shares ``pages`` (it did not write them)."""
        self._pages[h] = list(pages)
        refs = self._refs
        for p in pages:
            held = refs.get(p)
            if held is None:
                refs[p] = [h]
            else:
                held.append(h)

    def _reserve_commit(self, h: int, pages: tuple[int, ...]) -> None:
        """Hold ``h`` (new, above every hold committed before) writes ``pages``, free in the ledger
        (so no hold holds them)."""
        ledger = self.ledger
        ledger.allocate(h, ledger.open_step, pages=pages)
        self._pages[h] = list(pages)
        if len(pages) == 1:
            p = pages[0]
            self._refs[p] = [h]
            self._writer[p] = h
        else:
            self._refs.update(zip(pages, [[h] for _ in pages], strict=True))
            self._writer.update(dict.fromkeys(pages, h))
        self._dirty = True

    def _finish(self, h: int) -> None:
        self.ledger.finish(h)
        refs = self._refs
        hp = self._pages.pop(h)
        held = list(map(refs.pop, hp))
        if max(map(len, held)) > 1:  # shared pages: the other holds keep them
            for p, hs in zip(hp, held, strict=True):
                if len(hs) > 1:
                    hs.remove(h)
                    refs[p] = hs
        writer = self._writer
        if writer.get(hp[0]) == h:  # (a hold wrote all of its pages or none)
            for p in hp:
                del writer[p]

    def _release_counted(self, need: Counter) -> None:
        """``release`` with pins, or pages listed more than once: references counted per page."""
        pins = self._pins
        if pins:  # pins go first: the page stays held in the ledger while vLLM counts a reference
            for p in need.keys() & pins.keys():
                k = min(need[p], pins[p])
                need[p] -= k
                pins[p] -= k
                if not pins[p]:
                    del pins[p]
        refs, own = self._refs, self._pages
        short = [p for p, n in need.items() if n > len(refs.get(p, ()))]
        if short:
            raise InvalidArgumentError(f"release of pages {short[:8]} the ledger holds no reference to")
        candidates: dict[int, None] = {}
        for p in [q for q, n in need.items() if n > 0]:
            candidates.update(dict.fromkeys(refs[p]))
        partial: list[int] = []
        for h in sorted(candidates, key=lambda h: -len(own[h])):
            hp = own[h]
            if all(need[q] > 0 for q in hp):
                for q in hp:
                    need[q] -= 1
                self._finish(h)
            else:
                partial.append(h)
        for h in partial:
            drop = [q for q in own[h] if need[q] > 0]
            if drop:
                for q in drop:
                    need[q] -= 1
                self._split(h, drop)
        if self._stale:
            self._evict_stale()

    def _split(self, h: int, drop: list[int]) -> None:
        """Hold ``h`` lets go of ``drop`` and keeps the rest, by a new hold."""
        dropped = set(drop)
        keep = [p for p in self._pages[h] if p not in dropped]
        self._finish(h)
        self.splits += 1
        key_of = self._key_of
        hashed = [p for p in keep if p in key_of]
        fresh = tuple(p for p in keep if p not in key_of)
        if hashed:
            h2 = self._new_hold()
            self.ledger.share(h2, tuple([key_of[p] for p in hashed]))
            self._add(h2, hashed)
        if fresh:
            self._reserve_commit(self._new_hold(), fresh)

    def _evict(self, pages: list[int]) -> None:
        self.ledger.evict(pages=pages)
        key_of, page_of, stale, tokens = self._key_of, self._page_of, self._stale, self._tokens
        for p in pages:
            del page_of[key_of.pop(p)]
            stale.discard(p)
            tokens.pop(p, None)

    def _evict_stale(self) -> None:
        gone = [p for p in self._stale if p not in self._refs]
        if gone:
            self._evict(gone)
