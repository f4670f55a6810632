"""``MetricsServer``: a registry over HTTP on loopback, a thread per scrape, stopped on ``close()``.

    server = MetricsServer(registry, port=0)      # 0: any free port (server.port says which)
    ... GET http://127.0.0.1:PORT/metrics  (Prometheus text exposition; any path serves it)
    server.wait_scrape(after=n, timeout=30)       # block until scrape n + 1 has been served
    server.wait_fresh_scrape(timeout=30)          # ... until one that began after this call has
    server.close()                                # returns at once; answers in progress finish

One listening thread accepts connections; each connection is served in its own
daemon thread, so a client that connects and sends nothing (or reads slowly)
blocks no other scrape and not ``close()``. What a client can hold is bounded
three ways, so memory and threads stay bounded whatever clients do and a scrape
always gets through:

    idle_timeout      seconds a connection may wait between two reads or writes (5)
    request_timeout   seconds a connection may last in all, from accept to its last byte
                      written (10): a client that trickles a byte a second is dropped at it,
                      however often it sends
    max_clients       connections served at once (16); one more evicts the oldest
                      connection still sending its request (an answer being written is never
                      cut short), and is closed at once only when every slot is answering

So 16 clients that trickle their requests hold every slot only until a real scrape
comes: it takes the slot of the oldest of them. ``close()`` stops accepting,
releases the port and returns without waiting for answers in progress (their
threads end on their own, within ``request_timeout``). Threads are daemons: an
interpreter that exits without ``close()`` does not hang on them.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from kvledger.core.errors import ConfigurationError, InvalidArgumentError

from .hooks import prometheus

__all__ = ["MetricsServer"]


class _QuietHandler(WSGIRequestHandler):
    timeout = 5.0  # seconds a connection may sit idle (per read / write); the server sets its own
    server: _ThreadingServer

    def parse_request(self) -> bool:
        """The request line and headers are in: from here the connection is being answered."""
        ok = super().parse_request()
        self.server.answering(self.connection)
        return ok

    def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr
        pass


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """A WSGI server answering each connection in its own daemon thread, at most ``max_clients`` at
    once, each for at most ``request_timeout`` seconds in all (the module docstring's bounds)."""

    daemon_threads = True
    block_on_close = False  # close() never waits for an answer in progress

    def limit(self, max_clients: int, request_timeout: float) -> None:
        self.slots = threading.BoundedSemaphore(max_clients)
        self.request_timeout = request_timeout
        self._lock = threading.Lock()
        self._began: dict[Any, float] = {}  # every connection served: when it was accepted
        self._reading: dict[Any, None] = {}  # those still sending their request, oldest first
        self.evicted = 0  # connections cut off: past request_timeout, or for a newcomer

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the accepting thread: take a slot (the oldest connection still sending its request
        gives up its own when none is free), or close the newcomer when every slot is answering."""
        if not self.slots.acquire(blocking=False):
            with self._lock:
                oldest = next(iter(self._reading), None)
            if oldest is None or not self._evict(oldest) or not self.slots.acquire(timeout=1.0):
                self.shutdown_request(request)
                return
        with self._lock:
            self._began[request] = time.monotonic()
            self._reading[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {"connections": len(self._began), "reading": len(self._reading), "evicted": self.evicted}

    def answering(self, request: Any) -> None:
        with self._lock:
            self._reading.pop(request, None)

    def service_actions(self) -> None:
        """In the accepting thread, every poll: cut off connections older than ``request_timeout``."""
        now = time.monotonic()
        with self._lock:
            late = [r for r, t in self._began.items() if now - t > self.request_timeout]
        for r in late:
            self._evict(r)

    def _evict(self, request: Any) -> bool:
        """Shut the connection down: its thread's read or write ends at once, and frees its slot."""
        with self._lock:
            if request not in self._began:
                return False
            self._began[request] = float("inf")  # (cut off once)
            self._reading.pop(request, None)
            self.evicted += 1
        with contextlib.suppress(OSError):  # (already gone)
            request.shutdown(socket.SHUT_RDWR)
        return True

    def _forget(self, request: Any) -> None:
        with self._lock:
            self._began.pop(request, None)
            self._reading.pop(request, None)
        self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or broke ends quietly (the library prints nothing)."""

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)


class _Delivered:
    """A WSGI body that reports once the server has written all of it: the server calls
    ``close()`` after its last write, so a scrape counts as served only when its answer is on
    the socket (a demo that stops serving after "one more scrape" never cuts that answer off)."""

    def __init__(self, body: Any, served: Any) -> None:
        self._body, self._served = body, served

    def __iter__(self) -> Any:
        return iter(self._body)

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._served()


class MetricsServer:
    """Serve ``registry`` on ``host:port`` until ``close()`` (also a context manager).

    ``idle_timeout``: seconds a connection may wait between reads or writes before it is
    dropped; ``request_timeout``: seconds it may last in all; ``max_clients``: connections
    served at once (module docstring). Raises ``InvalidArgumentError`` for a port outside
    0..65535 or a bad bound, and ``ConfigurationError`` when the address cannot be bound
    (nothing started then).
    """

    def __init__(self, registry: Any, port: int = 0, host: str = "127.0.0.1", *, idle_timeout: float = 5.0,
                 max_clients: int = 16, request_timeout: float = 10.0) -> None:
        if type(port) is not int or not 0 <= port <= 65535:
            raise InvalidArgumentError(f"port must be an int in 0..65535, got {port!r}")
        if type(idle_timeout) not in (int, float) or not idle_timeout > 0:
            raise InvalidArgumentError(f"idle_timeout must be a positive number of seconds, got {idle_timeout!r}")
        if type(request_timeout) not in (int, float) or not request_timeout > 0:
            raise InvalidArgumentError(f"request_timeout must be a positive number of seconds, "
                                       f"got {request_timeout!r}")
        if type(max_clients) is not int or max_clients < 1:
            raise InvalidArgumentError(f"max_clients must be a positive int, got {max_clients!r}")
        app = prometheus().make_wsgi_app(registry)
        self.scrapes = 0
        self._served = threading.Condition()
        self._begun = 0  # scrapes that reached the registry, numbered in the order they began
        self._newest_served = 0  # the highest such number among the scrapes served

        def counted(environ: dict, start_response: Any) -> Any:
            if environ.get("REQUEST_METHOD") != "GET":
                return app(environ, start_response)
            with self._served:
                self._begun += 1
                number = self._begun
            body = app(environ, start_response)  # the registry is collected here
            return _Delivered(body, lambda: self._count_served(number))

        handler = type("_Handler", (_QuietHandler,), {"timeout": float(idle_timeout)})
        try:
            httpd = make_server(host, port, counted, server_class=_ThreadingServer, handler_class=handler)
        except OSError as exc:
            raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        assert isinstance(httpd, _ThreadingServer)
        httpd.limit(max_clients, float(request_timeout))
        self._httpd: _ThreadingServer = httpd
        self.host = host
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="kvledger-metrics", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def statistics(self) -> dict[str, int]:
        """``scrapes`` served; ``connections`` open now, of which ``reading`` still send their
        request; ``evicted``: connections cut off so far (past ``request_timeout``, or for a newcomer)."""
        return {"scrapes": self.scrapes, **self._httpd.statistics()}

    def _count_served(self, number: int) -> None:
        with self._served:
            self.scrapes += 1
            self._newest_served = max(self._newest_served, number)
            self._served.notify_all()

    def wait_scrape(self, after: int, timeout: float) -> bool:
        """Block until more than ``after`` scrapes were served (True) or ``timeout`` s pass (False)."""
        with self._served:
            return self._served.wait_for(lambda: self.scrapes > after, timeout)

    def wait_fresh_scrape(self, timeout: float) -> bool:
        """Block until a scrape that began after this call has been served (True) or ``timeout``
        s pass (False). A scrape already in flight does not count: it may have collected the
        registry before the caller's last change (``kvledger demo --metrics-linger`` waits on
        this once the run is over, so the scrape it waits for holds the final figures)."""
        with self._served:
            mark = self._begun
            return self._served.wait_for(lambda: self._newest_served > mark, timeout)

    def close(self) -> None:
        """Stop accepting and release the port, without waiting for answers in progress. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()  # the listening loop ends within its 50 ms poll
        self._thread.join()
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
