"""The leader's async driver: ``open_leader`` / ``WireLeader`` over any byte stream (memory or TCP).

One piece: ``WireLeader``'s link tasks, step path and completions share its links and
events; who may become a rank is its own object (``admission``).

It moves bytes between the transports and the pure state machines (one
``LeaderLink`` per peer, the ``Leader`` decision rule, the ``Completions``
ledger) and owns the leader's clocks: the vote deadline (``run_step(...,
timeout=)``) and the completion deadline (``wait_completed(..., timeout=)``).
The peer's driver, ``run_peer``, is in ``kvledger.wire.peer_driver`` (and still
importable from here).

    leader process / task                          peer r (one per remote rank)
    ─────────────────────                          ────────────────────────────
    async with open_leader(geometry, world_size=W) as leader:
        leader.attach(stream)  or  await leader.listen_tcp()
        with anyio.fail_after(t): await leader.wait_joined()
        plan = ledger.seal_step(step)
        d = await leader.run_step(plan, payload, timeout=0.5)
        d.launch: clear plan.clear_list locally,     run_peer(stream, geometry, rank=r, world_size=W,
                  run the step,                               key=leader.key, on_launch=clear_and_run)
                  c = await leader.wait_completed(    on LAUNCH: on_launch(step, clear_pages, payload),
                          step, timeout=1.0)                     then COMPLETE(ok, or failed + why)
                  ledger.complete_step(step, r)      on ABORT:  on_drop(step, code, rank)  (nothing cleared)
                      for r in c.completed
                  c.ok or ledger.abort_step(step)
        else:     ledger.abort_step(step)

Who may be a rank (layout 9): every link proves the job's key before it counts
(``kvledger.wire.auth``; the key is ``key=``, else ``$KVLEDGER_WIRE_KEY``, else a
fresh one: ``WireLeader.key``). Links that have not are bounded in time and number,
may be pinned to an address, and a failed accept (EMFILE) is survived: ``admission``.

Per link the leader runs a reader task (frames in, votes to the decision rule,
completions to the ledger of completions) and a writer task fed by a bounded
outbox. A peer that stops reading (paused, partitioned) fills its outbox; the
leader then drops the link instead of blocking, counts the rank as lost (it
owes no COMPLETE any more: missing at once) and aborts the step in flight and
every later one until the rank rejoins. Failures are fail-closed: a lost link,
an expired deadline or a REJECT all end in ABORT on every reachable rank, and a
rank clears and launches a step only on a LAUNCH its own state machine accepts.

Logging goes through a structlog logger passed in (or ``kvledger.wire``'s);
nothing here configures output.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import ByteStream, TaskStatus

from ..core.errors import InvalidArgumentError, WireProtocolError
from ..core.events import Geometry, StepPlan
from .admission import Admission
from .auth import INSECURE_TEST_KEY, check_key, key_from_env, new_key, new_nonce
from .codec import RejectCode, Sanitize
from .completion import Completions, StepCompletion
from .decision import Leader
from .leader import LeaderLink, LeaderState
from .peer_driver import STREAM_CLOSED, OnDrop, OnLaunch, run_peer, wire_logger
from .protocol import NEED_DATA, Completed, ConnectionClosed, Decision, PeerHello
from .transport import accept, listen_tcp, listener_address, memory_pipe

__all__ = ["WireLeader", "open_leader", "run_peer", "OnLaunch", "OnDrop"]

_DECIDABLE = (LeaderState.IDLE, LeaderState.AWAITING, LeaderState.VOTED)  # a link that can take LAUNCH / ABORT


class _Conn:
    __slots__ = ("link", "stream", "out_send", "out_recv", "rank", "cancel", "alive", "writer_done", "handshake")

    def __init__(self, link: LeaderLink, stream: ByteStream, outbox: int) -> None:
        self.link = link
        self.stream = stream
        self.out_send, self.out_recv = anyio.create_memory_object_stream[bytes](outbox)
        self.rank: int | None = None
        self.cancel: anyio.CancelScope | None = None
        self.alive = True
        self.writer_done = anyio.Event()
        self.handshake = anyio.CancelScope()  # the handshake deadline (set when the link's task starts)


class WireLeader:
    """The leader (rank 0) of one tensor-parallel group. Build it with ``open_leader``.

    ``run_step`` is the only way a step goes out; one step is in flight at a
    time. ``wait_completed`` waits for the peers' COMPLETEs of a launched step
    (any number of launched steps may await theirs). ``statistics()`` gives the
    decision rule's counters, the completions' and the links'.

    ``key``: the job's key (None: ``$KVLEDGER_WIRE_KEY``, else a fresh one; read it
    back from ``key`` to hand it to the peers). ``handshake_timeout``: seconds a
    link may take to prove the key and join; ``max_pending``: links held at once
    that have not (module docstring); ``pinned``: {peer rank: IP address} each
    such rank must connect from. Raises ``InvalidArgumentError`` for a bad value,
    ``ConfigurationError`` for a ``$KVLEDGER_WIRE_KEY`` that is not a key.
    """

    def __init__(
        self,
        geometry: Geometry,
        *,
        world_size: int,
        next_step: int = 0,
        outbox_frames: int = 32,
        close_grace: float = 1.0,
        logger: Any = None,
        key: bytes | None = None,
        handshake_timeout: float = 5.0,
        max_pending: int = 64,
        pinned: Mapping[int, str] | None = None,
    ) -> None:
        self.geometry = geometry
        self.world_size = world_size
        self._rule = Leader(geometry, world_size=world_size, next_step=next_step)
        env_key = key_from_env() if key is None else None
        self._key = check_key(key) if key is not None else env_key if env_key is not None else new_key()
        self._log = wire_logger(logger)
        self._door = Admission(world_size, handshake_timeout=handshake_timeout, max_pending=max_pending,
                               pinned=pinned, logger=self._log)
        self._auth_failed = 0  # proofs that failed on links already closed
        self._outbox = outbox_frames
        self._close_grace = close_grace
        self._tg: anyio.abc.TaskGroup | None = None
        self._conns: dict[int, _Conn] = {}
        self._all: set[_Conn] = set()
        self._joined_changed = anyio.Event()
        self._decided = anyio.Event()
        self._done = Completions()
        self._completions_changed = anyio.Event()
        self._step_lock = anyio.Lock()
        self._closing = False
        if self._key == INSECURE_TEST_KEY:
            self._log.warning("wire.insecure_test_key", side="leader",
                              detail="INSECURE_TEST_KEY is publicly known: any process can be a rank")

    @property
    def key(self) -> bytes:
        """The job's key every peer must prove (hand it to them: ``run_peer(..., key=)``, the
        environment's ``KVLEDGER_WIRE_KEY`` as hex, or the rendezvous store)."""
        return self._key

    # ------------------------------------------------------------------ links

    def attach(self, stream: ByteStream) -> None:
        """Serve one peer over ``stream`` (any anyio byte stream); returns at once. The link is
        pending until its peer proved the key and joined (``admission``: a deadline, a cap)."""
        if self._tg is None or self._closing:
            raise InvalidArgumentError("attach() outside open_leader() or after it closed")
        link = LeaderLink(self.geometry, world_size=self.world_size, key=self._key, nonce=new_nonce())
        conn = _Conn(link, stream, self._outbox)
        self._door.admit(conn)
        self._all.add(conn)
        self._tg.start_soon(self._run_conn, conn)

    async def run_local_peer(self, rank: int, on_launch: OnLaunch, **kwargs: Any) -> dict[str, int]:
        """Run peer ``rank`` in this process over an in-memory pipe, proving this leader's key
        (an in-process rank needs nothing handed to it). ``kwargs`` go to ``run_peer``;
        returns its counters when the leader closes the link."""
        mine, theirs = memory_pipe()
        self.attach(mine)
        return await run_peer(theirs, self.geometry, rank=rank, world_size=self.world_size, key=self._key,
                              on_launch=on_launch, **kwargs)

    async def listen(self, listener: Any) -> tuple[str, int]:
        """Accept peers on ``listener`` (from ``listen_tcp``) until the leader closes; returns its address."""
        if self._tg is None or self._closing:
            raise InvalidArgumentError("listen() outside open_leader() or after it closed")
        await self._tg.start(self._serve, listener)
        return listener_address(listener)

    async def listen_tcp(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen for peers on ``host:port`` (0: any free port); returns ``(host, port)`` to publish."""
        return await self.listen(await listen_tcp(host, port))

    async def _serve(
        self, listener: Any, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept until the leader closes; a failed accept (EMFILE, ...) is retried after a pause
        (``admission``) while the links already served go on."""
        async with listener:
            task_status.started()
            while True:
                try:
                    stream = await accept(listener)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return
                except OSError as exc:
                    await anyio.sleep(self._door.accept_failed(exc))
                    continue
                self._door.accepted()
                if self._closing:
                    await stream.aclose()
                    return
                self.attach(stream)

    @property
    def ranks(self) -> frozenset[int]:
        """Peer ranks with a live, joined link."""
        return frozenset(r for r, c in self._conns.items() if c.alive)

    async def wait_joined(self, ranks: Iterable[int] | None = None) -> None:
        """Wait until every peer rank (or those in ``ranks``) has a live link. Put a deadline around it."""
        want = set(range(1, self.world_size)) if ranks is None else set(ranks)
        while not want <= self.ranks:
            ev = self._joined_changed
            await ev.wait()

    def _changed(self) -> None:
        ev, self._joined_changed = self._joined_changed, anyio.Event()
        ev.set()

    def _completed(self) -> None:
        ev, self._completions_changed = self._completions_changed, anyio.Event()
        ev.set()

    def _flush(self, conn: _Conn) -> None:
        """Queue what the link wants sent without waiting; a full outbox drops the link."""
        data = conn.link.data_to_send()
        if not data or not conn.alive:
            return
        try:
            conn.out_send.send_nowait(data)
        except anyio.WouldBlock:
            self._log.warning("wire.link_backlog", rank=conn.rank, queued=self._outbox)
            self._drop(conn)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._drop(conn)

    async def _flush_all(self, conns: list[_Conn], seconds: float) -> None:
        """Queue what each link wants sent: first to every link with outbox room, without
        waiting; then, for links whose outbox is full, wait up to ``seconds`` in all for
        room, and drop the ones still full. A stalled peer never delays the others."""
        waiting = []
        for conn in conns:
            data = conn.link.data_to_send()
            if not data or not conn.alive:
                continue
            try:
                conn.out_send.send_nowait(data)
            except anyio.WouldBlock:
                waiting.append((conn, data))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._drop(conn)
        if not waiting:
            return
        deadline = anyio.current_time() + seconds
        for conn, data in waiting:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                try:
                    await conn.out_send.send(data)
                    continue
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
            self._log.warning("wire.link_backlog", rank=conn.rank, queued=self._outbox)
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        """The link is gone (closed, broken, backlogged): count the rank lost, stop its tasks."""
        if not conn.alive:
            return
        conn.alive = False
        if conn.cancel is not None:
            conn.cancel.cancel()
        r = conn.rank
        if r is not None and self._conns.get(r) is conn:
            d = self._rule.lose(r)
            if d is not None:
                self._decided.set()
            if self._done.lose(r, "link lost"):
                self._completed()
            self._changed()

    async def _run_conn(self, conn: _Conn) -> None:
        try:
            async with anyio.create_task_group() as tg:
                conn.cancel = tg.cancel_scope
                tg.start_soon(self._write_loop, conn)
                with conn.handshake:  # lifted (deadline inf) once the peer proved the key and joined
                    await self._read_loop(conn)
                if conn.handshake.cancelled_caught and conn.rank is None:
                    self._door.dropped(conn, conn.link.state.value)
                    tg.cancel_scope.cancel()  # nothing owed to a link that never joined
                conn.out_send.close()
                with anyio.move_on_after(self._close_grace):
                    await conn.writer_done.wait()
                tg.cancel_scope.cancel()
        finally:
            self._door.gone(conn)
            self._auth_failed += conn.link.statistics()["auth_failed"]
            self._drop(conn)
            self._all.discard(conn)
            with anyio.CancelScope(shield=True):
                await conn.stream.aclose()

    async def _write_loop(self, conn: _Conn) -> None:
        try:
            async with conn.out_recv:
                async for data in conn.out_recv:
                    await conn.stream.send(data)
        except STREAM_CLOSED:
            self._drop(conn)
        finally:
            conn.writer_done.set()

    async def _read_loop(self, conn: _Conn) -> None:
        link = conn.link
        while True:
            try:
                data = await conn.stream.receive()
            except STREAM_CLOSED:
                data = b""
            link.receive_data(data)
            while True:
                try:
                    ev = link.next_event()
                except WireProtocolError as exc:
                    if conn.rank is not None:
                        self._log.warning("wire.peer_error", rank=conn.rank, code=int(exc.code), detail=exc.detail)
                    elif self._door.quota("handshake_failed"):  # (a flood of them is one line a second)
                        self._log.warning("wire.handshake_failed", code=int(exc.code), detail=exc.detail,
                                          since_last=self._door.held_back("handshake_failed"))
                    self._flush(conn)
                    return
                if ev is NEED_DATA:
                    break
                if type(ev) is ConnectionClosed:
                    self._log.info("wire.peer_closed", rank=conn.rank)
                    return
                if not self._on_event(conn, ev):
                    self._flush(conn)
                    return
            self._flush(conn)

    def _on_event(self, conn: _Conn, ev: Any) -> bool:
        if type(ev) is PeerHello:  # (the peer proved the key: the link says so only then)
            r = ev.rank
            old = self._conns.get(r)
            if old is not None and old.alive:
                conn.link.refuse(RejectCode.BAD_RANK, f"rank {r} is already connected")
                return False
            problem = self._door.pin_problem(r, conn.stream)
            if problem is not None:
                conn.link.refuse(RejectCode.BAD_AUTH, problem)
                return False
            self._door.joined(conn)
            rule = self._rule
            rule.join(r)
            conn.rank = r
            self._conns[r] = conn
            conn.link.accept(rule.step if rule.step is not None else rule.next_step)
            self._log.info("wire.peer_joined", rank=r, step=conn.link.step)
            self._changed()
            return True
        if type(ev) is Completed:
            if self._done.record(ev):
                self._completed()
            if not ev.ok:
                self._log.warning("wire.step_failed", rank=ev.rank, step=ev.step, detail=ev.detail)
            return True
        # a vote (Ready / Reject) for the step in flight
        if self._rule.vote(ev) is not None:
            self._decided.set()
        return True

    # ------------------------------------------------------------------ steps

    async def run_step(
        self, plan: StepPlan, payload: bytes = b"", *, timeout: float, sanitize: Sanitize | None = None
    ) -> Decision:
        """PREPARE ``plan`` on every peer, wait up to ``timeout`` s for the votes, LAUNCH or ABORT.

        Returns the ``Decision``; the caller clears and runs the step locally only
        if ``decision.launch``, then collects the peers' completions with
        ``wait_completed``. ``sanitize``: the poison and committed lists of a
        sanitize-mode step (peers without a sanitizer refuse it). Raises
        ``StepOrderError``, ``PageOutOfRangeError``, ``DuplicatePageError`` or
        ``InvalidArgumentError`` before sending anything when the plan is not the
        next step or a list is bad (nothing changes then). A step that is decided
        is finished even if the caller is cancelled meanwhile (the decision goes
        out shielded).
        """
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {timeout!r}")
        async with self._step_lock:
            rule = self._rule
            data, crc = rule.begin(plan, payload, sanitize=sanitize)
            self._decided = anyio.Event()
            try:
                # (acquiring the step lock was a checkpoint: the writers got to send the last decision)
                if rule.decision is None:
                    await self._prepare_all(plan.step, data, crc, timeout)
            finally:
                with anyio.CancelScope(shield=True):
                    decision = await self._decide_all(timeout)
            if not decision.launch:
                self._log.warning(
                    "wire.abort",
                    step=decision.step,
                    code=int(decision.code),
                    rank=decision.rank,
                    detail=decision.detail,
                )
            return decision

    async def _prepare_all(self, step: int, data: bytes, crc: int, timeout: float) -> None:
        """Queue the PREPARE on every idle live link, then wait up to ``timeout`` s for the decision."""
        deadline = anyio.current_time() + timeout
        out = [c for c in list(self._conns.values()) if c.alive and c.link.state is LeaderState.IDLE]
        for conn in out:
            conn.link.prepare(step, data, crc)
        await self._flush_all(out, timeout)
        if self._rule.decision is None:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await self._decided.wait()

    async def _decide_all(self, timeout: float) -> Decision:
        """The decision (ABORT TIMEOUT if none yet) on every live link at its step; finish the step."""
        rule = self._rule
        decision = rule.decision if rule.decision is not None else rule.expire()
        out = [
            c
            for c in list(self._conns.values())
            if c.alive and c.link.step == decision.step and c.link.state in _DECIDABLE
        ]
        for conn in out:
            conn.link.decide(decision)
        rule.finish()
        if decision.launch:  # every peer READY: awaited, but those whose link is gone owe nothing
            sent = {c.rank for c in out}
            self._done.launch(decision.step, rule.peers, lost=rule.peers - sent)
        await self._flush_all(out, timeout)
        return decision

    async def wait_completed(self, step: int, *, timeout: float) -> StepCompletion:
        """Wait up to ``timeout`` s for every peer's COMPLETE of launched ``step``.

        Returns a settled ``StepCompletion``: ``completed`` (ranks that ran it),
        ``failed`` (their detail) and ``missing`` (ranks whose link was lost, or
        with no COMPLETE by the deadline; a later one changes nothing). Never
        waits past the deadline and never raises for a peer: the caller records
        ``StepCompleted`` for ``completed`` and aborts unless ``ok``. Raises
        ``InvalidArgumentError`` for a bad timeout, or a step not launched (or
        older than the last launched steps the leader keeps).
        """
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise InvalidArgumentError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        done = self._done
        c = done.get(step)
        with anyio.move_on_after(timeout):
            while not c.settled:
                await self._completions_changed.wait()
                c = done.get(step)
        if c.settled:
            return c
        c = done.expire(step, f"no COMPLETE within {timeout:g} s")
        self._log.warning("wire.not_completed", step=step, missing=[r for r, _ in c.missing])
        return c

    def completion(self, step: int) -> StepCompletion:
        """Where launched ``step`` stands now, without waiting (``pending`` ranks not heard from).
        Raises ``InvalidArgumentError`` like ``wait_completed``."""
        return self._done.get(step)

    @property
    def next_step(self) -> int:
        return self._rule.next_step

    def statistics(self) -> dict[str, int]:
        """The decision rule's counters, the completions' (``complete.*``), the handshake's
        (``pending`` links now, ``evicted``, ``handshake_timeouts``, ``auth_failed``, ``pin_refused``,
        ``accept_errors``) and, per live rank, its link's."""
        out = dict(self._rule.statistics())
        out.update({f"complete.{k}": v for k, v in self._done.statistics().items()})
        out.update(self._door.statistics(),
                   auth_failed=self._auth_failed + sum(c.link.statistics()["auth_failed"] for c in self._all))
        for r, c in sorted(self._conns.items()):
            for k, v in c.link.statistics().items():
                out[f"rank{r}.{k}"] = v
        return out

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[WireLeader]:
        """Run the links' tasks in a task group of the leader's own while the block runs; on exit
        flush the links' queued frames (for up to ``close_grace`` s) and close every link."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                yield self
            finally:
                await self._shutdown()
                tg.cancel_scope.cancel()

    async def _shutdown(self) -> None:
        self._closing = True
        for conn in list(self._all):
            conn.out_send.close()
        with anyio.move_on_after(self._close_grace, shield=True):
            for conn in list(self._all):
                await conn.writer_done.wait()


@asynccontextmanager
async def open_leader(
    geometry: Geometry, *, world_size: int, next_step: int = 0, **kwargs: Any
) -> AsyncIterator[WireLeader]:
    """The leader of a ``world_size``-rank group (this process is rank 0).

        async with open_leader(geometry, world_size=4) as leader:
            host, port = await leader.listen_tcp()   # or leader.attach(stream)
            ...

    On exit the links' queued frames are flushed (for up to ``close_grace`` s),
    then every link is closed: peers see the end of the stream and stop.
    Keyword arguments go to ``WireLeader``.
    """
    async with WireLeader(geometry, world_size=world_size, next_step=next_step, **kwargs).serving() as leader:
        yield leader
