"""R16: leaving the engine while steps are in flight never damages its log (issue #11, defect 1).

``run_step`` calls started from a task group outside the engine are in flight, queued
for the step lock, or not yet started when the engine's ``async with`` is left: the
body returns, raises, or the task group around the engine is cancelled, at a random
instant. Oracles, for every trial:

* the log reopens (``open_ledger``: no ``CorruptLogError``, no refusal), it was closed
  cleanly, and a replay of its events has the reopened ledger's digest;
* every step whose ``run_step`` returned a ``StepResult`` is in it, completed on every
  rank; every step the log holds as sealed is settled there (completed on every rank,
  or aborted); a step whose caller got ``EngineClosedError`` is not completed;
* nothing is written after close: the file's bytes when ``open_engine`` returned are
  its bytes once every caller has finished;
* callers see a ``StepResult``, ``EngineClosedError``, their own cancellation, or
  ``StepFailedError`` for a step recorded as aborted because a rank's executor task was
  cancelled with the task group around the engine; nothing else (no
  ``ClosedResourceError``, no ``LogClosedError``).

Mutants these tests kill (checked by hand, see the engine's report): "close not waiting
for in-flight steps" (``Engine._settle_in_flight`` without its wait on the step lock:
R16 sees torn hash chains, writes after close and callers told a step completed that
the log does not hold), "a recording without the closed check" and "the worker
thread's side without the state check" (``LedgerAccess.record`` / ``_command`` /
``_outcome``: the serialized-path tests below), "close outside the serialized path"
(``LedgerAccess.close`` calling the ledger's close in a thread of its own: the
ordering test below; this was the defect's cause).

Quick profile: 200 trials, most with sleep-free graphs and random checkpoints
(``anyio.sleep(0)``) on a tmpfs log, a few with real sleeps or on the real disk.
``KVLEDGER_HYPOTHESIS=heavy``: 5,000 trials.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from support.engine import last_abort

from kvledger import EngineClosedError, Geometry, KVLedgerError, StepFailedError, replay
from kvledger.options import LogOptions
from kvledger.core.events import StepAborted, StepCompleted, StepSealed
from kvledger.core.log import open_view
from kvledger.engine import RankSpec, open_engine
from kvledger.engine.access import LedgerAccess

durable = pytest.importorskip("kvledger.durable")

G = Geometry(num_pages=32, page_tokens=4)
HEAVY = os.environ.get("KVLEDGER_HYPOTHESIS") == "heavy"
TRIALS = 5000 if HEAVY else 200
SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class _Leave(Exception):
    """The body's own error: the engine is left by an exception."""


# ---------------------------------------------------------------------- one trial


def _plan(rng: random.Random) -> dict:
    """A trial's schedule, all drawn from ``rng``."""
    real = rng.random() < 0.04
    return {
        "background": rng.random() < 0.5,  # the log writes in its own thread: ledger calls on the loop
        "fsync": rng.choice(["per_step", "none"]),
        "ranks": rng.choice([1, 2]),
        "graph": "sleep" if real else rng.choice(["sync", "yields", "yields", "none"]),
        "yields": [rng.randrange(0, 6) for _ in range(2)],  # per rank, in "yields" graphs
        "sleep_s": rng.uniform(0.002, 0.02),
        "callers": rng.randrange(1, 4),
        "done_first": rng.randrange(0, 3),  # steps run to their end before the callers start
        "exit": rng.choice(["return", "return", "raise", "cancel"]),
        "exit_after": rng.uniform(0, 0.02) if real else rng.randrange(0, 25),
        "disk": rng.random() < 0.03,
    }


def _graph(plan: dict):
    kind = plan["graph"]
    if kind == "none":
        return None
    if kind == "sync":
        return lambda ctx, step, inputs: None
    if kind == "sleep":
        async def sleeper(ctx, step, inputs):
            await anyio.sleep(plan["sleep_s"])
        return sleeper

    async def yielder(ctx, step, inputs):
        for _ in range(plan["yields"][ctx.rank]):
            await anyio.sleep(0)
    return yielder


async def _caller(engine, step: int, told: dict) -> None:
    try:
        result = await engine.run_step(step)
    except EngineClosedError:
        told[step] = "closed"
        return
    except StepFailedError as err:  # a rank's executor task was cancelled with the engine's task group
        told[step] = "failed" if err.step == step and not err.failures else f"other: {err!r}"
        return
    except Exception as exc:  # what a caller must never see (ClosedResourceError, LogClosedError, ...)
        told[step] = f"other: {exc!r}"
        return
    except anyio.get_cancelled_exc_class():
        told[step] = "cancelled"
        raise
    assert result.step == step
    told[step] = "completed"


async def _body(engine, plan: dict, tg, told: dict) -> None:
    step = 0
    for _ in range(plan["done_first"]):
        await engine.reserve(100 + step, 1)
        await engine.commit(100 + step, step, 1)
        await _caller(engine, step, told)
        step += 1
    for i in range(plan["callers"]):
        await engine.reserve(200 + i, 1)
        await engine.commit(200 + i, step + i, 1)
        tg.start_soon(_caller, engine, step + i, told)
    if isinstance(plan["exit_after"], float):
        await anyio.sleep(plan["exit_after"])
    else:
        for _ in range(plan["exit_after"]):
            await anyio.sleep(0)
    if plan["exit"] == "raise":
        raise _Leave()
    if plan["exit"] == "cancel":
        tg.cancel_scope.cancel()
        await anyio.sleep(0)


def _contents(path: Path):
    """The bytes of a log file, or of every file of a log directory (name -> bytes)."""
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir())}
    return path.read_bytes()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


async def run_trial(path: Path, plan: dict, segment_bytes: int | None = None) -> dict:
    """One trial: the engine left while callers are in flight. What the callers were
    told, the log's bytes when ``open_engine`` returned and once every caller finished
    (``segment_bytes`` makes the log a directory of segments)."""
    told: dict[int, str] = {}
    specs = [RankSpec(graph=_graph(plan)) for _ in range(plan["ranks"])]
    at_close: Any = b""
    try:
        async with anyio.create_task_group() as tg:
            try:
                options = LogOptions(fsync=plan["fsync"], background=plan["background"], segment_bytes=segment_bytes)
                async with open_engine(G, log=path, ranks=specs, log_options=options) as engine:
                    await _body(engine, plan, tg, told)
            finally:
                at_close = _contents(path)
    except* _Leave:
        pass
    return {"told": told, "at_close": at_close, "after": _contents(path)}


def check_log(path: Path, outcome: dict) -> dict:
    """The oracles on one trial's log. Raises AssertionError naming what broke; returns counts."""
    assert outcome["after"] == outcome["at_close"], "bytes written after close"
    with durable.open_ledger(path) as reopened:  # refuses a broken hash chain (CorruptLogError)
        assert reopened.recovery.closed_cleanly, "the log was not closed"
        live = reopened.digest()
    with open_view(path) as view:
        events = [ev for _, ev, _ in view.iter_events()]
    assert replay(events, check=True).digest() == live
    sealed = {e.step for e in events if type(e) is StepSealed}
    aborted = {e.step for e in events if type(e) is StepAborted}
    ranks_of: dict[int, set[int]] = {}
    for e in events:
        if type(e) is StepCompleted:
            ranks_of.setdefault(e.step, set()).add(e.rank)
    world = outcome["ranks"]
    # completed on every rank and not aborted (a step aborted after its ranks finished, the
    # close or a cancellation landing first, is carried into the next step: aborted)
    complete = {s for s, r in ranks_of.items() if len(r) == world} - aborted
    for step in sealed:
        assert step in complete or step in aborted, f"step {step} sealed but never settled"
    told = outcome["told"]
    other = sorted(what for what in told.values() if what.startswith("other"))
    assert not other, f"callers told {other}"
    reported = {s for s, what in told.items() if what == "completed"}
    assert reported <= complete, f"steps reported complete but not in the log: {sorted(reported - complete)}"
    closed = {s for s, what in told.items() if what == "closed"}
    assert not closed & complete, f"callers told closed for completed steps {sorted(closed & complete)}"
    failed = {s for s, what in told.items() if what == "failed"}
    assert failed <= aborted, f"callers told failed for steps not aborted {sorted(failed - aborted)}"
    return {"reported": len(reported), "found": len(reported & complete),
            "aborted_at_close": len(closed & aborted)}


def run_trials(n: int, seed: int, tmp: Path, layout: str = "file") -> dict:
    """``n`` trials; every figure counted from what the trials observed (``layout``: "file", or
    "segments": a log directory of 4 KiB segments that roll every few steps)."""
    segment_bytes = 4096 if layout == "segments" else None
    figures: dict[str, Any] = {
        "trials": 0, "trials_raised": 0, "refused_or_corrupt": 0, "oracle_failures": 0, "written_after_close": 0,
        "callers_told_other": 0, "steps_reported_complete": 0, "reported_and_found": 0,
        "steps_aborted_at_close": 0, "real_sleep_trials": 0, "disk_trials": 0,
    }
    failures: list[str] = []
    shm = Path(tempfile.mkdtemp(prefix="kvledger-r16-", dir=SHM)) if SHM else tmp

    async def main() -> None:
        for i in range(n):
            rng = random.Random(seed * 1_000_003 + i)
            plan = _plan(rng)
            path = (tmp if plan["disk"] or not SHM else shm) / (f"t{i}" if segment_bytes else f"t{i}.kvlog")
            figures["trials"] += 1
            try:
                outcome = await run_trial(path, plan, segment_bytes)
            except Exception as exc:  # leaving the engine raised (e.g. the close hit a torn buffer)
                figures["trials_raised"] += 1
                failures.append(f"trial {i} {plan}: leaving the engine raised {exc!r}")
                _remove(path)
                continue
            outcome["ranks"] = plan["ranks"]
            figures["callers_told_other"] += sum(what.startswith("other") for what in outcome["told"].values())
            figures["real_sleep_trials"] += plan["graph"] == "sleep"
            figures["disk_trials"] += bool(plan["disk"] or not SHM)
            figures["written_after_close"] += outcome["after"] != outcome["at_close"]
            try:
                counts = check_log(path, outcome)
            except KVLedgerError as exc:  # the log refused to open: corrupt, torn, ...
                figures["refused_or_corrupt"] += 1
                failures.append(f"trial {i} {plan}: {exc!r}")
            except AssertionError as exc:
                figures["oracle_failures"] += 1
                failures.append(f"trial {i} {plan}: {exc}")
            else:
                figures["steps_reported_complete"] += counts["reported"]
                figures["reported_and_found"] += counts["found"]
                figures["steps_aborted_at_close"] += counts["aborted_at_close"]
            _remove(path)

    try:
        anyio.run(main)
    finally:
        if shm is not tmp:
            shutil.rmtree(shm)
    figures["failures"] = failures
    return figures


@pytest.mark.parametrize("layout", ["file", "segments"])
def test_r16_leaving_the_engine_with_steps_in_flight(disk_tmp_path, layout):
    trials = TRIALS if layout == "file" or HEAVY else TRIALS // 4  # (quick: fewer on directories)
    figures = run_trials(trials, seed=16, tmp=disk_tmp_path, layout=layout)
    failures = figures.pop("failures")
    print(f"\nR16 ({layout}) " + " ".join(f"{k}={v}" for k, v in figures.items()))
    for line in failures[:5]:
        print("  " + line)
    assert figures["trials"] == trials
    assert figures["trials_raised"] == 0
    assert figures["callers_told_other"] == 0
    assert figures["refused_or_corrupt"] == 0
    assert figures["oracle_failures"] == 0
    assert figures["written_after_close"] == 0
    assert figures["reported_and_found"] == figures["steps_reported_complete"]
    # the schedule reached what it is about: steps completed, and steps aborted by the close
    assert figures["steps_reported_complete"] > 0 and figures["steps_aborted_at_close"] > 0
    assert figures["real_sleep_trials"] > 0


# ---------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("leave", ["return", "raise"])
def test_leaving_while_a_graph_sleeps(tmp_path, leave):
    # Issue #11's schedule: an outer task group starts run_step; the engine's context is
    # left while the step's graph sleeps. A clean exit waits for the step; an exit by an
    # error cancels it and records it as aborted. Either way the log reopens.
    path = tmp_path / "sleep.kvlog"
    plan = {"fsync": "per_step", "background": False, "ranks": 1}
    running = anyio.Event()

    async def graph(ctx, step, inputs):
        running.set()
        await anyio.sleep(0.1)

    async def main():
        told: dict[int, str] = {}
        at_close = b""
        try:
            async with anyio.create_task_group() as tg:
                try:
                    async with open_engine(G, log=path, ranks=[RankSpec(graph=graph)],
                                           log_options=LogOptions(fsync="per_step")) as engine:
                        await engine.reserve(1, 2)
                        await engine.commit(1, 0, 2)
                        tg.start_soon(_caller, engine, 0, told)
                        await running.wait()
                        if leave == "raise":
                            raise _Leave()
                finally:
                    at_close = path.read_bytes()
        except* _Leave:
            assert leave == "raise"
        return {"told": told, "at_close": at_close, "after": path.read_bytes(), **plan}

    outcome = anyio.run(main)
    assert outcome["told"] == {0: "completed" if leave == "return" else "closed"}
    counts = check_log(path, outcome)
    assert counts == ({"reported": 1, "found": 1, "aborted_at_close": 0} if leave == "return"
                      else {"reported": 0, "found": 0, "aborted_at_close": 1})
    with open_view(path) as view:
        events = [ev for _, ev, _ in view.iter_events()]
    if leave == "return":
        assert [type(e) for e in events[-2:]] == [StepSealed, StepCompleted]
    else:
        assert last_abort(events) == StepAborted(step=0, reason="engine closed")


@pytest.mark.parametrize("background", [False, True])
def test_after_close_every_call_raises_and_nothing_is_written(tmp_path, background):
    path = tmp_path / "closed.kvlog"

    async def main():
        async with open_engine(G, log=path, ranks=1,
                               log_options=LogOptions(fsync="per_step", background=background)) as engine:
            await engine.reserve(1, 1)
        size = path.stat().st_size
        for call in (engine.reserve(2, 1), engine.commit(1, 0, 1), engine.finish(1), engine.run_step(0),
                     engine.call(lambda ledger: ledger.reserve(3, 1)), engine.digest(), engine.flush(),
                     engine.alias_snapshot(5, 1), engine.release_snapshot(5)):
            with pytest.raises(EngineClosedError):
                await call
        assert path.stat().st_size == size

    anyio.run(main)


# ---------------------------------------------------------------------- the serialized path


class _Ledger:
    """A stand-in for a durable ledger: its log fsyncs inline (calls go to the worker thread)
    or writes in the background (calls run on the loop). It records the order of calls;
    a call can be held in the worker thread."""

    def __init__(self, background: bool = False) -> None:
        self.log = type("Log", (), {"background": background, "may_block": False})()
        self.calls: list[str] = []
        self.hold = threading.Event()
        self.held = threading.Event()

    def slow(self) -> None:
        self.held.set()
        self.hold.wait(5)
        self.calls.append("slow")

    def write(self, what: str) -> None:
        self.calls.append(what)

    def close(self) -> None:
        self.calls.append("close")


def test_close_runs_after_the_calls_queued_before_it_and_refuses_them():
    # kills "close outside the serialized path" and "the worker thread's side without the state check"
    ledger = _Ledger()

    async def main():
        access = LedgerAccess(ledger, ledger.log, ledger.close)
        assert access.threaded and not access.direct
        outcomes: dict[str, object] = {}

        async def command(name, fn, *args):
            try:
                outcomes[name] = await access.call(fn, *args)
            except EngineClosedError as exc:
                outcomes[name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(command, "slow", ledger.slow)
            await anyio.to_thread.run_sync(ledger.held.wait)
            tg.start_soon(command, "queued", ledger.write, "queued")  # accepted while open, waits for the thread
            await anyio.sleep(0.01)
            access.begin_close()
            tg.start_soon(access.close)
            await anyio.sleep(0.01)
            assert ledger.calls == []  # close waits behind the held call
            ledger.hold.set()
        assert ledger.calls == ["slow", "close"]
        assert isinstance(outcomes["queued"], EngineClosedError)
        with pytest.raises(EngineClosedError):
            await access.call(ledger.write, "late")
        with pytest.raises(EngineClosedError):
            await access.record(ledger.write, "late outcome")
        assert ledger.calls == ["slow", "close"]

    anyio.run(main)


@pytest.mark.parametrize("background", [False, True])
def test_outcomes_are_recorded_while_closing_and_refused_once_closed(background):
    # kills "a recording without the closed check"
    ledger = _Ledger(background)

    async def main():
        access = LedgerAccess(ledger, ledger.log, ledger.close)
        assert access.threaded is not background
        access.begin_close()
        with pytest.raises(EngineClosedError):
            await access.call(ledger.write, "command while closing")
        await access.record(ledger.write, "outcome while closing")
        await access.close()
        with pytest.raises(EngineClosedError):
            await access.record(ledger.write, "outcome after close")
        assert ledger.calls == ["outcome while closing", "close"]

    anyio.run(main)


def test_a_failed_recording_breaks_the_engine():
    ledger = _Ledger()

    def fails():
        raise OSError("disk gone")

    async def main():
        access = LedgerAccess(ledger, ledger.log, ledger.close)
        with pytest.raises(OSError):
            await access.record(fails)
        with pytest.raises(EngineClosedError, match="broken") as info:
            await access.call(ledger.write, "after")
        assert isinstance(info.value.__cause__, OSError)
        await access.close()  # still releases the ledger
        assert ledger.calls == ["close"]

    anyio.run(main)
