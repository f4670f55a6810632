"""The demo's ranks: each rank's share of the model and its FP8 planes, and the step graph it runs.

    RankState     one rank: its model shard, 2 x layers FP8 planes [pages, page_tokens, heads/rank, head_dim]
    StepWork      one step's work for the graphs (StepInputs.data), and what they report back
    make_graph    the graph every rank runs after its clears: prefill (write K/V, write the
                  recurrent state through the snapshot rows; --prefix-cache: read a prefix
                  hit's state from its snapshot rows, attend over the block table's pages),
                  decode (gather pages, masked SDPA), verify (non-finite logits:
                  INVALID_SPECULATION)
    SkipClearBackend  ``--no-clear``: validates clear lists, zeroes nothing

In-process ranks compute in worker threads and meet per layer in ``AllReduce``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import anyio
import torch

from kvledger.core.errors import ConfigurationError
from kvledger.core.events import Geometry
from kvledger.engine import StepInputs
from kvledger.core import checks
from kvledger.executors.backend import ClearBackendBase
from kvledger.executors.sanitize import SanitizerCheck
from kvledger.executors.torch_backend import TorchClearBackend

from .model import HybridDecoder, ModelConfig, RankModel
from .workload import DemoConfig

__all__ = ["AllReduce", "RankState", "SkipClearBackend", "StepWork", "backend_bytes", "devices", "make_graph",
           "warm_kernels", "warm_up"]

ALLREDUCE_TIMEOUT_S = 120.0


class SkipClearBackend(ClearBackendBase):
    """``--no-clear``: the seed's unfixed executor. Validates each clear list exactly as a
    real backend does (``PageOutOfRangeError`` / ``DuplicatePageError``) and counts the
    pages, but zeroes nothing, so the ledger's plan is intact and only the zeroing is
    missing. For ``--sanitize`` it poisons and checks like the torch backend over the
    same planes (``poison``, ``start_verify``): only the clear is skipped. Used by the
    demo only; it is not in the backend registry."""

    name = "none (--no-clear)"
    can_sanitize = True

    def __init__(self, planes: Sequence[torch.Tensor]) -> None:
        self.num_pages = int(planes[0].shape[0])
        self.pages_skipped = 0
        self._planes = tuple(planes)
        self._sanitizer: TorchClearBackend | None = None

    def clear(self, page_ids: Sequence[int]) -> None:
        self.pages_skipped += len(checks.page_ids(page_ids, self.num_pages))

    def clear_checked(self, page_ids: tuple[int, ...]) -> None:
        self.pages_skipped += len(page_ids)

    def _torch(self) -> TorchClearBackend:
        if self._sanitizer is None:
            self._sanitizer = TorchClearBackend(self._planes)
        return self._sanitizer

    def poison(self, page_ids: Sequence[int]) -> None:
        """Fill every plane of the listed pages with 0xFF (``TorchClearBackend.poison``)."""
        self._torch().poison(page_ids)

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        """The sanitizer's check over the planes (``TorchClearBackend.start_verify``)."""
        return self._torch().start_verify(cleared_ids, committed_ids)


class AllReduce:
    """Sum of one tensor from every rank, in rank order (deterministic), for in-process
    ranks running their graphs in worker threads. One per step; ``abort()`` breaks it so
    a rank's failure fails the others instead of leaving them waiting."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.parts: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=ALLREDUCE_TIMEOUT_S) if world > 1 else None

    def for_rank(self, rank: int, stream: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        parts, barrier = self.parts, self.barrier
        if barrier is None:  # one rank: nothing to meet
            return identity

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


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


class StepWork:
    """One step's work for the graphs (``StepInputs.data``) and what they report back."""

    __slots__ = ("prefill", "decode", "snapshots", "allreduce", "logits", "finite", "nan_bytes")

    def __init__(self, world: int) -> None:
        self.prefill: list = []  # (req, block table)
        self.decode: list = []  # (req, block table)
        self.snapshots: dict = {}  # request -> [(checkpoint index, snapshot pages, snap)]
        self.allreduce = AllReduce(world)
        self.logits: list = [{} for _ in range(world)]
        self.finite: list = [{} for _ in range(world)]
        self.nan_bytes = [0] * world


class RankState:
    """One rank: its model shard and its FP8 K/V planes (two per layer)."""

    def __init__(self, rank: int, world: int, device: torch.device, geometry: Geometry, model: HybridDecoder) -> None:
        c = model.config
        h = c.heads // world
        self.rank = rank
        self.device = device
        self.model: RankModel = model.shard(rank, world, device)
        shape = (geometry.num_pages, geometry.page_tokens, h, c.head_dim)
        self.planes = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device) for _ in range(2 * c.layers)]
        self.page_bytes = sum(p[0].numel() * p.element_size() for p in self.planes)


def _forward(ranks: list, work: StepWork, ctx: Any) -> None:
    """One rank's step graph: prefill, snapshot rows, decode, verify."""
    r = ctx.rank
    rk: RankState = ranks[r]
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
                if req.split:
                    out, at = _prefill_split(m, req, r, planes, bt, reduce)
                else:
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


def _prefill_split(m: RankModel, req: Any, r: int, planes: Sequence[torch.Tensor], bt: torch.Tensor,
                   reduce: Callable) -> tuple[torch.Tensor, list]:
    """``--prefix-cache``'s prefill of one request, in two spans split after the shared
    prefix (``req.split`` tokens). A hit (``req.restore``: the prefix state's snapshot pages)
    reads the recurrent state back from the snapshot rows and skips the first span, its
    K/V being in the shared pages at the head of the block table; a miss computes it.
    Returns the logits and the states at ``req.checkpoints``."""
    split, prompt, state = req.split, req.prompt[r], req.states[r]
    cps = req.checkpoints
    if req.restore is not None:
        m.read_snapshot(m.snapshot_rows(planes, req.restore), state)
        first: list = []
    else:
        _, first = m.prefill_span(prompt, 0, split, planes, bt, state, reduce, [c for c in cps if c <= split])
    out, rest = m.prefill_span(prompt, split, prompt.shape[0], planes, bt, state, reduce,
                               [c for c in cps if c > split])
    return out, first + rest


def make_graph(ranks: list, world: int) -> Callable:
    """The step graph of every rank (``RankSpec.graph``): ``StepInputs.data`` is the step's ``StepWork``."""
    if world == 1:

        def graph(ctx: Any, step: int, inputs: StepInputs) -> None:
            _forward(ranks, cast(StepWork, inputs.data), ctx)

        return graph

    async def graph_threaded(ctx: Any, step: int, inputs: StepInputs) -> None:
        # Each rank computes in its own thread; the all-reduce meets them per layer.
        await anyio.to_thread.run_sync(_forward, ranks, cast(StepWork, inputs.data), ctx)

    return graph_threaded


def backend_bytes(engine: Any) -> int | None:
    """Bytes the ranks' backends report having zeroed, where they keep count (the torch
    backend does); None if one does not (another backend, or ``--no-clear``)."""
    total = 0
    for ex in engine.executors:
        if not isinstance(ex.backend, TorchClearBackend):
            return None
        total += ex.backend.statistics()["bytes"]
    return total


def warm_up(ranks: list, mc: ModelConfig, page_tokens: int) -> None:
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
            m.prefill(tokens, scratch, bt, state, identity, (1, page_tokens + 1))
            m.prefill_span(tokens, page_tokens, page_tokens + 1, scratch, bt, state, identity, (page_tokens + 1,))
            m.decode(0, page_tokens + 1, scratch, table, bt, state, identity)
        if rk.device.type == "cuda":
            torch.cuda.synchronize(rk.device)


def warm_kernels(engine: Any, devices: list) -> None:
    """Kernel warm-up (Triton compiles on first use): zero page 0 while every page is still
    free and all-zero, so no byte changes and no ledger state is involved."""
    for ex in engine.executors:
        if isinstance(ex.backend, SkipClearBackend):
            continue
        with torch.cuda.device(ex.context.device) if ex.context.stream is not None else contextlib.nullcontext():
            ex.backend.clear([0])
    if devices[0].type == "cuda":
        for d in set(devices):
            torch.cuda.synchronize(d)


def devices(config: DemoConfig) -> list:
    """One device per rank: the CPU, or the CUDA devices round robin."""
    if config.device == "cpu":
        return [torch.device("cpu")] * config.ranks
    if not torch.cuda.is_available():
        raise ConfigurationError("--device cuda: torch sees no CUDA device here")
    n = torch.cuda.device_count()
    return [torch.device("cuda", r % n) for r in range(config.ranks)]
