"""Durability: where the writes and fsyncs of a log happen, behind one ``hand_off`` interface.

    appender (EventLog)                        the writer side (this module)
    -------------------                        -----------------------------
    batch.take() ─► hand_off(items,            Inline: the round runs here, now
                    last seq, sync?, stamp?)   Background: queued; the writer thread
                                               ("kvledger-log-fsync") runs rounds

    a round:  seal the items (``LiveSegment.seal``: encoding, chain, CRC) ─► write
              ─► [FLUSH: fsync here] [ROLL: fsync, then the next segment with its
              checkpoint (``LogDirectory.roll``)] ─► fsync if asked ─► stamp if asked
              ─► publish: durable_seq, counters; wake every waiter

Both modes own the same state and invariants: ``live`` (the segment appends
go to; only the writer side touches it), ``durable_seq`` (the highest seq on
stable storage: it only grows, and only after the fsync that covers it
returned), ``failure`` / ``failed_op`` (the first error of a write, fsync,
roll or stamp: afterwards nothing more is written, ever, since the bytes after
the last durable point are unknown), and the counters of ``statistics()``.

Background rounds group every hand-off queued while the last round ran into
one fsync (group commit), after waiting ``GROUP_DELAY`` for more. ``lag`` is
what was handed off and not yet done (estimated bytes: payloads exactly,
events at the average size written so far); the appender blocks while it
passes its bound (back-pressure), and since every hand-off is done by the
thread whatever the policy, that wait always ends. The thread starts with the
first hand-off and holds no reference to the ``EventLog``: a log dropped without
``close()`` is collected, and its finalizer (``EventLog``) calls ``abandon``
here, which gives back the thread, the file and the lock.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from .batch import FLUSH, ROLL
from .directory import LogDirectory
from .live import LiveSegment

__all__ = ["GROUP_DELAY", "Background", "Durability", "Inline"]

GROUP_DELAY = 0.001  # how long a woken writer waits for more steps to join its fsync


class Durability:
    """The writer side's state and its round, shared by ``Inline`` and ``Background``."""

    background = False

    def __init__(self, live: LiveSegment, layer, directory: LogDirectory | None, next_seq: int, *,
                 on_failure: Callable[[], Callable[[str, BaseException], object] | None] | None = None) -> None:
        """``on_failure``: a weak reference (``weakref.WeakMethod``) to ``callable(op, exc)``, told of
        the failure from whichever thread hit it (a weak one: the writer thread keeps no log alive)."""
        self.live = live
        self.layer = layer
        self.directory = directory
        self.durable_seq = next_seq - 1
        self.failure: BaseException | None = None
        self.failed_op = ""
        self.records = self.bytes_written = self.syncs = self.events_written = 0
        self.event_bytes = 32.0  # average encoded bytes of an event so far (the lag estimate)
        # estimated bytes handed off (the appender's count) and done (the writer's): each written
        # by one thread only, so a hand-off takes no lock; lag = handed - done
        self.handed_bytes = self.done_bytes = 0.0
        self.on_failure = on_failure
        self.cond = threading.Condition()  # notified after every round and on failure

    # what the appender reads (published by the round)

    @property
    def segment(self) -> int:
        return self.live.index

    @property
    def size(self) -> int:
        return self.live.size

    @property
    def lag(self) -> float:
        """Estimated bytes handed off and not yet written (and synced, when asked)."""
        return self.handed_bytes - self.done_bytes

    def estimate(self, events: int, payload_bytes: int) -> float:
        """The bytes a hand-off of ``events`` events and ``payload_bytes`` of other payloads will write."""
        return events * self.event_bytes + payload_bytes

    # the interface (``Inline`` and ``Background``)

    def hand_off(self, items: list, last_seq: int, sync: bool, stamp: bool = False, estimate: float = 0.0) -> None:
        """Write ``items`` (``batch.Batch.take``), fsync if ``sync`` (then ``durable_seq`` reaches
        ``last_seq``), stamp if ``stamp``; ``estimate``: the bytes it will write (back-pressure)."""
        raise NotImplementedError

    def wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Block until ``ready()`` (True), or ``timeout`` passes or the log failed (False)."""
        raise NotImplementedError

    def wait_done(self) -> bool:
        """Wait until every hand-off so far is done; False if the log failed first."""
        raise NotImplementedError

    def lag_bytes(self) -> int:
        """Bytes handed off and not yet written and synced."""
        raise NotImplementedError

    def abandon(self) -> None:
        """Finish what was handed off, then give back the thread (if any), the file and the lock."""
        raise NotImplementedError

    # the round

    def _round(self, items: list, last_seq: int, sync: bool, stamp: bool) -> None:
        """Seal, write, fsync, roll and stamp as the items say; publish. Raises what the layer
        raised, after recording it as the failure (nothing is written after it)."""
        op = "write"
        live = self.live
        try:
            start = 0
            for i, item in enumerate(items):
                kind = item[0]
                if kind in (FLUSH, ROLL):
                    self._write(live, items, start, i)
                    op = "fsync"
                    live.sync()
                    self.syncs += 1
                    if kind == ROLL:
                        op = "rotate"
                        assert self.directory is not None
                        live = self.live = self.directory.roll(live, item[1], item[3], item[1])
                        self.records += 1
                    self._publish(item[1] - 1)
                    op = "write"
                    start = i + 1
            self._write(live, items, start, len(items))
            if sync:
                op = "fsync"
                live.sync()
                self.syncs += 1
                self._publish(last_seq)
            if stamp:
                op = "stamp"
                live.stamp(self.layer, last_seq + 1)
        except BaseException as exc:
            self._fail(op, exc)
            raise

    def _write(self, live: LiveSegment, items: list, start: int, end: int) -> None:
        if start >= end:
            return
        part = items[start:end] if start or end < len(items) else items
        data, records = live.seal(part)
        if data:
            live.write(data)
            self.records += records
            self.bytes_written += len(data)
            self.events_written += sum(item[2] for item in part)
            if self.events_written:
                self.event_bytes = self.bytes_written / self.events_written

    def _publish(self, seq: int) -> None:
        with self.cond:
            if seq > self.durable_seq:
                self.durable_seq = seq
            self.cond.notify_all()

    def _fail(self, op: str, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = exc
                self.failed_op = op
            self.cond.notify_all()
        tell = self.on_failure() if self.on_failure is not None else None
        if tell is not None:
            tell(op, exc)

    def release(self) -> None:
        """Close the live segment and the directory's lock."""
        self.live.close()
        if self.directory is not None:
            self.directory.release()


class Inline(Durability):
    """The appender's own thread writes and fsyncs, inside ``hand_off``."""

    background = False

    def hand_off(self, items: list, last_seq: int, sync: bool, stamp: bool = False, estimate: float = 0.0) -> None:
        """Run the round now. Raises the layer's ``OSError`` (recorded as the failure first)."""
        self._round(items, last_seq, sync, stamp)

    def wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        return ready()  # (nothing happens behind the appender's back)

    def wait_done(self) -> bool:
        return self.failure is None

    def lag_bytes(self) -> int:
        return self.live.size - self.live.synced

    def stop(self) -> None:
        pass

    def abandon(self) -> None:
        self.release()


class Background(Durability):
    """A writer thread runs the rounds (see the module docstring)."""

    background = True

    def __init__(self, live: LiveSegment, layer, directory: LogDirectory | None, next_seq: int, *,
                 on_failure: Callable[[], Callable[[str, BaseException], object] | None] | None = None) -> None:
        super().__init__(live, layer, directory, next_seq, on_failure=on_failure)
        self._q: queue.SimpleQueue = queue.SimpleQueue()  # (items, last seq, sync, stamp, estimate) or None: stop
        self.handed = self.done = 0  # hand-offs queued, and finished (written, synced as asked)
        self.released = False
        self._thread: threading.Thread | None = None  # started by the first hand-off

    def hand_off(self, items: list, last_seq: int, sync: bool, stamp: bool = False, estimate: float = 0.0) -> None:
        """Queue the round; returns at once (a failure surfaces through ``failure``)."""
        self.handed_bytes += estimate
        self.handed += 1
        self._q.put((items, last_seq, sync, stamp, estimate))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvledger-log-fsync", daemon=True)
            self._thread.start()

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Block until ``ready()`` (True), or ``timeout`` passes, the log failed or the thread ended (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not ready():
                if self.failure is not None or not self._alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(left)
        return True

    def wait_done(self) -> bool:
        """Wait until every hand-off so far is done; False if the log failed first."""
        target = self.handed
        return self.wait(lambda: self.done >= target, None)

    def lag_bytes(self) -> int:
        return max(0, int(self.lag))

    def stop(self) -> None:
        """Finish what was queued, then end the thread (returns when it has)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._q.put(None)
            if threading.current_thread() is not thread:
                thread.join()

    def abandon(self) -> None:
        """Finish what was queued, end the thread, give back the file and the lock (a finalizer may
        call this from any thread, the writer's own included: then the thread releases on its way out)."""
        if threading.current_thread() is self._thread:
            self.released = True  # (the thread releases after its loop)
            self._q.put(None)
            return
        self.stop()
        self.release()

    def _run(self) -> None:
        q = self._q
        while True:
            item = q.get()
            if item is None:
                break
            time.sleep(GROUP_DELAY)  # let the steps of the next millisecond join this fsync
            batch = [item]
            stop = False
            while not q.empty():
                nxt = q.get()
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            if not self._group(batch):
                while q.get() is not None:  # after a failure: write nothing more, stop when told
                    pass
                break
            if stop:
                break
        if self.released:
            self.release()

    def _group(self, batch: list) -> bool:
        """One round for every hand-off in ``batch``; False after a failure."""
        items = batch[0][0] if len(batch) == 1 else [it for b in batch for it in b[0]]
        try:
            self._round(items, max(b[1] for b in batch), any(b[2] for b in batch), any(b[3] for b in batch))
        except BaseException:  # an OSError, or whatever a test's layer raises: recorded, the thread stops writing
            return False
        with self.cond:
            self.done_bytes += sum(b[4] for b in batch)
            self.done += len(batch)
            self.cond.notify_all()
        return True
