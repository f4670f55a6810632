"""R8's prefix-caching rules: publish, write and publish, allocation under pressure, lookup then
share, evict (a mixin of tests/core/test_state_machine.py's ``LedgerMachine``).

Each rule asks the model (``support.r8.model``) what must happen (which error, which
pages, which evictions, which ``BlocksStored`` / ``BlocksRemoved`` /
``PagesMarked`` effects) before it looks at what the ledgers did.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from .invalid import UNKNOWN_HASH

from kvledger import InvalidArgumentError
from kvledger.core.events import BlocksStored, PagesPublished, PagesShared

__all__ = ["PrefixRules"]


class PrefixRules:
    """Rules over prefix-shared pages; the host class supplies ``both``, ``rejected``, ``_reserve``,
    ``_commit_pages``, ``_gone``, ``_alias_n``, ``seal_and_complete``, ``expect_folded`` and ``_evicted``."""

    def _writers(self):
        return [r for r in self.m.requests.values() if r.kv]

    def _publish(self, data, r, explicit):
        m = self.m
        default = next((i for i, (p, _) in enumerate(r.kv) if p not in m.hashes), len(r.kv))
        start = data.draw(st.integers(0, len(r.kv) - 1)) if explicit else default
        k = data.draw(st.integers(1, max(1, len(r.kv) - start)))
        entries = r.kv[start : start + k]
        reuse = m.pages_of and data.draw(st.integers(0, 5)) == 0  # now and then a hash in use
        hashes = [self.new_hash() for _ in range(k)]
        if reuse:
            hashes[-1] = data.draw(st.sampled_from([m.hashes[p] for p in sorted(m.hashes)]))
        tokens = tuple(range(self.hashes_made * 100, self.hashes_made * 100 + k * self.page_tokens))
        lora = data.draw(st.sampled_from([(None, None), (7, "sql")]))
        call = lambda L: L.publish(r.rid, hashes, tokens, start=start if explicit else None,  # noqa: E731
                                   lora_id=lora[0], lora_name=lora[1])
        if len(entries) != k:
            self.rejected(call, InvalidArgumentError)  # past the end of the block table
            return
        err = m.publish_error(r, entries, hashes)
        if err is not None:
            self.rejected(call, err)
            self.stats[f"publish refused ({err.__name__})"] += 1
            return
        parent = m.hashes.get(r.kv[start - 1][0]) if start > 0 else None
        since = len(self.seen)
        pages = tuple(p for p, _ in entries)
        assert self.both(call) == pages
        event = PagesPublished(request=r.rid, page_ids=pages, hashes=tuple(hashes), parent_hash=parent,
                               token_ids=tokens, lora_id=lora[0], lora_name=lora[1])
        stored = BlocksStored(hashes=tuple(hashes), parent_hash=parent, token_ids=tokens,
                              page_tokens=self.page_tokens, lora_id=lora[0], lora_name=lora[1])
        self.expect_folded(since, [(event, (stored,))])
        m.publish(r, entries, hashes)
        self.b.publish(pages, r)
        self.stats["pages published"] += k

    @precondition(lambda self: self._writers())
    @rule(data=st.data(), explicit=st.booleans())
    def publish(self, data, explicit):
        self._publish(data, data.draw(st.sampled_from(self._writers())), explicit)

    @rule(data=st.data(), rid=st.sampled_from((0, 1, 2, 3)), n=st.integers(1, 3), then_finish=st.booleans())
    def write_and_publish(self, data, rid, n, then_finish):
        """A request writes a prompt's pages in a step that runs everywhere and publishes them
        (then, half the time, finishes: what it published goes to the cache)."""
        pages = self._reserve(data, rid, n)
        if pages is None:
            return
        r = self.m.requests[rid]
        self._commit_pages(rid, self.m.open_step, pages)
        self.seal_and_complete()
        self._publish(data, r, explicit=False)
        if then_finish:
            self._gone(rid, True)

    @precondition(lambda self: self.m.lru)
    @rule(data=st.data(), rid=st.sampled_from((0, 1, 2, 3)), extra=st.integers(1, 3), alias=st.booleans())
    def allocate_under_pressure(self, data, rid, extra, alias):
        """More pages than are free: the allocation evicts the least recently used cached pages,
        or, when free + cached is too small, fails and changes nothing."""
        n = len(self.m.reservable()) + extra
        if alias:
            self._alias_n(data.draw(st.sampled_from((0, 1, 2))), n)
        else:
            self._reserve(data, rid, n)

    @precondition(lambda self: self.m.pages_of)
    @rule(data=st.data(), rid=st.sampled_from((0, 1, 2, 3)), unknown_tail=st.booleans(), whole=st.booleans())
    def lookup_then_share(self, data, rid, unknown_tail, whole):
        """``lookup`` says how many leading blocks the request's tenant may share (every published
        one under released_aliases); ``share`` takes them, or (``whole``) every published one."""
        m = self.m
        hashes = data.draw(st.lists(st.sampled_from([m.hashes[p] for p in sorted(m.hashes)]),
                                    min_size=1, max_size=3, unique=True))
        known = len(hashes)
        if unknown_tail:
            hashes.append(UNKNOWN_HASH)
        r = m.requests.get(rid)
        writer = m.hash_tenant[m.pages_of[hashes[0]]]
        tenant = data.draw(st.sampled_from((writer, *self.tenants) if r is None else (None, r.tenant)))
        reader = tenant if r is None else r.tenant
        n = self.both(lambda L: L.lookup(hashes, tenant=reader))
        assert n == m.lookup(hashes, reader), (n, m.lookup(hashes, reader), hashes, reader)
        self.stats["lookups"] += 1
        self.stats["lookups cut by the tenant"] += n < known
        take = hashes[:known] if whole else hashes[:n]
        pages = [m.pages_of[h] for h in take]
        call = lambda L: L.share(rid, take, tenant=tenant)  # noqa: E731
        err = m.share_error(rid, tenant, pages)
        if err is not None:
            self.rejected(call, err)
            self.stats[f"share refused ({err.__name__})"] += 1
            return
        since = len(self.seen)
        from_cache = sum(1 for p in pages if p in m.lru)
        assert self.both(call) == tuple(pages)
        self.expect_folded(since, [(PagesShared(request=rid, page_ids=tuple(pages), tenant=tenant), ())])
        m.share(rid, tenant, pages)
        self.stats["pages shared"] += len(pages)
        self.stats["pages shared from the cache"] += from_cache

    @precondition(lambda self: self.m.lru)
    @rule(data=st.data(), how=st.sampled_from(["n", "all", "pages"]))
    def evict(self, data, how):
        m = self.m
        if how == "n":
            k = data.draw(st.integers(1, len(m.lru)))
            pages, call = m.lru[:k], (lambda L: L.evict(k))
        elif how == "all":
            pages, call = list(m.lru), (lambda L: L.evict())
        else:
            order = data.draw(st.permutations(m.lru))
            pages = list(order[: data.draw(st.integers(1, len(order)))])
            call = lambda L: L.evict(pages=list(pages))  # noqa: E731
        since = len(self.seen)
        assert self.both(call) == tuple(pages)
        hashes = m.evict(pages)
        self.b.evicted(pages)
        self.expect_folded(since, [self._evicted(pages, hashes)])
        self.stats["evicted by evict"] += len(pages)
