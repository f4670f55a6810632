"""Test layers under the event log: a power-loss simulator and a fault injector.

    SimulatedDisk    in-memory files that remember what was synced; ``crash()``
                     keeps an arbitrary subset of the unsynced writes, sector by
                     sector, torn or whole, in any order (power loss);
                     ``crash(keep=0.0)`` drops every unsynced byte
    FaultInjector    wraps a layer and fails the n-th write, sync, truncate or
                     stamp with EIO, optionally after writing part of the data

Both are ``FileLayer`` s (``kvledger/core/log/files.py``); the log cannot tell them from real files.
They are test doubles: they live here, beside the tests, not in the library.
"""

from __future__ import annotations

import errno as _errno
import random

from kvledger.core.errors import LogExistsError, LogLockedError
from kvledger.core.log.files import OsFileLayer, stamp_path

__all__ = ["FaultInjector", "SimulatedDisk"]


class _SimFile:
    __slots__ = ("data", "durable", "ops", "locked")

    def __init__(self, data: bytes) -> None:
        self.data = bytearray(data)  # what reads see now (the page cache)
        self.durable = bytearray(data)  # what survives a crash for certain
        self.ops: list[tuple] = []  # writes ("w", offset, bytes) and truncates ("t", size) since the last sync
        self.locked = False


class _SimHandle:
    __slots__ = ("path", "_disk", "_file", "_gen", "_open")

    def __init__(self, disk: SimulatedDisk, path: str, f: _SimFile) -> None:
        self.path = path
        self._disk = disk
        self._file = f
        self._gen = disk.generation
        self._open = True

    def _live(self) -> _SimFile:
        if not self._open or self._gen != self._disk.generation:
            raise OSError(_errno.EIO, "simulated disk: handle died in a crash or was closed")
        return self._file

    def size(self) -> int:
        return len(self._live().data)

    def read(self):
        return bytes(self._live().data)

    def write(self, data) -> None:
        f = self._live()
        data = bytes(data)
        f.ops.append(("w", len(f.data), data))
        f.data += data

    def sync(self) -> None:
        f = self._live()
        f.durable = bytearray(f.data)
        f.ops.clear()

    def truncate(self, size: int) -> None:
        f = self._live()
        del f.data[size:]
        f.ops.append(("t", size))

    def close(self) -> None:
        if self._open:
            self._open = False
            if self._gen == self._disk.generation:
                self._file.locked = False


class SimulatedDisk:
    """In-memory files with a power-loss model (a ``FileLayer``).

    Bytes reach the "platter" only through ``sync``. ``crash(rng)`` models power
    loss: starting from the synced contents, each unsynced write is cut into
    ``sector``-aligned pieces and every piece independently survives, is lost, or
    (rarely) survives torn at a byte; unsynced truncates survive or not; the file
    size ends at the last surviving byte or at the full pre-crash size (holes read
    as zeros). Later writes can survive without earlier ones, so reordering is
    covered. Every handle dies with the crash. Creating a file and writing a
    stamp are atomic and durable, as ``OsFileLayer`` makes them.
    """

    def __init__(self, sector: int = 512) -> None:
        self.sector = sector
        self.files: dict[str, _SimFile] = {}
        self.dirs: set[str] = set()
        self.generation = 0

    # directories: created and removed atomically and durably, like OsFileLayer's (which fsyncs them)

    def isdir(self, path: str) -> bool:
        return path in self.dirs

    def makedir(self, path: str) -> None:
        if path in self.dirs or path in self.files:
            raise FileExistsError(_errno.EEXIST, "exists", path)
        self.dirs.add(path)

    def listdir(self, path: str) -> list[str]:
        if path not in self.dirs:
            raise FileNotFoundError(_errno.ENOENT, "no such simulated directory", path)
        prefix = path.rstrip("/") + "/"
        return [p[len(prefix):] for p in self.files if p.startswith(prefix) and "/" not in p[len(prefix):]]

    def size_of(self, path: str) -> int:
        return len(self.files[path].data)

    def remove(self, path: str) -> None:
        del self.files[path]

    def remove_stamp(self, path: str) -> None:
        self.files.pop(stamp_path(path), None)

    def exists(self, path: str) -> bool:
        return path in self.files or path in self.dirs

    def create(self, path: str, data: bytes) -> _SimHandle:
        if path in self.files:
            raise LogExistsError(f"{path} already exists")
        self.files[path] = _SimFile(data)
        return self.open(path)

    def open(self, path: str) -> _SimHandle:
        f = self.files.get(path)
        if f is None:
            raise FileNotFoundError(_errno.ENOENT, "no such simulated file", path)
        if f.locked:
            raise LogLockedError(f"{path} is open for writing elsewhere")
        f.locked = True
        return _SimHandle(self, path, f)

    def read(self, path: str):
        f = self.files.get(path)
        if f is None:
            raise FileNotFoundError(_errno.ENOENT, "no such simulated file", path)
        return bytes(f.data)

    def read_stamp(self, path: str) -> bytes | None:
        f = self.files.get(stamp_path(path))
        return None if f is None else bytes(f.data)

    def write_stamp(self, path: str, data: bytes) -> None:
        self.files[stamp_path(path)] = _SimFile(data)

    def durable_bytes(self, path: str) -> bytes:
        return bytes(self.files[path].durable)

    def put(self, path: str, data: bytes) -> None:
        """Make ``path`` hold ``data``, durably (a file as another machine or a crash left it)."""
        self.files[path] = _SimFile(data)

    def crash(self, rng: random.Random, keep: float | None = None) -> None:
        """Lose power: every file becomes one of the images a real disk could leave.

        ``keep``: the chance that an unsynced sector survives (drawn per file when None;
        0.0 drops every unsynced byte).
        """
        self.generation += 1
        for f in self.files.values():
            img = bytearray(f.durable)
            k = rng.choice((0.0, 0.2, 0.5, 0.8, 1.0)) if keep is None else keep
            for op in f.ops:
                if op[0] == "t":
                    if rng.random() < 0.5:
                        del img[op[1]:]
                    continue
                self._replay_write(img, op[1], op[2], k, rng)
            if len(img) < len(f.data) and k > 0 and rng.random() < 0.5:
                img.extend(bytes(len(f.data) - len(img)))  # size reached the disk, data did not
            f.data = img
            f.durable = bytearray(img)
            f.ops = []
            f.locked = False

    def _replay_write(self, img: bytearray, offset: int, data: bytes, keep: float, rng: random.Random) -> None:
        sector = self.sector
        pos, end = offset, offset + len(data)
        while pos < end:
            piece_end = min(end, (pos // sector + 1) * sector)
            if rng.random() < keep:
                if rng.random() < 0.05:
                    piece_end = rng.randrange(pos, piece_end + 1)  # torn inside a sector
                if len(img) < pos:
                    img.extend(bytes(pos - len(img)))
                img[pos:piece_end] = data[pos - offset : piece_end - offset]
            pos = (pos // sector + 1) * sector


# ---------------------------------------------------------------------- fault injection


class _FaultyHandle:
    __slots__ = ("path", "_inner", "_faults")

    def __init__(self, inner, faults: FaultInjector) -> None:
        self.path = inner.path
        self._inner = inner
        self._faults = faults

    def size(self) -> int:
        return self._inner.size()

    def read(self):
        return self._inner.read()

    def write(self, data) -> None:
        fl = self._faults
        fl.operation("write", self.path)
        fl.writes += 1
        if fl.writes == fl.fail_write:
            fl.injected += 1
            if fl.partial and len(data) > 1:
                self._inner.write(bytes(data)[: len(data) // 2])
            raise fl.fault("write", fl.writes)
        self._inner.write(data)

    def sync(self) -> None:
        fl = self._faults
        fl.operation("fsync", self.path)
        fl.syncs += 1
        if fl.syncs == fl.fail_sync:
            fl.injected += 1
            raise fl.fault("fsync", fl.syncs)
        self._inner.sync()

    def truncate(self, size: int) -> None:
        fl = self._faults
        fl.operation("truncate", self.path)
        fl.truncates += 1
        if fl.truncates == fl.fail_truncate:
            fl.injected += 1
            raise fl.fault("truncate", fl.truncates)
        self._inner.truncate(size)

    def close(self) -> None:
        self._inner.close()


class FaultInjector:
    """A layer that fails the ``fail_write``-th write, ``fail_sync``-th sync,
    ``fail_truncate``-th truncate or ``fail_stamp``-th stamp (1-based, counted
    over all its handles) with EIO.

    ``partial=True`` writes the first half of the failing write before raising,
    like a disk that filled up mid-write. ``error(op, n)`` builds the exception
    instead of ``OSError(EIO)`` (a test's "power cut" raises its own exception:
    the log then did not see a failure, it just stopped). The counters
    (``writes``, ``syncs``, ``truncates``, ``stamps``, ``injected``) also count a clean run.

    ``fail_op=n`` fails the n-th file operation of any kind that changes the disk
    (create, makedir, write, fsync, truncate, stamp, remove, remove_stamp), before it
    happens; ``ops`` lists every such operation as ``(op, path)``, in order.
    """

    def __init__(self, inner=None, *, fail_write: int | None = None, fail_sync: int | None = None,
                 fail_truncate: int | None = None, fail_stamp: int | None = None, partial: bool = False,
                 error=None, fail_op: int | None = None) -> None:
        self.inner = inner if inner is not None else OsFileLayer()
        self.error = error
        self.fail_write = fail_write
        self.fail_sync = fail_sync
        self.fail_truncate = fail_truncate
        self.fail_stamp = fail_stamp
        self.partial = partial
        self.writes = self.syncs = self.truncates = self.stamps = 0
        self.injected = 0  # failures raised so far
        self.fail_op = fail_op
        self.ops: list[tuple[str, str]] = []

    def operation(self, op: str, path: str) -> None:
        """Count one operation that changes the disk; fail it when it is the ``fail_op``-th."""
        self.ops.append((op, path))
        if len(self.ops) == self.fail_op:
            self.injected += 1
            raise self.fault(op, len(self.ops))

    def fault(self, op: str, n: int) -> BaseException:
        if self.error is not None:
            return self.error(op, n)
        return OSError(_errno.EIO, f"injected {op} failure #{n}")

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def create(self, path: str, data: bytes):
        self.operation("create", path)
        return _FaultyHandle(self.inner.create(path, data), self)

    def open(self, path: str):
        return _FaultyHandle(self.inner.open(path), self)

    def read(self, path: str):
        return self.inner.read(path)

    def read_stamp(self, path: str) -> bytes | None:
        return self.inner.read_stamp(path)

    def isdir(self, path: str) -> bool:
        return self.inner.isdir(path)

    def makedir(self, path: str) -> None:
        self.operation("makedir", path)
        self.inner.makedir(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def size_of(self, path: str) -> int:
        return self.inner.size_of(path)

    def remove(self, path: str) -> None:
        self.operation("remove", path)
        self.inner.remove(path)

    def remove_stamp(self, path: str) -> None:
        self.operation("remove_stamp", path)
        self.inner.remove_stamp(path)

    def write_stamp(self, path: str, data: bytes) -> None:
        self.operation("stamp", path)
        self.stamps += 1
        if self.stamps == self.fail_stamp:
            self.injected += 1
            raise self.fault("stamp", self.stamps)
        self.inner.write_stamp(path, data)

