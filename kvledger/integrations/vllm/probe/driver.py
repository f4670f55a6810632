"""The probe's trace and workers: vLLM's scheduler step by step, the worker emulated on the tagged cache.

    each step   arrivals (prompts: one of a few shared system prefixes + a unique tail)
                schedule()                                   (sync: then execute, update)
                [async: schedule() again before the previous step executes; aborts land between]
                execute(step): poison released blocks (sanitizer) -> zero new_block_ids_to_zero ->
                    copy-on-write copies -> in each group, for the whole batch as a GPU runs it:
                        attention: every request writes its chunk's tokens' KV, then every
                            request reads the blocks it attends to
                        Mamba align: every request's previous state block is copied into its
                            current one (a read; zeros for a request with no state yet), then
                            every request writes its checkpoints and final state;
                        Mamba none: every request reads block 0, then every request writes it
                    (so a hit on a block another request writes in the same step reads what the
                    block held before the step, as the batched kernels do)
                    -> the ModelRunnerOutput (a sampled token once a request's prompt is done)
                update_from_output()
    aborts      a running request now and then; its prompt comes back at once as a new request
                (an immediate retry); under async scheduling with ``drop``, the worker skips an
                aborted request's share of the steps already scheduled (its writes never happen,
                the output omits it): vLLM PR #56525's mechanism

Tokens are a function of (request, position), so the scheduler and the workers agree on
every token without a device; a position's KV content is a hash of the tokens up to it,
a state's the hash of the tokens it has seen, so a prefix-cache hit expects the same
contents its writer wrote.

Rules: ``vllm`` (vLLM's own ``new_block_ids_to_zero``: every new attention block, no
Mamba block), ``groups`` and ``all_reused`` (kvledger installed with that policy and
``zeroing=True``), ``sanitizer`` (kvledger recording with ``released_aliases``, nothing
zeroed, every block vLLM releases filled with 0x7F: the first stale read is named).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from .configs import BLOCK_SIZE, allocate, kv_cache_config, scheduler
from .memory import Finding, TaggedCache

__all__ = ["ProbeStats", "run_probe"]

_MASK = (1 << 62) - 1


def _token(rid: str, p: int) -> int:
    """The token a request samples at position ``p`` (a function of both: no device needed)."""
    return (hash((rid.split("+")[0], p)) & 0x7FFF) + 3


@dataclass
class ProbeStats:
    config: str
    rule: str
    async_scheduling: bool
    steps: int
    stale: int
    unwritten: int  # state reads of a hit whose writing step did not run (issue 28's "unwritten")
    unwritten_kv: int  # attention reads of such a hit: zeros under a zeroing rule, the old bytes otherwise
    masked_same: int
    wrong: int
    zeroed_blocks: int
    zeroed_bytes: int
    state_reads: int
    kv_block_reads: int
    finished: int
    aborted: int
    hit_tokens: int
    first_stale: str | None
    ledger_events: int
    log: str | None
    wrong_examples: list


class _Req:
    """The worker's view of one request (as the model runner keeps it)."""

    def __init__(self, rid: str, prompt: list[int], groups: int) -> None:
        self.rid, self.prompt = rid, prompt
        self.blocks: list[list[int]] = [[] for _ in range(groups)]
        self.computed = 0
        self.hashes: list[int] = []  # hashes[p]: the tokens up to position p
        self.state_at: dict[int, int] = {}  # group -> the state block index written last (align)

    def token(self, p: int) -> int:
        return self.prompt[p] if p < len(self.prompt) else _token(self.rid, p)

    def upto(self, n: int) -> list[int]:
        h = self.hashes
        while len(h) < n:
            p = len(h)
            h.append(hash((h[-1] if h else 0, self.token(p))) & _MASK)
        return h


class _Worker:
    """Executes scheduler outputs on the tagged cache, in order (module docstring)."""

    def __init__(self, planned: Any, mem: TaggedCache, null_block: int) -> None:
        self.planned, self.mem, self.null = planned, mem, null_block
        self.groups = len(planned.config.kv_cache_groups)
        self.reqs: dict[str, _Req] = {}
        self.dropped: set = set()  # (group, content) whose write was dropped
        self.drop_now: set[str] = set()  # requests aborted after being scheduled: their work there is skipped
        self.seen: dict[tuple, tuple] = {}  # (request, group, block) -> (version, seq in block) last read
        self.released: list[int] = []  # blocks vLLM released since the last step (sanitizer)
        self.poisoning = False

    def execute(self, out: Any, step: int, utils: Any) -> Any:
        mem = self.mem
        if self.poisoning and self.released:
            mem.poison([b for b in dict.fromkeys(self.released) if b != self.null])
            self.released.clear()
        mem.zero(list(out.new_block_ids_to_zero or ()))
        if out.kv_cache_block_copies:
            mem.copy_blocks([(c.src_block_id, c.dst_block_id) for c in out.kv_cache_block_copies])
        for rid in out.finished_req_ids:
            self.reqs.pop(rid, None)
            self.drop_now.discard(rid)
        for rid in out.preempted_req_ids or ():
            self.reqs.pop(rid, None)
        for nr in out.scheduled_new_reqs:
            new = _Req(nr.req_id, list(nr.prompt_token_ids), self.groups)
            new.blocks = [list(b) for b in nr.block_ids]
            new.computed = nr.num_computed_tokens
            self.reqs[nr.req_id] = new
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())  # (0.34 resends a resumed request as a new one)
        for i, rid in enumerate(cached.req_ids):
            known = self.reqs.get(rid)
            if known is None:
                continue
            ids_by_group = cached.new_block_ids[i]
            if rid in resumed:
                known.blocks = [list(b) for b in ids_by_group] if ids_by_group is not None else known.blocks
                known.state_at.clear()
            elif ids_by_group is not None:
                for g, ids in enumerate(ids_by_group):
                    known.blocks[g].extend(ids)
            known.computed = cached.num_computed_tokens[i]
        ran, sampled, batch = [], [], []
        for rid, n in out.num_scheduled_tokens.items():
            r = self.reqs.get(rid)
            if r is None:
                continue
            if rid in self.drop_now:
                self._drop(r, n)
                continue
            batch.append((r, n))
        self._run(batch, step)
        for r, n in batch:
            ran.append(r.rid)
            end = r.computed + n
            sampled.append([_token(r.rid, end)] if end >= len(r.prompt) else [])
            r.computed = end
        import dataclasses

        from vllm.v1.outputs import ModelRunnerOutput

        index = {"req_id_to_index": {rid: i for i, rid in enumerate(ran)}}  # (vLLM 0.33's field; 0.34 has none)
        if "req_id_to_index" not in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
            index = {}
        return ModelRunnerOutput(req_ids=ran, **index, sampled_token_ids=sampled, logprobs=None,
                                 prompt_logprobs_dict={}, pooler_output=[])

    def _drop(self, r: _Req, n: int) -> None:
        """The request's share of this step never runs: what it would have written is dropped."""
        h = r.upto(r.computed + n)
        for g, (kind, _) in enumerate(self.planned.kinds):
            if kind == "mamba":
                self.dropped.add((g, ("st", r.computed + n, h[-1])))
                for i in range(r.computed // BLOCK_SIZE, (r.computed + n) // BLOCK_SIZE):
                    self.dropped.add((g, ("st", (i + 1) * BLOCK_SIZE, h[(i + 1) * BLOCK_SIZE - 1])))
            else:
                self.dropped.update((g, h[p]) for p in range(r.computed, r.computed + n))

    def _run(self, batch: list[tuple[_Req, int]], step: int) -> None:
        """One forward pass over the batch, in a GPU's order, group by group: every request's
        initial state is read (Mamba align: copied into its current block) before any request's
        state is written, and every request's KV is written before any request's attention reads
        (a layer's cache write precedes its attention for the whole batch). A request hitting a
        block another request of the same step writes therefore reads what the block held before
        the step."""
        for g, (kind, _) in enumerate(self.planned.kinds):
            if kind == "mamba":
                for r, n in batch:
                    self._mamba_read(r, g, n, step)
                for r, n in batch:
                    self._mamba_write(r, g, n, step)
            else:
                for r, n in batch:
                    self._attention_write(r, g, n, step)
                for r, n in batch:
                    self._attention_read(r, g, n, step)

    def _attention_write(self, r: _Req, g: int, n: int, step: int) -> None:
        mem, c0, end = self.mem, r.computed, r.computed + n
        h = r.upto(end)
        blocks = r.blocks[g]
        p = c0
        while p < end:  # the chunk's KV, block by block
            i, s = divmod(p, BLOCK_SIZE)
            k = min(BLOCK_SIZE - s, end - p)
            b = blocks[i]
            if b != self.null:
                mem.write_tokens(g, b, s, h[p : p + k], r.rid, step)
            p += k

    def _attention_read(self, r: _Req, g: int, n: int, step: int) -> None:
        mem, end = self.mem, r.computed + n
        h = r.upto(end)
        blocks = r.blocks[g]
        window = mem.window.get(g)
        first = 0 if not window else max(0, end - window) // BLOCK_SIZE
        last = (end - 1) // BLOCK_SIZE
        for i in range(first, last + 1):
            b = blocks[i] if i < len(blocks) else self.null
            if b == self.null:
                continue
            key = (r.rid, g, b)
            seen = (mem.version[b], min(end - i * BLOCK_SIZE, BLOCK_SIZE))
            if self.seen.get(key) == seen:
                continue  # (the same bytes it read before)
            self.seen[key] = seen
            mem.read_kv(g, r.rid, step, b, range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE), end, h, self.dropped)

    def _mamba_read(self, r: _Req, g: int, n: int, step: int) -> None:
        """The state the request starts the step from (align: copied into its current block first)."""
        mem, c0, end = self.mem, r.computed, r.computed + n
        h = r.upto(end)
        blocks = r.blocks[g]
        start = ("st", c0, h[c0 - 1]) if c0 else None
        if self.planned.mamba_mode == "align":
            curr = (end + BLOCK_SIZE - 1) // BLOCK_SIZE - 1
            prev = r.state_at.get(g, (c0 - 1) // BLOCK_SIZE if c0 else -1)
            if prev >= 0 and prev != curr and blocks[prev] != self.null:
                mem.read_state(g, r.rid, step, blocks[prev], start, self.dropped)
                mem.copy_state(g, blocks[prev], blocks[curr])
            elif prev == curr:  # the state stays in its block: read in place
                mem.read_state(g, r.rid, step, blocks[curr], start, self.dropped)
            elif prev < 0:  # no state yet: the kernel reads the block it will write
                mem.read_state(g, r.rid, step, blocks[curr], None, self.dropped)
        else:
            mem.read_state(g, r.rid, step, blocks[0], start, self.dropped)

    def _mamba_write(self, r: _Req, g: int, n: int, step: int) -> None:
        """The states the step leaves: checkpoints at block ends crossed (align) and the last one."""
        mem, c0, end = self.mem, r.computed, r.computed + n
        h = r.upto(end)
        blocks = r.blocks[g]

        def content(m: int) -> tuple:
            return ("st", m, h[m - 1])

        if self.planned.mamba_mode == "align":
            curr = (end + BLOCK_SIZE - 1) // BLOCK_SIZE - 1
            for i in range(c0 // BLOCK_SIZE, curr):  # checkpoints at block ends crossed
                if (i + 1) * BLOCK_SIZE > c0 and blocks[i] != self.null:
                    mem.write_state(g, blocks[i], content((i + 1) * BLOCK_SIZE), r.rid, step)
            mem.write_state(g, blocks[curr], content(end), r.rid, step)
            r.state_at[g] = curr
        else:
            mem.write_state(g, blocks[0], content(end), r.rid, step)


class _Trace:
    """Arrivals: a few shared system prefixes and unique tails, seeded."""

    def __init__(self, seed: int, rate: float = 0.9) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        self.prefixes = [[rng.randrange(3, 30000) for _ in range(rng.randrange(32, 160))] for _ in range(4)]
        self.rate = rate
        self.next = 0

    def arrivals(self) -> list[tuple[str, list[int], int]]:
        rng, out = self.rng, []
        k = 0
        while rng.random() < self.rate / (k + 1):
            k += 1
            head = rng.choice(self.prefixes) if rng.random() < 0.8 else []
            tail = [rng.randrange(3, 30000) for _ in range(rng.randrange(8, 200))]
            out.append((f"r{self.next}", head + tail, rng.randrange(4, 96)))
            self.next += 1
        return out


def _request(utils: Any, rid: str, prompt: list[int], max_tokens: int) -> Any:
    if not getattr(_request, "ready", False):
        utils.init_none_hash(utils.sha256)
        _request.ready = True  # type: ignore[attr-defined]
    params = utils.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return utils.Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params, pooling_params=None,
                         block_hasher=utils.get_request_block_hasher(BLOCK_SIZE, utils.sha256))


def run_probe(utils: Any, config: str, rule: str, *, steps: int = 1000, async_scheduling: bool = False,
              drop: bool = True, seed: int = 0, num_blocks: int = 240, log_dir: str | None = None,
              abort_rate: float = 0.03) -> ProbeStats:
    """Drive vLLM's scheduler (``utils``: vLLM's tests/v1/core/utils module) over configuration ``config``
    under ``rule`` (module docstring) for ``steps`` steps; returns the counts."""
    from ..install import install

    planned = kv_cache_config(utils, config, num_blocks)
    inst = None
    if rule != "vllm":
        policy = {"groups": "groups", "all_reused": "all_reused", "sanitizer": "released_aliases"}[rule]
        inst = install(policy=policy, zeroing=rule != "sanitizer", log=log_dir, on_error="fail")
    try:
        sched = scheduler(utils, planned, async_scheduling=async_scheduling)
        _, caches = allocate(planned)
        mem = TaggedCache(planned, caches)
        pool = sched.kv_cache_manager.block_pool
        worker = _Worker(planned, mem, pool.null_block.block_id)
        if rule == "sanitizer":
            worker.poisoning = True
            _watch_releases(pool, worker.released)
        stats = _drive(utils, sched, worker, steps, async_scheduling, drop, seed, abort_rate)
        ledger = getattr(pool, "ledger", None)
        events = ledger.seq if ledger is not None else 0
        log = str(pool.log_path) if getattr(pool, "log_path", None) is not None else None
    finally:
        if inst is not None:
            inst.uninstall()
    c = mem.counts
    return ProbeStats(config, rule, async_scheduling, steps, c.stale, c.unwritten, c.unwritten_kv, c.masked_same,
                      c.wrong,
                      mem.zeroed_blocks, mem.zeroed_blocks * mem.page_bytes, c.state_reads, c.kv_block_reads,
                      stats["finished"], stats["aborted"], stats["hit_tokens"],
                      str(c.first) if isinstance(c.first, Finding) else None, events, log, c.wrong_examples)


def _watch_releases(pool: Any, released: list[int]) -> None:
    """Collect the blocks vLLM releases (freed unhashed, or evicted from the cache): the sanitizer poisons
    them before the next step runs."""
    free, evict = pool.free_blocks, pool._maybe_evict_cached_block

    def free_blocks(blocks: Any, *args: Any, **kwargs: Any) -> None:
        blocks = list(blocks)
        free(blocks, *args, **kwargs)
        released.extend(b.block_id for b in blocks if b.ref_cnt == 0 and b.block_hash is None and not b.is_null)

    def maybe_evict(block: Any) -> bool:
        done = evict(block)
        if done:
            released.append(block.block_id)
        return done

    pool.free_blocks = free_blocks
    pool._maybe_evict_cached_block = maybe_evict


def _drive(utils: Any, sched: Any, worker: _Worker, steps: int, async_: bool, drop: bool, seed: int,
           abort_rate: float) -> dict:
    from vllm.v1.request import RequestStatus

    trace = _Trace(seed)
    rng = random.Random(seed + 1)
    pending: deque = deque()
    finished = aborted = hit_tokens = 0
    for step in range(steps):
        for rid, prompt, out_len in trace.arrivals():
            sched.add_request(_request(utils, rid, prompt, out_len))
        out = sched.schedule()
        for nr in out.scheduled_new_reqs:
            hit_tokens += nr.num_computed_tokens
        pending.append((step, out))
        if async_ and len(pending) < 2:
            continue
        # aborts land here: after this step was scheduled, before the oldest scheduled one ran
        running = [r for r in list(sched.running) if r.request_id in out.num_scheduled_tokens]
        if running and rng.random() < abort_rate * len(running):
            victim = rng.choice(running)
            sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
            aborted += 1
            if drop and async_:
                worker.drop_now.add(victim.request_id)
            retry = _request(utils, victim.request_id + "+", list(victim.prompt_token_ids),
                             victim.sampling_params.max_tokens)
            sched.add_request(retry)
        k, oldest = pending.popleft()
        mro = worker.execute(oldest, k, utils)
        result = sched.update_from_output(oldest, mro)
        for eco in (result or {}).values():
            finished += sum(1 for o in getattr(eco, "outputs", ()) if getattr(o, "finish_reason", None))
    while pending:
        k, oldest = pending.popleft()
        sched.update_from_output(oldest, worker.execute(oldest, k, utils))
    return {"finished": finished, "aborted": aborted, "hit_tokens": hit_tokens}
