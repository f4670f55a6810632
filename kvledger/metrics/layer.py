"""A file layer that times the event log's writes and fsyncs (``LedgerMetrics.timed_layer``).

    open_ledger(path, g, log_options=LogOptions(layer=metrics.timed_layer()))
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
from typing import Any, Protocol

from kvledger.core.log.files import FileHandle, FileLayer, default_layer

__all__ = ["TimedFileLayer"]


class _Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


class _TimedHandle:
    """A handle whose ``write`` and ``sync`` are timed; every other member passes through."""

    __slots__ = ("path", "_inner", "_write_s", "_fsync_s")

    def __init__(self, inner: FileHandle, write_s: _Histogram, fsync_s: _Histogram) -> None:
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


class TimedFileLayer:
    """Wraps a file layer (``inner``, default: real files); the handles it opens observe
    each ``write`` and ``sync`` in the two histograms. Every other member of the layer
    (``FileLayer``: stamps, directories, removal) is the inner layer's, untimed."""

    def __init__(self, write_s: _Histogram, fsync_s: _Histogram, inner: FileLayer | None = None) -> None:
        self.inner: FileLayer = inner if inner is not None else default_layer
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

    def read_stamp(self, path: str) -> bytes | None:
        return self.inner.read_stamp(path)

    def write_stamp(self, path: str, data: bytes) -> None:
        self.inner.write_stamp(path, data)

    def remove_stamp(self, path: str) -> None:
        self.inner.remove_stamp(path)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def makedir(self, path: str) -> None:
        self.inner.makedir(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def size_of(self, path: str) -> int:
        return self.inner.size_of(path)

    def remove(self, path: str) -> None:
        self.inner.remove(path)
