"""The background writer of an ``EventLog``: one thread that writes, fsyncs and publishes.

    appender thread                         writer thread ("kvledger-log-fsync")
    ---------------                         ------------------------------------
    seal records into bytes (no I/O)
    hand_off(bytes, last seq, sync?) ──►    queue ──► wait _GROUP_DELAY for more
    [back-pressure: block while more          write every queued item
     than max_lag bytes are unsynced]        fsync once for all of them (group commit)
                                             publish: synced_end, durable_seq,
                                             notify every waiter

One fsync covers every hand-off queued while the thread wrote or synced the
last ones. A failed write or fsync stops the thread from writing anything more
(nothing is ever written after an unknown region), records the failure on the
log and wakes every waiter; later hand-offs are dropped. ``stop()`` drains
what was queued before it (close) and joins the thread.

The thread owns the file's write side and the published counters of the log
(``_size``, ``_bytes``, ``_syncs``, ``_synced_end``, ``_durable_seq``); the
appender owns everything else.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .writer import EventLog

__all__ = ["Syncer"]

_GROUP_DELAY = 0.001  # how long a woken writer waits for more steps to join its fsync


class Syncer:
    """The writer thread of one background ``EventLog`` (see the module docstring)."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self._q: queue.SimpleQueue = queue.SimpleQueue()  # (bytes | None, last seq, fsync?) or None: stop
        self.cond = threading.Condition()  # notified after every round and on failure
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name="kvledger-log-fsync", daemon=True)
        self._thread.start()

    def hand_off(self, data, last_seq: int, sync: bool) -> None:
        self._q.put((data, last_seq, sync, None))

    def quiesce(self) -> None:
        """Return once every round that took items queued before this call has finished
        (a rotation switches files: no round may still hold the old one)."""
        done = threading.Event()
        self._q.put((None, -1, False, done))
        while not done.wait(0.05):
            if not self._thread.is_alive():
                return

    def wait(self, ready, timeout: float | None) -> bool:
        """Block until ``ready()`` is true (True), or ``timeout`` passes or the log failed (False)."""
        log = self._log
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not ready():
                if log._failure is not None or not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def stop(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    def _run(self) -> None:
        q = self._q
        while True:
            item = q.get()
            if item is None:
                return
            time.sleep(_GROUP_DELAY)  # let the steps of the next millisecond join this fsync
            items = [item]
            stop = False
            while not q.empty():
                nxt = q.get()
                if nxt is None:
                    stop = True
                    break
                items.append(nxt)
            if not self._round(items):
                self._drain()
                return
            if stop:
                return

    def _round(self, items: list) -> bool:
        """Write the items, fsync once if any asked for it, publish. False after a failure."""
        log = self._log
        handle = log._handle
        op = "write"
        want, seq, size = False, -1, log._size
        try:
            for data, last, sync, _ in items:
                if data is not None:
                    handle.write(data)
                    size += len(data)
                    log._size = size
                    log._bytes += len(data)
                want = want or sync
                seq = max(seq, last)
            if want:
                op = "fsync"
                handle.sync()
        except Exception as exc:  # an OSError, or whatever a test's layer raises: the thread stops writing
            log._record_failure(op, exc)
            with self.cond:
                self.cond.notify_all()
            _release(items)
            return False
        with self.cond:
            if want:
                log._syncs += 1
                log._synced_end = size
                if seq > log._durable_seq:
                    log._durable_seq = seq
            self.rounds += 1
            self.cond.notify_all()
        _release(items)
        return True

    def _drain(self) -> None:
        """After a failure: write nothing more, stop when told."""
        while (item := self._q.get()) is not None:
            _release([item])


def _release(items: list) -> None:
    for item in items:
        if item[3] is not None:
            item[3].set()
