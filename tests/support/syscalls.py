"""A system-call recorder with a simulated page cache, over real files.

``SyscallRecorder`` wraps ``os.write``, ``os.fsync``, ``os.fdatasync``,
``os.rename``, ``os.link`` and ``os.unlink`` (monkeypatched: the log's file
layer looks them up at call time) and keeps, in order, every call the log
makes. It also models what a power cut keeps:

* a file's bytes survive only up to what its last completed fsync/fdatasync
  covered (the recorder snapshots the file's contents right after the real
  call returns);
* a new or renamed directory entry survives only after a completed fsync of
  its directory (before that, the path keeps what its durable entry named).

``crash_image(path)`` is the bytes a power cut at this instant would leave at
``path`` (None: no durable entry). ``fail`` makes chosen calls raise EIO
(``fail = {"fdatasync": 3}``: the third fdatasync; ``"dir_fsync"`` counts
fsyncs of directories). ``before_sync`` runs inside every file sync, before
the real call: tests check there that nothing was acknowledged ahead of it.
"""

from __future__ import annotations

import errno
import os
import stat
import threading


def norm(path) -> str:
    """A path with its directory resolved (what /proc/self/fd shows)."""
    p = os.path.abspath(os.fspath(path))
    return os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))


class SyscallRecorder:
    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, str]] = []  # (call, path)
        self.counts: dict[str, int] = {}
        self.fail: dict[str, int] = {}
        self.before_sync = None
        self._lock = threading.RLock()
        self._durable_content: dict[tuple[int, int], bytes] = {}  # inode -> bytes covered by its last sync
        self._durable_entry: dict[str, tuple[int, int]] = {}  # path -> inode its durable entry names
        self._pending: dict[str, dict[str, tuple[int, int] | None]] = {}  # dir -> {path: inode or None (unlinked)}
        self._names: dict[tuple[int, int], str] = {}  # inode -> the name it last got
        real = {name: getattr(os, name) for name in ("write", "fsync", "fdatasync", "rename", "link", "unlink")}
        self._real = real
        for name in real:
            monkeypatch.setattr(os, name, getattr(self, f"_{name}"))

    # ------------------------------------------------------------------ bookkeeping

    def _count(self, call: str, path: str) -> None:
        with self._lock:
            self.calls.append((call, path))
            n = self.counts[call] = self.counts.get(call, 0) + 1
        if self.fail.get(call) == n:
            raise OSError(errno.EIO, f"recorder: injected {call} failure #{n}")

    def _path_of(self, fd: int) -> str:
        """The name the file last got through link/rename (a log's fd comes from its temp file)."""
        try:
            name = self._names.get(self._inode(os.fstat(fd)))
            return name if name is not None else norm(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return f"fd{fd}"

    @staticmethod
    def _inode(st) -> tuple[int, int]:
        return (st.st_dev, st.st_ino)

    def _entry_changed(self, path: str, inode) -> None:
        p = norm(path)
        with self._lock:
            self._pending.setdefault(os.path.dirname(p), {})[p] = inode
            if inode is not None:
                self._names[inode] = p

    # ------------------------------------------------------------------ wrapped calls

    def _write(self, fd, data):
        self._count("write", self._path_of(fd))
        return self._real["write"](fd, data)

    def _sync_file(self, call: str, fd: int) -> None:
        st = os.fstat(fd)
        path = self._path_of(fd) if not stat.S_ISDIR(st.st_mode) else norm(os.readlink(f"/proc/self/fd/{fd}"))
        if stat.S_ISDIR(st.st_mode):
            self._count("dir_fsync", path)
            self._real["fsync"](fd)
            with self._lock:
                for p, inode in self._pending.pop(norm(path), {}).items():
                    if inode is None:
                        self._durable_entry.pop(p, None)
                    else:
                        self._durable_entry[p] = inode
            return
        self._count(call, path)
        if self.before_sync is not None:
            self.before_sync(path)
        self._real[call](fd)
        content = os.pread(fd, st.st_size + (1 << 24), 0)
        with self._lock:
            self._durable_content[self._inode(st)] = content

    def _fsync(self, fd):
        self._sync_file("fsync", fd)

    def _fdatasync(self, fd):
        self._sync_file("fdatasync", fd)

    def _link(self, src, dst, *a, **kw):
        self._count("link", str(dst))
        self._real["link"](src, dst, *a, **kw)
        self._entry_changed(str(dst), self._inode(os.stat(dst, follow_symlinks=False)))

    def _rename(self, src, dst, *a, **kw):
        self._count("rename", str(dst))
        inode = self._inode(os.stat(src, follow_symlinks=False))
        self._real["rename"](src, dst, *a, **kw)
        self._entry_changed(str(dst), inode)
        self._entry_changed(str(src), None)

    def _unlink(self, path, *a, **kw):
        self._count("unlink", str(path))
        self._real["unlink"](path, *a, **kw)
        self._entry_changed(str(path), None)

    # ------------------------------------------------------------------ the crash model

    def adopt(self, path: str) -> None:
        """Treat the file now at ``path`` as durable, whole (made before the recorder was installed)."""
        p = norm(path)
        st = os.stat(p)
        with open(p, "rb") as f:
            data = f.read()
        with self._lock:
            self._durable_entry[p] = self._inode(st)
            self._durable_content[self._inode(st)] = data

    def crash_image(self, path: str) -> bytes | None:
        with self._lock:
            inode = self._durable_entry.get(norm(path))
            if inode is None:
                return None
            return self._durable_content.get(inode, b"")
