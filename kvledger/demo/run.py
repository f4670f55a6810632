"""The serving simulation, driven entirely through the embedded async engine.

One loop iteration is one step (``_Serving.step``). Commands go through ``kvledger.engine`` (and its
durable log, when one is given); the model runs as every rank's step graph, after
the executor's input copies and clears:

    retire    finish requests that are done, cancel INVALID_SPECULATION ones
    admit     FIFO, while the pages of the request (at its final length) fit in
              free pages + evictable snapshot pages - growth promised to running ones
    evict     release least-recently-made snapshots until this step's pages fit;
              their pages become free *and marked* (they hold snapshot row bytes)
    tails     a decoding request whose next token starts a page reserves and commits
              one page: the LIFO allocator hands it the page freed last, so a page just
              released by a snapshot becomes a partially filled tail page
    prefill   admitted requests reserve and commit their prompt pages; snapshots of
              their recurrent state (every ``snapshot_every`` prompt tokens and at the
              prompt's end, as hybrid models keep them for prefix caching) are aliased
              onto free pages, evicting older snapshots when there are none
    run_step  seal -> every rank: clears (the step's clear list) -> graph:
              prefill (write K/V, write the state through the snapshot rows), decode
              (gather pages, masked SDPA), verify (non-finite logits:
              INVALID_SPECULATION, device error 6)
    release   an evicted snapshot's rows are checked against the state written into
              them (no live row was ever overwritten), then released

With ``--prefix-cache`` (``prefix.py``), admission looks the request's prefix up and
shares it into its block table on a hit, prefill runs in two spans over the block
table's pages, and a step's finite prefills publish their full prompt blocks once the
step completed; reservations and snapshot aliases evict cached pages under pressure.
Every ``bare_every``-th step also runs its graph bare (``bare.py``), for the engine's
per-step overhead.

A reference run (``reference=True``) runs the same requests with a page budget
that holds every request and every snapshot at once and never frees anything
until the end: no page is ever reused, so nothing is ever stale (and nothing is
shared: with ``--prefix-cache`` each request computes its prefix itself). The oracle
compares each request's logits with it, bit for bit.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvledger.core.errors import ConfigurationError, SanitizerError, StepFailedError
from kvledger.core.events import Geometry
from kvledger.engine import RankSpec, StepInputs, StepOptions, open_engine
from kvledger.executors.backend import backend_class

from .bare import BareLoop
from .model import HybridDecoder, ModelConfig
from .prefix import PrefixCache, alias_counting, reserve_counting
from .ranks import RankState, SkipClearBackend, StepWork, backend_bytes, devices, make_graph, warm_kernels, warm_up
from .snapshots import Snap, SnapshotCache
from .results import DemoReport, RunResult, compare_logits
from .sanitize import engine_options
from .workload import DemoConfig, RequestSpec

__all__ = ["model_config", "run_demo", "simulate"]


@dataclasses.dataclass
class _Req:
    spec: RequestSpec
    prompt: list  # per rank: the prompt token ids on the rank's device
    checkpoints: tuple  # token counts after which prefill snapshots the recurrent state
    states: list  # per rank: the recurrent state
    pos: int = 0  # tokens whose K/V are in the cache
    pages: int = 0  # pages committed (the block table's length)
    generated: int = 0
    last_token: int = -1
    logits: list = dataclasses.field(default_factory=list)
    split: int = 0  # --prefix-cache: prefill runs in two spans, split after this many tokens (the prefix)
    restore: tuple | None = None  # a prefix hit: the pages of the snapshot holding the state after the prefix


def _kv_tables(ledger: Any, requests: Sequence[int]) -> list:
    return [ledger.kv_pages(r) for r in requests]


def model_config(config: DemoConfig) -> ModelConfig:
    mc = ModelConfig(layers=config.layers, heads=config.heads, head_dim=config.head_dim, d_model=config.d_model)
    mc.validate(config.ranks, config.page_tokens)
    return mc


async def simulate(
    config: DemoConfig,
    *,
    reference: bool = False,
    log_path: str | None = None,
    progress: Callable[[int], None] | None = None,
    model: HybridDecoder | None = None,
    metrics: Any = None,
) -> RunResult:
    """Run the trace once through the engine; return what happened.

    ``reference=True``: no memory pressure (a budget holding everything, nothing freed
    before the end, clears on). ``log_path``: write the durable event log there (the
    engine's ``log=``). ``progress(n)`` is called with the number of requests that
    just ended (passed or failed). ``metrics``: a ``kvledger.metrics.LedgerMetrics`` that
    tracks the engine and is told every step's outcome.

    Raises ``ConfigurationError`` for a budget too small for the trace or an unusable
    device/backend, and what the engine raises (``StepFailedError`` if a graph fails).
    ``config.threads`` sets torch's intra-op threads for the run (restored after): the
    model's ops are tiny, and two OpenMP threads on a shared 2-core machine cost far
    more in contention than they gain.
    """
    threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return await _Serving(config, reference, log_path, progress, model, metrics).run()
    finally:
        torch.set_num_threads(threads)


def _budget(config: DemoConfig, mc: ModelConfig, reference: bool) -> int:
    """Pages in the cache: tight under pressure, everything at once for the reference.
    ``ConfigurationError`` if the largest request does not fit."""
    pt = config.page_tokens
    specs = config.specs()
    if reference:
        snap_pages = mc.snapshot_pages(pt, config.ranks)
        split = config.prefix_tokens()
        budget = sum(s.pages(pt) + snap_pages * len(s.checkpoints(config.snapshot_every, split)) for s in specs)
    else:
        budget = config.budget()
    largest = max(s.pages(pt) for s in specs)
    if budget < largest:
        raise ConfigurationError(
            f"page budget {budget} is too small: the largest request needs {largest} pages of {pt} tokens"
        )
    return budget


class _Serving:
    """One run of the trace: the scheduler's queues and the phases of a step (module docstring).

    Built before the engine opens (a bad configuration raises then, before any log
    exists); ``run`` opens the engine and steps until every request has ended.
    """

    def __init__(self, config: DemoConfig, reference: bool, log_path: str | None,
                 progress: Callable[[int], None] | None, model: HybridDecoder | None, metrics: Any = None) -> None:
        config.validate()
        self.config, self.reference, self.log_path, self.progress = config, reference, log_path, progress
        self.metrics = metrics
        self.mc = mc = model_config(config)
        self.pt, self.world = config.page_tokens, config.ranks
        specs = config.specs()
        self.snap_pages = mc.snapshot_pages(self.pt, self.world)
        budget = _budget(config, mc, reference)
        self.geometry = Geometry(num_pages=budget, page_tokens=self.pt)
        model = model if model is not None else HybridDecoder(mc, config.seed)
        self.devices = devices(config)
        self.clear = clear = config.clear or reference
        if clear:
            backend_class(config.backend)  # an unknown or unavailable backend fails here, before any log exists
        self.engine_options = engine_options(config, reference)  # --sanitize without a sanitizer: here too
        self.ranks = [RankState(r, self.world, self.devices[r], self.geometry, model) for r in range(self.world)]
        graph = make_graph(self.ranks, self.world)
        self.rank_specs = [RankSpec(planes=rk.planes, graph=graph,
                                    backend=config.backend if clear else SkipClearBackend(rk.planes))
                           for rk in self.ranks]
        label = "reference (no pressure)" if reference else ("clears on" if clear else "clears off (--no-clear)")
        self.res = RunResult(label=label, requests=len(specs), page_budget=budget, log_path=log_path,
                             backend=config.backend if clear else SkipClearBackend.name)
        self.gen_prompt = torch.Generator()
        self.waiting = collections.deque(specs)
        self.running: dict[int, _Req] = {}
        self.held_done: list[int] = []  # reference: done requests keep their pages until the end
        self.invalid: set[int] = set()  # requests that had non-finite logits (INVALID_SPECULATION)
        self.plane_bytes = sum(rk.page_bytes for rk in self.ranks)
        self.retire_done: list[int] = []
        self.retire_failed: list[int] = []
        self.engine: Any = None
        self.prefix = PrefixCache(config, mc.vocab, self.res, share=not reference) if config.prefix_cache else None
        self.snaps = SnapshotCache(self.ranks, self.res, self.prefix)
        self.cache = self.snaps.live
        self.bare = None if reference or not config.bare_every else BareLoop(graph, self.world, self.pt,
                                                                              config.bare_every, self.res)

    async def run(self) -> RunResult:
        res = self.res
        warm_up(self.ranks, self.mc, self.pt)
        # timings: the demo reports each phase's device time (and the graph's, for the overhead)
        async with open_engine(self.geometry, log=self.log_path, ranks=self.rank_specs, policy=self.config.policy,
                               steps=StepOptions(timings=True), **self.engine_options) as engine:
            self.engine = engine
            warm_kernels(engine, self.devices)
            if self.metrics is not None:  # --no-clear zeroes nothing: no bytes to count
                self.metrics.track_engine(engine, page_bytes=None if self.clear else [0] * self.world)
            zeroed_before = backend_bytes(engine)
            t_start = time.perf_counter()
            while await self.step():
                pass
            # drain: what the reference held, and every snapshot still cached
            for rid in self.held_done:
                await engine.finish(rid)
            while self.cache:
                await self.snaps.evict(engine, next(iter(self.cache)))
            res.pages_cached_end = engine.ledger.cached_count
            res.events = engine.seq
            res.digest = await engine.digest()
            zeroed = backend_bytes(engine)
            if self.clear and zeroed is not None and zeroed_before is not None:
                res.bytes_zeroed = zeroed - zeroed_before  # what the backends say they zeroed
        res.wall_s = time.perf_counter() - t_start
        return res

    async def step(self) -> bool:
        """One step: retire, admit, evict, tails, prefill, snapshots, run_step, verify. False when done."""
        if not (self.waiting or self.running or self.retire_done or self.retire_failed):
            return False
        engine = self.engine
        step = engine.open_step
        await self._retire()
        if not self.waiting and not self.running:
            return False
        tails, admit = await self._admit()
        need_now = len(tails) + sum(self._prompt_pages(a) for a in admit)
        while engine.free_count < need_now and (sid := self.snaps.victim(engine, need_now)) is not None:
            await self.snaps.evict(engine, sid)
        work = StepWork(self.world)
        await self._grow_tails(tails, step)
        await self._prefill(admit, step)
        for spec in admit:
            await self._snapshots(spec.request, work)
        ran = await self._run_model(step, admit, work)
        prefilled = self._verify(work) if ran else []
        if self.prefix is not None:
            await self.prefix.publish(engine, prefilled)
            self.prefix.end_step([a.request for a in admit])
        return True

    # ------------------------------------------------------------------ the phases of a step

    async def _retire(self) -> None:
        """Finish the requests that are done (the reference holds them to the end), cancel failed ones."""
        engine = self.engine
        for rid in self.retire_failed:
            await engine.cancel(rid)
        for rid in self.retire_done:
            if self.reference:
                self.held_done.append(rid)
            else:
                await engine.finish(rid)
        ended = len(self.retire_done) + len(self.retire_failed)
        self.retire_done, self.retire_failed = [], []
        if self.progress is not None and ended:
            self.progress(ended)

    async def _admit(self) -> tuple[list[_Req], list[RequestSpec]]:
        """The decoding requests that need a tail page now, and the waiting ones admitted (FIFO)
        while their final pages fit in free + cached + evictable snapshot pages, less the
        growth promised (``--prefix-cache``: a hit shares its prefix here, costing less)."""
        pt, running, engine = self.pt, self.running, self.engine
        tails = [q for q in running.values() if q.generated and q.pos // pt >= q.pages]
        free = engine.free_count + engine.ledger.cached_count
        keep = () if self.prefix is None else self.prefix.state_key  # prefix states: not counted on
        evictable = 0 if self.reference else sum(len(s.pages) for sid, s in self.cache.items() if sid not in keep)
        growth = sum(q.spec.pages(pt) - q.pages for q in running.values())
        avail = free + evictable - growth
        admit: list[RequestSpec] = []
        while self.waiting and len(running) + len(admit) < self.config.max_running:
            spec = self.waiting[0]
            if self.prefix is None:
                need: int | None = spec.pages(pt)
            else:
                need = await self.prefix.admit(engine, spec, self._prompt_gen(spec), avail, self.cache,
                                               self.snap_pages)
            if need is None or need > avail:
                break
            avail -= need
            admit.append(self.waiting.popleft())
        if not admit and not running:
            w = self.waiting[0]
            raise ConfigurationError(f"page budget {self.geometry.num_pages} cannot admit request {w.request} "
                                     f"({w.pages(pt)} pages) even with every snapshot evicted")
        return tails, admit

    async def _grow_tails(self, tails: list[_Req], step: int) -> None:
        """A decoding request whose next token starts a page reserves and commits one (LIFO:
        the page freed last, often a released snapshot page)."""
        engine = self.engine
        for q in tails:
            got = await self._reserve(q.spec.request, 1)
            self.res.tails_released += self.snaps.note_reuse(got)
            await engine.commit(q.spec.request, step, 1)
            q.pages += 1

    async def _prefill(self, admit: list[RequestSpec], step: int) -> None:
        """Admitted requests reserve and commit their prompt pages (less a prefix hit's shared
        ones); their prompts are drawn."""
        engine, config, prefix = self.engine, self.config, self.prefix
        for spec in admit:
            n = self._prompt_pages(spec)
            got = await self._reserve(spec.request, n, spec.tenant)
            self.snaps.note_reuse(got)
            await engine.commit(spec.request, step, n)
            if prefix is None:
                prompt = torch.randint(0, self.mc.vocab, (spec.prompt_tokens,), generator=self._prompt_gen(spec))
                cps, split, restore, hit = spec.checkpoints(config.snapshot_every), 0, None, 0
            else:
                adm = prefix.admissions[spec.request]
                prompt, cps, split = adm.tokens, prefix.checkpoints(spec, config.snapshot_every), prefix.split
                restore, hit = adm.restore, adm.hit_blocks
            self.running[spec.request] = _Req(
                spec=spec, prompt=[prompt.to(rk.device) for rk in self.ranks], checkpoints=cps,
                states=[rk.model.new_state() for rk in self.ranks], pages=n + hit, split=split, restore=restore)

    def _prompt_gen(self, spec: RequestSpec) -> torch.Generator:
        """The generator of the request's own prompt tokens, seeded for it."""
        return self.gen_prompt.manual_seed(self.config.seed * 1_000_003 + spec.request)

    def _prompt_pages(self, spec: RequestSpec) -> int:
        """Prompt pages the request reserves: all of them, less a prefix hit's shared ones."""
        n = spec.prompt_pages(self.pt)
        return n if self.prefix is None else n - self.prefix.admissions[spec.request].hit_blocks

    async def _reserve(self, request: int, n: int, tenant: str | None = None) -> tuple[int, ...]:
        """``engine.reserve``; with a prefix cache, counting the cached pages it evicted."""
        if self.prefix is None or not self.prefix.share:
            return await self.engine.reserve(request, n, tenant=tenant)
        pages, evicted = await self.engine.call(reserve_counting, request, n, tenant)
        self.res.pages_evicted += evicted
        return pages

    async def _alias(self, sid: int) -> tuple[int, ...]:
        """``engine.alias_snapshot``; with a prefix cache, counting the cached pages it evicted."""
        if self.prefix is None or not self.prefix.share:
            return await self.engine.alias_snapshot(sid, self.snap_pages)
        pages, evicted = await self.engine.call(alias_counting, sid, self.snap_pages)
        self.res.pages_evicted += evicted
        return pages

    async def _snapshots(self, request: int, work: StepWork) -> None:
        """The hybrid model's state snapshots of an admitted request: rows aliasing free pages
        (evicting older snapshots to make room; a checkpoint is skipped when there is none)."""
        engine, cache, res = self.engine, self.cache, self.res
        q = self.running[request]
        cap = None if self.reference else self.config.snapshot_cache
        for k in range(len(q.checkpoints)):
            if not self.reference:
                while cap is not None and len(cache) >= cap and (sid := self.snaps.victim(engine)) is not None:
                    await self.snaps.evict(engine, sid)
                while engine.free_count < self.snap_pages and (sid := self.snaps.victim(engine, self.snap_pages)) \
                        is not None:
                    await self.snaps.evict(engine, sid)
            if cap == 0 or engine.free_count + engine.ledger.cached_count < self.snap_pages:
                res.snapshots_skipped += 1
                continue
            sid = self.snaps.next_id
            self.snaps.next_id += 1
            pages = await self._alias(sid)
            if self.prefix is not None:
                self.prefix.note_snapshot(request, q.checkpoints[k], sid)
            self.snaps.note_reuse(pages)
            snap = Snap(pages=tuple(pages), saved=[None] * self.world)
            cache[sid] = snap
            res.snapshots_made += 1
            work.snapshots.setdefault(request, []).append((k, pages, snap))

    async def _run_model(self, step: int, admit: list[RequestSpec], work: StepWork) -> bool:
        """Block tables from the ledger, then the step: clears, then the model, on every rank.
        False when the sanitizer stopped the step before its graph (``_stopped``)."""
        engine, res = self.engine, self.res
        prefill_q = [self.running[s.request] for s in admit]
        decode_q = [q for q in self.running.values() if q.generated]
        ids = [q.spec.request for q in prefill_q] + [q.spec.request for q in decode_q]
        tables = await engine.call(_kv_tables, ids)
        work.prefill = list(zip(prefill_q, tables[: len(prefill_q)], strict=True))
        work.decode = list(zip(decode_q, tables[len(prefill_q):], strict=True))
        bare = self.bare
        shadow = bare.prepare(work) if bare is not None and bare.due(res.steps) else None
        try:
            result = await self._run_step(step, work)
        except SanitizerError as exc:
            await self._stopped(exc, work)
            return False
        if shadow is not None:
            await bare.run([ex.context for ex in engine.executors], step, work, shadow, result)  # type: ignore[union-attr]
        res.add_step(result)
        if result.clear_list and self.clear:
            res.pages_zeroed += len(result.clear_list)
            res.bytes_zeroed += len(result.clear_list) * self.plane_bytes
        res.nan_bytes_written += sum(work.nan_bytes)
        return True

    async def _stopped(self, error: SanitizerError, work: StepWork) -> None:
        """``--sanitize``: the sanitizer stopped the step before its graph read anything (the
        engine recorded the violations and aborted it). Every request of the step fails (none
        got its token); the snapshots made for it are dropped (their rows were never written)."""
        rids = [q.spec.request for q, _ in work.prefill + work.decode]
        self.res.add_stop(error, len(rids))
        for rid in rids:
            self.res.failed_requests.append(rid)
            self.retire_failed.append(rid)
            del self.running[rid]
        await self.snaps.drop_unwritten(self.engine)

    async def _run_step(self, step: int, work: StepWork) -> Any:
        """``engine.run_step``; its outcome also goes to the metrics, when there are any."""
        metrics = self.metrics
        try:
            result = await self.engine.run_step(step, StepInputs(data=work))
        except StepFailedError as exc:
            if metrics is not None:
                metrics.step_failed(exc)
            raise
        if metrics is not None:
            metrics.step_completed(result)
        return result

    def _verify(self, work: StepWork) -> list[int]:
        """Non-finite logits fail a request (INVALID_SPECULATION); the others take their token.
        Returns the requests prefilled this step whose logits were finite on every rank."""
        res, running = self.res, self.running
        prefilled = [q.spec.request for q, _ in work.prefill
                     if all(work.finite[r][q.spec.request] for r in range(self.world))]
        for q, _ in work.prefill + work.decode:
            rid = q.spec.request
            if not all(work.finite[r][rid] for r in range(self.world)):
                if rid not in self.invalid:
                    self.invalid.add(rid)
                    res.invalid_speculation += 1
                    res.failed_requests.append(rid)
                if not self.config.keep_going:
                    self.retire_failed.append(rid)
                    del running[rid]
                    continue
            out = work.logits[0][rid]
            q.logits.append(out.to("cpu", copy=True))
            q.pos = q.spec.prompt_tokens if q.generated == 0 else q.pos + 1
            q.generated += 1
            q.last_token = int(out.argmax())
            if q.generated == q.spec.gen_tokens:
                res.passed += rid not in self.invalid
                self.retire_done.append(rid)
                del running[rid]
                res.logits[rid] = torch.stack(q.logits)
        return prefilled


async def run_demo(
    config: DemoConfig,
    *,
    log_path: str | None = None,
    reference: bool = True,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
    metrics: Any = None,
) -> DemoReport:
    """The demo: the trace under pressure (clears on, or off with ``config.clear=False``)
    through an engine that logs to ``log_path``, then (``reference=True``) the same
    trace with no pressure in memory, and the oracle comparing their logits.

    ``progress(label, total)`` returns the callback one run reports ended requests to.
    ``metrics`` (a ``kvledger.metrics.LedgerMetrics``) follows the run under pressure only.
    Raises what ``simulate`` raises.
    """
    config.validate()
    t0 = time.perf_counter()
    model = HybridDecoder(model_config(config), config.seed)
    cb = progress(("clears on" if config.clear else "clears off"), config.requests) if progress else None
    run = await simulate(config, log_path=log_path, progress=cb, model=model, metrics=metrics)
    ref = oracle = None
    if reference:
        cb = progress("reference", config.requests) if progress else None
        ref = await simulate(config, reference=True, progress=cb, model=model)
        oracle = compare_logits(run, ref)
    return DemoReport(config=config, run=run, reference=ref, oracle=oracle, wall_s=time.perf_counter() - t0)
