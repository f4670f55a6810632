"""File layers under the event log: the real one, a power-loss simulator, a fault injector.

The log does all its I/O through a *layer* (``create``, ``open``, ``read``,
``exists``) and the *handles* it returns (``write`` appends, ``sync``,
``truncate``, ``read``, ``close``). Swapping the layer is how the reliability
tests crash the disk and fail writes without touching the log's code.

    OsFileLayer      real files: atomic create (temp file, fsync, link, fsync dir),
                     an exclusive flock per writer, fdatasync, mmap for reads
    SimulatedDisk    in-memory files that remember what was synced; ``crash()``
                     keeps an arbitrary subset of the unsynced writes, sector by
                     sector, torn or whole, in any order (power loss)
    FaultInjector    wraps a layer and fails the n-th write or sync with EIO,
                     optionally after writing part of the data

Handles raise ``OSError`` (the log turns it into ``LogIOError``), except lock
conflicts (``LogLockedError``) and creating an existing path (``LogExistsError``).
"""

from __future__ import annotations

import errno as _errno
import os
import random
from typing import Protocol

from ..errors import LogExistsError, LogLockedError

__all__ = ["FileHandle", "FileLayer", "OsFileLayer", "SimulatedDisk", "FaultInjector", "release_buffer"]


class FileHandle(Protocol):
    path: str

    def size(self) -> int: ...
    def read(self): ...  # a buffer of the current contents; release it with release_buffer()
    def write(self, data) -> None: ...  # append all of data at the end of the file
    def sync(self) -> None: ...
    def truncate(self, size: int) -> None: ...
    def close(self) -> None: ...


class FileLayer(Protocol):
    def exists(self, path: str) -> bool: ...
    def create(self, path: str, data: bytes) -> FileHandle: ...
    def open(self, path: str) -> FileHandle: ...
    def read(self, path: str): ...  # read-only buffer, no lock


def release_buffer(buf) -> None:
    """Release a buffer returned by a layer's ``read`` (closes an mmap; no-op for bytes)."""
    close = getattr(buf, "close", None)
    if close is not None:
        close()


# ---------------------------------------------------------------------- real files


def _mmap_fd(fd: int):
    import mmap

    size = os.fstat(fd).st_size
    if size == 0:
        return b""
    return mmap.mmap(fd, size, access=mmap.ACCESS_READ)


class _OsHandle:
    __slots__ = ("path", "_fd")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read(self):
        return _mmap_fd(self._fd)

    def write(self, data) -> None:
        view = memoryview(data)
        fd = self._fd
        done, total = 0, len(view)
        with view:
            while done < total:
                done += os.write(fd, view[done:])

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _fsync_dir(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


class OsFileLayer:
    """Real files. Writers hold an exclusive ``flock``; readers take no lock."""

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def create(self, path: str, data: bytes) -> _OsHandle:
        """Create ``path`` holding ``data``, durably and atomically: it appears complete or not at all."""
        tmp = "%s.tmp-%016x" % (path, random.getrandbits(64))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _OsHandle(tmp, fd).write(data)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise LogExistsError(f"{path} already exists") from None
            except OSError as exc:
                if exc.errno not in (_errno.EPERM, _errno.EOPNOTSUPP, _errno.EXDEV, _errno.EMLINK):
                    raise
                if os.path.exists(path):  # no hard links here: rename, checking first
                    raise LogExistsError(f"{path} already exists") from None
                os.rename(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(path)
        return self.open(path)

    def open(self, path: str) -> _OsHandle:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_APPEND)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LogLockedError(f"{path} is open for writing elsewhere") from None
        except BaseException:
            os.close(fd)
            raise
        return _OsHandle(path, fd)

    def read(self, path: str):
        fd = os.open(path, os.O_RDONLY)
        try:
            return _mmap_fd(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------- power-loss simulator


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
    covered. Every handle dies with the crash.
    """

    def __init__(self, sector: int = 512) -> None:
        self.sector = sector
        self.files: dict[str, _SimFile] = {}
        self.generation = 0

    def exists(self, path: str) -> bool:
        return path in self.files

    def create(self, path: str, data: bytes) -> _SimHandle:
        if path in self.files:
            raise LogExistsError(f"{path} already exists")
        self.files[path] = _SimFile(data)  # atomic and durable, like OsFileLayer.create
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

    def durable_bytes(self, path: str) -> bytes:
        return bytes(self.files[path].durable)

    def put(self, path: str, data: bytes) -> None:
        """Make ``path`` hold ``data``, durably (a file as another machine or a crash left it)."""
        self.files[path] = _SimFile(data)

    def crash(self, rng: random.Random) -> None:
        """Lose power: every file becomes one of the images a real disk could leave."""
        self.generation += 1
        sector = self.sector
        for f in self.files.values():
            img = bytearray(f.durable)
            keep = rng.choice((0.0, 0.2, 0.5, 0.8, 1.0))
            for op in f.ops:
                if op[0] == "t":
                    if rng.random() < 0.5:
                        del img[op[1]:]
                    continue
                _, offset, data = op
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
            if len(img) < len(f.data) and rng.random() < 0.5:
                img.extend(bytes(len(f.data) - len(img)))  # size reached the disk, data did not
            f.data = img
            f.durable = bytearray(img)
            f.ops = []
            f.locked = False


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
        fl.writes += 1
        if fl.writes == fl.fail_write:
            fl.injected += 1
            if fl.partial and len(data) > 1:
                self._inner.write(bytes(data)[: len(data) // 2])
            raise fl._error("write", fl.writes)
        self._inner.write(data)

    def sync(self) -> None:
        fl = self._faults
        fl.syncs += 1
        if fl.syncs == fl.fail_sync:
            fl.injected += 1
            raise fl._error("fsync", fl.syncs)
        self._inner.sync()

    def truncate(self, size: int) -> None:
        fl = self._faults
        fl.truncates += 1
        if fl.truncates == fl.fail_truncate:
            fl.injected += 1
            raise fl._error("truncate", fl.truncates)
        self._inner.truncate(size)

    def close(self) -> None:
        self._inner.close()


class FaultInjector:
    """A layer that fails the ``fail_write``-th write, ``fail_sync``-th sync or
    ``fail_truncate``-th truncate (1-based, counted over all its handles) with EIO.

    ``partial=True`` writes the first half of the failing write before raising,
    like a disk that filled up mid-write. ``error(op, n)`` builds the exception
    instead of ``OSError(EIO)`` (a test's "power cut" raises its own exception:
    the log then did not see a failure, it just stopped). The counters
    (``writes``, ``syncs``, ``truncates``, ``injected``) also count a clean run.
    """

    def __init__(self, inner=None, *, fail_write: int | None = None, fail_sync: int | None = None,
                 fail_truncate: int | None = None, partial: bool = False, error=None) -> None:
        self.inner = inner if inner is not None else OsFileLayer()
        self.error = error
        self.fail_write = fail_write
        self.fail_sync = fail_sync
        self.fail_truncate = fail_truncate
        self.partial = partial
        self.writes = self.syncs = self.truncates = 0
        self.injected = 0  # failures raised so far

    def _error(self, op: str, n: int) -> BaseException:
        if self.error is not None:
            return self.error(op, n)
        return OSError(_errno.EIO, "injected %s failure #%d" % (op, n))

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def create(self, path: str, data: bytes):
        return _FaultyHandle(self.inner.create(path, data), self)

    def open(self, path: str):
        return _FaultyHandle(self.inner.open(path), self)

    def read(self, path: str):
        return self.inner.read(path)


default_layer = OsFileLayer()
"""The file layer every log uses unless a caller passes another (fault injection in tests)."""
