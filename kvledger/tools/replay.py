"""``kvledger replay LOG``: fold a log and compare it with what the live run recorded.

    scan (CRC, hash chain, seq of every record; a log directory: from the starting segment on)
      ─► start: seq 0, or the checkpoint a later segment opens with, or (--from-checkpoint)
         the last checkpoint at or before --until
      ─► checked (the default), for each event:
             validate (a StepSealed's recorded clear list must equal the one the fold derives,
             else ReplayMismatchError) ─► apply ─► at sealed steps: every invariant
         trusted (--trusted), for each event: its bounds (page ids in the geometry, step numbers
             against the open step and the steps in flight), apply without its precondition, and a
             StepSealed's recorded clear list must equal the derived one
      ─► at checkpoint records: the recorded state digest must equal the replayed one
         (checked: every checkpoint; trusted: checkpoints at least 16 x num_pages events apart,
         each with every invariant, and the checkpoint at the end)
      ─► at the end: every invariant, the digest

The loop is the library's own (``kvledger.core.log.fold``: ``start_state`` then
``fold_records``); replay hands it its hooks: ``on_events`` (count a record's events in
bulk; checked: every invariant at the sealed steps the schedule names),
``on_checkpoint`` (compare digests) and ``on_record`` (progress). Both modes
count the same things (``replay_report.Tally``) and reach the same digest.

LOG is a log file, a log directory (every segment, from the first one retention
kept) or one segment of a directory (from that segment on: the fold starts at
the checkpoint it opens with). An error names the file holding the bad record.

Invariant checks cost O(num_pages) each (about a microsecond or two per page
here, as much as folding an event). ``--invariants steps`` runs them at every
sealed step (trusted: every checkpoint); ``auto`` (the default) at the first
sealed step (trusted: checkpoint) after every 16 x num_pages events and at the
end (trusted: unless the log ends with a checkpoint whose digest the replay
reaches: that state is the one the live ledger's validated commands reached,
whose invariants held; a closed log ends so); ``end``; ``none``. A checked replay validates every event and compares
every recorded plan, whatever the choice.

What ``--trusted`` skips, exactly: each event's precondition against the
state (that a reserved page is free, a committed page reserved by that
request, a released snapshot live, ...), and with it the invariant checks
between checkpoints. It still verifies every record's CRC and hash chain,
refuses any event whose page ids fall outside the geometry or whose step
number does not fit the open step and the steps in flight (``StepOrder`` /
``PageOutOfRange``: an impossible state), compares every sealed step's
recorded clear list, and at checkpoints ``16 x num_pages`` events apart
compares the state digest and checks every invariant (at the end: the last
checkpoint's digest, and the invariants unless that digest matched). A forged
event that breaks only a precondition and leaves a state those checks accept
is not found: replay without ``--trusted`` (``open_ledger`` validates the
events it folds on reopen for the same reason).

Exit status: 0 the log replays (a torn tail is reported, not replayed: that is
what a crash leaves, and ``open_ledger`` truncates it); 1 a replay mismatch, a
broken invariant or an event the fold rejects; 2 bad usage or an unreadable
file; 3 a corrupt log (the first bad record's file, offset and seq are printed).

    replay.py          replay_log: the start, the hooks, the end
    replay_report.py   the summary (ReplaySummary, its JSON), the tally, render, exit codes
    replay_cli.py      ``kvledger replay``'s arguments, progress bar and output
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from kvledger.core.errors import (
    CorruptLogError,
    InvalidArgumentError,
    KVLedgerError,
    ReplayMismatchError,
)
from kvledger.core.events.events import (
    PagesCommitted,
    PagesEvicted,
    PagesPublished,
    PagesShared,
    StepSealed,
)
from kvledger.core.log import LogView, open_view
from kvledger.core.log.fold import fold_records, start_state, without_gc
from kvledger.core.log.format import KIND_EVENTS, Checkpoint, RecordInfo
from kvledger.core.state import LedgerState
from kvledger.core.state.invariants import check_invariants

from .replay_report import (
    EXIT_CORRUPT,
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_USAGE,
    INVARIANT_MODES,
    ReplayError,
    ReplaySummary,
    Tally,
    error_of,
    exit_code,
    render,
    summary_of,
)

__all__ = ["EXIT_CORRUPT", "EXIT_MISMATCH", "EXIT_OK", "EXIT_USAGE", "INVARIANT_MODES", "ReplayError", "ReplaySummary",
           "exit_code", "record_of", "render", "replay_log"]

NEVER = 1 << 62

def replay_log(path, *, until: int | None = None, from_checkpoint: bool = False, invariants: str = "auto",
               trusted: bool = False, progress: Callable[[int, int], None] | None = None,
               layer=None) -> ReplaySummary:
    """Replay the log at ``path`` (a file, a log directory or one of its segments); never raises for
    what is inside the records.

    ``until``: stop after the event with this seq (inclusive). ``from_checkpoint``:
    start from the last checkpoint at or before ``until`` (the default replays
    from the first event the view holds: seq 0, or the checkpoint a later
    segment opens with). ``invariants``: one of ``INVARIANT_MODES`` (module
    docstring). ``trusted``: apply events without re-validating them (module
    docstring). ``progress(done_bytes, total_bytes)`` is called after each
    record. Problems in records end the replay and land in ``summary.error``;
    an unreadable file or a bad header raises ``LogError`` (``CorruptLogError``
    for a bad header), an ``until`` before the view's first event
    ``InvalidArgumentError``. Nothing is written anywhere.
    """
    if invariants not in INVARIANT_MODES:
        raise InvalidArgumentError(f"invariants must be one of {INVARIANT_MODES}, got {invariants!r}")
    t0 = time.perf_counter()
    with open_view(path, layer=layer, until=until) as view, without_gc():
        if until is not None and until < view.first_seq:
            raise InvalidArgumentError(f"until {until} is before the first event of {view.paths[0]} "
                                       f"(seq {view.first_seq}): start from an earlier segment")
        sc = view.scan
        s = summary_of(view, until, "trusted" if trusted else "checked")
        run = _Replay(view, s, invariants, trusted, progress)
        run.run(until, from_checkpoint)
        scan_error = sc.error
        if s.error is None and scan_error is not None and (until is None or scan_error.seq is None
                                                           or until >= scan_error.seq):
            s.error = error_of(scan_error, None, None, None)
        st = run.st
        s.last_seq = st.seq - 1
        s.requests_open = len(st.requests)
        s.snapshots_live = len(st.snapshots)
        s.ranks = len(st.completed)
        s.ok = s.error is None
        s.seconds = time.perf_counter() - t0
    return s


class _Replay:
    """Replay's hooks into ``fold_records``: count into the tally, compare, locate the first problem."""

    def __init__(self, view: LogView, s: ReplaySummary, invariants: str, trusted: bool,
                 progress: Callable[[int, int], None] | None) -> None:
        self.view, self.s = view, s
        self.trusted = trusted
        self.invariants = invariants
        self.progress = progress
        self.st = LedgerState()
        self.tally = Tally(self.st)
        self.gap = {"steps": 0, "auto": 16 * view.header.geometry.num_pages}.get(invariants, NEVER)
        self.last_check = 0  # seq of the last invariant check (trusted: of the last checkpoint compared)
        self.last_cp: tuple[RecordInfo, Checkpoint] | None = None  # trusted: the last one not compared
        self.failed_at: tuple[int, int | None, str | None] | None = None  # (seq, offset, file) a hook found
        self.digested: tuple[int, str] = (-1, "")  # (seq, digest) of the last digest computed: O(num_pages) each

    def run(self, until: int | None, from_checkpoint: bool) -> None:
        """Start, fold, finish; the first problem lands in ``s.error``, the counts in the summary."""
        s = self.s
        try:
            start = self._start(until, from_checkpoint)
        except KVLedgerError as exc:
            s.error = error_of(exc, None, None, None)
            return
        st = self.st
        self.tally = tally = Tally(st)
        self.last_check = st.seq
        hooks: dict = {"on_checkpoint": self._on_checkpoint, "on_record": self._progress_hook()}
        if self.trusted:
            hooks.update(trusted=True, verify_gap=NEVER)
        else:
            hooks.update(raw_rejections=True)  # (an event the fold rejects is a rejection, exit 1)
        hooks["on_events"] = self._events_hook()
        try:
            fold_records(self.view, st, start, until=until, **hooks)
            self._at_end()
        except KVLedgerError as exc:
            s.error = self._locate(exc)
        finally:
            tally.into(s, st)
            s.digest = self.digest_of(st) if st.geometry is not None else ""

    def _start(self, until: int | None, from_checkpoint: bool) -> int:
        """Index of the first record to fold; a checkpoint start replaces ``self.st``."""
        view, s = self.view, self.s
        first = view.first_seq
        if not from_checkpoint and first == 0:
            return 0
        at = (None if until is None else until + 1) if from_checkpoint else first
        st, start, ck = start_state(view, at=at, trusted=self.trusted)
        if ck is None:
            if first > 0:
                raise CorruptLogError(view.paths[0], view.header.size, first, f"the view starts at seq {first} "
                                      "but holds no checkpoint at or before it to start from")
            return 0
        self.st = st
        s.start_seq = s.from_checkpoint = ck.seq
        return start

    def _progress_hook(self) -> Callable[[RecordInfo], None] | None:
        progress = self.progress
        if progress is None:
            return None
        base, total = _segment_bases(self.view)
        return lambda rec: progress(base[rec.segment] + rec.end, total)

    def _events_hook(self) -> Callable[[RecordInfo, list, int], None]:
        """``on_events(record, events, listed)`` after each record counts its events in bulk (``listed``:
        the commits that listed pages, which the fold saw in their effects); checked, the invariants
        at the first sealed step of a record after every ``gap`` events."""
        tally = self.tally
        counts = tally.counts
        extra = (PagesCommitted, StepSealed, PagesEvicted, PagesPublished, PagesShared)

        def on_events(rec: RecordInfo, events: list, listed: int) -> None:
            for t, k in Counter(map(type, events)).items():
                counts[t] += k
            tally.commits_listing += listed
            for seq, ev in enumerate(events, rec.seq):
                t = type(ev)
                if t in extra:
                    if t is PagesCommitted:
                        tally.pages_committed += len(ev.page_ids)
                    elif t is StepSealed:
                        self._sealed(seq, ev)
                    else:
                        _count_pages(tally, t, ev)

        return on_events

    def _sealed(self, seq: int, ev: StepSealed) -> None:
        """Count the plan; checked: every invariant at the first sealed step ``gap`` events after the last check."""
        tally = self.tally
        if ev.clear_list:
            tally.plans_with_clears += 1
            tally.pages_cleared += len(ev.clear_list)
        if not self.trusted and seq - self.last_check >= self.gap:
            self._invariants((seq, None, None))  # the seal was folded: st.seq is past it
            self.last_check = seq

    def _invariants(self, where: tuple[int, int | None, str | None]) -> None:
        """Every invariant of the state now; ``where`` locates a failure (seq, offset, file)."""
        try:
            check_invariants(self.st)
        except KVLedgerError:
            self.failed_at = where
            raise
        self.tally.invariant_checks += 1

    def _on_checkpoint(self, rec: RecordInfo, cp: Checkpoint) -> None:
        """Compare the recorded digest (trusted: with every invariant, at checkpoints ``gap`` apart)."""
        st = self.st
        if rec.seq != st.seq:
            return
        if self.trusted:
            if st.seq - self.last_check < self.gap or self.invariants in ("end", "none"):
                self.last_cp = (rec, cp)  # compared at the end if it is the last one
                return
            self.last_cp = None
            self._compare(rec, cp, self.digest_of(st))
            self._invariants((rec.seq, rec.offset, self.view.paths[rec.segment]))
            self.last_check = st.seq
        else:
            self._compare(rec, cp, self.digest_of(st))

    def digest_of(self, st: LedgerState) -> str:
        """``st.digest()``, computed once per seq (the end's checkpoint and the summary share it)."""
        if self.digested[0] != st.seq:
            self.digested = (st.seq, st.digest())
        return self.digested[1]

    def _compare(self, rec: RecordInfo, cp: Checkpoint, digest: str) -> None:
        if digest != cp.digest:
            self.failed_at = (rec.seq, rec.offset, self.view.paths[rec.segment])
            raise ReplayMismatchError(rec.seq, f"checkpoint at offset {rec.offset} recorded state digest "
                                               f"{cp.digest[:16]}..., the replay has {digest[:16]}...")
        self.s.checkpoints_compared += 1

    def _at_end(self) -> None:
        """Trusted: the checkpoint at the final seq, if it was not compared; then every invariant of the
        final state, unless (trusted, ``auto``) that checkpoint's digest matched: the state is then the one
        the live ledger's validated commands reached, whose invariants held."""
        st = self.st
        if st.geometry is None:
            return
        implied = False
        if self.last_cp is not None and self.last_cp[0].seq == st.seq:
            rec, cp = self.last_cp
            self._compare(rec, cp, self.digest_of(st))
            implied = self.trusted and self.invariants == "auto"
        if self.invariants != "none" and not implied:
            self._invariants((st.seq, self.view.scan.end, self.view.paths[-1]))

    def _locate(self, exc: KVLedgerError) -> ReplayError:
        """The summary's error: where a hook found it, else the events record holding the seq the fold reached."""
        if isinstance(exc, CorruptLogError):
            return error_of(exc, None, None, None)
        seq, offset, file = self.failed_at if self.failed_at is not None else (self.st.seq, None, None)
        if offset is None:
            rec = record_of(self.view, seq)
            if rec is not None:
                offset, file = rec.offset, self.view.paths[rec.segment]
        return error_of(exc, seq, offset, file)


def _count_pages(tally: Tally, t: type, ev) -> None:
    n = len(ev.page_ids)
    if t is PagesPublished:
        tally.pages_published += n
    elif t is PagesShared:
        tally.pages_shared += n
    else:
        tally.pages_evicted += n


def record_of(view: LogView, seq: int) -> RecordInfo | None:
    """The events record of ``view`` holding event ``seq`` (for an error's location); None if none does."""
    found = None
    for rec in view.records:
        if rec.kind == KIND_EVENTS and rec.seq <= seq:
            found = rec
        elif rec.seq > seq:
            break
    return found


def _segment_bases(view: LogView) -> tuple[list[int], int]:
    """Byte offsets of each file of the view as if they were one (for a progress bar), and the total."""
    ends = [0] * len(view.paths)
    for rec in view.records:
        ends[rec.segment] = rec.end
    base, total = [], 0
    for end in ends:
        base.append(total)
        total += end
    return base, total
