"""The durable event log: an append-only file of checksummed, hash-chained records.

    Ledger command ─► validate ─► EventLog.append(seq, event) ─► fold
                                   │ encode into the open batch (no I/O)
                                   │ StepSealed (per_step) / every event (per_event):
                                   └► seal the batch record ─► write ─► fsync ─► durable_seq
                                      (inline, or in the background writer thread)

``EventLog.append`` has the signature of a ``Ledger`` sink. Events are encoded
into an in-memory batch as they arrive; the batch becomes one record and is
written and fsynced when the policy says so (group commit):

    "per_step"   (default) when a ``StepSealed`` is appended
    "per_event"  after every event
    "none"       only on ``sync()`` / ``close()`` (and writes, unsynced, past 4 MiB)

``durable_seq`` is the highest seq known to be on stable storage (-1: none);
nothing at or below it is lost by a crash.

Inline (the default): the append that commits writes and fsyncs before it
returns, so ``seal_step`` returns a durable step. A failed write or fsync raises
``LogIOError`` from that append (the command fails, the ledger state is
unchanged) and closes the log to appends: the bytes after the last durable
point are unknown, and nothing is ever appended after an unknown region.

Background (``background=True``): the committing append hands the sealed
records to a writer thread and returns; the thread waits a millisecond for more
steps to join, writes them, fsyncs once for all of them and advances
``durable_seq`` (group commit). Folding the next steps overlaps the write and
fsync of the last ones. ``wait_durable(seq)`` and ``sync()`` block until an
event is durable. A write or fsync failure in the thread surfaces as
``LogIOError`` from the next append, ``sync``, ``wait_durable`` or ``close``,
and the log refuses appends from then on; events after ``durable_seq`` were
never acknowledged and may be lost.

Reopen the log to continue after a failure; open truncates a torn tail and
refuses corruption (see ``codec`` for the format and how the two are told apart).

All methods block on file I/O; async callers use ``anyio.to_thread.run_sync``.
The log does not log (``kvledger.durable`` does).
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time

import msgspec

from ..errors import InvalidArgumentError, LogError, TornLogError
from .format import (
    HEADER_SIZE,
    KIND_CHECKPOINT,
    KIND_CLOSE,
    KIND_EVENTS,
    PREFIX,
    PREFIX_SIZE,
    RECORD_MAGIC,
    Checkpoint,
    LogHeader,
    Scan,
    decode_header,
    encode_header,
    max_event_bytes,
    max_record_bytes,
    new_chain,
    scan,
    seal_record,
)
from ..errors import LogClosedError, LogIOError, RecordTooLargeError
from ..events.events import EVENT_TYPES, Geometry, StepSealed
from .files import default_layer, release_buffer
from .reader import LogView

__all__ = ["EventLog", "LogStatistics", "FSYNC_POLICIES"]

FSYNC_POLICIES = ("per_step", "per_event", "none")
_BATCH_BYTES = 1 << 20  # close an events record past this size
_FLUSH_BYTES = 4 << 20  # write (without fsync) past this much buffered
_GROUP_DELAY = 0.001  # background: how long a woken writer waits for more steps to join its fsync
_EVENT_TYPES = frozenset(EVENT_TYPES)
_SYNC_TYPES = {1: frozenset((StepSealed,)), 2: _EVENT_TYPES, 0: frozenset()}  # per policy code: commit after these
_BATCH_HEAD = bytes(PREFIX_SIZE + 5)  # prefix + array32 header, filled in when the batch is sealed
_COUNT = struct.Struct(">I")
_POLICY_CODES = {"per_step": 1, "per_event": 2, "none": 0}


class LogStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    events: int  # events in the log (= the next seq)
    durable_seq: int
    appended: int  # events appended by this handle
    records: int  # records written by this handle
    bytes_written: int
    syncs: int
    checkpoints: int
    size: int  # file size, buffered bytes excluded


def _check_fsync(fsync: str) -> int:
    code = _POLICY_CODES.get(fsync) if type(fsync) is str else None
    if code is None:
        raise InvalidArgumentError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
    return code


class EventLog:
    """An open, appendable event log. Build it with ``create`` or ``open``.

    After ``open``, ``recovery`` is the ``Scan`` of what was found (records,
    torn tail, whether it had been closed cleanly) and ``loaded`` what the
    ``loader`` built from the verified records.
    """

    __slots__ = (
        "fsync", "background", "path", "header", "recovery", "loaded", "notify",
        "_sync_types", "_handle", "_enc", "_encode_into", "_event_cap", "_record_cap", "_buf", "_batch_at",
        "_batch_seq", "_chain", "_end", "_size", "_synced_end", "_next_seq", "_start_seq", "_durable_seq", "_ok",
        "_failure", "_failed_op", "_reported", "_closed", "_records", "_bytes", "_syncs", "_checkpoints",
        "_checkpoint_seq",
        "_q", "_thread", "_written_seq",
    )

    def __init__(self, handle, header: LogHeader, *, fsync: str, size: int, next_seq: int, chain,
                 background: bool = False) -> None:
        code = _check_fsync(fsync)
        self.fsync = fsync
        self._sync_types = _SYNC_TYPES[code]
        self.background = bool(background)
        self.path = handle.path
        self.header = header
        self.notify = None  # notify(name, fields): how the log tells its owner what happened
        self._handle = handle
        self._enc = msgspec.msgpack.Encoder()
        self._encode_into = self._enc.encode_into
        self._event_cap = max_event_bytes(header.geometry.num_pages)
        self._record_cap = max_record_bytes(header.geometry.num_pages)
        self._buf = bytearray()
        self._batch_at = -1
        self._batch_seq = 0
        self._chain = chain
        self._end = size  # end of everything handed over (written, or queued for the writer thread)
        self._size = size  # bytes written to the file
        self._synced_end = size  # bytes known to be on stable storage
        self._next_seq = next_seq
        self._start_seq = next_seq
        self._durable_seq = next_seq - 1
        self._written_seq = next_seq - 1  # highest seq in bytes handed to the file
        self._ok = True  # open and not failed: the one flag the hot path reads
        self._failure: BaseException | None = None  # the OSError that stopped the log
        self._failed_op = ""
        self._reported = False
        self._closed = False
        self._records = self._bytes = self._syncs = self._checkpoints = 0
        self._checkpoint_seq = -1
        self.recovery: Scan | None = None
        self.loaded = None
        self._q = None
        if self.background:
            self._q = queue.SimpleQueue()  # (bytes or None, last seq, fsync?, Event or None); None stops
            self._thread = threading.Thread(target=self._syncer, name="kvledger-log-fsync", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, path, geometry: Geometry, *, policy: str = "released_aliases", fsync: str = "per_step",
               background: bool = False, layer=None, log_id: bytes | None = None) -> EventLog:
        """Create a new log holding only its header, atomically and durably.

        Raises ``LogExistsError`` if ``path`` exists, ``LogIOError`` if the file
        cannot be written (nothing is left at ``path`` then).
        """
        _check_fsync(fsync)
        if not isinstance(geometry, Geometry):
            raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
        layer = layer if layer is not None else default_layer
        path = os.fspath(path)
        header_bytes = encode_header(geometry, policy, log_id if log_id is not None else os.urandom(16))
        try:
            handle = layer.create(path, header_bytes)
        except LogError:
            raise
        except OSError as exc:
            raise LogIOError(path, "create", exc) from exc
        chain = new_chain(header_bytes[12:28])
        chain.update(header_bytes)
        return cls(handle, decode_header(header_bytes, path), fsync=fsync, size=HEADER_SIZE, next_seq=0,
                   chain=chain, background=background)

    @classmethod
    def open(cls, path, *, fsync: str = "per_step", background: bool = False, layer=None, repair: bool = True,
             loader=None) -> EventLog:
        """Open an existing log for appending: verify it, repair a torn tail, fsync.

        ``loader(view)``, if given, runs on the verified records before anything
        is changed on disk (the ledger rebuilds its state there); its result is
        ``self.loaded``. If it raises, the file is left exactly as it was.

        Raises ``CorruptLogError`` (offset and seq of the first bad record; the
        file is untouched), ``LogVersionError``, ``LogLockedError``,
        ``TornLogError`` (``repair=False`` and the tail is torn), ``LogIOError``.
        A torn tail is truncated and made durable before anything is appended;
        ``recovery`` (the ``Scan``) reports it.
        """
        _check_fsync(fsync)
        layer = layer if layer is not None else default_layer
        path = os.fspath(path)
        try:
            handle = layer.open(path)
        except LogError:
            raise
        except FileNotFoundError:
            raise LogError(f"{path}: no such log") from None
        except OSError as exc:
            raise LogIOError(path, "open", exc) from exc
        try:
            try:
                buf = handle.read()
            except OSError as exc:
                raise LogIOError(path, "read", exc) from exc
            view = None
            try:
                res = scan(buf, path)
                res.raise_error()
                if res.torn_at is not None and not repair:
                    raise TornLogError(path, res.torn_at, res.torn_bytes)
                loaded = None
                if loader is not None:
                    view = LogView(buf, res, path)
                    loaded = loader(view)
            finally:
                if view is not None:
                    view.close()
                else:
                    release_buffer(buf)
            if res.torn_at is not None:
                try:
                    handle.truncate(res.end)
                except OSError as exc:
                    raise LogIOError(path, "truncate", exc) from exc
            try:
                handle.sync()  # what we read may sit only in the page cache
            except OSError as exc:
                raise LogIOError(path, "fsync", exc) from exc
        except BaseException:
            handle.close()
            raise
        log = cls(handle, res.header, fsync=fsync, size=res.end, next_seq=res.next_seq, chain=res.chain,
                  background=background)
        log.recovery = res
        log.loaded = loaded
        return log

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
            checkpoints=self._checkpoints, size=self._size,
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
            raise RecordTooLargeError(f"checkpoint at seq {seq} is {len(payload)} bytes, the limit is {self._record_cap}")
        if self._batch_at >= 0:
            self._finish_batch()
        self._add_record(KIND_CHECKPOINT, seq, payload)
        self._checkpoints += 1
        self._checkpoint_seq = seq

    def sync(self) -> None:
        """Write and fsync everything appended so far and wait for it: afterwards
        ``durable_seq == seq - 1``. Raises ``LogIOError`` / ``LogClosedError``."""
        if self._failure is not None or self._closed:
            self._refuse()
        self._commit()
        if self.background:
            self._wait_synced(None)

    def wait_durable(self, seq: int, timeout: float | None = None) -> bool:
        """Block until event ``seq`` is durable (True), or ``timeout`` passes or the
        event is still in an uncommitted batch (False). Raises ``LogIOError`` if an
        fsync failed before ``seq`` became durable. Inline logs answer at once.
        """
        if self._durable_seq >= seq:
            return True
        if self._failure is not None:
            self._refuse()
        if not self.background or seq >= self._next_seq or self._batch_at >= 0 and seq >= self._batch_seq:
            return False
        return self._wait_synced(timeout) and self._durable_seq >= seq

    def close(self) -> None:
        """Sync, append a close record (it proves the whole file synced), sync, release the file.

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
                    self._wait_synced(None)  # the close record claims everything before it synced
                self._add_record(KIND_CLOSE, self._next_seq, b"")
                self._commit()
                if self.background:
                    self._wait_synced(None)
            elif not self._reported:
                self._refuse()
        finally:
            self._closed = True
            self._ok = False
            self._stop_syncer()
            self._handle.close()

    def abandon(self) -> None:
        """Release the file without writing anything more (a failed open built on this log)."""
        if self._closed:
            return
        self._closed = True
        self._ok = False
        self._stop_syncer()
        self._handle.close()

    def _stop_syncer(self) -> None:
        if self.background and self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

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
        seal_record(buf, start, self._chain)
        self._batch_at = -1
        self._records += 1

    def _add_record(self, kind: int, seq: int, payload: bytes) -> None:
        buf = self._buf
        start = len(buf)
        buf += PREFIX.pack(RECORD_MAGIC, kind, 0, len(payload), seq, 0, self._synced_end)
        buf += payload
        seal_record(buf, start, self._chain)
        self._records += 1

    def _commit(self) -> None:
        """Seal the open batch; write and fsync everything sealed (inline) or queue it (background)."""
        if self._batch_at >= 0:
            self._finish_batch()
        self._hand_off(True)

    def _hand_off(self, sync: bool) -> None:
        """Write what is sealed, then fsync it: here (inline), or in the background thread."""
        buf = self._buf
        if self.background:
            if buf:
                self._buf = bytearray()
                self._end += len(buf)
                self._written_seq = self._next_seq - 1  # (buf held only sealed records)
            elif not sync:
                return
            self._q.put((buf or None, self._written_seq, sync, None))
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

    def _fail(self, op: str, exc: OSError):
        self._failure = exc
        self._failed_op = op
        self._ok = False
        self._reported = True
        if self.notify is not None:
            self.notify("write_failed", {"op": op, "errno": exc.errno, "durable_seq": self._durable_seq,
                                         "error": str(exc)})
        raise LogIOError(self.path, op, exc, f"events after seq {self._durable_seq} may be lost; reopen the log") from exc

    def _wait_synced(self, timeout: float | None) -> bool:
        """Background: wait until everything handed to the thread is written and fsynced."""
        done = threading.Event()
        self._q.put((None, self._written_seq, True, done))
        ok = done.wait(timeout)
        if self._failure is not None:
            self._refuse()
        return ok

    def _syncer(self) -> None:
        """The background thread: write what was handed over, fsync, publish, repeat.

        Hand-offs that queue up while it writes or fsyncs are served by the next
        round: one fsync for all of them (group commit). It runs little Python:
        the caller's thread holds the GIL most of the time, and the thread lets
        go of it inside every write and fsync.
        """
        q, handle = self._q, self._handle
        while True:
            item = q.get()
            if item is None:
                return
            if item[3] is None:
                time.sleep(_GROUP_DELAY)  # let the steps of the next millisecond join this fsync
            waiters = []
            want = False
            seq = -1
            op = "write"
            try:
                while True:
                    data, last, sync, done = item
                    if data is not None:
                        handle.write(data)
                        self._size += len(data)
                        self._bytes += len(data)
                    if sync:
                        want = True
                    if last > seq:
                        seq = last
                    if done is not None:
                        waiters.append(done)
                    if q.empty():
                        break
                    item = q.get()
                    if item is None:
                        q.put(None)  # stop after this round
                        break
                if want:
                    op = "fsync"
                    handle.sync()
            except OSError as exc:
                self._failed_op = op
                self._failure = exc
                self._ok = False
                if self.notify is not None:
                    self.notify("write_failed", {"op": op, "errno": exc.errno,
                                                 "durable_seq": self._durable_seq, "error": str(exc)})
                for w in waiters:
                    w.set()
                while True:  # release later waiters too, write nothing more, stop when told
                    item = q.get()
                    if item is None:
                        return
                    if item[3] is not None:
                        item[3].set()
            if want:
                self._syncs += 1
                self._synced_end = self._size
                if seq > self._durable_seq:
                    self._durable_seq = seq
            for w in waiters:
                w.set()
