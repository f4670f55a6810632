"""The serving simulation, driven entirely through the embedded async engine.

One loop iteration is one step. Commands go through ``kvledger.engine`` (and its
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

A reference run (``reference=True``) runs the same requests with a page budget
that holds every request and every snapshot at once and never frees anything
until the end: no page is ever reused, so nothing is ever stale. The oracle
compares each request's logits with it, bit for bit.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Optional, Sequence

import anyio
import torch

from kvledger.core.errors import ConfigurationError
from kvledger.core.events import Geometry
from kvledger.engine import RankSpec, StepInputs, open_engine
from kvledger.executors.backend import backend_class, check_page_ids

from .model import HybridDecoder, ModelConfig, RankModel
from .workload import DemoConfig, RequestSpec

__all__ = ["DemoReport", "RunResult", "SkipClearBackend", "compare_logits", "run_demo", "simulate"]

ALLREDUCE_TIMEOUT_S = 120.0


class SkipClearBackend:
    """``--no-clear``: the seed's unfixed executor. Validates each clear list exactly as a
    real backend does (``PageOutOfRangeError`` / ``DuplicatePageError``) and counts the
    pages, but zeroes nothing, so the ledger's plan is intact and only the zeroing is
    missing. Used by the demo only; it is not in the backend registry."""

    name = "none (--no-clear)"

    def __init__(self, planes: Sequence[torch.Tensor]) -> None:
        self.num_pages = int(planes[0].shape[0])
        self.pages_skipped = 0

    def clear(self, page_ids: Sequence[int]) -> None:
        self.pages_skipped += len(check_page_ids(page_ids, self.num_pages))


@dataclasses.dataclass
class RunResult:
    """What one run did (all counts are over the whole run)."""

    label: str
    requests: int = 0
    passed: int = 0
    invalid_speculation: int = 0
    steps: int = 0
    wall_s: float = 0.0
    step_s: float = 0.0  # sum of run_step wall times (seal -> every rank done)
    clear_s: float = 0.0  # sum over steps of the slowest rank's clear phase
    graph_s: float = 0.0
    steps_with_clears: int = 0
    clear_step_s: float = 0.0  # run_step wall time of the steps that had a clear list
    pages_listed: int = 0  # clear-list entries of completed steps
    pages_zeroed: int = 0  # listed pages a backend actually zeroed (0 with --no-clear)
    bytes_zeroed: int = 0  # over every plane of every rank
    tails_released: int = 0  # decode tail pages that were released snapshot pages (row bytes in them)
    page_reuses: int = 0  # reservations that got a page some request or snapshot held before
    snapshots_made: int = 0
    snapshots_released: int = 0
    snapshots_skipped: int = 0
    snapshot_rows_intact: int = 0  # snapshots whose rows still held their state at release
    nan_bytes_written: int = 0  # FP8 NaN bytes (0x7F / 0xFF) written through snapshot rows
    page_budget: int = 0
    events: int = 0
    digest: str = ""
    log_path: Optional[str] = None
    backend: str = ""
    logits: dict = dataclasses.field(default_factory=dict, repr=False)  # request -> [gen, vocab] float32
    failed_requests: list = dataclasses.field(default_factory=list)

    def figures(self) -> dict:
        """The flat figures (no logits), for JSON and tables."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("logits", "failed_requests")}
        out["failed_requests"] = list(self.failed_requests)
        out["step_mean_s"] = self.step_s / self.steps if self.steps else 0.0
        out["clear_share"] = self.clear_s / self.step_s if self.step_s else 0.0
        return out


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


@dataclasses.dataclass
class _Snap:
    pages: tuple
    saved: list  # per rank: the state written through the rows


class _AllReduce:
    """Sum of one tensor from every rank, in rank order (deterministic), for in-process
    ranks running their graphs in worker threads. One per step; ``abort()`` breaks it so
    a rank's failure fails the others instead of leaving them waiting."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.parts: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=ALLREDUCE_TIMEOUT_S) if world > 1 else None

    def for_rank(self, rank: int, stream: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        if self.world == 1:
            return _identity
        parts, barrier = self.parts, self.barrier

        def reduce(t: torch.Tensor) -> torch.Tensor:
            parts[rank] = t
            if stream is not None:
                stream.synchronize()  # the part is on the device before others read it
            barrier.wait()
            total = parts[0].to(t.device) + parts[1].to(t.device)
            for p in parts[2:]:
                total = total + p.to(t.device)
            barrier.wait()  # every rank has read every part before the next call
            return total

        return reduce

    def abort(self) -> None:
        if self.barrier is not None:
            self.barrier.abort()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _StepWork:
    """One step's work for the graphs (``StepInputs.data``) and what they report back."""

    __slots__ = ("prefill", "decode", "snapshots", "allreduce", "logits", "finite", "nan_bytes")

    def __init__(self, world: int) -> None:
        self.prefill: list = []  # (req, block table)
        self.decode: list = []  # (req, block table)
        self.snapshots: dict = {}  # request -> [(checkpoint index, snapshot pages, snap)]
        self.allreduce = _AllReduce(world)
        self.logits: list = [dict() for _ in range(world)]
        self.finite: list = [dict() for _ in range(world)]
        self.nan_bytes = [0] * world


class _Rank:
    def __init__(self, rank: int, world: int, device: torch.device, geometry: Geometry, model: HybridDecoder) -> None:
        c = model.config
        h = c.heads // world
        self.rank = rank
        self.device = device
        self.model: RankModel = model.shard(rank, world, device)
        shape = (geometry.num_pages, geometry.page_tokens, h, c.head_dim)
        self.planes = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device) for _ in range(2 * c.layers)]
        self.page_bytes = sum(p[0].numel() * p.element_size() for p in self.planes)


def _forward(ranks: list, work: _StepWork, ctx: Any) -> None:
    """One rank's step graph: prefill, snapshot rows, decode, verify."""
    r = ctx.rank
    rk: _Rank = ranks[r]
    m = rk.model
    planes = rk.planes
    reduce = work.allreduce.for_rank(r, ctx.stream)
    logits, finite = work.logits[r], work.finite[r]
    dev = rk.device
    try:
        if ctx.stream is not None:
            torch.cuda.set_device(dev)
        with torch.no_grad(), (torch.cuda.stream(ctx.stream) if ctx.stream is not None else contextlib.nullcontext()):
            for req, table in work.prefill:
                rid = req.spec.request
                bt = torch.tensor(table, dtype=torch.int64, device=dev)
                out, at = m.prefill(req.prompt[r], planes, bt, req.states[r], reduce, req.checkpoints)
                logits[rid] = out
                # snapshot rows: the state at each checkpoint, written through the KV pages
                for k, pages, snap in work.snapshots.get(rid, ()):
                    snap.saved[r] = at[k]
                    work.nan_bytes[r] += m.write_snapshot(at[k], m.snapshot_rows(planes, pages))
            for req, table in work.decode:
                bt = torch.tensor(table, dtype=torch.int64, device=dev)
                out = m.decode(req.last_token, req.pos, planes, table, bt, req.states[r], reduce)
                logits[req.spec.request] = out
            # verification: a request whose logits are not finite fails (INVALID_SPECULATION)
            for rid, out in logits.items():
                finite[rid] = bool(torch.isfinite(out).all())
    except BaseException:
        work.allreduce.abort()
        raise


def _make_graph(ranks: list, world: int) -> Callable:
    if world == 1:

        def graph(ctx: Any, step: int, inputs: StepInputs) -> None:
            _forward(ranks, inputs.data, ctx)

        return graph

    async def graph_threaded(ctx: Any, step: int, inputs: StepInputs) -> None:
        # Each rank computes in its own thread; the all-reduce meets them per layer.
        await anyio.to_thread.run_sync(_forward, ranks, inputs.data, ctx)

    return graph_threaded


def _backend_bytes(engine: Any) -> Optional[int]:
    """Bytes the ranks' backends report having zeroed, where they keep count (the torch
    backend does); None if one does not."""
    total = 0
    for ex in engine.executors:
        stats = getattr(ex.backend, "statistics", None)
        figures = stats() if callable(stats) else None
        if not isinstance(figures, dict) or "bytes" not in figures:
            return None
        total += int(figures["bytes"])
    return total


def _warm_up(ranks: list, mc: ModelConfig, page_tokens: int) -> None:
    """Run the model once on scratch planes (never the engine's), outside any timing:
    CUDA context, cuBLAS handles and attention kernels are set up before step 0."""
    for rk in ranks:
        scratch = [torch.zeros_like(p[:3]) for p in rk.planes]
        m = rk.model
        state = m.new_state()
        table = (0, 1, 2)
        bt = torch.tensor(table, dtype=torch.int64, device=rk.device)
        tokens = torch.zeros(page_tokens + 1, dtype=torch.int64, device=rk.device)
        with torch.no_grad():
            m.prefill(tokens, scratch, bt, state, _identity, (1, page_tokens + 1))
            m.decode(0, page_tokens + 1, scratch, table, bt, state, _identity)
        if rk.device.type == "cuda":
            torch.cuda.synchronize(rk.device)


def _kv_tables(ledger: Any, requests: Sequence[int]) -> list:
    return [ledger.kv_pages(r) for r in requests]


def _devices(config: DemoConfig) -> list:
    if config.device == "cpu":
        return [torch.device("cpu")] * config.ranks
    if not torch.cuda.is_available():
        raise ConfigurationError("--device cuda: torch sees no CUDA device here")
    n = torch.cuda.device_count()
    return [torch.device("cuda", r % n) for r in range(config.ranks)]


def model_config(config: DemoConfig) -> ModelConfig:
    mc = ModelConfig(layers=config.layers, heads=config.heads, head_dim=config.head_dim, d_model=config.d_model)
    mc.validate(config.ranks, config.page_tokens)
    return mc


async def simulate(
    config: DemoConfig,
    *,
    reference: bool = False,
    log_path: Optional[str] = None,
    progress: Optional[Callable[[int], None]] = None,
    model: Optional[HybridDecoder] = None,
) -> RunResult:
    """Run the trace once through the engine; return what happened.

    ``reference=True``: no memory pressure (a budget holding everything, nothing freed
    before the end, clears on). ``log_path``: write the durable event log there (the
    engine's ``log=``). ``progress(n)`` is called with the number of requests that
    just ended (passed or failed).

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
        return await _simulate(config, reference, log_path, progress, model)
    finally:
        torch.set_num_threads(threads)


async def _simulate(
    config: DemoConfig,
    reference: bool,
    log_path: Optional[str],
    progress: Optional[Callable[[int], None]],
    model: Optional[HybridDecoder],
) -> RunResult:
    config.validate()
    mc = model_config(config)
    pt = config.page_tokens
    world = config.ranks
    specs = config.specs()
    snap_pages = mc.snapshot_pages(pt, world)
    if reference:
        budget = sum(s.pages(pt) + snap_pages * len(s.checkpoints(config.snapshot_every)) for s in specs)
    else:
        budget = config.budget()
    largest = max(s.pages(pt) for s in specs)
    if budget < largest:
        raise ConfigurationError(
            "page budget %d is too small: the largest request needs %d pages of %d tokens" % (budget, largest, pt)
        )
    geometry = Geometry(num_pages=budget, page_tokens=pt)
    if model is None:
        model = HybridDecoder(mc, config.seed)
    devices = _devices(config)
    clear = config.clear or reference
    if clear:
        backend_class(config.backend)  # an unknown or unavailable backend fails here, before any log exists
    ranks = [_Rank(r, world, devices[r], geometry, model) for r in range(world)]
    backends = [config.backend if clear else SkipClearBackend(rk.planes) for rk in ranks]
    graph = _make_graph(ranks, world)
    rank_specs = [RankSpec(planes=rk.planes, graph=graph, backend=b) for rk, b in zip(ranks, backends)]

    label = "reference (no pressure)" if reference else ("clears on" if clear else "clears off (--no-clear)")
    res = RunResult(label=label, requests=len(specs), page_budget=budget, log_path=log_path)
    res.backend = config.backend if clear else SkipClearBackend.name
    gen_prompt = torch.Generator()
    waiting = collections.deque(specs)
    running: dict[int, _Req] = {}
    held_done: list[int] = []  # reference: done requests keep their pages until the end
    cache: "collections.OrderedDict[int, _Snap]" = collections.OrderedDict()
    seen_pages: set[int] = set()
    released_rows: set[int] = set()  # pages freed by a snapshot release, not taken since
    next_snapshot = 0
    invalid: set[int] = set()  # requests that had non-finite logits (INVALID_SPECULATION)
    plane_bytes = sum(rk.page_bytes for rk in ranks)

    _warm_up(ranks, mc, pt)
    async with open_engine(geometry, log=log_path, ranks=rank_specs, policy=config.policy) as engine:
        for ex in engine.executors:
            # Kernel warm-up (Triton compiles on first use): zero page 0 while every page is
            # still free and all-zero, so no byte changes and no ledger state is involved.
            if isinstance(ex.backend, SkipClearBackend):
                continue
            with torch.cuda.device(ex.context.device) if ex.context.stream is not None else contextlib.nullcontext():
                ex.backend.clear([0])
        if devices[0].type == "cuda":
            for d in set(devices):
                torch.cuda.synchronize(d)
        zeroed_before = _backend_bytes(engine)
        t_start = time.perf_counter()

        def can_evict() -> bool:
            # the oldest snapshot, unless it was made this step (its rows are written by
            # this step's graph: it cannot be released before then)
            return bool(cache) and next(iter(cache.values())).saved[0] is not None

        async def evict() -> None:
            s, snap = cache.popitem(last=False)
            intact = all(RankModel.snapshot_matches(snap.saved[r], RankModel.snapshot_rows(ranks[r].planes, snap.pages))
                         for r in range(world))
            res.snapshot_rows_intact += intact
            await engine.release_snapshot(s)
            released_rows.update(snap.pages)
            res.snapshots_released += 1

        def note_reuse(pages: Sequence[int]) -> int:
            """Count pages taken again; return how many of them were released snapshot
            pages still holding row bytes (never rewritten since their release)."""
            rows = 0
            for p in pages:
                if p in seen_pages:
                    res.page_reuses += 1
                    if p in released_rows:
                        released_rows.discard(p)
                        rows += 1
                else:
                    seen_pages.add(p)
            return rows

        retire_done: list[int] = []
        retire_failed: list[int] = []
        while waiting or running or retire_done or retire_failed:
            step = engine.open_step
            # -- retire
            for rid in retire_failed:
                await engine.cancel(rid)
            for rid in retire_done:
                if reference:
                    held_done.append(rid)
                else:
                    await engine.finish(rid)
            ended = len(retire_done) + len(retire_failed)
            retire_done, retire_failed = [], []
            if progress is not None and ended:
                progress(ended)
            if not waiting and not running:
                break
            # -- admit (accounting only)
            tails = [q for q in running.values() if q.generated and q.pos // pt >= q.pages]
            free = engine.free_count
            evictable = 0 if reference else sum(len(s.pages) for s in cache.values())
            growth = sum(q.spec.pages(pt) - q.pages for q in running.values())
            avail = free + evictable - growth
            admit: list[RequestSpec] = []
            while waiting and len(running) + len(admit) < config.max_running:
                need = waiting[0].pages(pt)
                if need > avail:
                    break
                avail -= need
                admit.append(waiting.popleft())
            if not admit and not running:
                raise ConfigurationError(
                    "page budget %d cannot admit request %d (%d pages) even with every snapshot evicted"
                    % (budget, waiting[0].request, waiting[0].pages(pt))
                )
            # -- evict under pressure
            need_now = len(tails) + sum(a.prompt_pages(pt) for a in admit)
            while engine.free_count < need_now and can_evict():
                await evict()
            work = _StepWork(world)
            # -- tails
            for q in tails:
                got = await engine.reserve(q.spec.request, 1)
                res.tails_released += note_reuse(got)
                await engine.commit(q.spec.request, step, 1)
                q.pages += 1
            # -- prefill
            for spec in admit:
                n = spec.prompt_pages(pt)
                got = await engine.reserve(spec.request, n, tenant=spec.tenant)
                note_reuse(got)
                await engine.commit(spec.request, step, n)
                gen_prompt.manual_seed(config.seed * 1_000_003 + spec.request)
                prompt = torch.randint(0, mc.vocab, (spec.prompt_tokens,), generator=gen_prompt)
                q = _Req(spec=spec, prompt=[prompt.to(rk.device) for rk in ranks],
                         checkpoints=spec.checkpoints(config.snapshot_every),
                         states=[rk.model.new_state() for rk in ranks], pages=n)
                running[spec.request] = q
            for spec in admit:
                q = running[spec.request]
                # the hybrid model's state snapshots: rows aliasing free pages (evicting
                # older snapshots to make room; a checkpoint is skipped when there is none)
                cap = None if reference else config.snapshot_cache
                for k in range(len(q.checkpoints)):
                    if not reference:
                        while cap is not None and len(cache) >= cap and can_evict():
                            await evict()
                        while engine.free_count < snap_pages and can_evict():
                            await evict()
                    if cap == 0 or engine.free_count < snap_pages:
                        res.snapshots_skipped += 1
                        continue
                    sid = next_snapshot
                    next_snapshot += 1
                    pages = await engine.alias_snapshot(sid, snap_pages)
                    note_reuse(pages)
                    snap = _Snap(pages=tuple(pages), saved=[None] * world)
                    cache[sid] = snap
                    res.snapshots_made += 1
                    work.snapshots.setdefault(spec.request, []).append((k, pages, snap))
            # -- block tables, from the ledger
            prefill_q = [running[s.request] for s in admit]
            decode_q = [q for q in running.values() if q.generated]
            ids = [q.spec.request for q in prefill_q] + [q.spec.request for q in decode_q]
            tables = await engine.call(_kv_tables, ids)
            work.prefill = list(zip(prefill_q, tables[: len(prefill_q)]))
            work.decode = list(zip(decode_q, tables[len(prefill_q):]))
            # -- the step: clears, then the model
            result = await engine.run_step(step, StepInputs(data=work))
            res.steps += 1
            res.step_s += result.wall_s
            res.clear_s += max(t.clear_s for t in result.ranks)
            res.graph_s += max(t.graph_s for t in result.ranks)
            if result.clear_list:
                res.steps_with_clears += 1
                res.clear_step_s += result.wall_s
                res.pages_listed += len(result.clear_list)
                if clear:
                    res.pages_zeroed += len(result.clear_list)
                    res.bytes_zeroed += len(result.clear_list) * plane_bytes
            res.nan_bytes_written += sum(work.nan_bytes)
            # -- verify and advance
            for q, _ in work.prefill + work.decode:
                rid = q.spec.request
                if not all(work.finite[r][rid] for r in range(world)):
                    if rid not in invalid:
                        invalid.add(rid)
                        res.invalid_speculation += 1
                        res.failed_requests.append(rid)
                    if not config.keep_going:
                        retire_failed.append(rid)
                        del running[rid]
                        continue
                out = work.logits[0][rid]
                q.logits.append(out.to("cpu", copy=True))
                q.pos = q.spec.prompt_tokens if q.generated == 0 else q.pos + 1
                q.generated += 1
                q.last_token = int(out.argmax())
                if q.generated == q.spec.gen_tokens:
                    res.passed += rid not in invalid
                    retire_done.append(rid)
                    del running[rid]
                    res.logits[rid] = torch.stack(q.logits)
        # -- drain: what the reference held, and every snapshot still cached
        for rid in held_done:
            await engine.finish(rid)
        while cache:
            await evict()
        res.events = engine.seq
        res.digest = await engine.digest()
        zeroed = _backend_bytes(engine)
        if clear and zeroed is not None and zeroed_before is not None:
            res.bytes_zeroed = zeroed - zeroed_before  # what the backends say they zeroed
    res.wall_s = time.perf_counter() - t_start
    return res


def compare_logits(run: RunResult, ref: RunResult) -> dict:
    """The oracle: per request, are the logits bit-identical to the reference's?

    Returns ``{"equal": bool, "requests_equal": n, "requests": n, "max_abs_diff": float}``;
    a request that failed (no logits) counts as different.
    """
    equal = 0
    max_diff = 0.0
    for rid, want in ref.logits.items():
        got = run.logits.get(rid)
        if got is None or got.shape != want.shape:
            continue
        if torch.equal(got, want):
            equal += 1
        else:
            d = (got - want).abs()
            d = d[torch.isfinite(d)]
            if d.numel():
                max_diff = max(max_diff, float(d.max()))
    return {
        "equal": equal == ref.requests and len(ref.logits) == ref.requests,
        "requests_equal": equal,
        "requests": ref.requests,
        "max_abs_diff": max_diff,
    }


@dataclasses.dataclass
class DemoReport:
    """A demo: the run under pressure, the reference run (optional) and the oracle."""

    config: DemoConfig
    run: RunResult
    reference: Optional[RunResult]
    oracle: Optional[dict]
    wall_s: float

    @property
    def ok(self) -> bool:
        """With clears on: every request passed and (when checked) logits equal the
        reference. With clears off the demo shows the failure, so always True."""
        if not self.config.clear:
            return True
        return self.run.passed == self.run.requests and (self.oracle is None or self.oracle["equal"])

    def to_dict(self) -> dict:
        """Everything but the logits, JSON-ready."""
        return {
            "config": dataclasses.asdict(self.config),
            "run": self.run.figures(),
            "reference": self.reference.figures() if self.reference is not None else None,
            "oracle": self.oracle,
            "ok": self.ok,
            "wall_s": self.wall_s,
        }


async def run_demo(
    config: DemoConfig,
    *,
    log_path: Optional[str] = None,
    reference: bool = True,
    progress: Optional[Callable[[str, int], Callable[[int], None]]] = None,
) -> DemoReport:
    """The demo: the trace under pressure (clears on, or off with ``config.clear=False``)
    through an engine that logs to ``log_path``, then (``reference=True``) the same
    trace with no pressure in memory, and the oracle comparing their logits.

    ``progress(label, total)`` returns the callback one run reports ended requests to.
    Raises what ``simulate`` raises.
    """
    config.validate()
    t0 = time.perf_counter()
    model = HybridDecoder(model_config(config), config.seed)
    cb = progress(("clears on" if config.clear else "clears off"), config.requests) if progress else None
    run = await simulate(config, log_path=log_path, progress=cb, model=model)
    ref = oracle = None
    if reference:
        cb = progress("reference", config.requests) if progress else None
        ref = await simulate(config, reference=True, progress=cb, model=model)
        oracle = compare_logits(run, ref)
    return DemoReport(config=config, run=run, reference=ref, oracle=oracle, wall_s=time.perf_counter() - t0)
