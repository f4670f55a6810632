"""The real file layer under the event log (``OsFileLayer``) and what every layer offers.

The log does all its I/O through a *layer* (``FileLayer``: files, sync stamps and
log directories) and the *handles* it returns
(``write`` appends, ``sync``, ``truncate``, ``read``, ``close``). Swapping the
layer is how the reliability tests crash the disk and fail writes without
touching the log's code (``tests/support/simdisk.py``: ``SimulatedDisk``,
``FaultInjector``).

What ``OsFileLayer`` guarantees:

    create     a temp file (mode 0600, O_EXCL, never through a link), locked,
               written, fsynced, hard-linked to the path, directory fsynced:
               the log appears complete or not at all
    open       O_NOFOLLOW: a symbolic link is refused, never written through;
               only a regular file owned by this process's user is opened for
               writing; an exclusive ``flock`` per writer, and the path must
               still name the locked file (a concurrent recovery may replace it)
    read       readers take no lock and never block: a FIFO, a directory or a
               device is refused at once (O_NONBLOCK, then ``fstat``); the file
               is memory-mapped
    truncate   never in place: the kept prefix is copied to a temp file,
               fsynced and renamed over the path (directory fsynced). A reader
               that mapped the file before keeps the old bytes whole, so no
               reader ever touches pages a writer cut off (SIGBUS)
    stamps     ``<path>.sync``: a 52-byte file replaced atomically (temp file,
               fsync, rename, directory fsync) that says how much of the log
               was synced (``format.SyncStamp``)

Appends go only at the end and nothing else changes a log's bytes in place, so
a mapping taken at any moment shows a prefix of the log that never changes.

Errors: handles raise ``OSError`` (the log turns it into ``LogIOError``), except
lock conflicts (``LogLockedError``), creating an existing path
(``LogExistsError``) and files that are not logs (``LogError``). A directory
fsync that fails is an error like any other (``EINVAL``/``EOPNOTSUPP``, a
filesystem that cannot sync directories, excepted).
"""

from __future__ import annotations

import contextlib
import errno as _errno
import os
import random
import stat
from typing import Protocol, runtime_checkable

from ..errors import LogError, LogExistsError, LogLockedError

__all__ = ["FileHandle", "FileLayer", "OsFileLayer", "default_layer", "release_buffer", "stamp_path"]

LOG_MODE = 0o600
_NOT_SUPPORTED = (_errno.EINVAL, _errno.EOPNOTSUPP)


class FileHandle(Protocol):
    path: str

    def size(self) -> int: ...
    def read(self): ...  # a buffer of the current contents; release it with release_buffer()
    def write(self, data) -> None: ...  # append all of data at the end of the file
    def sync(self) -> None: ...
    def truncate(self, size: int) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class FileLayer(Protocol):
    """Everything the log asks of a file layer (every member; nothing is looked up by name).

    Files: ``exists``, ``create`` (whole and durable, or not at all), ``open`` (for appending,
    locked), ``read`` (a read-only buffer, no lock; release it with ``release_buffer``).
    Sync stamps (``<path>.sync``): ``read_stamp`` (None: none), ``write_stamp`` (atomic and
    durable), ``remove_stamp``. Log directories: ``isdir``, ``makedir``, ``listdir``,
    ``size_of``, ``remove`` (durable). ``OsFileLayer`` is the real one; tests swap in a
    simulated disk (``tests/support/simdisk.py``), metrics a timed one.
    """

    def exists(self, path: str) -> bool: ...
    def create(self, path: str, data: bytes) -> FileHandle: ...
    def open(self, path: str) -> FileHandle: ...
    def read(self, path: str): ...  # read-only buffer, no lock
    def read_stamp(self, path: str) -> bytes | None: ...
    def write_stamp(self, path: str, data: bytes) -> None: ...
    def remove_stamp(self, path: str) -> None: ...
    def isdir(self, path: str) -> bool: ...
    def makedir(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def size_of(self, path: str) -> int: ...
    def remove(self, path: str) -> None: ...


def stamp_path(path: str) -> str:
    """Where the sync stamp of the log at ``path`` lives."""
    return f"{path}.sync"


def release_buffer(buf) -> None:
    """Release a buffer returned by a layer's ``read`` (closes an mmap; no-op for bytes)."""
    close = getattr(buf, "close", None)
    if close is not None:
        close()


# ---------------------------------------------------------------------- system calls


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, flags: int, *, follow: bool) -> int:
    """Open ``path`` if it is a regular file, without ever blocking; return the fd.

    Raises ``LogError`` for a directory, FIFO, device, socket or (``follow=False``)
    a symbolic link, ``FileNotFoundError`` / ``OSError`` otherwise.
    """
    fl = flags | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, fl)
    except OSError as exc:
        if exc.errno == _errno.ELOOP and not follow:
            raise LogError(f"{path} is a symbolic link: a log is never written through a link") from None
        if exc.errno == _errno.EISDIR:
            raise LogError(f"{path} is a directory, not a log file") from None
        if exc.errno == _errno.ENXIO:
            raise LogError(f"{path} is not a regular file (a FIFO or socket)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LogError(f"{path} is {_kind(st.st_mode)}, not a log file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: str) -> None:
    """fsync the directory holding ``path`` (a new or renamed entry is durable after it).

    Raises ``OSError``; a filesystem that cannot sync directories (EINVAL,
    EOPNOTSUPP) is let through.
    """
    d = os.path.dirname(os.path.abspath(path))
    fd = os.open(d, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NOT_SUPPORTED:
            raise
    finally:
        os.close(fd)


def _lock(fd: int, path: str) -> None:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LogLockedError(f"{path} is open for writing elsewhere") from None


def _temp_file(path: str) -> tuple[str, int]:
    tmp = f"{path}.tmp-{random.getrandbits(64):016x}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, LOG_MODE)
    try:
        os.fchmod(fd, LOG_MODE)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return tmp, fd


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    done, total = 0, len(view)
    with view:
        while done < total:
            done += os.write(fd, view[done:])


def _copy_prefix(src: int, dst: int, size: int) -> None:
    done = 0
    while done < size:
        n = os.copy_file_range(src, dst, size - done, done, done) if hasattr(os, "copy_file_range") else 0
        if n <= 0:
            chunk = os.pread(src, min(size - done, 1 << 20), done)
            if not chunk:
                raise OSError(_errno.EIO, f"file ended at {done} bytes while copying {size}")
            n = os.pwrite(dst, chunk, done)
        done += n


def _link_new(tmp: str, path: str) -> bool:
    """Give the file ``tmp`` the new name ``path`` (never replacing anything); True when done."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise LogExistsError(f"{path} already exists") from None
    except OSError as exc:
        if exc.errno not in (_errno.EPERM, _errno.EOPNOTSUPP, _errno.EXDEV, _errno.EMLINK):
            raise
        if os.path.lexists(path):  # no hard links here: rename, checking first
            raise LogExistsError(f"{path} already exists") from None
        os.rename(tmp, path)
    return True


def _set_append(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)


def _mmap_fd(fd: int):
    import mmap

    size = os.fstat(fd).st_size
    if size == 0:
        return b""
    return mmap.mmap(fd, size, access=mmap.ACCESS_READ)


# ---------------------------------------------------------------------- real files


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
        _write_all(self._fd, data)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def truncate(self, size: int) -> None:
        """Keep the first ``size`` bytes: a copy renamed over the path (see the module docstring).

        On failure the path still names the old, whole file and this handle is unchanged.
        """
        tmp, fd = _temp_file(self.path)
        try:
            _lock(fd, tmp)
            _copy_prefix(self._fd, fd, size)
            os.fsync(fd)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        old, self._fd = self._fd, fd
        os.close(old)
        _set_append(fd)
        fsync_dir(self.path)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class OsFileLayer:
    """Real files (see the module docstring). Writers hold an exclusive ``flock``; readers take no lock."""

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def create(self, path: str, data: bytes) -> _OsHandle:
        """Create ``path`` holding ``data``, durably and atomically; returns the locked handle.

        Raises ``LogExistsError`` if ``path`` exists (a link or anything else), ``OSError``.
        """
        tmp, fd = _temp_file(path)
        linked = False
        try:
            _lock(fd, tmp)
            _write_all(fd, data)
            os.fsync(fd)
            linked = _link_new(tmp, path)
            fsync_dir(path)
            _set_append(fd)
        except BaseException:
            os.close(fd)
            if linked:
                os.unlink(path)  # its entry may not be durable: leave nothing behind
            raise
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        return _OsHandle(path, fd)

    def open(self, path: str) -> _OsHandle:
        """Open an existing log for appending (see the module docstring for what is refused)."""
        for _ in range(8):
            fd = open_regular(path, os.O_RDWR | os.O_APPEND, follow=False)
            try:
                st = os.fstat(fd)
                if st.st_uid != os.geteuid():
                    raise LogError(f"{path} belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()}): "
                                   "a log is written only by its owner")
                _lock(fd, path)
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                return _OsHandle(path, fd)
            os.close(fd)  # recovery replaced the file while we waited: open the new one
        raise LogLockedError(f"{path} keeps being replaced by another writer")

    def read(self, path: str):
        fd = open_regular(path, os.O_RDONLY, follow=True)
        try:
            return _mmap_fd(fd)
        finally:
            os.close(fd)

    # directories (a segmented log)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path) and not os.path.islink(path)

    def makedir(self, path: str) -> None:
        """Create a log directory (mode 0700), durably. Raises ``FileExistsError``, ``OSError``."""
        os.mkdir(path, 0o700)
        fsync_dir(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def size_of(self, path: str) -> int:
        return os.stat(path, follow_symlinks=False).st_size

    def remove(self, path: str) -> None:
        """Delete a file, durably (a reader that has it mapped keeps reading it)."""
        os.unlink(path)
        fsync_dir(path)

    def remove_stamp(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stamp_path(path))

    def read_stamp(self, path: str) -> bytes | None:
        try:
            fd = open_regular(stamp_path(path), os.O_RDONLY, follow=False)
        except FileNotFoundError:
            return None
        try:
            return os.pread(fd, 4096, 0)
        finally:
            os.close(fd)

    def write_stamp(self, path: str, data: bytes) -> None:
        """Replace the sync stamp atomically and durably. Raises ``OSError``."""
        dest = stamp_path(path)
        tmp, fd = _temp_file(dest)
        try:
            _write_all(fd, data)
            os.fsync(fd)
            os.rename(tmp, dest)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        fsync_dir(dest)


default_layer = OsFileLayer()
"""The file layer every log uses unless a caller passes another (fault injection in tests)."""
