"""Drive vLLM's own ``KVCacheManager`` through a serving trace, the way vLLM's scheduler calls it.

Used by the example, the tests and ``bench/bench_vllm_manager.py``. A trace is a
list of ``TraceRequest`` (arrival step, prompt token ids, output length),
generated from a seed before any clock runs (``make_trace``: prompts share a
few system prefixes, so prefix caching has hits). ``run_trace`` plays it:

    each step:  manager.new_step_starts()
                running requests first: allocate_slots(r, 1 decode token or the next
                  prefill chunk); no room -> preempt the newest running request
                  (free it, recompute later: vLLM's policy)
                then waiting ones: get_computed_blocks(r) -> allocate_slots(r, chunk,
                  num_new_computed_tokens=hit, new_computed_blocks=blocks)
                manager.take_new_block_ids()      (what the scheduler does per step)
                [manager.take_events()]
                "the model ran": num_computed_tokens advance, a sampled token is
                  appended after the prompt; a request with all its tokens -> free

Needs vLLM (and torch, for the KV cache spec's dtype); imported when called.
Deterministic for a given trace: the same calls in the same order on any pool.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunStats", "TraceRequest", "make_manager", "make_request", "make_trace", "run_trace"]


@dataclass(frozen=True)
class TraceRequest:
    arrival: int  # the step it arrives in
    prompt: tuple[int, ...]
    output_len: int


@dataclass
class RunStats:
    steps: int = 0
    finished: int = 0
    preempted: int = 0
    allocations: int = 0  # allocate_slots calls that succeeded
    scheduled_tokens: int = 0
    hit_tokens: int = 0  # prompt tokens served by the prefix cache
    events: list = field(default_factory=list)  # take_events() per step, when asked
    block_ids: list = field(default_factory=list)  # per allocation: (request id, block ids), when asked


def make_trace(*, seed: int = 0, requests: int = 200, prefixes: int = 6, prefix_tokens: tuple[int, int] = (64, 512),
               suffix_tokens: tuple[int, int] = (16, 384), output_tokens: tuple[int, int] = (8, 192),
               arrivals_per_step: float = 1.0, vocab: int = 32000) -> list[TraceRequest]:
    """A seeded serving trace: each prompt is one of ``prefixes`` shared system prefixes (or none,
    one in five) plus a unique suffix; arrivals are Poisson-like, ``arrivals_per_step`` on average."""
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(vocab) for _ in range(rng.randint(*prefix_tokens))) for _ in range(prefixes)]
    out = []
    step = 0.0
    for _ in range(requests):
        step += rng.expovariate(arrivals_per_step)
        head = () if rng.random() < 0.2 else rng.choice(systems)
        tail = tuple(rng.randrange(vocab) for _ in range(rng.randint(*suffix_tokens)))
        out.append(TraceRequest(int(step), head + tail, rng.randint(*output_tokens)))
    return out


def make_manager(num_blocks: int, block_size: int = 16, *, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False, max_model_len: int = 8192) -> Any:
    """A ``KVCacheManager`` over one full-attention group of ``num_blocks`` blocks (vLLM's own class:
    with kvledger installed, it runs on a ``LedgerBlockPool``)."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                          hash_block_size=block_size, enable_caching=enable_caching,
                          enable_kv_cache_events=enable_kv_cache_events)


_hash_ready: set[int] = set()


def make_request(request_id: str, prompt: tuple[int, ...] | list[int], output_len: int, block_size: int = 16) -> Any:
    """A vLLM ``Request`` with vLLM's sha256 block hasher (as vLLM's own tests build them)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready.add(1)
    params = SamplingParams(max_tokens=output_len)
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(block_size, sha256))


def run_trace(manager: Any, trace: list[TraceRequest], *, block_size: int = 16, max_running: int = 48,
              token_budget: int = 2048, chunk: int = 512, collect_events: bool = False,
              collect_blocks: bool = False, on_step: Callable[[int], None] | None = None,
              max_steps: int = 100_000) -> RunStats:
    """Play ``trace`` on ``manager`` until every request finished (or ``max_steps``). Returns the counts.

    Raises ``RuntimeError`` if a request can never be scheduled (the pool is too small for it).
    """
    player = _Player(manager, trace, block_size, max_running, chunk, collect_blocks)
    stats = player.stats
    step = 0
    while player.busy() and step < max_steps:
        player.arrive(step)
        manager.new_step_starts()
        budget = player.schedule_running(token_budget)
        player.admit(budget)
        manager.take_new_block_ids()
        if collect_events:
            stats.events.append(manager.take_events())
        player.model_ran()
        if on_step is not None:
            on_step(step)
        step += 1
    stats.steps = step
    return stats


class _Player:
    """``run_trace``'s state between steps: arrived, waiting and running requests, this step's work."""

    def __init__(self, manager: Any, trace: list[TraceRequest], block_size: int, max_running: int, chunk: int,
                 collect_blocks: bool) -> None:
        self.manager, self.trace, self.block_size = manager, trace, block_size
        self.max_running, self.chunk, self.collect_blocks = max_running, chunk, collect_blocks
        self.stats = RunStats()
        self.pending = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
        self.next = 0
        self.waiting: list[tuple[int, Any]] = []  # (trace index, request)
        self.running: list[tuple[int, Any]] = []
        self.scheduled: list[tuple[int, Any, int]] = []  # (trace index, request, tokens) this step
        self.sampled = random.Random(len(trace))

    def busy(self) -> bool:
        return bool(self.next < len(self.pending) or self.waiting or self.running)

    def arrive(self, step: int) -> None:
        trace = self.trace
        while self.next < len(self.pending) and trace[self.pending[self.next]].arrival <= step:
            i = self.pending[self.next]
            self.waiting.append((i, make_request(str(i), trace[i].prompt, trace[i].output_len, self.block_size)))
            self.next += 1

    def _allocated(self, i: int, req: Any, todo: int) -> None:
        self.stats.allocations += 1
        if self.collect_blocks:
            self.stats.block_ids.append((req.request_id, self.manager.get_block_ids(req.request_id)))
        self.scheduled.append((i, req, todo))

    def schedule_running(self, budget: int) -> int:
        """Running requests first (vLLM's order); no room: preempt the newest. Returns the budget left."""
        manager, running = self.manager, self.running
        k = 0
        while k < len(running) and budget > 0:
            i, req = running[k]
            todo = min(req.num_tokens - req.num_computed_tokens, self.chunk, budget)
            if manager.allocate_slots(req, todo) is None:
                victim_i, victim = running.pop()  # preempt the newest (vLLM's FCFS policy): recompute later
                manager.free(victim)
                victim.num_computed_tokens = 0
                self.waiting.insert(0, (victim_i, victim))
                self.stats.preempted += 1
                self.scheduled = [s for s in self.scheduled if s[1] is not victim]
                continue
            self._allocated(i, req, todo)
            budget -= todo
            k += 1
        return budget

    def admit(self, budget: int) -> None:
        """Waiting requests, with their prefix-cache hits, while the budget and the pool allow."""
        manager, waiting = self.manager, self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_running:
            i, req = waiting[0]
            blocks, hit, _ = manager.get_computed_blocks(req)
            todo = min(req.num_tokens - hit, self.chunk, budget)
            if manager.allocate_slots(req, todo, num_new_computed_tokens=hit, new_computed_blocks=blocks) is None:
                if not self.running:
                    raise RuntimeError(f"request {i} ({req.num_tokens} tokens) never fits the pool")
                return
            waiting.pop(0)
            req.num_computed_tokens = hit
            self.stats.hit_tokens += hit
            self.running.append((i, req))
            self._allocated(i, req, todo)
            budget -= todo

    def model_ran(self) -> None:
        """The step ran: computed tokens advance; a request with every token computed samples one
        more, or finishes and is freed."""
        for i, req, todo in self.scheduled:
            req.num_computed_tokens += todo
            self.stats.scheduled_tokens += todo
            if req.num_computed_tokens >= req.num_tokens:
                if len(req.output_token_ids) >= self.trace[i].output_len:
                    self.manager.free(req)
                    self.running.remove((i, req))
                    self.stats.finished += 1
                else:
                    req.append_output_token_ids(self.sampled.randrange(32000))
        self.scheduled = []
