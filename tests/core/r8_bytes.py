"""R8's second oracle: what every page physically holds (tests/core/test_state_machine.py).

``Bytes`` follows each page's content: zeros, snapshot-row bytes, or KV data of
a request incarnation. When a step is sealed it runs the plan at once (zero the
listed pages), then lets every request read the pages committed for that step
or earlier, then write them; and it asserts RELIABILITY.md's two promises:

  * zero before first read: no request reads bytes its policy forbids;
  * exactly once: a plan zeroes only pages a listing owes it, in the step the
    listing is due (the commit's step, or the open step an abort carried it
    to), never a page holding its reader's own KV data, never a page that holds
    zeros already (released_aliases); every listing due by a step is zeroed by
    that step's plan.

Several steps may be in flight. Each keeps an undo record (a page's content
before that step touched it) and the pages commands wrote after its seal. An
abort of step k undoes k and every later step in flight, newest first, except
where a command wrote since: nothing of an aborted step may be assumed to have
run. A listing that an aborted plan had settled is owed again exactly when the
model carried its page; a page still held by the same request must be carried.
A completion that retires a step makes its effects final.

Prefix-shared pages: a page is published only while it holds its writer's KV; a
hashed page (shared or cached) keeps exactly that KV, is never zeroed, and every
sharer reads it; an evicted page keeps the old KV, and the policy decides who may
read it next (the ordinary rule above).
"""

from __future__ import annotations

from r8_model import SHARED, Model

__all__ = ["Bytes", "ROW", "ZERO"]

ZERO, ROW = "zero", "row"


class Bytes:
    """What each page physically holds; checks the promises at every sealed step."""

    def __init__(self, model: Model):
        self.m = model
        self.content = [ZERO] * model.n
        self.undo: dict[int, dict[int, object]] = {}  # step in flight -> {page: content before it}
        self.touched: dict[int, set[int]] = {}  # step in flight -> pages commands wrote since its seal
        self.owed: dict[tuple[int, int], int] = {}  # (page, inc) of a live listing -> the step it is due
        self.settled: dict[tuple[int, int], int] = {}  # (page, inc) -> the step in flight that zeroed it
        self.published: dict[int, object] = {}  # hashed page -> the KV it holds (its writer's)
        self.whole: set[tuple[int, int]] = set()  # (page, inc) committed to be read whole, not read yet
        self.overwrite: set[tuple[int, int]] = set()  # (page, inc) committed to be written whole before a read
        self.shared_reads = 0

    def own(self, r):
        return ("kv", r.tenant, r.inc)

    def acceptable(self, c, r):
        pol = self.m.policy
        if pol == "released_aliases":
            return c != ROW
        if pol == "cross_tenant":
            return c == ZERO or (c[0] == "kv" and c[1] == r.tenant)
        return c == ZERO or c == self.own(r)

    # ------------------------------------------------------------------ commands

    def write(self, p, c):
        self.content[p] = c
        for pages in self.touched.values():
            pages.add(p)

    def aliased(self, pages):
        for p in pages:
            self.write(p, ROW)

    def restored_into_request(self, pages, r):
        for p in pages:
            self.write(p, self.own(r))

    def let_go(self, pages, r):
        """``r`` gave the pages back: what it wrote there is no longer data it will read
        (a later reservation by the same request starts over), only its tenant's bytes."""
        for p in pages:
            if self.content[p] == self.own(r):
                self.content[p] = ("kv", r.tenant, -r.inc)

    def released(self, pages, r):
        """``r`` (still live) let go of some KV pages: as ``let_go``, also for the ones that stay
        hashed (cached, or shared by others), whose published KV is then no longer ``r``'s own."""
        for p in pages:
            if self.content[p] == self.own(r):
                self.content[p] = ("kv", r.tenant, -r.inc)
                if p in self.published:
                    self.published[p] = self.content[p]

    def committed(self, listed, step, r, whole=(), none=()):
        """``whole``: the committed pages the step reads whole before writing them (a state);
        ``none``: the ones it writes whole before it reads them."""
        for p in listed:
            self.owed[(p, r.inc)] = step
        self.whole.update((p, r.inc) for p in whole)
        self.overwrite.update((p, r.inc) for p in none)

    def left_kv(self, pages, r):
        for p in pages:
            self.owed.pop((p, r.inc), None)  # listed, never zeroed: the model marks it again

    def publish(self, pages, r):
        for p in pages:
            assert self.content[p] == self.own(r), ("published page does not hold its writer's KV", p)
            self.published[p] = self.content[p]

    def evicted(self, pages):
        for p in pages:
            del self.published[p]  # the bytes stay: the policy's mark decides who may read them

    # ------------------------------------------------------------------ steps

    def seal(self, step, plan):
        m = self.m
        self.undo[step], self.touched[step] = {}, set()
        undo = self.undo[step]
        for p in plan:
            r = m.first(p)
            c = self.content[p]
            assert r is not None and m.kind(p) == "kv", ("plan lists a page no request holds", p)
            assert p not in self.published, ("plan zeroes a hashed page", step, p)
            assert c != self.own(r), ("plan zeroes its reader's own KV data", step, p)
            if m.policy == "released_aliases":
                assert c != ZERO, ("plan zeroes a page that already holds zeros", step, p)
            key = (p, r.inc)
            assert self.owed.get(key) == step, ("plan zeroes a page no listing owes this step", step, p,
                                                self.owed.get(key), self.settled.get(key))
            del self.owed[key]
            self.settled[key] = step
            undo.setdefault(p, c)
            self.content[p] = ZERO
        late = {k: s for k, s in self.owed.items() if s <= step}
        assert not late, ("listings due by this step that its plan did not zero", step, late)
        for p, kv in self.published.items():
            assert self.content[p] == kv, ("a hashed page lost its KV", step, p, self.content[p], kv)
        self._read_and_write(step)

    def _read_and_write(self, step):
        """The step's graph reads every page committed for this step or earlier, then writes
        it; a hashed page is read (by its writer and every sharer) and never written."""
        undo = self.undo[step]
        for r in self.m.requests.values():
            for p, s in r.kv:
                if s > step:
                    continue
                if (p, r.inc) in self.overwrite:  # the step writes it whole first
                    self.overwrite.discard((p, r.inc))
                    undo.setdefault(p, self.content[p])
                    self.content[p] = self.own(r)
                c = self.content[p]
                if p in self.published:
                    assert c == self.published[p], (f"request {r.rid} reads shared page {p} holding {c!r}", step)
                    self.shared_reads += s == SHARED
                    continue
                assert self.acceptable(c, r), f"request {r.rid} reads page {p} holding {c!r} in step {step}"
                if (p, r.inc) in self.whole:  # its first read takes in every byte: zeros or its own only
                    self.whole.discard((p, r.inc))
                    assert c == ZERO or c == self.own(r), \
                        f"request {r.rid} reads page {p} whole holding {c!r} in step {step}"
                if c != self.own(r):
                    undo.setdefault(p, c)
                    self.content[p] = self.own(r)

    def retire(self, steps):
        """These steps ran everywhere (or can no longer be aborted): their effects are final."""
        gone = set(steps)
        for s in gone:
            self.undo.pop(s, None)
            self.touched.pop(s, None)
        self.settled = {k: s for k, s in self.settled.items() if s not in gone}

    def abort(self, steps, carried):
        """``steps`` (oldest first) were aborted; the model carried ``carried`` to the open step."""
        m = self.m
        for s in reversed(steps):
            touched = self.touched.pop(s)
            for p, prev in self.undo.pop(s).items():
                if p not in touched:
                    self.content[p] = prev  # nothing of the aborted step can be assumed done
        gone = set(steps)
        for (p, inc), s in list(self.settled.items()):
            if s in gone:
                del self.settled[(p, inc)]
                r = m.first(p)
                # (a request that released the page and took it back since owes it a newer listing)
                if r is not None and r.inc == inc and m.kind(p) == "kv" and (p, inc) not in self.owed:
                    assert p in carried, ("an aborted plan's page still in its request's KV was not carried", s, p)
        for p in carried:
            self.owed[(p, m.first(p).inc)] = m.open_step
