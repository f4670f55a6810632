"""``kvledger replay LOG``: fold a log with every check on and compare it with the live run.

    scan (CRC, hash chain, seq of every record) ─► [checkpoint ≤ --until] ─► for each event:
        validate (a StepSealed's recorded clear list must equal the one the fold
        derives, else ReplayMismatchError) ─► apply ─► at sealed steps: every
        invariant ─► at every checkpoint record: the recorded state digest must
        equal the replayed one ─► at the end: every invariant, the digest

The loop is the library's own (``kvledger.core.log.fold``: ``start_state`` then
``fold_records``); replay hands it three hooks: ``apply`` (count, fold, check
invariants at sealed steps), ``on_checkpoint`` (compare digests) and
``on_record`` (progress).

Invariant checks cost O(num_pages) each (about a microsecond or two per page
here, as much as folding an event). ``--invariants steps`` runs them at every
sealed step; ``auto`` (the default) at the first sealed step after every
16 x num_pages events and at the end, which keeps them under about a tenth of
the replay on any cache size; ``end``; ``none``. Every event is validated and
every recorded plan compared, whatever the choice.

Exit status: 0 the log replays (a torn tail is reported, not replayed: that is
what a crash leaves, and ``open_ledger`` truncates it); 1 a replay mismatch, a
broken invariant or an event the fold rejects; 2 bad usage or an unreadable
file; 3 a corrupt log (the first bad record's offset and seq are printed).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from kvledger.core.errors import (
    CorruptLogError,
    InvalidArgumentError,
    InvariantViolation,
    KVLedgerError,
    LogError,
    ReplayMismatchError,
)
from kvledger.core.events.events import (
    PagesCommitted,
    RequestCancelled,
    RequestFinished,
    RestoreCompleted,
    RestoreStarted,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepSealed,
)
from kvledger.core.log import open_view
from kvledger.core.log.fold import fold_records, start_state
from kvledger.core.log.format import KIND_CHECKPOINT, KIND_EVENTS, Checkpoint, RecordInfo
from kvledger.core.state.invariants import check_invariants
from kvledger.core.state import LedgerState
from kvledger.logs import get_logger

__all__ = ["EXIT_CORRUPT", "EXIT_MISMATCH", "EXIT_OK", "EXIT_USAGE", "INVARIANT_MODES", "ReplayError", "ReplaySummary",
           "exit_code", "main", "render", "replay_log"]

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_CORRUPT = 0, 1, 2, 3
INVARIANT_MODES = ("auto", "steps", "end", "none")


class ReplayError(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    kind: str  # "corrupt" | "mismatch" | "invariant" | "rejected"
    seq: int | None
    offset: int | None
    error: str  # the exception class
    message: str


class ReplaySummary(msgspec.Struct, kw_only=True, gc=False):
    """What ``replay_log`` found. ``ok`` is False when ``error`` is set."""

    path: str
    format_version: int
    log_id: str
    num_pages: int
    page_tokens: int
    policy: str
    records: int = 0
    event_records: int = 0
    checkpoint_records: int = 0
    close_records: int = 0
    closed_cleanly: bool = False
    torn_at: int | None = None
    torn_bytes: int = 0
    start_seq: int = 0  # first seq folded (a checkpoint's seq with --from-checkpoint)
    from_checkpoint: int | None = None
    until: int | None = None
    events: int = 0  # events folded by this replay
    last_seq: int = -1
    steps_sealed: int = 0
    steps_aborted: int = 0
    step_completions: int = 0
    ranks: int = 0
    pages_cleared: int = 0  # pages in sealed step plans
    plans_with_clears: int = 0
    commits: int = 0
    pages_committed: int = 0
    commits_listing: int = 0  # commits whose effect listed marked pages
    requests_admitted: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_open: int = 0
    snapshots_aliased: int = 0
    snapshots_released: int = 0
    snapshots_live: int = 0
    restores_started: int = 0
    restores_completed: int = 0
    checkpoints_compared: int = 0
    invariant_checks: int = 0
    digest: str = ""
    chain_head: str = ""
    seconds: float = 0.0
    ok: bool = True
    error: ReplayError | None = None


def _error(exc: KVLedgerError, seq: int | None, offset: int | None) -> ReplayError:
    if isinstance(exc, CorruptLogError):
        kind, seq, offset = "corrupt", exc.seq, exc.offset
    elif isinstance(exc, ReplayMismatchError):
        kind = "mismatch"
    elif isinstance(exc, InvariantViolation):
        kind = "invariant"
    else:
        kind = "rejected"
    return ReplayError(kind=kind, seq=seq, offset=offset, error=type(exc).__name__, message=str(exc))


def replay_log(path, *, until: int | None = None, from_checkpoint: bool = False, invariants: str = "auto",
               progress: Callable[[int, int], None] | None = None, layer=None) -> ReplaySummary:
    """Replay the log at ``path``; never raises for what is inside the records.

    ``until``: stop after the event with this seq (inclusive). ``from_checkpoint``:
    start from the last checkpoint at or before ``until`` (the default replays
    from seq 0). ``invariants``: one of ``INVARIANT_MODES`` (module docstring).
    ``progress(done_bytes, total_bytes)`` is called after each record. Problems
    in records end the replay and land in ``summary.error``; an unreadable file
    or a bad header raises ``LogError`` (``CorruptLogError`` for a bad header).
    """
    if invariants not in INVARIANT_MODES:
        raise InvalidArgumentError(f"invariants must be one of {INVARIANT_MODES}, got {invariants!r}")
    t0 = time.perf_counter()
    with open_view(path, layer=layer, until=until) as view:
        sc = view.scan
        s = _summary(view, until)
        st = LedgerState()
        try:
            start = 0
            if from_checkpoint:
                st, start, ck = start_state(view, at=None if until is None else until + 1)
                if ck is not None:
                    s.start_seq = s.from_checkpoint = ck.seq
            s.error = _Replay(view, st, s, invariants, progress).run(start, until)
            if s.error is None and invariants != "none":
                try:
                    check_invariants(st)
                    s.invariant_checks += 1
                except KVLedgerError as exc:
                    s.error = _error(exc, st.seq, sc.end)
        except KVLedgerError as exc:
            s.error = _error(exc, None, None)
        if s.error is None and sc.error is not None and (until is None or until >= sc.error.seq):
            s.error = _error(sc.error, None, None)
        s.last_seq = st.seq - 1
        s.requests_open = len(st.requests)
        s.snapshots_live = len(st.snapshots)
        s.ranks = len(st.completed)
        s.digest = st.digest() if st.geometry is not None else ""
        s.ok = s.error is None
        s.seconds = time.perf_counter() - t0
    return s


def _summary(view, until: int | None) -> ReplaySummary:
    """The summary's header part: what the scan alone tells."""
    sc, hdr = view.scan, view.header
    s = ReplaySummary(
        path=view.path, format_version=hdr.version, log_id=hdr.log_id.hex(),
        num_pages=hdr.geometry.num_pages, page_tokens=hdr.geometry.page_tokens, policy=hdr.policy,
        closed_cleanly=sc.closed, torn_at=sc.torn_at, torn_bytes=sc.torn_bytes, until=until,
        chain_head=sc.chain_head, records=len(sc.records),
    )
    for r in sc.records:
        if r.kind == KIND_EVENTS:
            s.event_records += 1
        elif r.kind == KIND_CHECKPOINT:
            s.checkpoint_records += 1
        else:
            s.close_records += 1
    return s


# indices into _Replay.tally
_PAGES_CLEARED, _PLANS_WITH_CLEARS, _COMMITS_LISTING, _PAGES_COMMITTED, _INVARIANT_CHECKS = range(5)


class _Replay:
    """Replay's hooks into ``fold_records``; counts into the summary, locates the first problem."""

    def __init__(self, view, st: LedgerState, s: ReplaySummary, invariants: str,
                 progress: Callable[[int, int], None] | None) -> None:
        self.view, self.st, self.s = view, st, s
        self.progress = progress
        self.counts: Counter = Counter()
        self.tally = [0] * 5
        num_pages = view.header.geometry.num_pages
        self.gap = {"steps": 0, "auto": 16 * num_pages}.get(invariants, 1 << 62)
        self.failed_at: tuple[int, int | None] | None = None  # (seq, offset or None) a hook located

    def run(self, start: int, until: int | None) -> ReplayError | None:
        """Fold from record index ``start``; the first problem (or None). Counts land in the summary."""
        st = self.st
        open_requests, live_snapshots = len(st.requests), len(st.snapshots)
        total = self.view.scan.end
        progress = self.progress
        on_record = None if progress is None else (lambda rec: progress(rec.end, total))
        try:
            fold_records(self.view, st, start, until=until, apply=self._apply_hook(),
                         on_checkpoint=self._on_checkpoint, on_record=on_record)
        except KVLedgerError as exc:
            seq, offset = self.failed_at if self.failed_at is not None else (st.seq, None)
            if offset is None and type(exc) is not CorruptLogError:
                offset = _offset_of(self.view, seq)
            return _error(exc, seq, offset)
        finally:
            self._count_into(self.s, open_requests, live_snapshots)
        return None

    def _apply_hook(self) -> Callable[[int, object], None]:
        """``apply(seq, event)``: fold it (validated: a recorded plan must match), count it after."""
        st, counts, tally, gap = self.st, self.counts, self.tally, self.gap
        fold = st.fold
        last_check = [st.seq]

        def apply(seq: int, ev) -> None:
            t = type(ev)
            if t is PagesCommitted:
                tally[_PAGES_COMMITTED] += len(ev.page_ids)
                if fold(ev):
                    tally[_COMMITS_LISTING] += 1
            elif t is StepSealed:
                fold(ev)
                if ev.clear_list:
                    tally[_PLANS_WITH_CLEARS] += 1
                    tally[_PAGES_CLEARED] += len(ev.clear_list)
                if seq - last_check[0] >= gap:
                    try:
                        check_invariants(st)
                    except KVLedgerError:
                        self.failed_at = (seq, None)  # the seal was folded: st.seq is past it
                        raise
                    tally[_INVARIANT_CHECKS] += 1
                    last_check[0] = seq
            else:
                fold(ev)
            counts[t] += 1  # a rejected event is not counted

        return apply

    def _on_checkpoint(self, rec: RecordInfo, cp: Checkpoint) -> None:
        st = self.st
        if rec.seq == st.seq:
            digest = st.digest()
            if digest != cp.digest:
                self.failed_at = (rec.seq, rec.offset)
                raise ReplayMismatchError(rec.seq, f"checkpoint at offset {rec.offset} recorded state digest "
                                                   f"{cp.digest[:16]}..., the replay has {digest[:16]}...")
            self.s.checkpoints_compared += 1

    def _count_into(self, s: ReplaySummary, open_requests: int, live_snapshots: int) -> None:
        counts, tally, st = self.counts, self.tally, self.st
        s.events += sum(counts.values())
        s.steps_sealed += counts[StepSealed]
        s.steps_aborted += counts[StepAborted]
        s.step_completions += counts[StepCompleted]
        s.commits += counts[PagesCommitted]
        s.requests_finished += counts[RequestFinished]
        s.requests_cancelled += counts[RequestCancelled]
        s.snapshots_released += counts[SnapshotReleased]
        s.restores_started += counts[RestoreStarted]
        s.restores_completed += counts[RestoreCompleted]
        s.pages_cleared += tally[_PAGES_CLEARED]
        s.plans_with_clears += tally[_PLANS_WITH_CLEARS]
        s.commits_listing += tally[_COMMITS_LISTING]
        s.pages_committed += tally[_PAGES_COMMITTED]
        s.invariant_checks += tally[_INVARIANT_CHECKS]
        # every request incarnation ends (finish / cancel) or is still open; same for snapshots
        s.requests_admitted += (counts[RequestFinished] + counts[RequestCancelled] + len(st.requests)
                                - open_requests)
        s.snapshots_aliased += counts[SnapshotReleased] + len(st.snapshots) - live_snapshots


def _offset_of(view, seq: int) -> int | None:
    """Offset of the events record holding event ``seq`` (for an error's location)."""
    found = None
    for rec in view.records:
        if rec.kind == KIND_EVENTS and rec.seq <= seq:
            found = rec.offset
        elif rec.seq > seq:
            break
    return found


# ---------------------------------------------------------------------- CLI


def exit_code(summary: ReplaySummary) -> int:
    if summary.error is None:
        return EXIT_OK
    return EXIT_CORRUPT if summary.error.kind == "corrupt" else EXIT_MISMATCH


def _n(x: int) -> str:
    return f"{x:,}"


def render(s: ReplaySummary) -> str:
    """The human summary."""
    rows = [
        ("log", f"{s.path}"),
        ("format", f"version {s.format_version}, log id {s.log_id}, {_n(s.num_pages)} pages x "
                   f"{s.page_tokens} tokens, policy {s.policy}"),
        ("records", f"{_n(s.records)} ({_n(s.event_records)} event batches, {_n(s.checkpoint_records)} checkpoints, "
                    f"{_n(s.close_records)} close)"),
    ]
    if s.torn_at is not None:
        rows.append(("tail", f"torn: {_n(s.torn_bytes)} bytes from offset {_n(s.torn_at)} not replayed "
                             "(a crash mid-append; opening the log truncates it)"))
    else:
        rows.append(("tail", "closed cleanly" if s.closed_cleanly else "intact, not closed (a live log or a crash)"))
    start = f"from the checkpoint at seq {_n(s.from_checkpoint)}" if s.from_checkpoint is not None else "from seq 0"
    rows += [
        ("events", f"{_n(s.events)} folded {start}" + (f", up to seq {_n(s.last_seq)}" if s.events else "")
                   + (f" (--until {s.until})" if s.until is not None else "")),
        ("steps", f"{_n(s.steps_sealed)} sealed, {_n(s.steps_aborted)} aborted; {_n(s.step_completions)} "
                  f"completions from {_n(s.ranks)} ranks"),
        ("pages", f"{_n(s.pages_cleared)} cleared in {_n(s.plans_with_clears)} step plans; {_n(s.commits)} commits "
                  f"of {_n(s.pages_committed)} pages, {_n(s.commits_listing)} listed marked pages"),
        ("requests", f"{_n(s.requests_admitted)} admitted, {_n(s.requests_finished)} finished, "
                     f"{_n(s.requests_cancelled)} cancelled, {_n(s.requests_open)} open at the end"),
        ("snapshots", f"{_n(s.snapshots_aliased)} aliased, {_n(s.snapshots_released)} released, "
                      f"{_n(s.snapshots_live)} live at the end"),
        ("restores", f"{_n(s.restores_started)} started, {_n(s.restores_completed)} completed"),
        ("checkpoints", f"{_n(s.checkpoints_compared)} recorded digests compared with the replay"),
        ("invariants", f"checked {_n(s.invariant_checks)} times (at sealed steps and at the end)"
                       if s.invariant_checks else "not checked"),
        ("digest", s.digest or "-"),
        ("chain head", s.chain_head or "-"),
    ]
    if s.error is None:
        rows.append(("result", f"OK ({s.seconds:.2f} s)"))
    else:
        e = s.error
        where = []
        if e.offset is not None:
            where.append(f"offset {e.offset}")
        if e.seq is not None:
            where.append(f"seq {e.seq}")
        at = f", {', '.join(where)}" if where else ""
        rows.append(("result", f"FAILED ({e.kind}{at}): {e.message}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


class _Progress:
    """A rich progress bar that appears only once the replay has taken a second."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.t0 = time.perf_counter()
        self.bar: Any = None
        self.task: Any = None
        self.calls = 0

    def __call__(self, done: int, total: int) -> None:
        self.calls += 1
        if self.bar is None:
            if self.mode == "never" or (self.calls & 63) or time.perf_counter() - self.t0 < 1.0:
                return
            if self.mode == "auto" and not sys.stderr.isatty():
                self.mode = "never"
                return
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("replay"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True, force_terminal=self.mode == "always" or None),
                                transient=True)
            self.bar.start()
            self.task = self.bar.add_task("replay", total=total)
        if (self.calls & 63) == 0 or done >= total:
            self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def main(argv=None, *, prog: str = "kvledger replay") -> int:
    ap = _parser(prog)
    ns = ap.parse_args(argv)
    if ns.until is not None and ns.until < 0:
        ap.error("--until must be >= 0")
    from kvledger.tools.cli import logging_configured

    with logging_configured(ns):
        return _run(ns)


def _parser(prog: str) -> argparse.ArgumentParser:
    from kvledger.tools.cli import add_logging_arguments

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the log file")
    ap.add_argument("--until", type=int, metavar="SEQ", help="stop after the event with this seq (inclusive)")
    ap.add_argument("--from-checkpoint", action="store_true",
                    help="start from the last checkpoint at or before --until instead of seq 0")
    ap.add_argument("--invariants", choices=INVARIANT_MODES, default="auto",
                    help="when to run the O(num_pages) invariant checks (default auto: at a sealed step every "
                         "16 x num_pages events, and at the end; steps: every sealed step); every event is "
                         "validated and every recorded plan compared anyway")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                    help="progress bar on stderr after a second (auto: when stderr is a terminal)")
    add_logging_arguments(ap)
    return ap


def _run(ns: argparse.Namespace) -> int:
    log = get_logger("kvledger.replay").bind(log=ns.log)
    bar = _Progress(ns.progress)
    gc.disable()  # a batch run: decoded events and the state hold no reference cycles
    try:
        summary = replay_log(ns.log, until=ns.until, from_checkpoint=ns.from_checkpoint,
                             invariants=ns.invariants, progress=bar)
    except LogError as exc:  # unreadable, or a bad header (CorruptLogError)
        bar.close()
        log.error("replay_failed", error=str(exc))
        corrupt = isinstance(exc, CorruptLogError)
        _print_failure(ns, "corrupt" if corrupt else "unreadable", exc)
        return EXIT_CORRUPT if corrupt else EXIT_USAGE
    finally:
        gc.enable()
    bar.close()
    if summary.torn_at is not None:
        log.warning("log_torn_tail", offset=summary.torn_at, bytes=summary.torn_bytes)
    if ns.json:
        sys.stdout.write(msgspec.json.encode(summary).decode() + "\n")
    else:
        print(render(summary))
    err = summary.error
    if err is not None:
        log.error("replay_failed", kind=err.kind, seq=err.seq, offset=err.offset)
    return exit_code(summary)


def _print_failure(ns, kind: str, exc: Exception) -> None:
    seq = getattr(exc, "seq", None)
    offset = getattr(exc, "offset", None)
    if ns.json:
        error = {"kind": kind, "seq": seq, "offset": offset, "error": type(exc).__name__, "message": str(exc)}
        sys.stdout.write(msgspec.json.encode({"path": ns.log, "ok": False, "error": error}).decode() + "\n")
    else:
        print(f"result  FAILED ({kind}): {exc}")
