"""A file layer that times the event log's writes and fsyncs (``LedgerMetrics.timed_layer``).

    open_ledger(path, g, layer=metrics.timed_layer())
        EventLog ─► handle.write(records) ─► kvledger_log_write_seconds  (inline, or the writer thread)
                 ─► handle.sync()         ─► kvledger_log_fsync_seconds

The log itself keeps no clock (``core/`` never reads one): appends encode into an
in-memory batch, and the time an append costs on the step path is the write and
fsync its commit does (inline logs) or none (background logs, where the writer
thread pays them). Timing the layer measures exactly those, wherever they run. A
write or fsync that raises is timed too, then its ``OSError`` goes on to the log
unchanged (the log turns it into ``LogIOError``).
"""

from __future__ import annotations

import time
from typing import Any

from kvledger.core.log.files import default_layer

__all__ = ["TimedFileLayer"]


class _TimedHandle:
    __slots__ = ("path", "_inner", "_write_s", "_fsync_s")

    def __init__(self, inner: Any, write_s: Any, fsync_s: Any) -> None:
        self.path = inner.path
        self._inner = inner
        self._write_s = write_s
        self._fsync_s = fsync_s

    def size(self) -> int:
        return self._inner.size()

    def read(self) -> Any:
        return self._inner.read()

    def write(self, data: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._inner.write(data)
        finally:
            self._write_s.observe(time.perf_counter() - t0)

    def sync(self) -> None:
        t0 = time.perf_counter()
        try:
            self._inner.sync()
        finally:
            self._fsync_s.observe(time.perf_counter() - t0)

    def truncate(self, size: int) -> None:
        self._inner.truncate(size)

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else the log asks of a handle: unchanged
        return getattr(self._inner, name)


class TimedFileLayer:
    """Wraps a file layer (``inner``, default: real files); the handles it opens observe
    each ``write`` and ``sync`` in the two histograms. Nothing else changes."""

    def __init__(self, write_s: Any, fsync_s: Any, inner: Any = None) -> None:
        self.inner = inner if inner is not None else default_layer
        self._write_s = write_s
        self._fsync_s = fsync_s

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def create(self, path: str, data: bytes) -> _TimedHandle:
        return _TimedHandle(self.inner.create(path, data), self._write_s, self._fsync_s)

    def open(self, path: str) -> _TimedHandle:
        return _TimedHandle(self.inner.open(path), self._write_s, self._fsync_s)

    def read(self, path: str) -> Any:
        return self.inner.read(path)

    def __getattr__(self, name: str) -> Any:  # stamps, directories, removal: untimed, unchanged
        return getattr(self.inner, name)
