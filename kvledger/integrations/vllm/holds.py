"""vLLM's block references as ledger requests ("holds"): the mirror under ``LedgerBlockPool``.

One piece: ``PageHolds`` is one class whose maps (holds, writers, hashes, pins, the
publishes waiting for their step) every transition updates together; the one-block
fast paths sit beside the general calls.

vLLM's ``BlockPool`` counts references to a block (``ref_cnt``) without saying
who holds them. The ledger names a holder for every page. ``PageHolds`` bridges
the two with *holds* (ledger requests); every reference is one (hold, page) pair
or a pin, so a block's ``ref_cnt`` is the number of holds holding it plus its pins:

    a named hold   one per vLLM request and KV cache group while it holds blocks
                   (``who = (request id, group)``: the pool learns it from the
                   manager that calls it). Created with its group's tenant and
                   labelled with the request id (``RequestLabelled``, first), it
                   allocates, shares and releases as that request does and
                   finishes when it holds nothing.
    an anonymous   one per call when no manager names the caller (vLLM's tests
      hold         calling the pool, a scheduler freeing copy-on-write endpoints).

    vLLM call                         ledger events (pages named as vLLM chose them)
    get_new_blocks(n)  ─► [PagesEvicted(cached pages vLLM evicted)]
                          PagesReserved + PagesCommitted(open step, reads)   (Ledger.allocate)
    touch(blocks)      ─► PagesShared                       (prefix hits: hashed pages)
    free_blocks(...)   ─► PagesReleased, or RequestFinished of a hold left with nothing
    cache_full_blocks  ─► PagesPublished                    (when the writing step completed)
    eviction / reset   ─► PagesEvicted

``reads``: a named hold's commit of a recurrent state's first block (a Mamba
group's request with no state yet, which reads that state before its first write)
reads the whole page (``PagesCommitted.reads="whole"``): under the marking
policies every mark is listed, whatever group or request left it.

A reference the ledger cannot name is a *pin*: a ``touch`` of an unhashed held
block (a connector keeping it while it copies it), a reference vLLM's managers
take by bumping ``ref_cnt`` themselves (copy-on-write endpoints; ``adopt``), or a
prefix hit on a block whose publish still waits for its step (below). Pins are
counted, not recorded, and released first, so a page stays held in the ledger
while vLLM counts any reference. A ``touch`` of a free unhashed block (vLLM's tests
hand such blocks over as cache hits) is recorded like an allocation.

Steps. Pages are committed into the ledger's open step. Two ways a step ends:

    manager only   (no scheduler drives the pool: vLLM's KVCacheManager tests)
                   ``seal`` seals the open step and records rank 0's completion
                   at once; a publish of pages committed in the open step seals it
                   first (vLLM orders every reader after its writer on the model
                   stream); one vLLM step may span several ledger steps.
    fenced         (``fenced = True``: vLLM's Scheduler drives it) one ledger step
                   per ``schedule()``: ``seal`` seals it, ``complete(step, ran)``
                   records the completion ``update_from_output`` observed. A block
                   vLLM hashes waits (``_pending``) until the step that writes it
                   completes; then it is published if its writer's request ran in
                   that step, else recorded ``PagesUnwritten`` and its hash withdrawn
                   from vLLM (``withdraw``). A state group's waiting block is hidden
                   from vLLM's lookups (``hidden``); an attention group's is not
                   (vLLM's stream-order rule: a later request's attention reads it
                   after the writing layers ran): a hit on it is a pin until the
                   publish, then a share. A writer that lets go of a waiting block
                   keeps it in the ledger (``_deferred``) until its publish resolves.

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
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from typing import NamedTuple

from ...core.errors import InvalidArgumentError

__all__ = ["NULL_HOLD", "PageHolds", "Pending", "Publish", "Who"]

NULL_HOLD = 0  # the ledger request that holds vLLM's null block, for good
_MAX_KEY = 60  # bytes of a ledger block hash before a page id is appended (the ledger takes 1-64)

# A block to publish: (page, vLLM hash key, its tokens, the page of the block before it in the
# request, or None at the start of the sequence)
Publish = tuple[int, bytes, Sequence[int], "int | None"]
# Who holds through a manager: (vLLM request id, KV cache group id)
Who = tuple[str, int]


class Pending(NamedTuple):
    """A block vLLM hashed whose writing step has not completed (fenced mode)."""

    hold: int  # its writer
    key: bytes  # its ledger hash
    tokens: tuple[int, ...]  # its page_tokens tokens
    parent: int | None  # the page of the block before it, or None
    step: int  # the ledger step that writes it
    hidden: bool  # a state group's block: vLLM's lookups do not see it until it is published


def _key(raw: bytes) -> bytes:
    return raw if len(raw) <= _MAX_KEY else hashlib.blake2b(raw, digest_size=32).digest()


class PageHolds:
    """Holds of vLLM block references as ledger requests, over ``ledger`` (module docstring).

    ``null_page``: vLLM's null block, held by ``NULL_HOLD`` from the start (never free).
    ``tenants``: KV cache group -> the tenant its holds are made with (the marking
    policies list a page that moves between tenants); ``state_groups``: the groups
    whose blocks hold a recurrent state. ``withdraw(page)``: called to remove vLLM's
    hash of a page whose writing step never ran (fenced mode).
    """

    def __init__(self, ledger, *, null_page: int | None = 0) -> None:
        self.ledger = ledger
        self.marking = ledger.state.policy != "released_aliases"
        self._refs: dict[int, list[int]] = {}  # page -> holds holding it (acquisition order)
        self._pages: dict[int, list[int]] = {}  # hold -> its pages, in its ledger block-table order
        self._writer: dict[int, int] = {}  # page -> the hold that reserved and committed it (it may publish it)
        self._key_of: dict[int, bytes] = {}  # page -> its ledger block hash
        self._page_of: dict[bytes, int] = {}  # ledger block hash -> page
        self._key_tenant: dict[int, str | None] = {}  # published page -> its writer's tenant
        self._stale: set[int] = set()  # held pages whose hash vLLM dropped: evicted once released
        self._tokens: dict[int, tuple[tuple, int]] = {}  # page -> (its publish's tokens, its offset in them)
        self._pins: dict[int, int] = {}  # page -> references the ledger cannot record
        self._named: dict[Who, int] = {}  # (request id, group) -> its live hold
        self._who: dict[int, Who] = {}  # named hold -> (request id, group)
        self._tenant: dict[int, str | None] = {}  # hold -> its tenant
        self.tenants: dict[int, str] = {}  # group -> tenant
        self.state_groups: frozenset[int] = frozenset()
        self._next = NULL_HOLD + 1
        self._open: set[int] = set()  # pages committed in the open step (manager only: publishing them seals it)
        self._dirty = False  # pages were committed in the open step
        self._clear: list[int] = []  # clear lists sealed since take_clear_list
        self._k = ledger.geometry.page_tokens
        self.fenced = False
        self._pending: dict[int, Pending] = {}  # page -> its publish, waiting for its step (fenced)
        self._pending_keys: dict[bytes, int] = {}  # ledger hash -> page, of the waiting publishes
        self._deferred: dict[int, int] = {}  # page -> the hold vLLM released it from while its publish waits
        self._early: dict[int, list[int]] = {}  # page -> named holds that took it as a pin while it waited
        self._step_pages: dict[int, dict[int, list[int]]] = {}  # fenced: step -> named hold -> pages it committed
        self._gone: dict[int, Who] = {}  # fenced: finished named hold -> its name, while a step it wrote is open
        self._unconfirmed: dict[int, int] = {}  # page -> the step that is to write it whole (reads="none")
        self.withdraw: Callable[[int], None] | None = None
        self.unwritten_pages = 0  # pages recorded PagesUnwritten (statistics)
        self.unwritten_reads = 0  # references taken on them while they waited (attention hits)
        if null_page is not None:
            self._tenant[NULL_HOLD] = None
            self._reserve_commit(NULL_HOLD, (null_page,))

    # ------------------------------------------------------------------ queries

    def refs(self, page: int) -> int:
        """References on ``page`` as vLLM counts them: its holds and pins, less a writer's hold
        kept only while the page's publish waits (vLLM already let go of it)."""
        return len(self._refs.get(page, ())) + self._pins.get(page, 0) - (page in self._deferred)

    def holds_of(self, page: int) -> tuple[int, ...]:
        return tuple(self._refs.get(page, ()))

    def key_of(self, page: int) -> bytes | None:
        """The page's ledger block hash (None: not published)."""
        return self._key_of.get(page)

    def tokens_of(self, page: int) -> tuple[int, ...] | None:
        """The tokens ``page`` was published with, or waits to be (None: neither)."""
        pend = self._pending.get(page)
        if pend is not None:
            return pend.tokens
        tokens, at = self._tokens.get(page, ((), 0))
        return tokens[at : at + self._k] if tokens else None

    def waiting(self, page: int) -> bool:
        """vLLM hashed ``page`` and its publish waits for the step that writes it."""
        return page in self._pending

    def hidden(self, page: int) -> bool:
        """A waiting state block: vLLM's lookups must not hit it yet."""
        pend = self._pending.get(page)
        return pend is not None and pend.hidden

    @property
    def deferred_count(self) -> int:
        """Pages vLLM let go of that the ledger keeps while their publish waits."""
        return len(self._deferred)

    def hold_of(self, who: Who) -> int | None:
        return self._named.get(who)

    # ------------------------------------------------------------------ groups

    def set_groups(self, tenants: dict[int, str], state_groups: Iterable[int]) -> None:
        """The KV cache groups the holds are named with: their tenants, and which hold states."""
        self.tenants = dict(tenants)
        self.state_groups = frozenset(state_groups)

    def _hold(self, who: Who | None) -> int:
        """The live hold of ``who`` (made and labelled if none), or a new anonymous one."""
        if who is not None:
            h = self._named.get(who)
            if h is not None:
                return h
        h = self._next
        self._next = h + 1
        if who is None:
            self._tenant[h] = None
            return h
        self._named[who] = h
        self._who[h] = who
        self._tenant[h] = self.tenants.get(who[1])
        self.ledger.label(h, who[0])
        return h

    # ------------------------------------------------------------------ transitions

    def allocate(self, pages: Sequence[int], who: Who | None = None, reads: str = "tail") -> None:
        """vLLM's ``get_new_blocks`` handed out ``pages`` (free blocks, evicting cached ones) to ``who``'s
        request (None: nobody named: a hold of its own). ``reads``: ``PagesCommitted.reads``."""
        if self._pending or self._deferred:
            back = [p for p in pages if p in self._pending or p in self._deferred]
            if back:
                self._reclaim(back)  # (cached blocks whose publish waited: vLLM evicted them to reuse)
        key_of = self._key_of
        if key_of and not key_of.keys().isdisjoint(pages):
            self._evict([p for p in pages if p in key_of])
        h = self._hold(who)
        ledger = self.ledger
        step = ledger.open_step
        # a page a step not yet completed is to write whole: maybe it never will
        if self._unconfirmed and self.marking and not self._unconfirmed.keys().isdisjoint(pages):
            reads = "whole"
        ledger.allocate(h, step, pages=tuple(pages), tenant=self._tenant[h], reads=reads)
        if self.fenced and who is not None:
            self._step_pages.setdefault(step, {}).setdefault(h, []).extend(pages)
            if reads == "none":
                self._unconfirmed.update(dict.fromkeys(pages, step))
        hp = self._pages.get(h)
        if hp is None:
            self._pages[h] = list(pages)
        else:
            hp.extend(pages)
        if len(pages) == 1:
            p = pages[0]
            self._refs[p] = [h]
            self._writer[p] = h
        else:
            self._refs.update(zip(pages, [[h] for _ in pages], strict=True))
            self._writer.update(dict.fromkeys(pages, h))
        self._dirty = True
        if not self.fenced:
            self._open.update(pages)

    def share(self, pages: Sequence[int], who: Who | None = None) -> None:
        """vLLM's ``touch`` added a reference to each page, for ``who``'s request (None: nobody named).

        A published page (a prefix hit) is shared by the hold. A page whose publish
        waits (an attention group's block hashed this step), an unhashed held page
        (a connector pinning it), or a page the hold holds already is a pin. A free
        unhashed page (vLLM's tests hand such blocks over as cache hits) changes
        holder like an allocation.
        """
        key_of, refs = self._key_of, self._refs
        h = self._named.get(who) if who is not None else None
        mine = set(self._pages.get(h, ())) if h is not None else set()
        hashed: list[int] = []
        adopted: list[int] = []
        for p in pages:
            if p in key_of and p not in mine:
                hashed.append(p)
                mine.add(p)
            elif p in refs or p in mine:
                self._pins[p] = self._pins.get(p, 0) + 1
                if who is not None and p in self._pending:
                    self._early.setdefault(p, []).append(self._hold(who))
            else:
                adopted.append(p)
        if hashed:
            if who is not None:
                h = self._hold(who)
                self.ledger.share(h, tuple(map(key_of.__getitem__, hashed)), tenant=self._tenant[h])
                self._add(h, hashed)
            else:
                for group in self._groups(hashed):
                    h = self._hold(None)
                    self._tenant[h] = self._key_tenant.get(group[0])
                    self.ledger.share(h, tuple(map(key_of.__getitem__, group)), tenant=self._tenant[h])
                    self._add(h, group)
        if adopted:
            if who is not None:
                self.allocate(adopted, who)
            else:
                for group in self._groups(adopted):
                    self.allocate(group)

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
        for p, n in zip(pages, ref_counts, strict=True):
            extra = n - self.refs(p)
            if extra > 0:
                self.pin(p, extra)

    def release(self, pages: Sequence[int], ref_counts: Sequence[int] | None = None, who: Who | None = None) -> None:
        """vLLM dropped one reference per listed page (``free_blocks``, ``unpin_blocks``), for
        ``who``'s request (None: nobody named); ``ref_counts``: vLLM's counts before the release
        (``adopt`` them first).

        ``who``'s hold lets go of the pages it holds (``PagesReleased``; ``RequestFinished``
        once it holds nothing) and of the pins it took; the rest is released by
        reference counts: whole anonymous holds finish, the others release what they
        lose. A writer keeps a page whose publish waits (fenced) until it resolves.
        Pages left unheld whose hash vLLM dropped are evicted. Raises
        ``InvalidArgumentError`` before any change when a page has no reference.
        """
        if not pages:
            return
        if who is not None:
            h = self._named.get(who)
            if h is not None:
                if ref_counts is not None:
                    self.adopt(pages, ref_counts)
                    ref_counts = None
                pages = self._release_named(h, pages)
                if not pages:
                    if self._stale:
                        self._evict_stale()
                    return
        if len(pages) == 1 and not self._pins and not self._deferred:  # (one block of its own hold)
            held1 = self._refs.get(pages[0])
            if held1 is not None and len(held1) == 1 and (ref_counts is None or ref_counts[0] <= 1):
                h = held1[0]
                if len(self._pages[h]) == 1 and h not in self._who:
                    self._finish(h)
                    if self._stale:
                        self._evict_stale()
                    return
        found = [self.refs(p) > 0 for p in pages]
        if not all(found):
            if ref_counts is not None:
                self.adopt(pages, ref_counts)  # (raises for the page vLLM holds and the ledger does not)
            bad = pages[found.index(False)]
            raise InvalidArgumentError(f"release of page {bad}, which the ledger holds no reference to")
        if ref_counts is not None:
            self.adopt(pages, ref_counts)
        self._release_counted(Counter(pages))

    def _release_named(self, h: int, pages: Sequence[int]) -> list[int]:
        """``release`` of hold ``h``'s own references among ``pages``; returns the pages left over."""
        hp = self._pages.get(h, ())
        own = set(hp)
        drop: list[int] = []
        rest: list[int] = []
        pending, deferred, early, pins = self._pending, self._deferred, self._early, self._pins
        for p in pages:
            takers = early.get(p) if early else None
            if takers is not None and h in takers and pins.get(p):  # a pin it took while the publish waited
                takers.remove(h)
                if not takers:
                    del early[p]
                self._unpin(p)
            elif p in own and p not in deferred:
                own.discard(p)
                if pins.get(p):  # pins go first: the page stays held while vLLM counts any reference
                    self._unpin(p)
                elif p in pending and pending[p].hold == h:
                    deferred[p] = h  # (its writer keeps it until its step completes)
                else:
                    drop.append(p)
            else:
                rest.append(p)
        if drop:
            self._drop(h, drop)
        return rest

    def _drop(self, h: int, drop: list[int]) -> None:
        """Hold ``h`` lets go of ``drop`` (pages it holds, none waiting): ``RequestFinished`` when it
        is left with nothing, else ``PagesReleased``."""
        hp = self._pages[h]
        if len(drop) == len(hp):
            self._finish(h)
            return
        self.ledger.release(h, tuple(drop))
        gone = set(drop)
        self._pages[h] = [p for p in hp if p not in gone]
        refs, writer = self._refs, self._writer
        for p in drop:
            held = refs[p]
            held.remove(h)
            if not held:
                del refs[p]
            if writer.get(p) == h:
                del writer[p]

    def _unpin(self, p: int) -> None:
        pins = self._pins
        n = pins[p] - 1
        if n:
            pins[p] = n
        else:
            del pins[p]

    # ------------------------------------------------------------------ publishing

    def publish_blocks(self, pages: list[int], keys: list[bytes], tokens: tuple, parent: int | None) -> None:
        """``publish`` of consecutive blocks of one vLLM request (``cache_full_blocks``): ``pages``
        with their vLLM hash keys, ``tokens`` theirs (``page_tokens`` each, in order), ``parent``
        the page before them in the request (None at its start). Manager only: one
        ``PagesPublished`` when they are a run of one hold, none published yet and every key new
        (the usual case); otherwise block by block, as ``publish``. Fenced: they wait."""
        k = len(pages)
        step = self._k
        if self.fenced:
            self._wait([(p, key, tokens[i * step : (i + 1) * step], parent if i == 0 else pages[i - 1])
                        for i, (p, key) in enumerate(zip(pages, keys, strict=True))])
            return
        key_of, page_of, writer = self._key_of, self._page_of, self._writer
        h = writer.get(pages[0])
        if (h is not None and key_of.keys().isdisjoint(pages) and max(map(len, keys)) <= _MAX_KEY
                and page_of.keys().isdisjoint(keys) and (k == 1 or len(set(keys)) == k)):
            hp = self._pages[h]
            start = hp.index(pages[0])
            if hp[start : start + k] == pages:
                if not self._open.isdisjoint(pages):
                    self.seal()  # (pages committed in the open step: their step completes first)
                lkeys = tuple(keys)
                self.ledger.publish(h, lkeys, tokens, start=start,
                                    parent_hash=None if parent is None else key_of.get(parent))
                key_of.update(zip(pages, lkeys, strict=True))
                page_of.update(zip(lkeys, pages, strict=True))
                self._key_tenant.update(dict.fromkeys(pages, self._tenant.get(h)))
                at = range(0, k * self._k, self._k)
                self._tokens.update(zip(pages, zip(repeat(tokens), at, strict=False), strict=True))
                return
        self.publish([(p, key, tokens[i * step : (i + 1) * step], parent if i == 0 else pages[i - 1])
                      for i, (p, key) in enumerate(zip(pages, keys, strict=True))])

    def publish(self, blocks: Sequence[Publish]) -> None:
        """vLLM cached these blocks (gave them a primary hash): publish them in the ledger (fenced:
        once the step that writes them completed).

        A page the ledger has already published keeps its ledger hash (a held
        page's hash cannot change); it is no longer stale. Runs of pages written
        by one hold, in its block-table order, go in one ``PagesPublished``; a
        run's parent is the ledger hash of the block before it in vLLM's request.
        """
        if self.fenced:
            self._wait(blocks)
            return
        items = []
        fresh: dict[bytes, int] = {}  # keys of this call (a page's key is recorded once it is published)
        for page, raw, tokens, parent in blocks:
            if page in self._key_of:
                self._stale.discard(page)
                continue
            key = self._new_key(raw, page, fresh)
            fresh[key] = page
            h = self._writer.get(page)
            if h is None:
                raise InvalidArgumentError(f"page {page} is cached by vLLM but no hold the ledger knows wrote it")
            items.append((page, h, key, tuple(tokens), parent))
        if items:
            if not self._open.isdisjoint(p for p, *_ in items):
                self.seal()  # (pages committed in the open step: their step completes first)
            self._publish_runs(items)

    def _new_key(self, raw: bytes, page: int, fresh: dict[bytes, int]) -> bytes:
        """The ledger hash for vLLM's ``raw`` key of ``page``: unique among published, waiting and
        this call's keys (vLLM may cache two blocks under one hash: the second gets its page id)."""
        key = _key(raw)
        if key in self._page_of or key in fresh or key in self._pending_keys:
            key = _key(raw + page.to_bytes(4, "big"))
        return key

    def _publish_runs(self, items: list[tuple[int, int, bytes, tuple, int | None]]) -> None:
        """Publish ``(page, writer, key, tokens, parent page)`` items: runs of one writer in its
        block-table order in one ``PagesPublished`` each."""
        key_of, page_of, own = self._key_of, self._page_of, self._pages
        runs: list[list] = []  # [hold, start, pages, keys, tokens, parent key]
        for page, h, key, tokens, parent in items:
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
        ledger, keep, k = self.ledger, self._tokens, self._k
        for h, start, pages, keys, toks, pkey in runs:
            tokens = tuple(chain.from_iterable(toks))
            ledger.publish(h, tuple(keys), tokens, start=start, parent_hash=pkey)
            key_of.update(zip(pages, keys, strict=True))
            page_of.update(zip(keys, pages, strict=True))
            self._key_tenant.update(dict.fromkeys(pages, self._tenant.get(h)))
            keep.update(zip(pages, zip(repeat(tokens), range(0, len(pages) * k, k), strict=False), strict=True))

    def _wait(self, blocks: Sequence[Publish]) -> None:
        """Fenced: the blocks wait for the step that writes them (the open one) to complete."""
        step = self.ledger.open_step
        pending, keys, writer = self._pending, self._pending_keys, self._writer
        for page, raw, tokens, parent in blocks:
            if page in self._key_of:
                self._stale.discard(page)
                continue
            if page in pending:
                continue
            h = writer.get(page)
            if h is None:
                raise InvalidArgumentError(f"page {page} is cached by vLLM but no hold the ledger knows wrote it")
            key = self._new_key(raw, page, {})
            who = self._who.get(h)
            pending[page] = Pending(h, key, tuple(tokens), parent, step,
                                    who is not None and who[1] in self.state_groups)
            keys[key] = page

    def complete(self, step: int, dropped: Iterable[str] = ()) -> None:
        """Fenced: the workers ran ``step`` (vLLM's ``update_from_output``); ``dropped``: the vLLM
        requests the step ran without (they ended before it ran). Their share is recorded
        ``PagesUnwritten`` (a page they were to write whole gets its mark back) and the hashes
        of their waiting blocks withdrawn; then the step completes, the other waiting blocks
        are published, pins taken on them become shares, and writers' releases held back are done."""
        dropped = set(dropped)
        due = [(p, e) for p, e in self._pending.items() if e.step <= step] if self._pending else []
        published: list[tuple[int, int, bytes, tuple, int | None]] = []
        for p, e in due:
            del self._pending[p]
            del self._pending_keys[e.key]
            who = self._who.get(e.hold) or self._gone.get(e.hold)
            if who is not None and who[0] in dropped:
                self.unwritten_reads += len(self._early.pop(p, []))
                if self.withdraw is not None:
                    self.withdraw(p)
                h = self._deferred.pop(p, None)
                if h is not None:
                    self._drop(h, [p])
            else:
                published.append((p, e.hold, e.key, e.tokens, e.parent))
        for s in sorted(s for s in self._step_pages if s <= step):
            for h, pages in self._step_pages.pop(s).items():
                who = self._who.get(h) or self._gone.get(h)
                if who is None or who[0] not in dropped:
                    continue
                gone = [p for p in dict.fromkeys(pages) if h not in self._refs.get(p, ())]
                if gone:  # (a dropped request ended: its hold let go of them)
                    self.ledger.record_unwritten(h, s, gone, "the step ran without the request")
                    self.unwritten_pages += len(gone)
        if self._gone:
            live = {h for holds in self._step_pages.values() for h in holds}
            self._gone = {h: w for h, w in self._gone.items() if h in live}
        if self._unconfirmed:
            self._unconfirmed = {p: s for p, s in self._unconfirmed.items() if s > step}
        self.ledger.complete_step(step, 0)
        if published:
            self._publish_runs(published)
            for p, *_ in published:
                self._convert_early(p)
                h = self._deferred.pop(p, None)
                if h is not None:
                    self._drop(h, [p])
        if self._stale:
            self._evict_stale()

    def _convert_early(self, p: int) -> None:
        """The pins named holds took on ``p`` while its publish waited become shares."""
        takers = self._early.pop(p, None)
        if not takers:
            return
        key = self._key_of[p]
        for h in takers:
            if h in self._who and p not in self._pages.get(h, ()) and self._pins.get(p):
                self.ledger.share(h, (key,), tenant=self._tenant[h])
                self._add(h, [p])
                self._unpin(p)

    def _reclaim(self, pages: list[int]) -> None:
        """vLLM took back cached blocks whose publish waited (to evict and reuse them): the publish is
        dropped and the writer's hold, kept for it, lets go."""
        for p in pages:
            e = self._pending.pop(p, None)
            if e is not None:
                del self._pending_keys[e.key]
                self._early.pop(p, None)
            h = self._deferred.pop(p, None)
            if h is not None:
                self._drop(h, [p])

    def drop_hashes(self, pages: Iterable[int]) -> None:
        """vLLM removed the hash of these pages: unheld ones are evicted now, held ones once released;
        a waiting publish is dropped."""
        cached = []
        for p in pages:
            if p in self._pending or p in self._deferred:
                self._reclaim([p])
                continue
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
        if self._pending or self._deferred:
            self._reclaim([p for p in (*self._pending, *self._deferred) if not self.refs(p)])
        pages = tuple(p for p in self._key_of if not self._refs.get(p))
        if pages:
            self._evict(list(pages))
        return pages

    # ------------------------------------------------------------------ steps

    def seal(self) -> tuple[int, ...]:
        """Seal the open step (manager only: if pages were committed in it, and record rank 0's
        completion at once) and return its clear list (also kept for ``take_clear_list``)."""
        if not self._dirty and not self.fenced:
            return ()
        ledger = self.ledger
        step = ledger.open_step
        plan = ledger.seal_step(step)
        if not self.fenced:
            ledger.complete_step(step, 0)
            self._open.clear()
        self._dirty = False
        if plan.clear_list:
            self._clear.extend(plan.clear_list)
        return plan.clear_list

    def take_clear_list(self) -> list[int]:
        """Seal, and return the pages to zero before the next forward pass: the clear lists of
        every step sealed since the last call, each page once, in listing order."""
        if self._dirty or self.fenced:
            self.seal()
        if not self._clear:
            return []
        out = list(dict.fromkeys(self._clear))
        self._clear.clear()
        return out

    # ------------------------------------------------------------------ internals

    def _groups(self, pages: Sequence[int]) -> list[list[int]]:
        """``pages`` cut into runs without a repeated page (one hold each)."""
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
        hp = self._pages.get(h)
        if hp is None:
            self._pages[h] = list(pages)
        else:
            hp.extend(pages)
        refs = self._refs
        for p in pages:
            held = refs.get(p)
            if held is None:
                refs[p] = [h]
            else:
                held.append(h)

    def _reserve_commit(self, h: int, pages: tuple[int, ...]) -> None:
        """Hold ``h`` (new) writes ``pages``, free in the ledger (so no hold holds them)."""
        ledger = self.ledger
        ledger.allocate(h, ledger.open_step, pages=pages, tenant=self._tenant.get(h))
        self._pages[h] = list(pages)
        self._refs.update(zip(pages, [[h] for _ in pages], strict=True))
        self._writer.update(dict.fromkeys(pages, h))
        self._dirty = True
        self._open.update(pages)

    def _finish(self, h: int) -> None:
        self.ledger.finish(h)
        refs = self._refs
        hp = self._pages.pop(h)
        writer = self._writer
        for p in hp:
            held = refs[p]
            held.remove(h)
            if not held:
                del refs[p]
            if writer.get(p) == h:
                del writer[p]
        who = self._who.pop(h, None)
        if who is not None:
            if self._named.get(who) == h:
                del self._named[who]
            if self.fenced:
                self._gone[h] = who  # (until the steps it committed in complete: a drop names it)
        self._tenant.pop(h, None)

    def _release_counted(self, need: Counter) -> None:
        """``release`` by reference counts: pins first, then whole holds (the larger first), then
        holds losing some of their pages (``PagesReleased``)."""
        pins = self._pins
        if pins:  # pins go first: the page stays held in the ledger while vLLM counts a reference
            for p in need.keys() & pins.keys():
                k = min(need[p], pins[p])
                need[p] -= k
                pins[p] -= k
                if not pins[p]:
                    del pins[p]
                    self._early.pop(p, None)
        refs, own, deferred = self._refs, self._pages, self._deferred
        short = [p for p, n in need.items() if n > len(refs.get(p, ())) - (p in deferred)]
        if short:
            raise InvalidArgumentError(f"release of pages {short[:8]} the ledger holds no reference to")
        candidates: dict[int, None] = {}
        for p in [q for q, n in need.items() if n > 0]:
            candidates.update(dict.fromkeys(h for h in refs[p] if deferred.get(p) != h))
        # Holds finish in the reverse of the order their pages are listed: vLLM lists a request's
        # blocks last first and puts them back at the head of its free queue in that order, and
        # each finished hold pushes its pages onto the ledger's free stack in block-table order.
        order = sorted(reversed(list(candidates)), key=lambda h: -len(own[h]))
        partial: list[int] = []
        for h in order:
            hp = own[h]
            if all(need[q] > 0 and deferred.get(q) != h for q in hp):
                for q in hp:
                    need[q] -= 1
                self._finish_or_wait(h, hp)
            else:
                partial.append(h)
        for h in partial:
            drop = [q for q in own[h] if need[q] > 0 and deferred.get(q) != h]
            if drop:
                for q in drop:
                    need[q] -= 1
                self._release_or_wait(h, drop)
        if self._stale:
            self._evict_stale()

    def _finish_or_wait(self, h: int, hp: list[int]) -> None:
        """Hold ``h`` lets go of all its pages: those whose publish it wrote and waits keep it."""
        waiting = [p for p in hp if p in self._pending and self._pending[p].hold == h]
        if not waiting:
            self._finish(h)
            return
        self._release_or_wait(h, list(hp))

    def _release_or_wait(self, h: int, drop: list[int]) -> None:
        pending, deferred = self._pending, self._deferred
        now = []
        for p in drop:
            if p in pending and pending[p].hold == h:
                deferred[p] = h
            else:
                now.append(p)
        if now:
            self._drop(h, now)

    def _evict(self, pages: list[int]) -> None:
        self.ledger.evict(pages=pages)
        key_of, page_of, stale, tokens, kt = self._key_of, self._page_of, self._stale, self._tokens, self._key_tenant
        for p in pages:
            del page_of[key_of.pop(p)]
            stale.discard(p)
            tokens.pop(p, None)
            kt.pop(p, None)

    def _evict_stale(self) -> None:
        gone = [p for p in self._stale if p not in self._refs]
        if gone:
            self._evict(gone)
