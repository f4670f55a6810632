"""The peer's async driver: ``run_peer`` serves one remote rank over any byte stream.

    run_peer(stream, geometry, rank=r, world_size=W, key=job_key, on_launch=..., on_drop=...)
        HELLO, CHALLENGE, AUTH (the key proved both ways) ──► joined (hello_timeout)
              ──► for every frame from the leader:
            PREPARE  validated and answered READY / REJECT by the link itself
            LAUNCH   on_launch(step, clear_pages, payload[, sanitize=lists]) ──► COMPLETE(ok)
                     (on_launch raised: COMPLETE(failed, detail), then the error propagates)
            ABORT    on_drop(step, code, culprit rank)      (nothing cleared, nothing run)
        end of stream ──► return the link's counters

Answers (READY, REJECT, COMPLETE) go out before the next event is handed on. The
link (``PeerLink``) decides everything; this module only moves bytes and calls
back. Logging goes through a structlog logger passed in (or ``kvledger.wire``'s);
nothing here configures output.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import anyio
import structlog
from anyio.abc import ByteStream

from ..core.errors import ConfigurationError, WireProtocolError
from ..core.events import Geometry
from .auth import INSECURE_TEST_KEY, KEY_ENV, check_key, key_from_env, new_nonce
from .codec import DEFAULT_MAX_PAYLOAD, RejectCode
from .peer import PeerLink
from .protocol import NEED_DATA, Answered, ConnectionClosed, DropStep, Joined, RunStep

__all__ = ["run_peer", "peer_key", "OnLaunch", "OnDrop"]

OnLaunch = Callable[..., None | Awaitable[None]]  # (step, clear_pages, payload[, *, sanitize])
OnDrop = Callable[[int, int, int], None | Awaitable[None]]

# What a stream raises once it is closed or broken (the drivers treat it as the end). Shared with rank.py.
STREAM_CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class _Line(dict):
    """An event dict that prints as ``event key=value ...`` (``kvledger.logs._EventDict``'s rule)."""

    def __str__(self) -> str:
        fields = " ".join(f"{k}={v!r}" for k, v in self.items() if k != "event")
        return f"{self.get('event', '')} {fields}".rstrip()


def _to_record(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> tuple:
    return (_Line(event_dict),), {}


def wire_logger(logger: Any) -> Any:
    """``logger``, or ``kvledger.wire``'s logger when it is None (shared with rank.py): through the
    standard ``logging`` module under ``kvledger.wire``, never structlog's global configuration,
    so an application that configures nothing sees nothing below WARNING, and nothing on stdout.
    (The same routing as ``kvledger.logs.get_logger``, which this package may not import: ``wire``
    depends on ``core`` only; the engine passes its own logger from there.)"""
    if logger is not None:
        return logger
    return structlog.stdlib.BoundLogger(logging.getLogger("kvledger.wire"),
                                        [structlog.stdlib.filter_by_level, _to_record], {})


def peer_key(key: bytes | None, log: Any) -> bytes:
    """The job key a peer proves: ``key``, else ``$KVLEDGER_WIRE_KEY``. A peer cannot make one
    up: ``ConfigurationError`` when there is neither. Warns when it is ``INSECURE_TEST_KEY``."""
    key = check_key(key) if key is not None else key_from_env()
    if key is None:
        raise ConfigurationError(f"no wire key: pass key= (the leader's WireLeader.key) or set {KEY_ENV} "
                                 "(hex) to the job's key; a rank joins only by proving it")
    if key == INSECURE_TEST_KEY:
        log.warning("wire.insecure_test_key", side="peer",
                    detail="INSECURE_TEST_KEY is publicly known: this link authenticates no one")
    return key


class _PeerIO:
    """Bytes between one stream and one ``PeerLink``; answers go out before events are handed on."""

    __slots__ = ("link", "stream", "open")

    def __init__(self, link: PeerLink, stream: ByteStream) -> None:
        self.link = link
        self.stream = stream
        self.open = True

    async def flush(self) -> None:
        data = self.link.data_to_send()
        if data and self.open:
            try:
                await self.stream.send(data)
            except STREAM_CLOSED:
                self.open = False

    async def next_event(self) -> Any:
        link = self.link
        while True:
            try:
                ev = link.next_event()
            except WireProtocolError:
                await self.flush()  # the REJECT naming what was wrong
                raise
            if ev is NEED_DATA:
                await self.flush()
                try:
                    data = await self.stream.receive()
                except STREAM_CLOSED:
                    data = b""
                link.receive_data(data)
                continue
            await self.flush()
            return ev

    async def join(self, timeout: float, log: Any) -> None:
        """Send HELLO and wait up to ``timeout`` s to be accepted. Raises ``TimeoutError``,
        or ``WireProtocolError`` when the leader refuses this rank or closes the link first."""
        link = self.link
        link.start()
        await self.flush()
        with anyio.fail_after(timeout):
            ev = await self.next_event()
        if type(ev) is ConnectionClosed:
            detail = f"the leader closed the link before accepting rank {link.rank}"
            raise WireProtocolError(RejectCode.PEER_LOST, detail, remote=True)
        if type(ev) is not Joined:  # the link allows nothing else first; kept as a real check
            raise WireProtocolError(RejectCode.UNEXPECTED_FRAME, f"expected to join, got {ev!r}", remote=True)
        log.info("wire.joined", rank=link.rank, step=ev.step)


async def run_peer(
    stream: ByteStream,
    geometry: Geometry,
    *,
    rank: int,
    world_size: int,
    on_launch: OnLaunch,
    key: bytes | None = None,
    on_drop: OnDrop | None = None,
    on_answer: Callable[[Answered], None] | None = None,
    hello_timeout: float = 30.0,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    sanitize: bool = False,
    logger: Any = None,
) -> dict[str, int]:
    """Run peer ``rank`` over ``stream`` until the leader closes it; return the link's counters.

    Sends HELLO, proves ``key`` (the job's; None: ``$KVLEDGER_WIRE_KEY``, else
    ``ConfigurationError``) once the leader proved it (else REJECT BAD_AUTH), and
    waits up to ``hello_timeout`` s to be accepted (``TimeoutError``). Then every
    PREPARE is validated and answered READY or REJECT by the link, ``on_launch(step,
    clear_pages, payload)`` runs for each LAUNCH (may be async; it clears the pages
    and runs the step) and is followed by a COMPLETE, and ``on_drop(step, code,
    rank)`` runs for each ABORT (nothing to clear). A PREPARE whose payload is
    over ``max_payload`` bytes is answered REJECT FRAME_TOO_LARGE (the step aborts).
    ``sanitize=True``: this rank runs sanitize-mode steps, and ``on_launch`` gets
    them with a keyword ``sanitize=`` (a ``Sanitize``: the poison and committed
    lists); without it such a PREPARE is answered REJECT UNSUPPORTED.

    Raises ``WireProtocolError`` when the leader breaks the protocol (after
    telling it why) or refuses us (``HandshakeRefused``). What ``on_launch``
    raises (an ``Exception``) is reported to the leader first, as COMPLETE
    failed with the error in its detail, then propagates: this rank failed
    mid-step, and the leader also sees the link close. Closes ``stream`` on exit.
    """
    log = wire_logger(logger)
    try:
        link = PeerLink(geometry, rank=rank, world_size=world_size, key=peer_key(key, log), nonce=new_nonce(),
                        max_payload=max_payload, sanitize=sanitize)
        io = _PeerIO(link, stream)
        await io.join(hello_timeout, log)
        while True:
            ev = await io.next_event()
            t = type(ev)
            if t is RunStep:
                await _run_step(io, ev, on_launch, log)
            elif t is DropStep:
                log.info("wire.dropped", rank=rank, step=ev.step, code=int(ev.code), culprit=ev.rank)
                if on_drop is not None and inspect.isawaitable(r := on_drop(ev.step, ev.code, ev.rank)):
                    await r
            elif t is Answered:
                if on_answer is not None:
                    on_answer(ev)
                if not ev.ready:
                    log.warning("wire.rejected", rank=rank, step=ev.step, code=int(ev.code), detail=ev.detail)
            elif t is ConnectionClosed:
                return link.statistics()
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()


async def _run_step(io: _PeerIO, ev: RunStep, on_launch: OnLaunch, log: Any) -> None:
    """Call ``on_launch`` for a launched step, then send its COMPLETE: ok, or failed with
    the error's type and message (that error is then re-raised). A cancelled
    ``on_launch`` sends nothing: the link closes and the leader counts the rank lost."""
    link = io.link
    try:
        if ev.sanitize is None:
            r = on_launch(ev.step, ev.clear_pages, ev.payload)
        else:
            r = on_launch(ev.step, ev.clear_pages, ev.payload, sanitize=ev.sanitize)
        if inspect.isawaitable(r):
            await r
    except Exception as exc:
        link.complete(ev.step, ok=False, detail=f"{type(exc).__name__}: {exc}")
        log.error("wire.step_failed", rank=link.rank, step=ev.step, error=repr(exc))
        with anyio.CancelScope(shield=True):
            await io.flush()
        raise
    link.complete(ev.step)
    await io.flush()
