"""What the engine wires in besides its ledger and ranks: observers, metrics, the log's
back-pressure, and waiting for the disk (kvledger/engine/extras.py, access.py).

Pins: ``chain_observers`` adds nothing it need not (None, the observer itself, one call
each in order); an engine with nothing observing puts no observer on its ledger, one with
one observer puts exactly that one, and a durable ledger chains the caller's after its own;
an engine with ``metrics`` on a durable log exports its figures (steps, failures, pages and
bytes zeroed, events, the log's durable seq, write and fsync seconds from the timed layer,
sanitizer violations) through the registry, and a caller's layer wins over the timed one;
with a tiny ``max_lag_bytes`` and a slow fsync, commands move to the worker thread under
back-pressure (``EventLog.may_block``) while the event loop keeps running; ``wait_durable``
waits for the writer thread and refuses what it cannot wait for.
"""

from __future__ import annotations

import contextlib
import threading
import time

import anyio
import pytest

from support.planes import filled_planes

from kvledger import (
    ConfigurationError,
    EngineClosedError,
    Geometry,
    InvalidArgumentError,
    LogClosedError,
    SanitizerError,
    StepFailedError,
)
from kvledger.engine import ExtraOptions, LogOptions
from kvledger.core.log.files import default_layer
from kvledger.durable import DurableLedger, chain_observers, open_ledger
from kvledger.engine import RankSpec, open_engine
from kvledger.executors.bytes_backend import BytesClearBackend

G = Geometry(num_pages=32, page_tokens=4)


def durable(engine) -> DurableLedger:
    """The engine's ledger, opened on a log."""
    assert isinstance(engine.ledger, DurableLedger)
    return engine.ledger


def planes():
    return filled_planes(G.num_pages, [8, 12], 7)


# ---------------------------------------------------------------------- observers


def test_chain_observers_costs_nothing_it_need_not():
    seen = []

    def a(seq, event, effects):
        seen.append(("a", seq))

    def b(seq, event, effects):
        seen.append(("b", seq))

    assert chain_observers() is None and chain_observers(None, None) is None
    assert chain_observers(None, a) is a
    two, three = chain_observers(a, None, b), chain_observers(b, a, b)
    assert two is not None and three is not None
    two(1, None, ())
    three(2, None, ())
    assert seen == [("a", 1), ("b", 1), ("b", 2), ("a", 2), ("b", 2)]
    with pytest.raises(InvalidArgumentError):
        chain_observers(a, "not callable")  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_the_ledger_gets_exactly_the_observers_it_needs(tmp_path):
    seen = []

    def mine(seq, event, effects):
        seen.append(seq)

    async with open_engine(G) as engine:
        assert engine.ledger.observer is None
    async with open_engine(G, extras=ExtraOptions(observers=[mine])) as engine:
        assert engine.ledger.observer is mine
        await engine.reserve(1, 2)
        assert seen == [0, 1]  # CacheConfigured, then the reservation
    seen.clear()
    with open_ledger(tmp_path / "o.kvlog", G, observer=mine) as led:
        led.reserve(1, 1)
    assert seen == [0, 1]
    with pytest.raises(InvalidArgumentError):
        open_ledger(tmp_path / "bad.kvlog", G, observer=3)  # type: ignore[arg-type]
    assert not (tmp_path / "bad.kvlog").exists()
    with pytest.raises(InvalidArgumentError):
        async with open_engine(G, extras=ExtraOptions(observers=[mine, 5])):  # type: ignore[list-item]
            pass
    with pytest.raises(InvalidArgumentError):
        async with open_engine(G, extras=ExtraOptions(metrics=object())):
            pass


# ---------------------------------------------------------------------- metrics


class NoClear(BytesClearBackend):
    def clear(self, page_ids):
        pass

    def clear_checked(self, page_ids):  # (the engine's path: a sealed plan's list)
        pass


@pytest.mark.asyncio
async def test_an_engine_with_metrics_on_a_durable_log_exports_its_figures(tmp_path):
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from kvledger.metrics import LedgerMetrics

    def scrape(reg):
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(prometheus_client.generate_latest(reg).decode())
                for s in fam.samples}

    def graph(ctx, step, inputs):
        if step == 3 and ctx.rank == 1:
            raise RuntimeError("rank 1 broke")

    reg = prometheus_client.CollectorRegistry()
    metrics = LedgerMetrics(reg)
    cleared = 0
    specs = [RankSpec(planes=planes(), graph=graph) for _ in range(2)]
    async with open_engine(G, log=tmp_path / "m.kvlog", ranks=specs, extras=ExtraOptions(metrics=metrics)) as engine:
        for step in range(6):
            await engine.alias_snapshot(step, 2)
            await engine.release_snapshot(step)
            await engine.reserve(step, 2)
            await engine.commit(step, step, 2)
            with contextlib.suppress(StepFailedError):
                cleared += len((await engine.run_step(step)).clear_list)
        await engine.flush()
        got = scrape(reg)
        durable_seq = durable(engine).durable_seq
    assert got["kvledger_steps_completed_total", ()] == 5
    assert got["kvledger_steps_failed_total", (("reason", "rank_error"),)] == 1
    assert got["kvledger_pages_cleared_total", ()] == cleared == 12  # the failed step's pages carried
    for rank in ("0", "1"):
        assert got["kvledger_bytes_zeroed_total", (("rank", rank),)] == cleared * 20
    assert got["kvledger_events_total", (("type", "step_sealed"),)] == 6
    assert got["kvledger_log_durable_seq", ()] == durable_seq > 0
    assert got["kvledger_log_write_seconds_count", ()] > 0 and got["kvledger_log_fsync_seconds_count", ()] > 0

    # a sanitizer violation is counted per rank and kind; a caller's layer is not replaced
    reg2 = prometheus_client.CollectorRegistry()
    m2 = LedgerMetrics(reg2)
    p = planes()
    async with open_engine(G, log=tmp_path / "s.kvlog", ranks=[RankSpec(planes=p, backend=NoClear(p))],
                           log_options=LogOptions(layer=default_layer),
                           extras=ExtraOptions(metrics=m2, sanitize=True)) as engine:
        await engine.alias_snapshot(1, 2)
        await engine.release_snapshot(1)
        await engine.reserve(1, 2)
        await engine.commit(1, 0, 2)
        with pytest.raises(SanitizerError) as info:
            await engine.run_step(0)
        got = scrape(reg2)
    n = len(info.value.violations)
    assert n == 2 * 2 * 2  # two pages, two planes, not zero and poisoned
    for kind in ("not_zero", "poison"):
        assert got["kvledger_sanitizer_violations_total", (("kind", kind), ("plane_kind", "other"),
                                                           ("rank", "0"))] == n // 2
    assert got["kvledger_events_total", (("type", "sanitizer_violation"),)] == n
    assert ("kvledger_log_write_seconds_count", ()) not in got


@pytest.mark.asyncio
async def test_metrics_time_the_wire_handshake_of_an_engine_with_a_peer():
    prometheus_client = pytest.importorskip("prometheus_client")

    from kvledger.engine import RemoteOptions
    from kvledger.metrics import LedgerMetrics
    from kvledger.wire import memory_pipe
    from kvledger.wire.rank import run_peer

    reg = prometheus_client.CollectorRegistry()
    metrics = LedgerMetrics(reg)
    async with open_engine(G, remote=RemoteOptions(world_size=2, listen=None, timeout=2.0),
                           extras=ExtraOptions(metrics=metrics)) as engine:
        with pytest.raises(StepFailedError):
            await engine.run_step(0)  # no peer yet: the leader aborts the step
        async with anyio.create_task_group() as tg:
            ours, theirs = memory_pipe()
            engine.leader.attach(ours)
            tg.start_soon(lambda: run_peer(theirs, G, rank=1, world_size=2, key=engine.leader.key,
                                           on_launch=lambda *a: None))
            await engine.wait_remote(5)
            for step in (1, 2):
                await engine.run_step(step)
            tg.cancel_scope.cancel()

    def value(name, **labels):
        return reg.get_sample_value(name, labels)

    assert value("kvledger_wire_round_trip_seconds_count", outcome="launch") == 2
    assert value("kvledger_wire_round_trip_seconds_count", outcome="abort") == 1
    assert value("kvledger_steps_failed_total", reason="wire_abort") == 1
    assert value("kvledger_steps_completed_total") == 2


# ---------------------------------------------------------------------- back-pressure and the disk


class SlowSync:
    """The real file layer whose fsync takes ``delay`` seconds once ``slow`` is set."""

    def __init__(self, delay):
        self.delay = delay
        self.slow = False

    def _wrap(self, handle):
        layer = self

        class Handle:
            def sync(self):
                if layer.slow:
                    time.sleep(layer.delay)
                handle.sync()

            def __getattr__(self, name):
                return getattr(handle, name)

        return Handle()

    def create(self, path, data):
        return self._wrap(default_layer.create(path, data))

    def open(self, path):
        return self._wrap(default_layer.open(path))

    def __getattr__(self, name):
        return getattr(default_layer, name)


@pytest.mark.asyncio
async def test_under_back_pressure_commands_move_to_the_thread_and_the_loop_keeps_running(tmp_path):
    delay = 0.2
    layer = SlowSync(delay)
    loop_thread = threading.get_ident()
    folded_in: list[int] = []
    gaps: list[float] = []

    def where(seq, event, effects):
        folded_in.append(threading.get_ident())

    async def ticker():
        last = time.perf_counter()
        while True:
            await anyio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with open_engine(G, log=tmp_path / "bp.kvlog", log_options=LogOptions(max_lag_bytes=1024, layer=layer),
                           extras=ExtraOptions(observers=[where])) as engine:
        log = durable(engine).log
        assert log.background and not log.may_block
        await engine.reserve(1, 1)
        assert folded_in[-1] == loop_thread  # no back-pressure: on the loop
        layer.slow = True
        before = len(folded_in)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            step = 0
            while log.statistics().stalls < 2 and step < 200:
                for r in range(4):
                    await engine.reserve(100 + r, 1)
                    await engine.finish(100 + r)
                await engine.run_step(step)
                step += 1
            moved = sum(1 for t in folded_in[before:] if t != loop_thread)
            tg.cancel_scope.cancel()
        assert log.statistics().stalls >= 2  # appends did wait for the disk ...
        assert moved > 0  # ... in the worker thread
        assert max(gaps) < delay / 2, max(gaps)  # while the loop kept running
        layer.slow = False
        await engine.flush()
        assert not log.may_block
        await engine.reserve(2, 1)
        assert folded_in[-1] == loop_thread  # caught up: back on the loop


@pytest.mark.asyncio
async def test_wait_durable_waits_for_the_writer_thread_and_refuses_what_it_cannot_wait_for(tmp_path):
    layer = SlowSync(0.05)
    async with open_engine(G, log=tmp_path / "w.kvlog", log_options=LogOptions(layer=layer)) as engine:
        layer.slow = True
        await engine.reserve(1, 1)
        await engine.commit(1, 0, 1)
        await engine.run_step(0)
        seq = engine.seq - 1
        sealed = seq - 1  # the seal handed the step's record to the writer thread
        assert durable(engine).durable_seq < sealed
        await engine.wait_durable(sealed)
        assert durable(engine).durable_seq >= sealed
        with pytest.raises(InvalidArgumentError):
            await engine.wait_durable(engine.seq)
        with pytest.raises(InvalidArgumentError):
            await engine.wait_durable(-1)
    with pytest.raises(EngineClosedError):
        await engine.wait_durable(0)
    async with open_engine(G) as engine:
        with pytest.raises(ConfigurationError):
            await engine.wait_durable(0)
    async with open_engine(G, log=tmp_path / "i.kvlog",
                           log_options=LogOptions(fsync="per_step", background=False)) as engine:
        await engine.reserve(1, 1)  # not durable before the next seal or flush, which nothing waits for
        with pytest.raises(LogClosedError):
            await engine.wait_durable(engine.seq - 1)
        await engine.flush()
        await engine.wait_durable(engine.seq - 1)
