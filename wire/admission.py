"""The leader's door: which links may still become ranks, for how long, and from where.

A link is *pending* from the moment it is attached until its peer proved the job's key and
joined (``LeaderLink`` hands out ``PeerHello`` only then). Pending links are what a client
without the key can hold, so they are bounded (issue 32):

    admit(conn)        a new link: its handshake deadline is set (``handshake_timeout`` s for
                       the whole handshake, however often the client sends); at ``max_pending``
                       pending links the oldest is evicted (its handshake scope cancelled), so
                       an idle flood never locks a real rank out and never holds more sockets
    joined(conn)       it proved the key: no deadline any more, no longer pending
    gone(conn)         it ended, joined or not
    pin_problem(r, s)  ``pinned`` ({rank: IP address}): why rank ``r`` may not join over
                       stream ``s`` (it came from another address), or None
    accept_failed(e)   accept() raised (EMFILE / ENFILE: out of file descriptors, ECONNABORTED,
                       ...): how long to wait before the next accept (doubling up to a second);
                       ``accepted()`` resets it
    quota(event)       whether to log ``event`` now: at most once a second each, the next line
                       saying how many were held back (``held_back``): a flood is a line a second

Every link is a ``_Conn`` of ``rank.py`` (what is used here: ``handshake``, an anyio
``CancelScope``, and ``stream``). No I/O beyond reading a stream's peer address; the clock
is anyio's, read when a link is admitted.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import anyio
from anyio.abc import ByteStream, SocketAttribute

from ..core.errors import InvalidArgumentError

__all__ = ["Admission", "peer_ip"]

_BACKOFF = (0.01, 1.0)  # seconds: the first wait after a failed accept, and the longest


def _unmapped(ip: Any) -> Any:
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def peer_ip(stream: ByteStream) -> Any:
    """The remote IP address of a TCP stream (None for a stream without one, e.g. a memory pipe)."""
    addr = stream.extra(SocketAttribute.remote_address, None)
    if not isinstance(addr, tuple):
        return None
    try:
        return _unmapped(ipaddress.ip_address(addr[0]))
    except ValueError:
        return None


class Admission:
    """The bounds on links that have not proved the key (module docstring). Raises
    ``InvalidArgumentError`` for a bad deadline, cap or pin."""

    def __init__(self, world_size: int, *, handshake_timeout: float, max_pending: int,
                 pinned: Mapping[int, str] | None, logger: Any) -> None:
        if not isinstance(handshake_timeout, (int, float)) or not handshake_timeout > 0:
            raise InvalidArgumentError(f"handshake_timeout must be a positive number of seconds, "
                                       f"got {handshake_timeout!r}")
        if type(max_pending) is not int or max_pending < 1:
            raise InvalidArgumentError(f"max_pending must be an int >= 1, got {max_pending!r}")
        self.handshake_timeout = float(handshake_timeout)
        self.max_pending = max_pending
        self._pinned: dict[int, Any] = {}
        for rank, host in (pinned or {}).items():
            if type(rank) is not int or not 1 <= rank < world_size:
                raise InvalidArgumentError(f"pinned: {rank!r} is not a peer rank of {world_size}")
            try:
                self._pinned[rank] = _unmapped(ipaddress.ip_address(host))
            except ValueError:
                raise InvalidArgumentError(f"pinned: rank {rank}'s address must be an IP address, "
                                           f"got {host!r}") from None
        self._log = logger
        self._pending: OrderedDict[Any, None] = OrderedDict()  # unproven links, oldest first
        self._backoff = _BACKOFF[0]
        self._held: dict[str, int] = {}  # log lines held back, by event
        self._logged: dict[str, float] = {}
        self.counts = {"evicted": 0, "handshake_timeouts": 0, "accept_errors": 0, "pin_refused": 0}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def admit(self, conn: Any) -> None:
        """A new link: set its handshake deadline; evict the oldest pending links past the cap."""
        while len(self._pending) >= self.max_pending:
            oldest, _ = self._pending.popitem(last=False)
            self.counts["evicted"] += 1
            if self.quota("pending_evicted"):
                self._log.warning("wire.pending_evicted", evicted=self.counts["evicted"],
                                  max_pending=self.max_pending, since_last=self.held_back("pending_evicted"))
            oldest.handshake.cancel()
        self._pending[conn] = None
        conn.handshake.deadline = anyio.current_time() + self.handshake_timeout

    def joined(self, conn: Any) -> None:
        self._pending.pop(conn, None)
        conn.handshake.deadline = math.inf

    def gone(self, conn: Any) -> None:
        self._pending.pop(conn, None)

    def dropped(self, conn: Any, state: str) -> None:
        """A link that never joined was cut off: at its deadline, or evicted for a newer one."""
        timed_out = anyio.current_time() >= conn.handshake.deadline
        self.counts["handshake_timeouts"] += timed_out
        if self.quota("handshake_dropped"):
            self._log.info("wire.handshake_dropped", reason="deadline" if timed_out else "evicted", state=state,
                           since_last=self.held_back("handshake_dropped"))

    def pin_problem(self, rank: int, stream: ByteStream) -> str | None:
        """Why rank ``rank`` may not join over ``stream`` (its pinned address differs), or None."""
        pin = self._pinned.get(rank)
        if pin is None:
            return None
        came = peer_ip(stream)
        if came == pin:
            return None
        self.counts["pin_refused"] += 1
        self._log.warning("wire.pin_refused", rank=rank, pinned=str(pin), came_from=str(came))
        return f"rank {rank} must connect from {pin}, came from {came}"

    def accept_failed(self, exc: OSError) -> float:
        """accept() raised: count it, log it (within the quota), and say how long to wait."""
        self.counts["accept_errors"] += 1
        wait, self._backoff = self._backoff, min(2 * self._backoff, _BACKOFF[1])
        if self.quota("accept_failed"):
            self._log.warning("wire.accept_failed", errno=exc.errno, error=str(exc), retry_s=wait,
                              since_last=self.held_back("accept_failed"))
        return wait

    def accepted(self) -> None:
        self._backoff = _BACKOFF[0]

    def quota(self, event: str) -> bool:
        """Whether to log ``event`` now (at most once a second each); counts the lines held back."""
        now = anyio.current_time()
        if now - self._logged.get(event, -math.inf) >= 1.0:
            self._logged[event] = now
            return True
        self._held[event] = self._held.get(event, 0) + 1
        return False

    def held_back(self, event: str) -> int:
        """Lines of ``event`` not logged since the last one that was (and forget them)."""
        return self._held.pop(event, 0)

    def statistics(self) -> dict[str, int]:
        return dict(self.counts, pending=len(self._pending))
