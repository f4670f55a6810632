"""Remote ranks for the embedded engine: the wire glue (leader side and peer side).

    leader (the engine's process)                     peer (another task, process or host)
    ─────────────────────────────                     ────────────────────────────────────
    async with open_engine(g, ranks=[RankSpec(planes=p0)],
                           remote=RemoteRanks(world_size=3, listen=("127.0.0.1", 0))) as engine:
        host, port = engine.remote_address    ──►  await serve_remote_rank(host, port, g, rank=1,
        key = engine.leader.key               ──►          world_size=3, planes=p1, key=key)
        await engine.wait_remote(timeout=5)
        await engine.run_step(step)
            seal ─► PREPARE to every peer ─► READY from all ─► LAUNCH ─► local ranks: copies, clears, graph
                                         └─► REJECT / timeout / lost peer ─► ABORT ─► StepFailedError,
                                             nothing cleared anywhere, StepAborted recorded

Who may be a rank: a peer counts only once it proved the job's key
(``kvledger.wire.auth``). ``RemoteRanks.key`` is that key; without one the
engine takes ``$KVLEDGER_WIRE_KEY`` (hex) or makes a fresh key per job, which
``engine.leader.key`` hands to the peers (``serve_remote_rank(..., key=)``; a
peer without ``key=`` reads ``$KVLEDGER_WIRE_KEY``; a rank in the engine's own
process needs nothing: ``engine.leader.run_local_peer(rank, on_launch)``). Links that have not proved
it are bounded (``handshake_timeout``, ``max_pending``), and ``pinned`` ties a
rank to the IP address it must connect from.

Wire ranks: the engine is wire rank 0 (the leader); peers are wire ranks
``1 .. world_size - 1``. In the engine's numbering (``StepFailedError.rank``) the
local ranks come first, so wire rank ``w`` is engine rank ``local_ranks - 1 + w``
(with one local rank both numberings agree).

Remote completions (wire layout 8). A peer answers each LAUNCH with COMPLETE
once its clears and graph are done, or failed (``run_peer`` sends it; the
detail names the error). ``collect_remote`` waits for those frames, up to
``RemoteRanks.complete_timeout``, and turns them into engine ranks: one that
sent COMPLETE ok has run the step and is recorded ``StepCompleted`` like a local
rank; one that failed, whose link was lost, or that stayed silent past the
deadline is a failure naming that rank, and the step is recorded as aborted
(before the completions of the ranks that did run it, as for a local failure).
Nothing is inferred from a LAUNCH, a READY or silence.

    steps.run ─► handshake ─► LAUNCH ─► local ranks' parts ─► collect_remote(leader, remote, step, local)
              ─► record: StepAborted if a local or remote rank did not complete, then
                 StepCompleted for every local rank and every ``RemoteOutcome.completed`` rank

A step aborted in the ledger is never assumed zeroed: its clear list is carried
into the next step and cleared again everywhere (zeroing is idempotent).

Importing this module does not import torch (``serve_remote_rank`` imports the
clear backend when it runs).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import msgspec

from kvledger.core.errors import InvalidArgumentError, WireProtocolError
from kvledger.logs import get_logger

__all__ = ["RemoteRanks", "RemoteOutcome", "collect_remote", "engine_rank", "serve_remote_rank"]


@dataclasses.dataclass(frozen=True)
class RemoteRanks:
    """Peers the engine drives through the wire (see the module docstring).

    ``world_size``: the wire group's size, the engine (rank 0) included, so
    ``world_size - 1`` peers; peers pass the same number to ``run_peer``.
    ``listen``: ``(host, port)`` to accept peers on over TCP (port 0: any free
    port; read ``engine.remote_address``), or ``None`` to attach streams yourself
    (``engine.leader.attach(stream)``, e.g. ``kvledger.wire.memory_pipe`` ends).
    ``timeout``: seconds ``run_step`` waits for every peer's vote before aborting.
    ``complete_timeout``: seconds ``collect_remote`` waits, once the local ranks
    are done, for every launched peer's COMPLETE; a peer silent that long is
    named as the rank that failed the step.
    ``close_grace``: seconds the links get to flush on close.
    ``key``: the job's key every peer must prove (None: ``$KVLEDGER_WIRE_KEY``,
    else a fresh one per engine: ``engine.leader.key``). ``handshake_timeout``:
    seconds a link may take to prove it and join before it is closed;
    ``max_pending``: links held at once that have not (one more closes the oldest);
    ``pinned``: {wire rank: IP address} a rank must connect from.

    Raises ``InvalidArgumentError`` for a bad value (nothing opened).
    """

    world_size: int
    listen: tuple[str, int] | None = ("127.0.0.1", 0)
    timeout: float = 1.0
    complete_timeout: float = 5.0
    close_grace: float = 1.0
    key: bytes | None = dataclasses.field(default=None, repr=False)
    handshake_timeout: float = 5.0
    max_pending: int = 64
    pinned: Mapping[int, str] | None = None

    def __post_init__(self) -> None:
        if type(self.world_size) is not int or self.world_size < 2:
            raise InvalidArgumentError("RemoteRanks.world_size must be an int >= 2 (the engine and a peer), "
                                       f"got {self.world_size!r}")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise InvalidArgumentError("RemoteRanks.timeout must be a positive number of seconds, "
                                       f"got {self.timeout!r}")
        if not isinstance(self.complete_timeout, (int, float)) or not self.complete_timeout > 0:
            raise InvalidArgumentError("RemoteRanks.complete_timeout must be a positive number of seconds, "
                                       f"got {self.complete_timeout!r}")
        if not isinstance(self.close_grace, (int, float)) or self.close_grace < 0:
            raise InvalidArgumentError(f"RemoteRanks.close_grace must be >= 0, got {self.close_grace!r}")
        if self.key is not None:
            from kvledger.wire.auth import check_key

            check_key(self.key, "RemoteRanks.key")
        if not isinstance(self.handshake_timeout, (int, float)) or not self.handshake_timeout > 0:
            raise InvalidArgumentError("RemoteRanks.handshake_timeout must be a positive number of seconds, "
                                       f"got {self.handshake_timeout!r}")
        if type(self.max_pending) is not int or self.max_pending < 1:
            raise InvalidArgumentError(f"RemoteRanks.max_pending must be an int >= 1, got {self.max_pending!r}")
        if self.pinned is not None and not isinstance(self.pinned, Mapping):
            raise InvalidArgumentError(f"RemoteRanks.pinned must be a mapping of rank to IP address, "
                                       f"got {self.pinned!r}")
        if self.listen is not None:
            ok = isinstance(self.listen, tuple) and len(self.listen) == 2 and isinstance(self.listen[0], str) \
                and type(self.listen[1]) is int and 0 <= self.listen[1] < 65536
            if not ok:
                raise InvalidArgumentError(f"RemoteRanks.listen must be None or (host, port), got {self.listen!r}")


def engine_rank(wire_rank: int, local_ranks: int) -> int:
    """The engine's number for wire rank ``wire_rank`` (>= 1) of an engine with ``local_ranks``
    local ranks: local ranks come first. Raises ``InvalidArgumentError`` for wire rank 0 (the
    engine itself) or a count below 1."""
    if type(local_ranks) is not int or local_ranks < 1:
        raise InvalidArgumentError(f"local_ranks must be an int >= 1, got {local_ranks!r}")
    if type(wire_rank) is not int or wire_rank < 1:
        raise InvalidArgumentError(f"a peer's wire rank is an int >= 1, got {wire_rank!r}")
    return local_ranks - 1 + wire_rank


class RemoteOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What the peers reported for one launched step, in engine ranks (ascending).

    ``completed``: ranks whose COMPLETE said they ran it: record ``StepCompleted`` for each.
    ``failures``: ``(rank, WireProtocolError)`` for every other peer the step was launched
    on: code ``PEER_FAILED`` (its COMPLETE said failed; the detail is its error),
    ``PEER_LOST`` (its link closed before its COMPLETE) or ``TIMEOUT`` (silent past
    ``complete_timeout``); ``remote`` is True on each. ``ok``: no failure.
    """

    step: int
    completed: tuple[int, ...] = ()
    failures: tuple[tuple[int, WireProtocolError], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    def reason(self) -> str | None:
        """The abort reason naming the first failed peer (``None`` when ``ok``)."""
        if not self.failures:
            return None
        rank, err = self.failures[0]
        return f"rank {rank} did not complete the step over the wire: code {int(err.code)}: {err.detail}"


async def collect_remote(leader: Any, remote: RemoteRanks, step: int, *, local_ranks: int) -> RemoteOutcome:
    """Wait (up to ``remote.complete_timeout`` s) for the COMPLETEs of launched ``step`` from
    every peer it went to, and return them in engine ranks (``RemoteOutcome``).

    Call it after the local ranks' parts, shielded when the caller must record the step
    whatever happens (it only waits; it changes nothing on the wire or in the ledger).
    Never raises for a peer: a failed, lost or silent peer is a failure in the outcome.
    Raises ``InvalidArgumentError`` for a step the leader did not launch (or no longer
    remembers) or a bad ``local_ranks``.
    """
    from kvledger.wire.codec import RejectCode

    engine_rank(1, local_ranks)  # checks local_ranks
    c = await leader.wait_completed(step, timeout=remote.complete_timeout)
    failures: list[tuple[int, WireProtocolError]] = []
    for wire, detail in c.failed:
        failures.append((wire, WireProtocolError(RejectCode.PEER_FAILED, detail or "failed", remote=True)))
    for wire, why in c.missing:
        code = RejectCode.PEER_LOST if why.startswith("link lost") else RejectCode.TIMEOUT
        failures.append((wire, WireProtocolError(code, why, remote=True)))
    failures.sort(key=_first)
    return RemoteOutcome(
        step=step,
        completed=tuple(engine_rank(w, local_ranks) for w in c.completed),
        failures=tuple((engine_rank(w, local_ranks), err) for w, err in failures),
    )


def _first(item: tuple[int, Any]) -> int:
    return item[0]


async def serve_remote_rank(
    host: str,
    port: int,
    geometry: Any,
    *,
    rank: int,
    world_size: int,
    planes: Sequence[Any] = (),
    backend: Any = "torch",
    on_step: Callable[[int, Any, bytes], Any] | None = None,
    on_drop: Callable[[int, int, int], Any] | None = None,
    connect_timeout: float = 10.0,
    hello_timeout: float = 10.0,
    logger: Any = None,
    key: bytes | None = None,
) -> dict:
    """Serve wire rank ``rank`` of an engine listening on ``host:port`` until it closes.

    Each LAUNCH clears the step's pages in ``planes`` through the clear backend
    ``backend`` (a name for ``kvledger.executors.backend.make_backend`` or a ready
    ``ClearBackend``), then calls ``on_step(step, clear_pages, payload)`` if given,
    then sends COMPLETE (ok); an ABORT clears nothing (``on_drop(step, code,
    culprit_rank)``). Returns the link's counters. ``key``: the job's key to prove
    (``engine.leader.key``; None: ``$KVLEDGER_WIRE_KEY``). Raises ``TimeoutError`` /
    ``OSError`` when the engine cannot be reached, ``ConfigurationError`` without a
    key, ``HandshakeRefused`` when it refuses this rank (another key, geometry,
    world size or a taken rank; nothing cleared), ``RemoteProtocolError`` BAD_AUTH
    when the engine cannot prove the key itself, and what the backend or ``on_step`` raises (sent first as a failed
    COMPLETE naming the error; then the link closes and later steps abort).
    ``logger``: a structlog logger for the link's events (default: ``kvledger.wire``
    through ``kvledger.logs``).
    """
    from kvledger.wire.rank import run_peer
    from kvledger.wire.transport import connect_tcp

    from kvledger.executors.backend import ClearBackend, as_clear_backend, make_backend

    clearer: ClearBackend | None
    if isinstance(backend, str):
        clearer = make_backend(backend, tuple(planes)) if planes else None
    else:
        clearer = as_clear_backend(backend, geometry.num_pages) if backend is not None else None

    async def on_launch(step: int, clear_pages: Any, payload: bytes) -> None:
        if clearer is not None and len(clear_pages):
            clearer.clear(clear_pages)
        if on_step is not None:
            r = on_step(step, clear_pages, payload)
            if inspect.isawaitable(r):
                await r

    with anyio.fail_after(connect_timeout):
        stream = await connect_tcp(host, port)
    return await run_peer(
        stream, geometry, rank=rank, world_size=world_size, key=key, on_launch=on_launch, on_drop=on_drop,
        hello_timeout=hello_timeout, logger=logger if logger is not None else get_logger("kvledger.wire"),
    )
