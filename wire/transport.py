"""Transports: the byte streams the wire drivers move frames over.

Two kinds, one interface (anyio's ``ByteStream``: ``send(bytes)``,
``receive() -> bytes``, ``EndOfStream`` at the end, ``aclose()``):

    in-process   memory_pipe()  two MemoryByteStream ends over a pair of bounded
                                anyio memory object streams (the embedded default)
    TCP          listen_tcp() / connect_tcp()   anyio TCP streams (TCP_NODELAY is
                                set by anyio on both ends), for processes and hosts

    leader ── MemoryByteStream ═══ [bounded queue] ═══ MemoryByteStream ── peer
    leader ── SocketStream ════════ loopback / network ═══ SocketStream ── peer

Nothing here waits on a clock: callers put ``anyio.fail_after`` around connect
and receive where they decide how long is too long. Buffers are bounded: a
memory pipe holds ``max_chunks`` chunks per direction (``send`` waits when it is
full), TCP relies on the kernel's socket buffers and the drivers' bounded
outboxes. Addresses for processes are published through torch.distributed's
rendezvous store by the callers (see ``examples/tp_ranks.py``), never discovered
here.
"""

from __future__ import annotations

from typing import Any

import anyio
from anyio import TypedAttributeProvider
from anyio.abc import ByteStream, SocketAttribute, SocketStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from anyio.streams.stapled import MultiListener

from ..core.errors import InvalidArgumentError

__all__ = ["MemoryByteStream", "memory_pipe", "listen_tcp", "accept", "listener_address", "connect_tcp"]


class MemoryByteStream(ByteStream):
    """One end of an in-process byte pipe (see ``memory_pipe``).

    ``send`` waits while the other end's queue is full; ``send_eof`` ends our
    direction (the other end's ``receive`` raises ``EndOfStream`` once drained);
    ``aclose`` ends both. Chunks are delivered whole unless ``max_bytes`` is
    smaller, in which case the rest is kept for the next ``receive``.
    """

    def __init__(
        self, send_stream: MemoryObjectSendStream[bytes], receive_stream: MemoryObjectReceiveStream[bytes]
    ) -> None:
        self._send = send_stream
        self._receive = receive_stream
        self._leftover: bytes | None = None

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._leftover is not None:
            chunk, self._leftover = self._leftover, None
        else:
            chunk = await self._receive.receive()  # EndOfStream once the other end closed
        if len(chunk) > max_bytes:
            chunk, self._leftover = chunk[:max_bytes], chunk[max_bytes:]
        return chunk

    async def send(self, item: bytes) -> None:
        if item:
            await self._send.send(bytes(item))

    def send_nowait(self, item: bytes) -> None:
        """Send without waiting; raises ``anyio.WouldBlock`` when the queue is full."""
        if item:
            self._send.send_nowait(bytes(item))

    async def send_eof(self) -> None:
        await self._send.aclose()

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()

    def statistics(self) -> dict[str, float]:
        s, r = self._send.statistics(), self._receive.statistics()
        return {
            "queued_out": s.current_buffer_used,
            "queued_in": r.current_buffer_used,
            "max_chunks": s.max_buffer_size,
        }


def memory_pipe(max_chunks: int = 64) -> tuple[MemoryByteStream, MemoryByteStream]:
    """Two connected in-process stream ends ``(a, b)``: what ``a`` sends, ``b`` receives, and back.

    Each direction holds at most ``max_chunks`` chunks. Raises
    ``InvalidArgumentError`` for ``max_chunks < 1``.
    """
    if type(max_chunks) is not int or max_chunks < 1:
        raise InvalidArgumentError(f"max_chunks must be an int >= 1, got {max_chunks!r}")
    a_send, b_recv = anyio.create_memory_object_stream[bytes](max_chunks)
    b_send, a_recv = anyio.create_memory_object_stream[bytes](max_chunks)
    return MemoryByteStream(a_send, a_recv), MemoryByteStream(b_send, b_recv)


async def listen_tcp(host: str = "127.0.0.1", port: int = 0) -> MultiListener[SocketStream]:
    """A TCP listener on ``host:port`` (port 0: any free port; read it with ``listener_address``)."""
    return await anyio.create_tcp_listener(local_host=host, local_port=port)


async def accept(listener: Any) -> SocketStream:
    """The next stream a listener from ``listen_tcp`` accepts (on its first socket when anyio
    bound one per address family). Raises what the listener raises once it is closed."""
    inner = getattr(listener, "listeners", None)
    stream: SocketStream = await (inner[0] if inner else listener).accept()  # MultiListener: one per family
    return stream


def listener_address(listener: TypedAttributeProvider) -> tuple[str, int]:
    """``(host, port)`` a listener from ``listen_tcp`` is bound to."""
    host = listener.extra(SocketAttribute.local_address)
    port = listener.extra(SocketAttribute.local_port)
    if isinstance(host, tuple):
        host = host[0]
    return str(host), int(port)


async def connect_tcp(host: str, port: int) -> SocketStream:
    """A TCP stream to ``host:port``. Put ``anyio.fail_after`` around it; raises ``OSError`` on refusal."""
    return await anyio.connect_tcp(host, port)
