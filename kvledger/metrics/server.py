"""``MetricsServer``: a registry over HTTP on loopback, in one thread, stopped on ``close()``.

    server = MetricsServer(registry, port=0)      # 0: any free port (server.port says which)
    ... GET http://127.0.0.1:PORT/metrics  (Prometheus text exposition; any path serves it)
    server.wait_scrape(after=n, timeout=30)       # block until scrape n + 1 has been served
    server.close()                                # the answer in progress is finished first

One thread serves one request at a time (scrapes are small). ``close()`` stops the
loop after the request in progress and releases the port; the thread is a daemon
so an interpreter that exits without ``close()`` does not hang on it.
"""

from __future__ import annotations

import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from kvledger.core.errors import ConfigurationError, InvalidArgumentError

from .hooks import prometheus

__all__ = ["MetricsServer"]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr
        pass


class MetricsServer:
    """Serve ``registry`` on ``host:port`` until ``close()`` (also a context manager).

    Raises ``InvalidArgumentError`` for a port outside 0..65535 and
    ``ConfigurationError`` when the address cannot be bound (nothing started then).
    """

    def __init__(self, registry: Any, port: int = 0, host: str = "127.0.0.1") -> None:
        if type(port) is not int or not 0 <= port <= 65535:
            raise InvalidArgumentError(f"port must be an int in 0..65535, got {port!r}")
        app = prometheus().make_wsgi_app(registry)
        self.scrapes = 0
        self._served = threading.Condition()

        def counted(environ: dict, start_response: Any) -> Any:
            body = app(environ, start_response)
            if environ.get("REQUEST_METHOD") == "GET":
                with self._served:
                    self.scrapes += 1
                    self._served.notify_all()
            return body

        try:
            self._httpd: WSGIServer = make_server(host, port, counted, handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self.host = host
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="kvledger-metrics", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def wait_scrape(self, after: int, timeout: float) -> bool:
        """Block until more than ``after`` scrapes were served (True) or ``timeout`` s pass (False)."""
        with self._served:
            return self._served.wait_for(lambda: self.scrapes > after, timeout)

    def close(self) -> None:
        """Stop serving (after the request in progress) and release the port. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._thread.join()
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
