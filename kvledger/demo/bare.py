"""The engine's per-step overhead, measured against the same graph run bare.

    engine overhead  StepResult.wall_s (seal -> every rank's completion recorded)
                     - the slowest rank's RankTiming.graph_s (the graph's own time):
                     the seal, the plan's hand-off, the clear phase, the completion records
    bare overhead    the wall time of calling the very same graph directly, with no ledger,
                     plan, executor or clear, waiting for it as the executor does
                     - the graph's own time, measured as the executor measures it

The graph's own time is host time on the CPU (the work is synchronous), and on a GPU the
time between two CUDA events recorded on the model stream around it; a GPU wait polls
the done event, then waits in a worker thread (``wait_cuda_event``, as the executor does).

Every ``DemoConfig.bare_every``-th step of the run under pressure runs twice: through the
engine, then bare right after it, on the same inputs: each request's recurrent state as
it was before the step (cloned before the engine ran it), the same block tables, fresh
snapshot records and outputs. The pages the step writes are saved before the bare run and
put back after it, so the bare run leaves no trace in the planes even were a kernel not
deterministic, and the run's schedule, events and digest are those of a run without it.
Its logits are compared with the engine's, bit for bit (``bare_mismatch``: requests that
differ; 0 when the graph is deterministic). Both overheads are averaged over the same
steps. The bare run goes second, so its caches are warm: if anything this flatters the
bare loop, never the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import torch

from kvledger.engine import StepInputs
from kvledger.executors.executor import wait_cuda_event

from .ranks import StepWork

__all__ = ["BareLoop"]


def _shadow_req(q: Any) -> Any:
    """The request as the graph saw it before the step: its own copy of the recurrent states."""
    return dataclasses.replace(q, states=[s.clone() for s in q.states])


class BareLoop:
    """Runs a step's graph again, bare, on every rank; adds the figures to ``res`` (a ``RunResult``)."""

    def __init__(self, graph: Callable, world: int, page_tokens: int, every: int, res: Any) -> None:
        self.graph, self.world, self.pt, self.every, self.res = graph, world, page_tokens, every, res

    def due(self, index: int) -> bool:
        """Is step number ``index`` of the run (0, 1, ...) one to run bare as well?"""
        return self.every > 0 and index % self.every == 0

    def prepare(self, work: StepWork) -> StepWork:
        """The bare run's inputs, taken before the engine runs the step (it advances the states)."""
        shadow = StepWork(self.world)
        shadow.prefill = [(_shadow_req(q), t) for q, t in work.prefill]
        shadow.decode = [(_shadow_req(q), t) for q, t in work.decode]
        shadow.snapshots = {rid: [(k, pages, types.SimpleNamespace(pages=pages, saved=[None] * self.world))
                                  for k, pages, _ in got] for rid, got in work.snapshots.items()}
        return shadow

    def _touched(self, work: StepWork) -> list[int]:
        pages = set()
        for _, table in work.prefill:
            pages.update(table)
        for q, table in work.decode:
            pages.add(table[q.pos // self.pt])
        for got in work.snapshots.values():
            for _, snap_pages, _ in got:
                pages.update(snap_pages)
        return sorted(pages)

    async def run(self, contexts: Sequence[Any], step: int, work: StepWork, shadow: StepWork, result: Any) -> None:
        """Run ``shadow`` bare on every rank (``contexts``: the executors' ``RankContext``) after
        the engine ran ``work`` as ``result`` (a ``StepResult``); record both overheads."""
        touched = self._touched(work)
        saved = []
        for ctx in contexts:
            with _on(ctx):
                idx = torch.tensor(touched, dtype=torch.int64, device=ctx.planes[0].device)
                saved.append((idx, [p.view(torch.uint8).index_select(0, idx) for p in ctx.planes]))
        try:
            wall, graph_s = await self._timed(contexts, step, shadow)
        finally:
            for ctx, (idx, before) in zip(contexts, saved, strict=True):
                with _on(ctx):
                    for plane, b in zip(ctx.planes, before, strict=True):
                        plane.view(torch.uint8).index_copy_(0, idx, b)
        res = self.res
        engine_over = result.wall_s - max(t.graph_s for t in result.ranks)
        bare_over = wall - graph_s
        res.bare_steps += 1
        res.bare_graph_s += graph_s
        res.bare_engine_overhead_s += engine_over
        res.bare_engine_overhead_max_s = max(res.bare_engine_overhead_max_s, engine_over)
        res.bare_overhead_s += bare_over
        res.bare_overhead_max_s = max(res.bare_overhead_max_s, bare_over)
        res.bare_mismatch += _mismatches(work, shadow)

    async def _timed(self, contexts: Sequence[Any], step: int, shadow: StepWork) -> tuple[float, float]:
        """(wall time, slowest rank's graph time) of one bare run of the graph on every rank."""
        inputs = StepInputs(data=shadow)
        graph_s = [0.0] * len(contexts)
        t0 = time.perf_counter()
        if len(contexts) == 1:
            await self._one(contexts[0], step, inputs, graph_s)
        else:
            async with anyio.create_task_group() as tg:
                for ctx in contexts:
                    tg.start_soon(self._one, ctx, step, inputs, graph_s)
        return time.perf_counter() - t0, max(graph_s)

    async def _one(self, ctx: Any, step: int, inputs: StepInputs, out: list) -> None:
        stream = ctx.stream
        if stream is None:
            t = time.perf_counter()
            result = self.graph(ctx, step, inputs)
            if inspect.isawaitable(result):
                await result
            out[ctx.rank] = time.perf_counter() - t
            return
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            result = self.graph(ctx, step, inputs)
        if inspect.isawaitable(result):
            await result
        done.record(stream)
        await wait_cuda_event(done)
        out[ctx.rank] = start.elapsed_time(done) * 1e-3


def _on(ctx: Any) -> Any:
    """Work for a rank on its model stream (nothing to do on the CPU)."""
    return contextlib.nullcontext() if ctx.stream is None else torch.cuda.stream(ctx.stream)


def _mismatches(work: StepWork, shadow: StepWork) -> int:
    """Requests whose logits from the bare run differ in any bit on any rank (NaN included)."""
    bad = set()
    for got, want in zip(shadow.logits, work.logits, strict=True):
        for rid, out in got.items():
            ref = want.get(rid)
            if ref is None or not torch.equal(out.view(torch.int32), ref.view(torch.int32)):
                bad.add(rid)
    return len(bad)
