"""Remote ranks for the embedded engine: the wire glue (leader side and peer side).

    leader (the engine's process)                     peer (another task, process or host)
    ─────────────────────────────                     ────────────────────────────────────
    async with open_engine(g, ranks=[RankSpec(planes=p0)],
                           remote=RemoteRanks(world_size=3, listen=("127.0.0.1", 0))) as engine:
        host, port = engine.remote_address    ──►  await serve_remote_rank(host, port, g, rank=1,
        await engine.wait_remote(timeout=5)            world_size=3, planes=p1)
        await engine.run_step(step)
            seal ─► PREPARE to every peer ─► READY from all ─► LAUNCH ─► local ranks: copies, clears, graph
                                         └─► REJECT / timeout / lost peer ─► ABORT ─► StepFailedError,
                                             nothing cleared anywhere, StepAborted recorded

Wire ranks: the engine is wire rank 0 (the leader); peers are wire ranks
``1 .. world_size - 1``. In the engine's numbering (``StepFailedError.rank``) the
local ranks come first, so wire rank ``w`` is engine rank ``local_ranks - 1 + w``
(with one local rank both numberings agree).

A LAUNCH is not acknowledged: the engine records ``StepCompleted`` for its local
ranks only. A local rank that fails after the peers launched aborts the step in
the ledger as usual; its clear list is carried into the next step and cleared
again everywhere (zeroing is idempotent), so nothing is assumed zeroed.

Importing this module does not import torch (``serve_remote_rank`` imports the
clear backend when it runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from kvledger.core.errors import InvalidArgumentError
from kvledger.logs import get_logger

__all__ = ["RemoteRanks", "serve_remote_rank"]


@dataclasses.dataclass(frozen=True)
class RemoteRanks:
    """Peers the engine drives through the wire (see the module docstring).

    ``world_size``: the wire group's size, the engine (rank 0) included, so
    ``world_size - 1`` peers; peers pass the same number to ``run_peer``.
    ``listen``: ``(host, port)`` to accept peers on over TCP (port 0: any free
    port; read ``engine.remote_address``), or ``None`` to attach streams yourself
    (``engine.leader.attach(stream)``, e.g. ``kvledger.wire.memory_pipe`` ends).
    ``timeout``: seconds ``run_step`` waits for every peer's vote before aborting.
    ``close_grace``: seconds the links get to flush on close.

    Raises ``InvalidArgumentError`` for a bad value (nothing opened).
    """

    world_size: int
    listen: tuple[str, int] | None = ("127.0.0.1", 0)
    timeout: float = 1.0
    close_grace: float = 1.0

    def __post_init__(self) -> None:
        if type(self.world_size) is not int or self.world_size < 2:
            raise InvalidArgumentError("RemoteRanks.world_size must be an int >= 2 (the engine and a peer), "
                                       f"got {self.world_size!r}")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise InvalidArgumentError("RemoteRanks.timeout must be a positive number of seconds, "
                                       f"got {self.timeout!r}")
        if not isinstance(self.close_grace, (int, float)) or self.close_grace < 0:
            raise InvalidArgumentError(f"RemoteRanks.close_grace must be >= 0, got {self.close_grace!r}")
        if self.listen is not None:
            ok = isinstance(self.listen, tuple) and len(self.listen) == 2 and isinstance(self.listen[0], str) \
                and type(self.listen[1]) is int and 0 <= self.listen[1] < 65536
            if not ok:
                raise InvalidArgumentError(f"RemoteRanks.listen must be None or (host, port), got {self.listen!r}")


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
) -> dict:
    """Serve wire rank ``rank`` of an engine listening on ``host:port`` until it closes.

    Each LAUNCH clears the step's pages in ``planes`` through the clear backend
    ``backend`` (a name for ``kvledger.executors.backend.make_backend`` or a ready
    ``ClearBackend``), then calls ``on_step(step, clear_pages, payload)`` if given;
    an ABORT clears nothing (``on_drop(step, code, culprit_rank)``). Returns the
    link's counters. Raises ``TimeoutError`` / ``OSError`` when the engine cannot
    be reached, ``HandshakeRefused`` when it refuses this rank (another geometry,
    world size or a taken rank; nothing cleared), and what the backend or
    ``on_step`` raises (the engine sees the link close and aborts later steps).
    ``logger``: a structlog logger for the link's events (default: ``kvledger.wire``
    through ``kvledger.logs``).
    """
    from kvledger.wire.rank import run_peer
    from kvledger.wire.transport import connect_tcp

    if isinstance(backend, str):
        from kvledger.executors.backend import make_backend

        clearer = make_backend(backend, tuple(planes)) if planes else None
    else:
        clearer = backend

    async def on_launch(step, clear_pages, payload):
        if clearer is not None and len(clear_pages):
            clearer.clear(clear_pages)
        if on_step is not None:
            r = on_step(step, clear_pages, payload)
            if hasattr(r, "__await__"):
                await r

    with anyio.fail_after(connect_timeout):
        stream = await connect_tcp(host, port)
    return await run_peer(
        stream, geometry, rank=rank, world_size=world_size, on_launch=on_launch, on_drop=on_drop,
        hello_timeout=hello_timeout, logger=logger if logger is not None else get_logger("kvledger.wire"),
    )
