"""vLLM's block references as ledger requests ("holds"): the mirror under ``LedgerBlockPool``.

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

Steps. Pages are committed into the ledger's open step; ``seal`` seals it and
records rank 0's completion at once: vLLM runs every reader of a block after
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
event; the mirror is only as consistent as vLLM's call sequence.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence

from ...core.errors import ConfigurationError, InvalidArgumentError
from ...core.events import PagesReserved

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
        self._wrote: dict[int, set[int]] = {}  # hold -> the pages it reserved and committed (it may publish them)
        self._step_of: dict[int, int] = {}  # hold -> the step it last committed pages in
        self._key_of: dict[int, bytes] = {}  # page -> its ledger block hash
        self._keys: set[bytes] = set()
        self._stale: set[int] = set()  # held pages whose hash vLLM dropped: evicted once released
        self.tokens: dict[int, tuple[int, ...]] = {}  # page -> the tokens it was published with
        self._pins: dict[int, int] = {}  # page -> references to an unhashed held page the ledger cannot record
        self._next = NULL_HOLD + 1
        self._completed = -1  # the last step sealed and completed
        self._dirty = False  # pages were committed in the open step
        self._clear: list[int] = []  # clear lists sealed since take_clear_list
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

    # ------------------------------------------------------------------ transitions

    def allocate(self, pages: Sequence[int]) -> None:
        """vLLM's ``get_new_blocks`` handed out ``pages`` (free blocks, evicting cached ones)."""
        cached = [p for p in pages if p in self._key_of]
        if cached:
            self._evict(cached)
        if self.per_page:
            for p in pages:
                self._reserve_commit(self._new_hold(), (p,))
        elif pages:
            self._reserve_commit(self._new_hold(), tuple(pages))

    def share(self, pages: Sequence[int]) -> None:
        """vLLM's ``touch`` added a reference to each page.

        A hashed page (a prefix hit) is shared by a new hold. An unhashed page
        (a connector pinning a held block while it copies it) cannot be shared in
        the ledger, which shares hashed pages only: the reference is a *pin*,
        counted here and not recorded; the page stays held by its holds until
        its last reference, pins included, is released.
        """
        hashed: list[int] = []
        adopted: list[int] = []
        for p in pages:
            if p in self._key_of:
                hashed.append(p)
            elif p in self._refs:
                self._pins[p] = self._pins.get(p, 0) + 1
            else:
                adopted.append(p)  # a free block handed over as if cached: it changes holder like an allocation
        for group in self._groups(hashed):
            h = self._new_hold()
            self.ledger.share(h, [self._key_of[p] for p in group])
            self._add(h, group, wrote=False)
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

    def release(self, pages: Iterable[int]) -> None:
        """vLLM dropped one reference per listed page (``free_blocks``, ``unpin_blocks``).

        Whole holds finish; a hold losing only some pages is split (see the module
        docstring). Pages left unheld whose hash vLLM dropped are evicted.
        """
        need = Counter(pages)
        if not need:
            return
        pins = self._pins
        if pins:  # pins go first: the page stays held in the ledger while vLLM counts a reference
            for p in need.keys() & pins.keys():
                k = min(need[p], pins[p])
                need[p] -= k
                pins[p] -= k
                if not pins[p]:
                    del pins[p]
        candidates: dict[int, None] = {}
        for p in [q for q, n in need.items() if n > 0]:
            for h in self._refs.get(p, ()):
                candidates[h] = None
        order = sorted(candidates, key=lambda h: -len(self._pages[h]))
        partial: list[int] = []
        for h in order:
            hp = self._pages[h]
            if all(need[q] > 0 for q in hp):
                for q in hp:
                    need[q] -= 1
                self._finish(h)
            else:
                partial.append(h)
        for h in partial:
            hp = self._pages[h]
            drop = [q for q in hp if need[q] > 0]
            if not drop:
                continue
            for q in drop:
                need[q] -= 1
            self._split(h, drop)
        left = [p for p, n in need.items() if n > 0]
        if left:
            raise InvalidArgumentError(f"release of pages {left[:8]} the ledger holds no reference to")
        self._evict_stale()

    def publish(self, blocks: Sequence[Publish]) -> None:
        """vLLM cached these blocks (gave them a primary hash): publish them in the ledger.

        A page the ledger has already published keeps its ledger hash (a held
        page's hash cannot change); it is no longer stale. Runs of pages written
        by one hold, in its block-table order, go in one ``PagesPublished``.
        """
        todo = []
        for page, raw, tokens, parent in blocks:
            if page in self._key_of:
                self._stale.discard(page)
                continue
            key = _key(raw)
            if key in self._keys:
                key = _key(raw + page.to_bytes(4, "big"))
            self._key_of[page] = key
            self._keys.add(key)
            self.tokens[page] = tuple(tokens)
            todo.append((page, key, tokens, None if parent is None else self._key_of.get(parent)))
        if todo:
            self._publish_runs(todo)

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
        self._completed = step
        self._dirty = False
        self._clear.extend(plan.clear_list)
        return plan.clear_list

    def take_clear_list(self) -> list[int]:
        """Seal, and return the pages to zero before the next forward pass: the clear lists of
        every step sealed since the last call, each page once, in listing order."""
        self.seal()
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
        groups: list[list[int]] = [[]]
        seen: set[int] = set()
        for p in pages:
            if p in seen:
                groups.append([])
                seen = set()
            groups[-1].append(p)
            seen.add(p)
        return [g for g in groups if g]

    def _add(self, h: int, pages: Sequence[int], *, wrote: bool) -> None:
        self._pages[h] = list(pages)
        for p in pages:
            self._refs.setdefault(p, []).append(h)
        if wrote:
            self._wrote[h] = set(pages)

    def _reserve_commit(self, h: int, pages: tuple[int, ...]) -> None:
        ledger = self.ledger
        ledger.submit(PagesReserved(request=h, page_ids=pages))
        step = ledger.open_step
        ledger.commit(h, step, len(pages))
        self._dirty = True
        self._step_of[h] = step
        self._add(h, pages, wrote=True)

    def _finish(self, h: int) -> None:
        self.ledger.finish(h)
        for p in self._pages.pop(h):
            holds = self._refs[p]
            holds.remove(h)
            if not holds:
                del self._refs[p]
        self._wrote.pop(h, None)
        self._step_of.pop(h, None)

    def _split(self, h: int, drop: list[int]) -> None:
        """Hold ``h`` lets go of ``drop`` and keeps the rest, by a new hold."""
        dropped = set(drop)
        keep = [p for p in self._pages[h] if p not in dropped]
        self._finish(h)
        self.splits += 1
        hashed = [p for p in keep if p in self._key_of]
        fresh = tuple(p for p in keep if p not in self._key_of)
        if hashed:
            h2 = self._new_hold()
            self.ledger.share(h2, [self._key_of[p] for p in hashed])
            self._add(h2, hashed, wrote=False)
        if fresh:
            self._reserve_commit(self._new_hold(), fresh)

    def _evict(self, pages: list[int]) -> None:
        self.ledger.evict(pages=pages)
        for p in pages:
            self._keys.discard(self._key_of.pop(p))
            self._stale.discard(p)
            self.tokens.pop(p, None)

    def _evict_stale(self) -> None:
        if self._stale:
            gone = [p for p in self._stale if not self._refs.get(p)]
            if gone:
                self._evict(gone)

    def _writer(self, page: int) -> int:
        for h in self._refs.get(page, ()):
            if page in self._wrote.get(h, ()):
                return h
        raise InvalidArgumentError(f"page {page} is cached by vLLM but no hold the ledger knows wrote it")

    def _publish_runs(self, todo: list) -> None:
        """Publish (page, key, tokens, parent) items as runs of one writer hold's block table."""
        runs: list[tuple[int, int, list]] = []  # (hold, start index, items)
        for item in todo:
            h = self._writer(item[0])
            i = self._pages[h].index(item[0])
            if runs and runs[-1][0] == h and runs[-1][1] + len(runs[-1][2]) == i:
                runs[-1][2].append(item)
            else:
                runs.append((h, i, [item]))
        if any(self._step_of[h] > self._completed for h, _, _ in runs):
            self.seal()
        ledger = self.ledger
        for h, start, items in runs:
            tokens: list[int] = []
            for item in items:
                tokens.extend(item[2])
            ledger.publish(h, [item[1] for item in items], tokens, start=start, parent_hash=items[0][3])
