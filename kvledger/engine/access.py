"""``LedgerAccess``: the one path from the engine to its ledger (and the ledger's log).

    open ──begin_close()──► closing ──close()──► closed
      │                        │                   ▲
      └──── a recording fails ─┴───────────────────┘ (broken: closed, chained to that error)

    state     commands, seals     a sealed step's outcome     close()
    open      run                 recorded                    -
    closing   EngineClosedError   recorded                    runs: the last call on the path
    closed    EngineClosedError   EngineClosedError           (idempotent)

Every ledger call of the engine, a command's, a seal's, a step's outcome, the
close, goes through here, and here it is checked against the state, exclusive
of every other call:

* where: right here on the event loop when the ledger cannot block (in memory,
  or a durable ledger whose log writes in the background: an append only
  encodes into a buffer), else in the engine's one worker thread (a log that
  writes and fsyncs inline; ``close`` and ``flush`` of any log; a call the log
  says may wait for the disk, see below). While any call is in (or waiting
  for) the worker thread, later calls queue behind it there too, so the
  ledger never sees two calls at once and calls keep their order;
* when: a call handed to the worker thread is checked again once it holds the
  thread (closing may have begun while it waited): after ``close()`` nothing
  reaches the ledger, and nothing is written.

What the engine calls on its ledger is ``LedgerPort`` (a ``Ledger`` is one), and on
a durable ledger's log ``LogPort`` (an ``EventLog`` is one): typed seams, nothing
looked up by name. The switch: ``log.background`` (True: the log writes and fsyncs
in its own thread, appends never wait for the disk but under back-pressure). Such
a log answers ``log.may_block`` (``EventLog.may_block``: True while its next append
could wait for the disk: back-pressure near ``max_lag_bytes``, a segment rotation
due); while it does, calls go to the worker thread, and the loop keeps running
while the append waits there. No log (an in-memory ledger): every call on the loop.

Raises ``EngineClosedError`` (chained to the recording failure when broken);
what a call raises comes out as it was raised and changes nothing here, except
that a failed recording breaks the engine.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

import anyio
import anyio.lowlevel

from kvledger.core.errors import EngineClosedError
from kvledger.core.events import Geometry, StepPlan
from kvledger.core.state import LedgerState

__all__ = ["YIELD_EVERY_S", "LedgerAccess", "LedgerPort", "LogPort", "loop_cancelled_check", "loop_checkpoint"]


class LogPort(Protocol):
    """What the engine asks of a durable ledger's log (``kvledger.core.log.EventLog``)."""

    @property
    def background(self) -> bool:
        """Whether a writer thread writes and fsyncs (appends wait only under back-pressure)."""
        ...

    @property
    def may_block(self) -> bool:
        """Whether the next append could wait for the disk (back-pressure, a rotation due)."""
        ...


class LedgerPort(Protocol):
    """What the engine calls on its ledger besides the commands it forwards (``Engine``): the
    step records, the digest and what it reports (``kvledger.core.ledger.Ledger`` is one)."""

    @property
    def geometry(self) -> Geometry: ...

    @property
    def seq(self) -> int: ...

    @property
    def open_step(self) -> int: ...

    @property
    def free_count(self) -> int: ...

    @property
    def state(self) -> LedgerState:
        """Read by the step recorder (the steps in flight), on the ledger's path."""
        ...

    def seal_step(self, step: int) -> StepPlan: ...

    def complete_step(self, step: int, rank: int) -> None: ...

    def abort_step(self, step: int, reason: str = "") -> None: ...

    def record_violation(self, step: int, rank: int, plane: int, page_id: int,
                         kind: Literal["not_zero", "poison"]) -> None: ...

    def digest(self) -> str: ...

YIELD_EVERY_S = 200e-6  # commands on the loop give it a turn at least this often by default (_command_point)


def loop_checkpoint() -> Callable[[], Awaitable[None]]:
    """``anyio.lowlevel.checkpoint`` for the running event loop, looked up once. On asyncio it is
    what anyio does there (``asyncio.sleep(0)``: a cancelled scope's cancellation is delivered
    at it, a shielded one's is not) without anyio's lookup of the backend on every call (about
    4 us in a task anyio did not start); on any other loop, anyio's own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return anyio.lowlevel.checkpoint
    return functools.partial(asyncio.sleep, 0)


def loop_cancelled_check() -> Callable[[], Awaitable[None]]:
    """``anyio.lowlevel.checkpoint_if_cancelled`` of the running loop's anyio backend, looked up
    once: anyio looks the backend up on every call (about 1 us of the 2 the call costs on
    asyncio). Through anyio's ``get_async_backend`` (stable since anyio 4.0, not exported);
    anyio's own function where that is not there or there is no running loop."""
    try:
        from anyio._core._eventloop import get_async_backend

        check: Callable[[], Awaitable[None]] = get_async_backend().checkpoint_if_cancelled
        return check
    except Exception:  # noqa: BLE001  (another anyio layout, no running loop)
        return anyio.lowlevel.checkpoint_if_cancelled


_OPEN, _CLOSING, _CLOSED = "open", "closing", "closed"


class LedgerAccess:
    """The engine's serialized path to ``ledger`` (see the module docstring); ``log``: a durable
    ledger's log, None for one in memory; ``close``: what closes the ledger (a durable one's
    ``close``), the last call on the path.

    ``direct`` is True while a command may call the ledger right here, with no
    check left to make (open, a ledger that cannot block, nothing in the worker
    thread): the engine's commands read it first and call the ledger in place.
    """

    def __init__(self, ledger: LedgerPort, log: LogPort | None = None,
                 close: Callable[[], None] | None = None) -> None:
        self.ledger = ledger
        self.log = log
        self._close_ledger = close
        self.durable = log is not None
        self.threaded = log is not None and not log.background  # every call in the thread
        self._may_block = log is not None and not self.threaded  # (asked of the log at each call)
        self._limiter = anyio.CapacityLimiter(1)
        self._state = _OPEN
        self._broken: BaseException | None = None
        self._waiting = 0  # calls in (or queued for) the worker thread
        self._ledger_closed = False
        self.direct = False
        self.is_open = True  # (the state is "open"; kept by _refresh, read on every call)
        self._refresh()
        self.checkpoint = loop_checkpoint()
        self.checkpoint_if_cancelled = loop_cancelled_check()
        self.yield_every_s = YIELD_EVERY_S
        self.yield_at = 0.0  # (perf_counter) the next command on the loop yields from then on

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> str:
        """``"open"``, ``"closing"`` or ``"closed"`` (also when broken)."""
        return self._state

    def check_open(self) -> None:
        """Raise ``EngineClosedError`` unless the engine is open."""
        if self._state is not _OPEN:
            self._refuse()

    def begin_close(self) -> None:
        """No more commands or seals (``EngineClosedError``); outcomes of sealed steps are still recorded."""
        if self._state is _OPEN:
            self._state = _CLOSING
            self._refresh()

    def _refuse(self) -> None:
        if self._broken is not None:
            raise EngineClosedError(f"the engine is broken: {self._broken!r}") from self._broken
        raise EngineClosedError(f"the engine is {self._state}")

    def _refresh(self) -> None:
        self.is_open = self._state is _OPEN
        self.direct = (self.is_open and not self.threaded and not self._may_block and self._waiting == 0)

    def _here(self) -> bool:
        """Whether a call may run on the loop now (never while another is in the worker thread)."""
        if self.threaded or self._waiting:
            return False
        return not self._may_block or self.log is None or not self.log.may_block

    # ------------------------------------------------------------------ the calls

    def fast(self) -> bool:
        """Whether a command may call the ledger right here, now, with nothing to await first:
        ``direct`` and the loop had its turn less than ``yield_every_s`` ago."""
        return self.direct and time.perf_counter() < self.yield_at

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A command (or a seal): a cancellation point (``_command_point`` where the call runs on
        the loop; the hop to the worker thread otherwise), then ``fn(*args, **kwargs)`` on the
        ledger, exclusive. Raises ``EngineClosedError`` unless open (nothing runs), the
        cancellation when the caller's scope was cancelled (nothing runs), else what ``fn``
        raises."""
        if self.direct:
            if time.perf_counter() < self.yield_at:  # (the loop had a turn lately: _command_point)
                return fn(*args, **kwargs)
            await self._command_point()
            if self.direct:
                return fn(*args, **kwargs)
        if self._state is not _OPEN:
            self._refuse()
        if self._here():  # (a background log: on the loop, while it says an append will not wait)
            if time.perf_counter() < self.yield_at:
                return fn(*args, **kwargs)
            await self._command_point()
            if self._state is not _OPEN:
                self._refuse()
            if self._here():
                return fn(*args, **kwargs)
        if kwargs:
            fn = functools.partial(fn, **kwargs)
        return await self._in_thread(self._command, (fn, *args))

    async def blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``call``, always in the worker thread: a call that may wait for the disk (``flush``)."""
        if self._state is not _OPEN:
            self._refuse()
        return await self._in_thread(self._command, (fn, *args))

    async def record(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Record a sealed step's outcome: ``fn(*args)``, while open or closing, shielded from
        cancellation; returns what ``fn`` returns. A failure of ``fn`` breaks the engine
        (every later call raises ``EngineClosedError`` chained to it) and is re-raised."""
        if self._state is _CLOSED:
            self._refuse()
        try:
            if self._here():
                return fn(*args)
            with anyio.CancelScope(shield=True):
                return await self._in_thread(self._outcome, (fn, *args))
        except BaseException as exc:
            if self._state is not _CLOSED:  # (refused in the thread: closed meanwhile, nothing recorded)
                self._broken = exc
                self._state = _CLOSED
                self._refresh()
            raise

    def records_here(self) -> bool:
        """Whether ``record`` would call ``fn`` right here, without awaiting: the caller may then
        record in place itself, and must call ``broken(exc)`` if that fails."""
        return self._state is not _CLOSED and self._here()

    def broken(self, exc: BaseException) -> None:
        """A recording made in place (``records_here``) failed with ``exc``: the engine is broken,
        as when ``record`` fails."""
        if self._state is not _CLOSED:
            self._broken = exc
            self._state = _CLOSED
            self._refresh()

    async def close(self) -> None:
        """The last call on the path, shielded: mark the engine closed, then close the
        ledger (a durable one in the worker thread, behind every call queued there).
        Idempotent. Raises what closing the log raises (the file is released anyway)."""
        with anyio.CancelScope(shield=True):
            if self._state is not _CLOSED:
                self._state = _CLOSED
                self._refresh()
            if self._close_ledger is not None and not self._ledger_closed:
                self._ledger_closed = True
                await self._in_thread(self._close_ledger, ())

    async def _command_point(self) -> None:
        """A command's cancellation point on the loop: the loop gets a turn (a full checkpoint:
        deadlines fire, a cancellation is delivered, other tasks run) once ``yield_every_s``
        has passed since the engine last gave it one (0: at every command). A yield per
        command would cost more than the command (3 to 10 us on asyncio, a poll of the
        selector); ``run_step`` takes its turns on the same clock. A command run before
        the turn comes is done and recorded; its caller sees a cancellation of its scope
        at the turn."""
        if time.perf_counter() >= self.yield_at:
            await self.checkpoint()
            self.yield_at = time.perf_counter() + self.yield_every_s

    # ------------------------------------------------------------------ the worker thread

    def _command(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._state is not _OPEN:
            self._refuse()
        return fn(*args)

    def _outcome(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._state is _CLOSED:
            self._refuse()
        return fn(*args)

    async def _in_thread(self, fn: Callable[..., Any], args: tuple) -> Any:
        """``fn(*args)`` in the worker thread, after every call queued there before it."""
        self._waiting += 1
        self.direct = False
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            self._waiting -= 1
            if not self._waiting:
                self._refresh()
