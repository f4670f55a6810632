"""A ledger that writes through the durable event log, and reopens to the same state.

    open_ledger(path, geometry)       path missing: create the log (header + seq 0)
    open_ledger(path)                 path exists: verify, rebuild the state from the
                                      last checkpoint + the events after it, repair a
                                      torn tail, continue appending

    command ─► validate ─► log.append (sink) ─► fold ─► [every N events: checkpoint]

A command whose append fails raises and leaves the state unchanged (the sink
runs before the fold). A failed write or fsync closes the log to appends: every
later command raises ``LogClosedError`` and the ledger must be reopened; events
after ``durable_seq`` may be lost then, never events at or below it.

Checkpoints hold ``state.canonical()`` and the state digest after ``seq``
events; they are taken after the fold, so a checkpoint never changes what a
command did. Reopen loads the last one and folds the rest; ``kvledger replay``
folds everything and compares each checkpoint's digest with its own.

Logging: structlog events on the ``kvledger`` logger, never configured here:
``log_created``, ``log_opened``, ``log_truncated`` (warning), ``log_closed``,
``log_write_failed`` (error), ``checkpoint_skipped`` (warning) and, at debug,
``checkpoint_written``, ``step_sealed`` and ``pages_committed`` (commits that
listed marked pages). Whether debug events are emitted is decided once, when the
ledger is opened, from the logger's level.

All methods block on file I/O; async code calls them through
``anyio.to_thread.run_sync``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

import msgspec

from kvledger.core import checks
from kvledger.core.errors import (
    ConfigurationError,
    InvalidArgumentError,
    LogError,
)
from kvledger.core.events.events import CLEAR_POLICIES, ClearPages, Geometry, StepSealed
from kvledger.core.ledger import EventObserver, Ledger
from kvledger.core.log import EventLog, LogView
from kvledger.core.log.files import default_layer
from kvledger.core.log.fold import rebuild_state, without_gc
from kvledger.core.log.segments import unfinished_directory
from kvledger.core.state import LedgerState
from kvledger.logs import Logger, get_logger
from kvledger.options import LOG_FIELDS, LogOptions, log_options_of, split_flat

__all__ = ["DurableLedger", "Recovery", "auto_checkpoint_every", "chain_observers", "open_ledger"]


class Recovery(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What ``open_ledger`` found and did."""

    path: str
    created: bool  # the log did not exist and was created
    events: int  # events in the log after open (= the ledger's seq)
    checkpoint_seq: int | None  # the state was loaded from the checkpoint at this seq
    folded: int  # events folded on top of it
    truncated_at: int | None  # offset of the torn tail that was cut off
    truncated_bytes: int
    lost_events: int | None  # events the torn record held (lost past the last synced point); None: unknown
    closed_cleanly: bool  # the previous writer closed the log (no crash)
    seconds: float


# ---------------------------------------------------------------------- the ledger


def chain_observers(*observers: EventObserver | None) -> EventObserver | None:
    """One ``Ledger`` observer that calls each of ``observers`` (``None`` entries skipped) in order.

    Costs nothing it need not: ``None`` when there is none, the observer itself when
    there is one, one plain function for two, a loop over a tuple beyond that.
    Raises ``InvalidArgumentError`` for an entry that is not callable.
    """
    fns = tuple(fn for fn in observers if fn is not None)
    for fn in fns:
        if not callable(fn):
            raise InvalidArgumentError(f"an observer must be callable(seq, event, effects), got {fn!r}")
    if not fns:
        return None
    if len(fns) == 1:
        return fns[0]
    if len(fns) == 2:
        first, second = fns

        def both(seq: int, event: object, effects: tuple) -> None:
            first(seq, event, effects)
            second(seq, event, effects)

        return both

    def each(seq: int, event: object, effects: tuple) -> None:
        for fn in fns:
            fn(seq, event, effects)

    return each


def auto_checkpoint_every(num_pages: int) -> int:
    """Events between checkpoints for ``checkpoint_every="auto"``: max(10,000, 4 x num_pages)."""
    return max(10_000, 4 * num_pages)


def _debug_enabled(logger) -> bool:
    for name in ("is_enabled_for", "isEnabledFor"):
        fn = getattr(logger, name, None)
        if fn is not None:
            try:
                return bool(fn(logging.DEBUG))
            except Exception:
                return True
    return True


class DurableLedger(Ledger):
    """A ``Ledger`` whose sink is an ``EventLog`` (a ``Journal``): every event is appended before it is folded.

    Built by ``open_ledger``. ``log`` is the ``EventLog``, ``recovery`` what open
    found. ``close()`` (or leaving a ``with`` block) writes a final checkpoint,
    syncs and releases the file; commands afterwards raise ``LogClosedError``.

    Checkpoints: before the event that would fold past ``checkpoint_every``
    events since the last one, the sink appends a checkpoint of the state as it
    is (so a checkpoint never changes what a command did). The ledger decides
    when; the log only writes what it is given. A checkpoint costs O(num_pages)
    (the canonical state and its digest), so ``"auto"`` (the default) takes one
    every max(10,000, 4 x num_pages) events: O(1) per command amortized on any
    cache size, and a reopen or replay starts at most that many events before
    any seq.

    ``observer(seq, event, effects)`` (optional): the caller's ``Ledger`` observer,
    called after the ledger's own debug observer (when debug logging is on) for
    every event folded from now on (a reopened log's replayed events are not
    observed: the state is rebuilt, not re-folded).
    """

    def __init__(self, log: EventLog, *, state: LedgerState | None = None, policy: str = "released_aliases",
                 check: bool = False, checkpoint_every: int | str | None = "auto", logger=None,
                 recovery: Recovery | None = None, observer: EventObserver | None = None) -> None:
        if checkpoint_every == "auto":
            checkpoint_every = auto_checkpoint_every(log.header.geometry.num_pages)
        if checkpoint_every is not None and (type(checkpoint_every) is not int or checkpoint_every < 1):
            raise InvalidArgumentError(f"checkpoint_every must be a positive int, 'auto' or None, "
                                       f"got {checkpoint_every!r}")
        self.log = log
        self.recovery = recovery
        self._every = checkpoint_every
        base = logger if logger is not None else get_logger("kvledger")
        self._logger = base.bind(log=log.path)
        self._debug = _debug_enabled(self._logger)
        self._closed = False
        log.notify = self._notify
        start = log.seq if state is None else state.seq
        self._next_checkpoint = start + checkpoint_every if checkpoint_every else 1 << 62
        log.call_at(self._next_checkpoint, self._when_due)
        own = self._observe if self._debug else None
        super().__init__(log.header.geometry, policy=policy, check=check, sink=log, state=state,
                         observer=chain_observers(own, observer))
        if self.state.seq != log.seq:
            raise ConfigurationError(f"state at seq {self.state.seq} for a log at seq {log.seq}")

    def _when_due(self, seq: int) -> None:
        """The log's ``call_at`` callback, before the event ``seq`` is appended: a checkpoint when one is
        due, or a new segment (which opens with one) when the live segment is full."""
        log = self.log
        if not log.rotation_due:
            self.checkpoint()
            return
        if self._every:
            self._next_checkpoint = self.state.seq + self._every
        log.call_at(self._next_checkpoint, self._when_due)
        seq, digest, state = self._checkpoint_state()
        log.rotate(seq, digest, state)  # (raises LogIOError: the command fails, nothing folded)
        self._logger.info("segment_rotated", seq=seq, segment=log.segment,
                          segments_deleted=log.segments_deleted)

    @property
    def durable_seq(self) -> int:
        """Highest seq on stable storage (-1: none)."""
        return self.log.durable_seq

    @property
    def logger(self):
        """The structlog logger the ledger reports on (bound to the log's path)."""
        return self._logger

    def _checkpoint_state(self) -> tuple:
        st = self.state
        cb = st.canonical_bytes()
        # LedgerState.digest() is BLAKE2b-256 of canonical_bytes(): computed once here (replay re-checks it)
        return st.seq, hashlib.blake2b(cb, digest_size=32).hexdigest(), cb

    def _notify(self, name: str, fields: dict) -> None:
        if name == "write_failed":
            self._logger.error("log_write_failed", seq=self.state.seq, **fields)
        elif self._debug:
            self._logger.debug(name, **fields)

    def _observe(self, seq: int, event, effects: tuple) -> None:
        """Debug events for commits that listed pages and for sealed steps (only when debug is on)."""
        if not effects:
            return
        eff = effects[0]
        if type(eff) is ClearPages:
            self._logger.debug("pages_committed", seq=seq, request=event.request, step=eff.step,
                               listed=list(eff.page_ids))
        elif type(event) is StepSealed:
            self._logger.debug("step_sealed", seq=seq, step=event.step, cleared=len(event.clear_list),
                               durable_seq=self.log.durable_seq)

    def checkpoint(self) -> None:
        """Append a checkpoint of the current state now (durable at the next sync).

        Never fails the caller: skipped when the log is closed or failed (the
        next command reports why) or when the state is too large for a record.
        """
        if self._every:
            self._next_checkpoint = self.state.seq + self._every
            self.log.call_at(self._next_checkpoint, self._when_due)
        if self.log.failed or self.log.closed:
            return
        seq, digest, state = self._checkpoint_state()
        try:
            self.log.checkpoint(seq, digest, state)
        except LogError as exc:
            self._logger.warning("checkpoint_skipped", seq=seq, error=str(exc))
            return
        if self._debug:
            self._logger.debug("checkpoint_written", seq=seq, bytes=len(state))

    def sync(self) -> None:
        """Make every event so far durable (``durable_seq == seq - 1``). Raises ``LogIOError``."""
        self.log.sync()

    flush = sync

    def wait_durable(self, seq: int, timeout: float | None = None) -> bool:
        """Block until event ``seq`` is durable (background logs); see ``EventLog.wait_durable``."""
        return self.log.wait_durable(seq, timeout)

    async def wait_durable_async(self, seq: int) -> None:
        """Wait without blocking the event loop until event ``seq`` is durable (``EventLog.wait_durable_async``)."""
        await self.log.wait_durable_async(seq)

    def close(self) -> None:
        """Checkpoint (if anything changed since the last one), sync, close the log. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            last = self.log.checkpoint_seq
            if self.recovery is not None and self.recovery.checkpoint_seq is not None:
                last = max(last, self.recovery.checkpoint_seq)
            if self._every and self.state.seq > last:
                self.checkpoint()
            self.log.close()
        finally:
            self._logger.info("log_closed", events=self.state.seq, durable_seq=self.log.durable_seq)

    def __enter__(self) -> DurableLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_ledger(path: str | os.PathLike[str], geometry: Geometry | None = None, *, policy: str | None = None,
                check: bool = False, logger: Logger | None = None, observer: EventObserver | None = None,
                log_options: LogOptions | None = None, **flat: object) -> DurableLedger:
    """Open the durable ledger at ``path``, creating the log if it does not exist.

    ``log_options``: how the log writes (``kvledger.options.LogOptions``: fsync,
    checkpoint_every, max_lag_bytes, max_pages, segment_bytes, retain_bytes /
    retain_segments, layer, background). Those as flat keywords
    (``open_ledger(path, g, fsync="per_step")``) still work for one release, with a
    ``DeprecationWarning``.

    Creating needs ``geometry``; ``policy`` defaults to ``"released_aliases"``.
    An existing log keeps its own geometry and policy (giving different ones
    raises ``ConfigurationError``). Opening verifies every record, rebuilds the
    state from the last checkpoint (verified: bytes, digest, invariants) and the
    events after it (each validated, as ``kvledger replay`` does), truncates a torn
    tail (``recovery`` and a ``log_truncated`` warning report it, with the
    events lost when the torn record says) and refuses corruption with
    ``CorruptLogError`` (offset and seq; the file is untouched), including
    damage to what the log's sync stamp proves was synced.
    ``check=True`` runs every invariant after every command (and once on open).

    ``fsync``: ``"background"`` (default: a writer thread group-commits and
    fsyncs; a sealed step is durable once ``durable_seq`` reaches it, which
    ``flush()`` / ``wait_durable`` wait for), or the opt-in inline policies
    ``"per_step"`` / ``"per_event"``, or ``"none"`` (see ``EventLog``).
    ``max_lag_bytes`` bounds what the writer thread may fall behind before
    appends block. ``max_pages`` bounds the geometry a log may claim (what an
    untrusted file can make the reader allocate). ``segment_bytes``: create
    ``path`` as a log directory of segments of about that size, each opening
    with a checkpoint (``core/log/segments.py``), with the retention bounds
    ``retain_bytes`` / ``retain_segments`` (oldest segments deleted while the
    server runs); an existing directory is reopened as one (default segments of
    64 MiB). ``layer`` swaps the file layer (fault injection, timing).
    ``observer``: a ``Ledger`` observer for every event folded from now on,
    chained after the ledger's own debug one (``chain_observers``). Raises
    ``LogLockedError`` when another writer has the log open, ``LogError`` for a
    path that is not a regular file of this user, ``InvalidArgumentError`` for an
    observer that is not callable (nothing opened).
    """
    t0 = time.perf_counter()
    split_flat("open_ledger", flat, dict.fromkeys(LOG_FIELDS, "log_options"))  # (TypeError: not an option)
    lo = log_options_of("open_ledger", log_options, flat)
    lay = lo.layer if lo.layer is not None else default_layer
    path = os.fspath(path)
    _check_open_arguments(geometry, policy, observer)
    opts = {"fsync": lo.fsync, "background": lo.background, "layer": lay, "max_pages": lo.max_pages,
            "max_lag_bytes": lo.max_lag_bytes, "segment_bytes": lo.segment_bytes, "retain_bytes": lo.retain_bytes,
            "retain_segments": lo.retain_segments}
    led_opts = {"check": check, "checkpoint_every": lo.checkpoint_every,
                "logger": logger if logger is not None else get_logger("kvledger"), "observer": observer}
    unfinished = lay.exists(path) and lay.isdir(path) and unfinished_directory(lay, path)  # (an interrupted create)
    if not lay.exists(path) or unfinished:
        if geometry is None:
            why = "holds only what an interrupted create left" if unfinished else "does not exist"
            raise ConfigurationError(f"{path} {why}: give a geometry to create it")
        return _create(path, geometry, policy or "released_aliases", opts, led_opts, t0)
    return _reopen(path, geometry, policy, opts, led_opts, t0)


def _check_open_arguments(geometry: Geometry | None, policy: str | None, observer: EventObserver | None) -> None:
    """``open_ledger``'s checks that need no file: ``ConfigurationError`` / ``InvalidArgumentError``."""
    if policy is not None and policy not in CLEAR_POLICIES:
        raise ConfigurationError(f"unknown clear policy {policy!r}; one of {CLEAR_POLICIES}")
    if geometry is not None:
        if not isinstance(geometry, Geometry):
            raise InvalidArgumentError(f"geometry must be a Geometry, got {geometry!r}")
        checks.geometry(geometry)
    if observer is not None and not callable(observer):
        raise InvalidArgumentError(f"observer must be callable(seq, event, effects), got {observer!r}")


def _create(path: str, geometry: Geometry, policy: str, opts: dict, led_opts: dict, t0: float) -> DurableLedger:
    log = EventLog.create(path, geometry, policy=policy, **opts)
    try:
        led = DurableLedger(log, policy=policy, **led_opts)
        log.sync()
    except BaseException:
        log.abandon()
        raise
    led.recovery = Recovery(path=path, created=True, events=led.seq, checkpoint_seq=None, folded=0,
                            truncated_at=None, truncated_bytes=0, lost_events=None, closed_cleanly=False,
                            seconds=time.perf_counter() - t0)
    led.logger.info("log_created", geometry=[geometry.num_pages, geometry.page_tokens], policy=policy,
                     fsync=opts["fsync"])
    return led


def _reopen(path: str, geometry: Geometry | None, policy: str | None, opts: dict, led_opts: dict,
            t0: float) -> DurableLedger:
    def load(view: LogView):
        hdr = view.header
        if geometry is not None and geometry != hdr.geometry:
            raise ConfigurationError(f"{path} holds geometry {hdr.geometry}, not {geometry}")
        if policy is not None and policy != hdr.policy:
            raise ConfigurationError(f"{path} uses clear policy {hdr.policy!r}, not {policy!r}")
        # the events after the last checkpoint (at most checkpoint_every of them) are validated one
        # by one: the ledger allocates from this state, so a forged event must not reach it
        with without_gc():
            return rebuild_state(view, check=led_opts["check"], trusted=False)

    log = EventLog.open(path, loader=load, **opts)
    res: Any = log.recovery  # the Scan of what open found, and what load built from it
    loaded: Any = log.loaded
    state, ck, folded = loaded
    log.loaded = None
    try:
        led = DurableLedger(log, state=state, policy=log.header.policy, **led_opts)
        if state is None:
            log.sync()  # the log held no events: seq 0 (CacheConfigured) was just appended
    except BaseException:
        log.abandon()
        raise
    led.recovery = Recovery(path=path, created=False, events=led.seq, checkpoint_seq=ck, folded=folded,
                            truncated_at=res.torn_at, truncated_bytes=res.torn_bytes, lost_events=res.torn_events,
                            closed_cleanly=res.closed, seconds=time.perf_counter() - t0)
    if res.torn_at is not None:
        led.logger.warning("log_truncated", offset=res.torn_at, bytes=res.torn_bytes, events=led.seq,
                            lost_events=res.torn_events)
    led.logger.info("log_opened", events=led.seq, checkpoint_seq=ck, folded=folded,
                     closed_cleanly=res.closed, seconds=round(led.recovery.seconds, 4))
    return led
