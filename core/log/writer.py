"""The durable event log: an append-only file (or directory) of checksummed, hash-chained records.

One piece: ``EventLog`` is one cohesive class, the appender's face of a log and its
state machine (open, then failed or closed); its parts are the objects listed
below, each in its own module, and nothing here reaches into them.

    Ledger command ─► validate ─► EventLog.append(seq, event) ─► fold
                                   │ the event object joins the open batch (no I/O, no encoding)
                                   │ StepSealed (per step) / every event (per_event) / a full batch:
                                   └► hand_off ─► seal (encode, chain, CRC) ─► write ─► fsync ─► durable_seq
                                      (in the background writer thread, or inline)

``EventLog`` is the appender's face of a log, made of four objects:

    Batch        (batch.py)       the open batch and the records queued behind it
    Inline /     (durability.py)  one ``hand_off`` interface; owns the live segment,
    Background                    durable_seq, the failure and the writer thread
    LiveSegment  (live.py)        the file appends go to: seal, write, sync, stamp, successor
    LogDirectory (directory.py)   a directory's lock, its roll to the next segment, retention

An ``EventLog`` is a ``Journal`` (``core/journal.py``): a ``Ledger`` given one as its sink
appends each event it folds to ``events`` (the open batch) itself while the event's seq
is below ``due``, and hands the others to ``put`` (``sink``), which runs the gate first
when it is due (a checkpoint the owner asked for with ``call_at``, a full batch, a roll, a
failure or a close: ``due`` follows them), measures an event whose fields may be
unbounded, and commits when the policy says so (every ``StepSealed``: a ledger hands
its seals to ``put``; every event under ``"per_event"``, where ``due`` stays -1).
``append`` is the same for an owner that did not validate its events. The policy says
when the batch is handed off and fsynced (group commit):

    "background" (default) a ``StepSealed`` hands the step's events to the writer
                 thread and returns at once; the thread encodes, writes and fsyncs,
                 one fsync for every step sealed meanwhile
    "per_step"   inline: the ``StepSealed`` append writes and fsyncs before it returns
    "per_event"  inline, after every event
    "none"       only on ``sync()`` / ``close()`` (a full batch is written, unsynced)

and under every policy a batch of ``BATCH_EVENTS`` events is handed off even
when no step is sealed (fsynced, except under ``"none"``).

``durable_seq`` is the highest seq known to be on stable storage (-1: none);
nothing at or below it is lost by a crash, and a crash loses at most the events
after it (reopening reports the torn tail). ``sync()`` / ``flush()`` write,
fsync, stamp and wait; ``wait_durable(seq)`` waits for the writer thread to
reach an event, and ``wait_durable_async(seq)`` does the same without blocking
an event loop. Durability never slows the step by default; waiting for it is
opt-in.

Back-pressure: with the writer thread, an append that hands off a batch while
more than ``max_lag_bytes`` (default 64 MiB, estimated: payloads exactly,
events at their average encoded size) are handed off and not yet written and
synced blocks until the thread catches up below that bound. The thread does
every hand-off whatever the policy, so the wait always ends, and memory never
grows without limit, whether steps are sealed or not.

Segments (a log directory): when the live segment passes ``segment_bytes``,
``rotation_due`` turns True and the owner hands a checkpoint to ``rotate``: one
call, queued like any hand-off (the writer thread rolls; inline, the call
does). The new segment is created with its checkpoint in one atomic, durable
step (``directory.py``).

Failures: a failed write, fsync, roll or stamp closes the log to appends (the
bytes after the last durable point are unknown, and nothing is ever appended
after an unknown region). Inline, the append that committed raises
``LogIOError`` (the command fails, the ledger state is unchanged). In the
background, the failure surfaces as ``LogIOError`` from the next append,
``sync``, ``wait_durable`` or ``close``; events after ``durable_seq`` were
never acknowledged and may be lost. Reopen the log to continue: open truncates
a torn tail and refuses corruption (``format.py`` says how the two are told
apart).

A log dropped without ``close()`` is not leaked: a finalizer (as for files)
warns with ``ResourceWarning``, lets the writer thread finish what was handed
off, and gives back the thread, the file and the lock. Events still in the open
batch are lost, as with ``abandon()``.

All methods block on file I/O, and one thread appends at a time (async callers
use ``anyio.to_thread.run_sync``; ``wait_durable`` may be called from any
thread). The log does not log (``kvledger.durable`` does, through ``notify``).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable

import msgspec

from ..errors import InvalidArgumentError, LogClosedError, LogError, LogIOError, RecordTooLargeError
from ..events.events import Geometry
from ..journal import Journal
from .batch import FLUSH, ROLL, Batch
from .directory import segment_options
from .durability import Background, Durability, Inline
from .files import default_layer
from .format import (
    DEFAULT_MAX_PAGES,
    KIND_CHECKPOINT,
    KIND_CLOSE,
    RECORD_OVERHEAD,
    SEGMENT_HEADER_SIZE,
    Checkpoint,
    max_event_bytes,
    max_record_bytes,
)
from .opening import Opened, create_log, open_log
from .policy import (
    APPENDABLE,
    BATCH_EVENTS,
    DEFAULT_MAX_LAG_BYTES,
    FSYNC_POLICIES,
    SIZE_RISKS,
    TENANT_CHARS,
    TENANT_TYPES,
    LogStatistics,
    policy_mode,
)
from .scan import Scan

__all__ = ["DEFAULT_MAX_LAG_BYTES", "FSYNC_POLICIES", "EventLog", "LogStatistics"]

_MEASURE, _COMMIT, _TENANT = 1, 2, 4  # what sink must do after appending an event of a type (EventLog._kinds)


def _check_lag(max_lag_bytes) -> None:
    if type(max_lag_bytes) is not int or max_lag_bytes < 1:
        raise InvalidArgumentError(f"max_lag_bytes must be a positive int, got {max_lag_bytes!r}")


def _unclosed(durability: Durability, path: str) -> None:
    """The finalizer of a log dropped without ``close()`` (see the module docstring)."""
    warnings.warn(f"kvledger log {path} was never closed: its writer thread, file and lock are released now; "
                  "events not handed off are lost", ResourceWarning, stacklevel=2)
    durability.abandon()


class EventLog(Journal):
    """An open, appendable event log. Build it with ``create`` or ``open``.

    After ``open``, ``recovery`` is the ``Scan`` of what was found (records,
    torn tail, whether it had been closed cleanly) and ``loaded`` what the
    ``loader`` built from the verified records.
    """

    __slots__ = ("fsync", "background", "path", "header", "recovery", "loaded", "notify", "max_lag_bytes",
                 "rotation_due", "_sync_types", "_cap_sync", "_batch", "events", "_durability", "_directory",
                 "_enc", "_event_cap", "_record_cap", "_ok", "_closed", "_reported", "_start_seq",
                 "_checkpoints", "_checkpoint_seq", "_stalls", "_segment", "_segment_size", "_finalizer", "due",
                 "_owner_due", "_when_due", "_kinds", "_put_each", "__weakref__")

    def __init__(self, opened: Opened, *, path: str, layer, fsync: str = "background",
                 background: bool | None = None, max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES) -> None:
        self._sync_types, bg = policy_mode(fsync, background)
        _check_lag(max_lag_bytes)
        live = opened.live
        self.fsync = fsync
        self.background = bg
        self.max_lag_bytes = max_lag_bytes
        self.path = path
        self.header = live.header
        self.recovery: Scan | None = opened.recovery
        self.loaded = opened.loaded
        self.notify: Callable[[str, dict], object] | None = None  # how the log tells its owner what happened
        self.rotation_due = False  # a log directory's live segment reached segment_bytes: rotate()
        # the one gate: before appending event ``due`` or later, _gate runs (the log failed or closed,
        # the batch is full, the owner's call_at is due, a roll is due); _reset_due recomputes it. A
        # ledger appends events below it to ``events`` itself (the Journal face).
        self._owner_due = 1 << 62
        self._put_each = self._sync_types == APPENDABLE  # ("per_event": every event commits, through put)
        self.due = -1 if self._put_each else BATCH_EVENTS + opened.next_seq
        self._when_due: Callable[[int], object] | None = None
        self._cap_sync = bool(self._sync_types)  # a full batch is fsynced too (all policies but "none")
        self._kinds = {t: (_MEASURE if t in SIZE_RISKS else 0) | (_COMMIT if t in self._sync_types else 0)
                       for t in APPENDABLE}
        for t in TENANT_TYPES:
            if self._kinds[t] == _MEASURE:
                self._kinds[t] = _TENANT
        self._batch = Batch(opened.next_seq)
        self.events: list = self._batch.events  # the open batch (one list: Batch copies out of it)
        self._directory = opened.directory
        self._segment = live.index  # the segment appends go to once every roll asked for is done
        self._segment_size = float(live.size)  # its size once everything handed off is written (estimated)
        self._enc = msgspec.msgpack.Encoder()
        self._event_cap = max_event_bytes(self.header.geometry.num_pages)
        self._record_cap = max_record_bytes(self.header.geometry.num_pages)
        self._ok = True  # open and not failed (the hot path reads due, which follows it)
        self._closed = self._reported = False
        self._start_seq = opened.next_seq
        self._checkpoints = self._stalls = 0
        self._checkpoint_seq = -1
        kind = Background if bg else Inline
        self._durability: Durability = kind(live, layer, opened.directory, opened.next_seq,
                                            on_failure=weakref.WeakMethod(self._writer_failed))
        self._finalizer = weakref.finalize(self, _unclosed, self._durability, path)

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, path, geometry: Geometry, *, policy: str = "released_aliases", fsync: str = "background",
               background: bool | None = None, layer=None, log_id: bytes | None = None,
               max_pages: int = DEFAULT_MAX_PAGES, max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES,
               segment_bytes: int | None = None, retain_bytes: int | None = None,
               retain_segments: int | None = None) -> EventLog:
        """Create a new log holding only its header, atomically and durably (``opening.create_log``).

        ``segment_bytes``: make ``path`` a log directory of segments of about that
        size, with the retention bounds ``retain_bytes`` / ``retain_segments``
        (oldest segments deleted past them); otherwise one file. Raises
        ``InvalidArgumentError`` for bad options (nothing created),
        ``LogExistsError``, ``LogError``, ``LogIOError``.
        """
        segs = segment_options(segment_bytes, retain_bytes, retain_segments)
        policy_mode(fsync, background)
        _check_lag(max_lag_bytes)
        layer = layer if layer is not None else default_layer
        path = os.fspath(path)
        opened = create_log(path, geometry, policy=policy, layer=layer, log_id=log_id, max_pages=max_pages,
                            segments=segs)
        return cls._build(opened, path, layer, fsync, background, max_lag_bytes)

    @classmethod
    def open(cls, path, *, fsync: str = "background", background: bool | None = None, layer=None,
             repair: bool = True, loader=None, max_pages: int = DEFAULT_MAX_PAGES,
             max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES, segment_bytes: int | None = None,
             retain_bytes: int | None = None, retain_segments: int | None = None) -> EventLog:
        """Open an existing log for appending (``opening.open_log`` has the details and what it raises).

        A directory is reopened as one (segments of ``segment_bytes``, default 64 MiB)."""
        policy_mode(fsync, background)
        _check_lag(max_lag_bytes)
        segs = segment_options(segment_bytes or 64 << 20, retain_bytes, retain_segments)
        layer = layer if layer is not None else default_layer
        path = os.fspath(path)
        opened = open_log(path, layer=layer, repair=repair, loader=loader, max_pages=max_pages, segments=segs)
        return cls._build(opened, path, layer, fsync, background, max_lag_bytes)

    @classmethod
    def _build(cls, opened: Opened, path: str, layer, fsync: str, background: bool | None,
               max_lag_bytes: int) -> EventLog:
        try:
            return cls(opened, path=path, layer=layer, fsync=fsync, background=background,
                       max_lag_bytes=max_lag_bytes)
        except BaseException:
            opened.live.close()
            if opened.directory is not None:
                opened.directory.release()
            raise

    # ------------------------------------------------------------------ state

    @property
    def seq(self) -> int:
        """The seq the next appended event must carry (= events in the log)."""
        return self._batch.next_seq

    @property
    def durable_seq(self) -> int:
        """Highest seq known to be on stable storage; -1 when none is."""
        return self._durability.durable_seq

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        return self._durability.failure is not None

    @property
    def segment(self) -> int:
        """The index of the segment appends go to (once the rolls asked for are done; 0: a file)."""
        return self._segment

    @property
    def segment_bytes(self) -> int | None:
        return None if self._directory is None else self._directory.segment_bytes

    @property
    def retain_bytes(self) -> int | None:
        return None if self._directory is None else self._directory.retain_bytes

    @property
    def retain_segments(self) -> int | None:
        return None if self._directory is None else self._directory.retain_segments

    @property
    def segments_deleted(self) -> int:
        """Segments retention deleted so far (the writer thread may still be deleting more)."""
        return 0 if self._directory is None else self._directory.deleted

    @property
    def may_block(self) -> bool:
        """Whether the next append could wait for the disk: always inline (a commit writes and
        fsyncs); with the writer thread, while back-pressure is near (what was handed off and not
        yet done, plus the open batch, passes half of ``max_lag_bytes``)."""
        d = self._durability
        if not d.background:
            return True
        return 2 * (d.lag + len(self.events) * d.event_bytes) > self.max_lag_bytes

    def statistics(self) -> LogStatistics:
        d = self._durability
        seq = self.seq
        return LogStatistics(
            events=seq, durable_seq=d.durable_seq, appended=seq - self._start_seq, records=d.records,
            bytes_written=d.bytes_written, syncs=d.syncs, checkpoints=self._checkpoints, size=d.size,
            lag_bytes=d.lag_bytes(), stalls=self._stalls,
        )

    def _refuse(self, report: bool = True) -> None:
        """Raise why the log takes no appends: the failure itself once, then LogClosedError.

        ``report=False`` never counts as the report (for calls whose caller may not pass it on).
        """
        d = self._durability
        if d.failure is not None:
            if not self._reported and report:
                self._reported = True
                raise LogIOError(self.path, d.failed_op, d.failure,
                                 f"events after seq {d.durable_seq} may be lost; reopen the log")
            raise LogClosedError(f"{self.path}: the log stopped taking appends after a failure "
                                 f"({d.failed_op}: {d.failure}); reopen it")
        raise LogClosedError(f"{self.path}: the log is closed")

    def _writer_failed(self, op: str, exc: BaseException) -> None:
        """The writer side failed (any thread): no more appends; tell the owner."""
        self._ok = False
        self.due = -1
        if self.notify is not None:
            self.notify("write_failed", {"op": op, "errno": getattr(exc, "errno", None),
                                         "durable_seq": self._durability.durable_seq, "error": str(exc)})

    # ------------------------------------------------------------------ appends

    def append(self, seq: int, event) -> None:
        """Append ``event`` as ``seq``. Durable per the fsync policy.

        Raises ``LogError`` (wrong seq), ``InvalidArgumentError`` (not an event),
        ``RecordTooLargeError`` (nothing changed), ``LogClosedError``, or
        ``LogIOError`` for a failed write/fsync (the log then refuses all
        appends; reopen it). In every case the event is not in the log's
        durable future: a ``Ledger`` does not fold it.
        """
        if not self._ok:
            self._refuse()
        if seq != self._batch.next_seq:
            raise LogError(f"{self.path}: append of seq {seq}, the log expects seq {self._batch.next_seq}")
        if type(event) not in APPENDABLE:
            raise InvalidArgumentError(f"not a kvledger event: {type(event).__name__}")
        self._check_size(seq, event)  # (unvalidated events: page lists of any length)
        self.put(seq, event)

    def put(self, seq: int, event) -> None:
        """``append`` for an owner that hands only validated kvledger events, in seq order (the
        ``Journal`` face: a ``Ledger``'s events at or past ``due``, its seals, its publishes). No
        seq or type check; only the events whose fields a validation leaves unbounded are measured
        (``policy.SIZE_RISKS``); the owner's ``call_at`` callback runs first when it is due. Raises
        as ``append``."""
        if seq >= self.due:
            self._gate(seq)
        self.events.append(event)
        kind = self._kinds[type(event)]  # one lookup: 0, _TENANT, or _MEASURE | _COMMIT
        if kind:
            if kind != _TENANT:
                self._sink_more(seq, event, kind)
            elif event.tenant is not None and len(event.tenant) > TENANT_CHARS:  # (the commonest event)
                self._sink_more(seq, event, _MEASURE)

    sink = put  # (the name of a ``Ledger`` sink)

    def _gate(self, seq: int) -> None:
        """What must happen before event ``seq`` is appended (see ``due``), rarely anything."""
        if not self._ok:
            self._refuse()
        if len(self.events) >= BATCH_EVENTS:
            self._commit(self._cap_sync)
        if self._when_due is not None and (seq >= self._owner_due or self.rotation_due):
            self._when_due(seq)
        self._reset_due()

    def _reset_due(self) -> None:
        if not self._ok or self._put_each:
            self.due = -1
        elif self.rotation_due and self._when_due is not None:
            self.due = -1  # (the owner is told before the next append)
        else:
            self.due = min(self._owner_due, self._batch.first_seq + BATCH_EVENTS)

    def _sink_more(self, seq: int, event, kind: int) -> None:
        """The rare part of ``sink``: measure an event whose fields may be unbounded (taking it back
        out of the batch if it is too large), then commit when the policy says so."""
        if kind & _MEASURE and SIZE_RISKS[type(event)](event):
            try:
                self._check_size(seq, event)
            except RecordTooLargeError:
                self.events.pop()
                raise
        if kind & _COMMIT:
            self._commit(True)

    def call_at(self, seq: int, when_due: Callable[[int], object]) -> None:
        """Have ``sink`` call ``when_due(seq)`` before it appends event ``seq`` or any later one (the
        owner's checkpoint schedule), and before the next append whenever a segment roll is due
        (``rotation_due``: the owner answers with ``rotate``). One schedule at a time."""
        self._owner_due = seq
        self._when_due = when_due
        self._reset_due()

    def _check_size(self, seq: int, event) -> None:
        size = len(self._enc.encode(event))
        if size > self._event_cap:
            raise RecordTooLargeError(f"event {type(event).__name__} at seq {seq} encodes to {size} bytes, "
                                      f"more than {self._event_cap}")

    @property
    def checkpoint_seq(self) -> int:
        """Seq of the last checkpoint this handle appended (-1: none)."""
        return self._checkpoint_seq

    def _checkpoint_payload(self, seq: int, digest: str, state: bytes, report: bool) -> bytes:
        if not self._ok or self._closed:
            self._refuse(report=report)
        if seq != self._batch.next_seq:
            raise LogError(f"{self.path}: checkpoint at seq {seq}, the log is at seq {self._batch.next_seq}")
        payload = self._enc.encode(Checkpoint(seq=seq, digest=digest, state=state))
        if len(payload) > self._record_cap:
            raise RecordTooLargeError(f"checkpoint at seq {seq} is {len(payload)} bytes, "
                                      f"the limit is {self._record_cap}")
        return payload

    def checkpoint(self, seq: int, digest: str, state: bytes) -> None:
        """Append a checkpoint of the state after ``seq`` events (no I/O until the next commit).

        Raises ``LogError`` unless ``seq`` equals ``self.seq``, ``RecordTooLargeError``
        (nothing changed), ``LogClosedError``.
        """
        payload = self._checkpoint_payload(seq, digest, state, False)
        self._batch.add_record(KIND_CHECKPOINT, seq, payload)
        self._checkpoints += 1
        self._checkpoint_seq = seq

    def rotate(self, seq: int, digest: str, state: bytes) -> None:
        """A log directory: roll to the next segment, which opens with this checkpoint of the state
        after ``seq`` events. Queued with what came before it (the writer thread rolls; inline, this
        call does). Raises ``LogError`` for a single-file log or a wrong seq, ``RecordTooLargeError``,
        ``LogClosedError``, ``LogIOError`` (inline)."""
        if self._directory is None:
            raise LogError(f"{self.path}: a single-file log has no segments to rotate")
        payload = self._checkpoint_payload(seq, digest, state, True)
        self._batch.add_record(ROLL, seq, payload)
        self._segment += 1
        self._checkpoints += 1
        self._checkpoint_seq = seq
        self._commit(True)
        self._segment_size = float(SEGMENT_HEADER_SIZE + RECORD_OVERHEAD + len(payload))
        self.rotation_due = False
        self._reset_due()

    # ------------------------------------------------------------------ durability

    def sync(self) -> None:
        """Write and fsync everything appended so far, wait for it, and stamp the log:
        afterwards ``durable_seq == seq - 1``. Raises ``LogIOError`` / ``LogClosedError``."""
        if not self._ok or self._closed:
            self._refuse()
        self._commit(True, stamp=True)
        if not self._durability.wait_done():
            self._refuse()

    flush = sync

    def wait_durable(self, seq: int, timeout: float | None = None) -> bool:
        """Block until event ``seq`` is durable (True), or ``timeout`` passes (False).

        Never writes: an event still in the open batch becomes durable when its
        step is sealed (or at ``sync``). Answers False at once for an inline log
        (whose durable point moves only in the appender's own calls) or a closed
        one. Raises ``LogIOError`` if the writer failed before ``seq`` was durable.
        Any thread may call it.
        """
        d = self._durability
        if d.durable_seq >= seq:
            return True
        if d.failure is not None:
            self._refuse()
        if not d.background or self._closed:
            return False
        ok = d.wait(lambda: d.durable_seq >= seq, timeout)
        if not ok and d.failure is not None:
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
            if self._closed or not self.background:
                if self.durable_seq >= seq:
                    return
                raise LogClosedError(f"{self.path}: seq {seq} is not durable and the log no longer syncs "
                                     f"by itself (closed or inline; durable_seq {self.durable_seq})")

    def close(self) -> None:
        """Write and fsync everything, then a close record (it claims the whole file synced), fsync,
        stamp, release the file.

        Idempotent. After a failure it only releases the file (raising the
        failure if it was never reported). Raises ``LogIOError`` if the final
        writes fail (the file is released anyway).
        """
        if self._closed:
            return
        try:
            if self._durability.failure is None:
                seq = self._batch.next_seq
                self._batch.add_record(FLUSH, seq, b"")
                self._batch.add_record(KIND_CLOSE, seq, b"")
                self._commit(True, stamp=True)
                if not self._durability.wait_done():
                    self._refuse()
            elif not self._reported:
                self._refuse()
        finally:
            self._release()

    def abandon(self) -> None:
        """Release the file without appending anything more (the writer thread finishes what was
        already handed off; the open batch is dropped): what a crash would leave, or a failed open."""
        if not self._closed:
            self._release()

    def _release(self) -> None:
        self._closed = True
        self._ok = False
        self.due = -1
        self._finalizer.detach()
        self._durability.abandon()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _commit(self, sync: bool, stamp: bool = False) -> None:
        """Hand everything queued to the writer side: inline, it is written (and fsynced) before this
        returns; in the background, queued (then back-pressure may wait)."""
        batch = self._batch
        items, events, payload = batch.take()
        if not items and not sync:
            return
        d = self._durability
        estimate = d.estimate(events, payload)
        try:
            d.hand_off(items, batch.first_seq - 1, sync, stamp, estimate)
        except OSError as exc:  # (inline: the durability recorded it; the log takes no more appends)
            self._reported = True
            raise LogIOError(self.path, d.failed_op, exc, f"events after seq {d.durable_seq} may be lost; "
                                                          "reopen the log") from exc
        if d.background and d.lag > self.max_lag_bytes:
            self._stall()
        directory = self._directory
        if directory is not None:  # the live segment's size, exact once the writer caught up, else estimated
            self._segment_size = d.size if d.segment == self._segment and d.lag < 1 else \
                self._segment_size + estimate
            if self._segment_size >= directory.segment_bytes:
                self.rotation_due = True
        self._reset_due()

    def _stall(self) -> None:
        """Back-pressure: wait until no more than ``max_lag_bytes`` are handed off and not yet done."""
        self._stalls += 1
        d = self._durability
        bound = self.max_lag_bytes
        if not d.wait(lambda: d.lag <= bound, None) and d.failure is not None:
            self._refuse()
