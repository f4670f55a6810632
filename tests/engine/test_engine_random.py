"""Random serving sessions through the engine, with rank failures and cancellations.

Oracles, for every example:
* zero before first read: whenever a rank's graph runs, no KV page of any live request
  holds a byte a snapshot row wrote (0x7F), in any plane of that rank;
* StepCompleted(step, rank) is recorded exactly for the (step, rank) pairs whose graph
  ran to its end;
* the ledger's digest equals a replay of its events, and the SPEC invariants hold.
"""

from __future__ import annotations

import anyio
from hypothesis import given, strategies as st

from support.engine import assert_consistent
from support.planes import ROW, filled_planes, page, write_rows

from kvledger import Geometry, OutOfPagesError, StepFailedError
from kvledger.core.events import StepCompleted
from kvledger.engine import RankSpec, StepInputs, open_engine

G = Geometry(num_pages=12, page_tokens=4)
RANKS = 2

command = st.tuples(
    st.sampled_from(["alias", "release", "churn", "admit", "admit", "grow", "finish", "cancel"]),
    st.integers(1, 4),
    st.integers(0, 10_000),
)
step_plan = st.tuples(
    st.lists(command, max_size=6),
    st.sampled_from(["ok", "ok", "ok", "graph_fails", "copy_fails", "cancelled"]),
    st.integers(0, RANKS - 1),
)


async def apply_command(engine, planes, command, ident, step, snapshots, requests):
    """One random command on the engine (``ident``: a new snapshot or request id); out of
    pages changes nothing and is skipped."""
    op, n, pick = command
    try:
        if op in ("alias", "churn"):
            pages = await engine.alias_snapshot(ident, n)
            for rp in planes:  # the row writes through its alias
                write_rows(rp, pages)
            if op == "churn":  # a short-lived snapshot: released at once
                await engine.release_snapshot(ident)
            else:
                snapshots.append(ident)
        elif op == "release" and snapshots:
            await engine.release_snapshot(snapshots.pop(pick % len(snapshots)))
        elif op == "admit":
            await engine.reserve(ident, n)
            await engine.commit(ident, step, max(1, n - 1))
            requests.append(ident)
        elif op == "grow" and requests:
            r = requests[pick % len(requests)]
            await engine.reserve(r, n)
            await engine.commit(r, step, n)
        elif op in ("finish", "cancel") and requests:
            r = requests.pop(pick % len(requests))
            await (engine.finish if op == "finish" else engine.cancel)(r)
    except OutOfPagesError:
        pass


async def session(steps):
    planes = [filled_planes(G.num_pages, [8, 5], 0) for _ in range(RANKS)]
    finished: set[tuple[int, int]] = set()
    current = {"outcome": "ok", "rank": 0, "scope": None}
    engine_box = {}

    async def graph(ctx, step, inputs):
        state = engine_box["engine"].ledger.state
        for rec in state.requests.values():
            for p in rec.kv:
                for plane in ctx.planes:
                    assert ROW not in page(plane, p), f"rank {ctx.rank} step {step} read row bytes in page {p}"
        if ctx.rank == current["rank"]:
            if current["outcome"] == "graph_fails":
                raise RuntimeError("graph failed")
            if current["outcome"] == "cancelled":
                current["scope"].cancel()
                await anyio.sleep_forever()
        finished.add((step, ctx.rank))

    specs = [RankSpec(planes=p, graph=graph) for p in planes]
    async with open_engine(G, ranks=specs, record=True, check=True) as engine:
        engine_box["engine"] = engine
        snapshots: list[int] = []
        requests: list[int] = []
        next_id = 0
        for step, (commands, outcome, rank) in enumerate(steps):
            for op, n, pick in commands:
                next_id += 1
                await apply_command(engine, planes, (op, n, pick), next_id, step, snapshots, requests)
            current.update(outcome=outcome, rank=rank)
            inputs = None
            if outcome == "copy_fails":
                bad = StepInputs(copies=[(bytes(2), bytearray(3))])
                inputs = {rank: bad}
            with anyio.CancelScope() as scope:
                current["scope"] = scope
                try:
                    await engine.run_step(step, inputs)
                    assert outcome == "ok"
                except StepFailedError as err:
                    assert outcome in ("graph_fails", "copy_fails") and err.rank == rank and err.step == step
            assert scope.cancelled_caught == (outcome == "cancelled")
        recorded = {(e.step, e.rank) for e in engine.ledger.events if type(e) is StepCompleted}
        assert recorded == finished
        assert_consistent(engine)


@given(st.lists(step_plan, min_size=1, max_size=10))
def test_random_sessions_with_failures_and_cancellations(steps):
    anyio.run(session, steps)
