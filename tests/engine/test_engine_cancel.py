"""Cancellation of the engine's own calls (issue 21, F6 and F12).

F6: an ``open_engine`` cancelled by asyncio's own ``task.cancel()`` (Ctrl-C under
``asyncio.run``) at any await point of the open closes what it opened: after every
trial no log-writer thread is left, no file descriptor, and the log reopens (no
``LogLockedError``). The trials cancel after 0, 1, 2, ... loop iterations, until
the open got through to the body, so every await point of the open is hit, and then
after random short delays (a cancellation that lands while the log opens in the
worker thread).

F12: the engine's async calls are cancellation points: ``move_on_after`` around a
loop of awaited commands and ``run_step`` (or of commands alone) stops it, another
task runs in between, and a step cancelled that way, or a command at its turn, did
nothing. ``yield_every_s=0`` gives the loop a turn at every command.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import anyio
import pytest

from kvledger import Geometry
from kvledger.engine import LogOptions, StepOptions
from kvledger.engine import RankSpec, open_engine

durable = pytest.importorskip("kvledger.durable")

G = Geometry(num_pages=64, page_tokens=4)


def _fds() -> set[str]:
    try:
        return set(os.listdir("/proc/self/fd"))
    except FileNotFoundError:  # not Linux: fds are not counted
        return set()


def _log_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvledger")]


async def _open_then_cancel(path, loops: int | None, delay: float | None, background: bool) -> bool:
    """Start an open_engine in a task, cancel it with task.cancel() after ``loops`` loop
    iterations (or ``delay`` seconds); True when the body had been reached."""
    reached = asyncio.Event()

    async def body() -> None:
        async with open_engine(G, log=path, ranks=[RankSpec(), RankSpec()],
                               log_options=LogOptions(background=background)):
            reached.set()
            await asyncio.sleep(3600)

    task = asyncio.get_running_loop().create_task(body())
    if delay is None:
        for _ in range(loops or 0):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(delay)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return reached.is_set()


def _settled(before_fds: set[str], before_threads: int, deadline_s: float = 5.0) -> None:
    """No log thread and no descriptor left (the writer thread may take a moment to end)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and (len(_log_threads()) > before_threads or _fds() - before_fds):
        time.sleep(0.01)
    assert len(_log_threads()) == before_threads, _log_threads()
    assert not _fds() - before_fds, [os.readlink(f"/proc/self/fd/{fd}") for fd in _fds() - before_fds
                                     if os.path.exists(f"/proc/self/fd/{fd}")]


@pytest.mark.parametrize("background", [True, False])
def test_a_cancelled_open_closes_what_it_opened(tmp_path, background):
    async def main() -> dict[str, int]:
        seen = {"trials": 0, "reached": 0}
        rng = random.Random(21)
        t0 = time.perf_counter()  # how long an open takes here, to spread the cancellations over it
        async with open_engine(G, log=tmp_path / "t0.kvlog", ranks=[RankSpec(), RankSpec()],
                               log_options=LogOptions(background=background)):
            took = time.perf_counter() - t0
        plan: list[tuple[int | None, float | None]] = [(n, None) for n in range(16)]
        plan += [(None, rng.uniform(0, 1.5 * took)) for _ in range(16)]
        for i, (loops, delay) in enumerate(plan):
            path = tmp_path / f"t{i % 3}.kvlog"  # reopened logs too: the first open creates it
            before_fds, before_threads = _fds(), len(_log_threads())
            reached = await _open_then_cancel(path, loops, delay, background)
            seen["trials"] += 1
            seen["reached"] += reached
            await anyio.to_thread.run_sync(_settled, before_fds, before_threads)
            with durable.open_ledger(path, G):  # not locked: the cancelled open released it
                pass
        return seen

    seen = asyncio.run(main())
    assert seen["trials"] == 32
    assert 0 < seen["reached"] < seen["trials"]  # cancelled before and after the body was reached


@pytest.mark.asyncio
@pytest.mark.parametrize("yield_every_s", [0, 200e-6])
async def test_awaited_commands_and_steps_are_cancellation_points(yield_every_s):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        async with open_engine(G, ranks=2, record=True, steps=StepOptions(yield_every_s=yield_every_s)) as engine:
            steps = 0
            give_up = time.monotonic() + 5.0
            with anyio.move_on_after(0.2) as scope:
                while time.monotonic() < give_up:  # never yields by itself: only the engine's calls can stop it
                    await engine.reserve(steps + 1, 1)
                    await engine.commit(steps + 1, steps, 1)
                    await engine.finish(steps + 1)
                    await engine.run_step(steps)
                    steps += 1
            assert scope.cancelled_caught
            assert ticks > steps if yield_every_s == 0 else ticks > 0  # another task ran in between
            # commands alone: the loop gets its turns too (every command, or every yield_every_s)
            before, done = ticks, 0
            with anyio.move_on_after(0.05) as scope:
                while time.monotonic() < give_up:
                    await engine.reserve(10_000 + done, 1)
                    await engine.return_reservation(10_000 + done)
                    done += 1
            assert scope.cancelled_caught and ticks > before
            if yield_every_s == 0:
                assert ticks - before >= done  # a turn at every command
            events = len(engine.ledger.events)
            # a step under a cancelled scope records nothing; so does a command at its turn
            with anyio.CancelScope() as dead:
                dead.cancel()
                await engine.run_step(engine.open_step)
            if yield_every_s == 0:  # every command is a turn
                with anyio.CancelScope() as dead:
                    dead.cancel()
                    await engine.reserve(9999, 1)
            assert len(engine.ledger.events) == events
        tg.cancel_scope.cancel()
