"""The durable event log: an append-only file of checksummed, hash-chained records.

    Ledger command ─► validate ─► EventLog.append(seq, event) ─► fold
                                   │ encode into the open batch (no I/O)
                                   │ StepSealed (per step) / every event (per_event):
                                   └► seal the batch record ─► write ─► fsync ─► durable_seq
                                      (in the background writer thread, or inline)

``EventLog.append`` has the signature of a ``Ledger`` sink. Events are encoded
into an in-memory batch as they arrive; the batch becomes one record and is
written and fsynced when the policy says so (group commit):

    "background" (default) a ``StepSealed`` hands the step's record to the writer
                 thread (``syncer.py``) and returns at once; the thread writes
                 and fsyncs, one fsync for every step sealed meanwhile
    "per_step"   inline: the ``StepSealed`` append writes and fsyncs before it returns
    "per_event"  inline, after every event
    "none"       only on ``sync()`` / ``close()`` (and writes, unsynced, past 4 MiB)

``durable_seq`` is the highest seq known to be on stable storage (-1: none);
nothing at or below it is lost by a crash, and a crash loses at most the events
after it (reopening reports the torn tail). ``sync()`` / ``flush()`` write,
fsync and wait; ``wait_durable(seq)`` waits for the writer thread to reach an
event, and ``wait_durable_async(seq)`` does the same without blocking an event
loop. Durability never slows the step by default; waiting for it is opt-in.

Back-pressure: with the writer thread, an append that hands off a record while
more than ``max_lag_bytes`` (default 64 MiB) are written-or-queued but not yet
synced blocks until the disk catches up below that bound; memory never grows
without limit because the disk is slow.

Failures: a failed write or fsync closes the log to appends (the bytes after
the last durable point are unknown, and nothing is ever appended after an
unknown region). Inline, the append that committed raises ``LogIOError`` (the
command fails, the ledger state is unchanged). In the background, the failure
surfaces as ``LogIOError`` from the next append, ``sync``, ``wait_durable`` or
``close``; events after ``durable_seq`` were never acknowledged and may be lost.
Reopen the log to continue: open truncates a torn tail and refuses corruption
(``format.py`` says how the two are told apart).

All methods block on file I/O, and one thread appends at a time (async callers
use ``anyio.to_thread.run_sync``; ``wait_durable`` may be called from any
thread). The log does not log (``kvledger.durable`` does, through ``notify``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from ..errors import InvalidArgumentError, LogClosedError, LogError, LogIOError, RecordTooLargeError
from ..events.events import Geometry
from .format import (
    KIND_CHECKPOINT,
    KIND_CLOSE,
    KIND_EVENTS,
    PREFIX,
    PREFIX_SIZE,
    RECORD_MAGIC,
    Checkpoint,
    LogHeader,
    SyncStamp,
    encode_stamp,
    max_event_bytes,
    max_record_bytes,
    seal_record,
)
from .policy import (
    _BATCH_BYTES,
    _BATCH_HEAD,
    _COUNT,
    _EVENT_TYPES,
    _FLUSH_BYTES,
    DEFAULT_MAX_LAG_BYTES,
    FSYNC_POLICIES,
    LogStatistics,
    policy_mode,
)
from .scan import Scan
from .syncer import Syncer

__all__ = ["EventLog", "LogStatistics", "FSYNC_POLICIES", "DEFAULT_MAX_LAG_BYTES"]

class EventLog:
    """An open, appendable event log. Build it with ``create`` or ``open`` (``opening.py``).

    After ``open``, ``recovery`` is the ``Scan`` of what was found (records,
    torn tail, whether it had been closed cleanly) and ``loaded`` what the
    ``loader`` built from the verified records.
    """

    __slots__ = (
        "fsync", "background", "path", "header", "recovery", "loaded", "notify", "max_lag_bytes",
        "_sync_types", "_handle", "_layer", "_enc", "_encode_into", "_event_cap", "_record_cap", "_buf",
        "_batch_at", "_batch_seq", "_chain", "_head", "_end", "_size", "_synced_end", "_next_seq", "_start_seq",
        "_durable_seq", "_ok", "_failure", "_failed_op", "_reported", "_closed", "_records", "_bytes", "_syncs",
        "_checkpoints", "_checkpoint_seq", "_stalls", "_syncer", "_written_seq",
        "segment_bytes", "retain_bytes", "retain_segments", "rotation_due", "segments_deleted", "_file", "_segment",
        "_lock",
    )

    def __init__(self, handle, header: LogHeader, *, fsync: str = "background", size: int, next_seq: int, chain,
                 head: bytes = bytes(8), background: bool | None = None, layer=None,
                 max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES, segments: dict | None = None) -> None:
        self._sync_types, bg = policy_mode(fsync, background)
        if type(max_lag_bytes) is not int or max_lag_bytes < 1:
            raise InvalidArgumentError(f"max_lag_bytes must be a positive int, got {max_lag_bytes!r}")
        self.fsync = fsync
        self.background = bg
        self.max_lag_bytes = max_lag_bytes
        self.path = handle.path
        self.header = header
        self._file = handle.path  # the file appends go to (the live segment of a log directory)
        self._segment = header.segment
        self._lock = None
        self.segment_bytes = self.retain_bytes = self.retain_segments = None
        self.rotation_due = False  # a log directory's live segment reached segment_bytes: rotate()
        self.segments_deleted = 0
        if segments is not None:  # a log directory: {"path", "segment_bytes", "retain_bytes", ...}
            self.path = segments["path"]
            self._lock = segments.get("lock")
            self.segment_bytes = segments["segment_bytes"]
            self.retain_bytes = segments.get("retain_bytes")
            self.retain_segments = segments.get("retain_segments")
        self.notify: Callable[[str, dict], object] | None = None  # how the log tells its owner what happened
        self._handle = handle
        self._layer = layer
        self._enc = msgspec.msgpack.Encoder()
        self._encode_into = self._enc.encode_into
        self._event_cap = max_event_bytes(header.geometry.num_pages)
        self._record_cap = max_record_bytes(header.geometry.num_pages)
        self._buf = bytearray()
        self._batch_at = -1
        self._batch_seq = 0
        self._chain = chain
        self._head = head  # chain value of the last sealed record
        self._end = size  # end of everything handed over (written, or queued for the writer thread)
        self._size = size  # bytes written to the file
        self._synced_end = size  # bytes known to be on stable storage
        self._next_seq = self._start_seq = next_seq
        self._durable_seq = self._written_seq = next_seq - 1
        self._ok = True  # open and not failed: the one flag the hot path reads
        self._failure: BaseException | None = None  # the OSError that stopped the log
        self._failed_op = ""
        self._reported = self._closed = False
        self._records = self._bytes = self._syncs = self._checkpoints = self._stalls = 0
        self._checkpoint_seq = -1
        self.recovery: Scan | None = None
        self.loaded = None
        self._syncer = Syncer(self) if bg else None

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, path, geometry: Geometry, **kw) -> EventLog:
        """Create a new log holding only its header (``opening.create_log`` has the details)."""
        from .opening import create_log

        return create_log(cls, path, geometry, **kw)

    @classmethod
    def open(cls, path, **kw) -> EventLog:
        """Open an existing log for appending (``opening.open_log`` has the details)."""
        from .opening import open_log

        return open_log(cls, path, **kw)

    # ------------------------------------------------------------------ state

    @property
    def seq(self) -> int:
        """The seq the next appended event must carry (= events in the log)."""
        return self._next_seq

    @property
    def durable_seq(self) -> int:
        """Highest seq known to be on stable storage; -1 when none is."""
        return self._durable_seq

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def statistics(self) -> LogStatistics:
        return LogStatistics(
            events=self._next_seq, durable_seq=self._durable_seq, appended=self._next_seq - self._start_seq,
            records=self._records, bytes_written=self._bytes, syncs=self._syncs,
            checkpoints=self._checkpoints, size=self._size, lag_bytes=self._end - self._synced_end,
            stalls=self._stalls,
        )

    def _refuse(self, report: bool = True) -> None:
        """Raise why the log takes no appends: the failure itself once, then LogClosedError.

        ``report=False`` never counts as the report (for calls whose caller may not pass it on).
        """
        if self._failure is not None:
            if not self._reported and report:
                self._reported = True
                raise LogIOError(self.path, self._failed_op, self._failure,
                                 f"events after seq {self._durable_seq} may be lost; reopen the log")
            raise LogClosedError(f"{self.path}: the log stopped taking appends after a failure "
                                 f"({self._failed_op}: {self._failure}); reopen it")
        raise LogClosedError(f"{self.path}: the log is closed")

    # ------------------------------------------------------------------ appends

    def append(self, seq: int, event) -> None:
        """Append ``event`` as ``seq`` (a ``Ledger`` sink). Durable per the fsync policy.

        Raises ``LogError`` (wrong seq), ``InvalidArgumentError`` (not an event),
        ``RecordTooLargeError`` (nothing changed), ``LogClosedError``, or
        ``LogIOError`` for a failed write/fsync (the log then refuses all
        appends; reopen it). In every case the event is not in the log's
        durable future: a ``Ledger`` does not fold it.
        """
        if seq != self._next_seq or not self._ok:
            self._refuse_append(seq)
        if type(event) not in _EVENT_TYPES:
            raise InvalidArgumentError(f"not a kvledger event: {type(event).__name__}")
        self.append_next(event)

    def append_next(self, event) -> None:
        """``append(self.seq, event)`` for a caller that owns the sequence and hands only
        validated kvledger events (``DurableLedger``): skips those two checks, nothing else."""
        if not self._ok:
            self._refuse()
        seq = self._next_seq
        buf = self._buf
        if self._batch_at < 0:
            self._batch_at = len(buf)
            self._batch_seq = seq
            buf += _BATCH_HEAD
        self._encode_into(event, buf, -1)
        self._next_seq = seq + 1
        if len(buf) - self._batch_at > _BATCH_BYTES:
            self._large_batch(seq, event)
        if type(event) in self._sync_types:
            self._commit()

    def _refuse_append(self, seq: int) -> None:
        if not self._ok:
            self._refuse()
        raise LogError(f"{self.path}: append of seq {seq}, the log expects seq {self._next_seq}")

    def _large_batch(self, seq: int, event) -> None:
        """The open batch passed its size: refuse an oversized event, else seal the batch (and maybe write)."""
        size = len(self._enc.encode(event))
        buf = self._buf
        if size > self._event_cap:
            del buf[len(buf) - size :]
            self._next_seq = seq
            if seq == self._batch_seq:
                del buf[self._batch_at :]
                self._batch_at = -1
            raise RecordTooLargeError(f"event {type(event).__name__} at seq {seq} encodes to {size} bytes, "
                                      f"more than {self._event_cap}")
        self._finish_batch()
        if len(buf) > _FLUSH_BYTES:
            self._hand_off(False)

    @property
    def checkpoint_seq(self) -> int:
        """Seq of the last checkpoint this handle appended (-1: none)."""
        return self._checkpoint_seq

    def checkpoint(self, seq: int, digest: str, state: bytes) -> None:
        """Append a checkpoint of the state after ``seq`` events (no I/O until the next commit).

        Raises ``LogError`` unless ``seq`` equals ``self.seq``, ``RecordTooLargeError``
        (nothing changed), ``LogClosedError``.
        """
        if self._failure is not None or self._closed:
            self._refuse(report=False)
        if seq != self._next_seq:
            raise LogError(f"{self.path}: checkpoint at seq {seq}, the log is at seq {self._next_seq}")
        payload = self._enc.encode(Checkpoint(seq=seq, digest=digest, state=state))
        if len(payload) > self._record_cap:
            raise RecordTooLargeError(f"checkpoint at seq {seq} is {len(payload)} bytes, "
                                      f"the limit is {self._record_cap}")
        if self._batch_at >= 0:
            self._finish_batch()
        self._add_record(KIND_CHECKPOINT, seq, payload)
        self._checkpoints += 1
        self._checkpoint_seq = seq

    def rotate(self, seq: int, digest: str, state: bytes) -> None:
        """A log directory: close the live segment and open the next one with this checkpoint
        (``segments.rotate``). Raises ``LogError`` for a single-file log, ``LogIOError``."""
        if self.segment_bytes is None:
            raise LogError(f"{self.path}: a single-file log has no segments to rotate")
        from .segments import rotate

        rotate(self, seq, digest, state)

    # ------------------------------------------------------------------ durability

    def sync(self) -> None:
        """Write and fsync everything appended so far, wait for it, and stamp the log:
        afterwards ``durable_seq == seq - 1``. Raises ``LogIOError`` / ``LogClosedError``."""
        if self._failure is not None or self._closed:
            self._refuse()
        self._commit()
        if self.background:
            self._wait_synced()
        self._stamp()

    flush = sync

    def wait_durable(self, seq: int, timeout: float | None = None) -> bool:
        """Block until event ``seq`` is durable (True), or ``timeout`` passes (False).

        Never writes: an event still in the open batch becomes durable when its
        step is sealed (or at ``sync``). Answers False at once for an inline log
        (whose durable point moves only in the appender's own calls) or a closed
        one. Raises ``LogIOError`` if the writer failed before ``seq`` was durable.
        Any thread may call it.
        """
        if self._durable_seq >= seq:
            return True
        if self._failure is not None:
            self._refuse()
        if self._syncer is None or self._closed:
            return False
        ok = self._syncer.wait(lambda: self._durable_seq >= seq, timeout)
        if not ok and self._failure is not None:
            self._refuse()
        return ok

    async def wait_durable_async(self, seq: int, poll: float = 0.05) -> None:
        """Wait, without blocking the event loop, until event ``seq`` is durable.

        Waits in a worker thread ``poll`` seconds at a time (cancellable between
        polls). Raises ``LogIOError`` if the writer failed, ``LogClosedError`` if
        the log closed (or is inline) before ``seq`` became durable.
        """
        import anyio

        while not await anyio.to_thread.run_sync(self.wait_durable, seq, poll, abandon_on_cancel=True):
            if self._closed or self._syncer is None:
                if self._durable_seq >= seq:
                    return
                raise LogClosedError(f"{self.path}: seq {seq} is not durable and the log no longer syncs "
                                     f"by itself (closed or inline; durable_seq {self._durable_seq})")

    def close(self) -> None:
        """Sync, append a close record (it proves the whole file synced), sync, stamp, release the file.

        Idempotent. After a failure it only releases the file (raising the
        failure if it was never reported). Raises ``LogIOError`` if the final
        writes fail (the file is released anyway).
        """
        if self._closed:
            return
        try:
            if self._failure is None:
                self._commit()
                if self.background:
                    self._wait_synced()  # the close record claims everything before it synced
                self._add_record(KIND_CLOSE, self._next_seq, b"")
                self._commit()
                if self.background:
                    self._wait_synced()
                self._stamp()
            elif not self._reported:
                self._refuse()
        finally:
            self._release()

    def abandon(self) -> None:
        """Release the file without writing anything more (a failed open built on this log)."""
        if not self._closed:
            self._release()

    def _release(self) -> None:
        self._closed = True
        self._ok = False
        if self._syncer is not None:
            self._syncer.stop()
        self._handle.close()
        if self._lock is not None:
            self._lock.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _finish_batch(self) -> None:
        buf, start = self._buf, self._batch_at
        n = len(buf) - start - PREFIX_SIZE
        count = self._next_seq - self._batch_seq
        PREFIX.pack_into(buf, start, RECORD_MAGIC, KIND_EVENTS, 0, n, self._batch_seq, count, self._synced_end)
        buf[start + PREFIX_SIZE] = 0xDD
        _COUNT.pack_into(buf, start + PREFIX_SIZE + 1, count)
        self._head = seal_record(buf, start, self._chain)
        self._batch_at = -1
        self._records += 1

    def _add_record(self, kind: int, seq: int, payload: bytes) -> None:
        buf = self._buf
        start = len(buf)
        buf += PREFIX.pack(RECORD_MAGIC, kind, 0, len(payload), seq, 0, self._synced_end)
        buf += payload
        self._head = seal_record(buf, start, self._chain)
        self._records += 1

    def _commit(self) -> None:
        """Seal the open batch; write and fsync everything sealed (inline) or queue it (background)."""
        if self._batch_at >= 0:
            self._finish_batch()
        self._hand_off(True)

    def _hand_off(self, sync: bool) -> None:
        """Write what is sealed, then fsync it: here (inline), or in the writer thread."""
        buf = self._buf
        if self._syncer is not None:
            if buf:
                self._buf = bytearray()
                self._end += len(buf)
                self._written_seq = self._next_seq - 1  # (buf held only sealed records)
            elif not sync:
                return
            self._syncer.hand_off(buf or None, self._written_seq, sync)
            if self._end - self._synced_end > self.max_lag_bytes:
                self._stall()
            if self.segment_bytes is not None and self._end >= self.segment_bytes:
                self.rotation_due = True
            return
        if buf:
            try:
                self._handle.write(buf)
            except OSError as exc:
                self._fail("write", exc)
            self._size += len(buf)
            self._end = self._size
            self._bytes += len(buf)
            self._buf = bytearray()
            self._written_seq = self._next_seq - 1
        if not sync:
            return
        try:
            self._handle.sync()
        except OSError as exc:
            self._fail("fsync", exc)
        self._syncs += 1
        self._synced_end = self._size
        self._durable_seq = self._next_seq - 1
        if self.segment_bytes is not None and self._end >= self.segment_bytes:
            self.rotation_due = True

    def _stall(self) -> None:
        """Back-pressure: wait until no more than ``max_lag_bytes`` are unsynced."""
        self._stalls += 1
        bound = self.max_lag_bytes
        self._syncer.wait(lambda: self._end - self._synced_end <= bound, None)  # type: ignore[union-attr]
        if self._failure is not None:
            self._refuse()

    def _record_failure(self, op: str, exc: Exception) -> None:
        """The log stops taking appends (writer thread or inline); tell the owner."""
        self._failure = exc
        self._failed_op = op
        self._ok = False
        if self.notify is not None:
            self.notify("write_failed", {"op": op, "errno": getattr(exc, "errno", None),
                                         "durable_seq": self._durable_seq, "error": str(exc)})

    def _fail(self, op: str, exc: OSError):
        self._record_failure(op, exc)
        self._reported = True
        raise LogIOError(self.path, op, exc, f"events after seq {self._durable_seq} may be lost; "
                                             "reopen the log") from exc

    def _wait_synced(self) -> None:
        """Background: wait until everything handed to the thread is written and fsynced."""
        end = self._end
        self._syncer.wait(lambda: self._synced_end >= end, None)  # type: ignore[union-attr]
        if self._failure is not None:
            self._refuse()

    def _stamp(self) -> None:
        """Record out of band that every byte so far is synced (``format.SyncStamp``)."""
        if self._layer is None or self._end != self._synced_end:
            return
        stamp = SyncStamp(log_id=self.header.log_id, size=self._synced_end, next_seq=self._next_seq,
                          chain=self._head)
        try:
            self._layer.write_stamp(self._file, encode_stamp(stamp))
        except OSError as exc:
            self._fail("stamp", exc)
