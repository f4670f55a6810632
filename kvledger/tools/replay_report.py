"""What ``kvledger replay`` reports: the summary, its error, the human rendering and the exit status.

``ReplaySummary`` is a plain msgspec value (``--json`` prints it, field for field,
in this order; ``tests/tools/test_replay_modes.py`` pins the keys). ``Tally`` is what
the replay's hooks count while the fold runs; ``Tally.into`` adds it to a
summary. Both replay modes fill the same fields the same way: only ``mode``,
``checkpoints_compared``, ``invariant_checks`` and ``seconds`` may differ
between a checked and a trusted replay of one log.
"""

from __future__ import annotations

import os

import msgspec

from kvledger.core.errors import CorruptLogError, InvariantViolation, KVLedgerError, ReplayMismatchError
from kvledger.core.events.events import (
    EVENT_TYPES,
    PagesCommitted,
    PagesEvicted,
    PagesPublished,
    PagesShared,
    RequestCancelled,
    RequestFinished,
    RestoreCompleted,
    RestoreStarted,
    SanitizerViolation,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepSealed,
)
from kvledger.core.log.format import KIND_CHECKPOINT, KIND_EVENTS

__all__ = ["EXIT_CORRUPT", "EXIT_MISMATCH", "EXIT_OK", "EXIT_USAGE", "INVARIANT_MODES", "MODES", "ReplayError",
           "ReplaySummary", "Tally", "error_of", "exit_code", "render", "summary_of"]

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_CORRUPT = 0, 1, 2, 3
INVARIANT_MODES = ("auto", "steps", "end", "none")
MODES = ("checked", "trusted")


class ReplayError(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    kind: str  # "corrupt" | "mismatch" | "invariant" | "rejected"
    seq: int | None
    offset: int | None  # in ``file``
    error: str  # the exception class
    message: str
    file: str | None = None  # the file (a segment of a log directory) holding the bad record


class ReplaySummary(msgspec.Struct, kw_only=True, gc=False):
    """What ``replay_log`` found. ``ok`` is False when ``error`` is set."""

    path: str
    format_version: int
    log_id: str
    num_pages: int
    page_tokens: int
    policy: str
    mode: str = "checked"  # one of MODES
    files: int = 1  # files in the view (segments of a log directory, from the starting one on)
    first_file: str = ""  # the file the view starts with
    first_seq: int = 0  # the seq its first record starts at (> 0: a later segment, or retention)
    records: int = 0
    event_records: int = 0
    checkpoint_records: int = 0
    close_records: int = 0
    closed_cleanly: bool = False
    torn_at: int | None = None
    torn_bytes: int = 0
    start_seq: int = 0  # first seq folded (a checkpoint's seq with --from-checkpoint or a later segment)
    from_checkpoint: int | None = None
    until: int | None = None
    events: int = 0  # events folded by this replay
    last_seq: int = -1
    steps_sealed: int = 0
    steps_aborted: int = 0  # StepAborted events
    steps_aborted_in_cascade: int = 0  # later steps in flight that an abort of an earlier step took with it
    step_completions: int = 0
    ranks: int = 0
    sanitizer_violations: int = 0
    pages_cleared: int = 0  # pages in sealed step plans
    plans_with_clears: int = 0
    commits: int = 0
    pages_committed: int = 0
    commits_listing: int = 0  # commits whose effect listed marked pages
    publishes: int = 0
    pages_published: int = 0  # blocks published (one page each)
    shares: int = 0
    pages_shared: int = 0
    evictions: int = 0
    pages_evicted: int = 0
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


def error_of(exc: KVLedgerError, seq: int | None, offset: int | None, file: str | None) -> ReplayError:
    """The summary's error for ``exc``; a ``CorruptLogError`` names its own seq, offset and file."""
    if isinstance(exc, CorruptLogError):
        kind, seq, offset, file = "corrupt", exc.seq, exc.offset, exc.path
    elif isinstance(exc, ReplayMismatchError):
        kind = "mismatch"
    elif isinstance(exc, InvariantViolation):
        kind = "invariant"
    else:
        kind = "rejected"
    return ReplayError(kind=kind, seq=seq, offset=offset, error=type(exc).__name__, message=str(exc), file=file)


def summary_of(view, until: int | None, mode: str) -> ReplaySummary:
    """The summary's header part: what the scan alone tells."""
    sc, hdr = view.scan, view.header
    s = ReplaySummary(
        path=view.path, format_version=hdr.version, log_id=hdr.log_id.hex(),
        num_pages=hdr.geometry.num_pages, page_tokens=hdr.geometry.page_tokens, policy=hdr.policy, mode=mode,
        files=len(view.paths), first_file=view.paths[0], first_seq=view.first_seq,
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


class Tally:
    """What the hooks count during a fold: events by type, and the pages some of them carry.

    ``counts`` holds every event type (a plain dict: ``counts[type(ev)] += 1`` is
    the whole per-event cost of counting).
    """

    __slots__ = ("aborted_before", "commits_listing", "counts", "invariant_checks", "pages_cleared",
                 "pages_committed", "pages_evicted", "pages_published", "pages_shared", "plans_with_clears",
                 "requests_before", "snapshots_before")

    def __init__(self, st) -> None:
        self.counts: dict[type, int] = dict.fromkeys(EVENT_TYPES, 0)
        self.pages_cleared = self.plans_with_clears = self.commits_listing = self.pages_committed = 0
        self.pages_published = self.pages_shared = self.pages_evicted = self.invariant_checks = 0
        self.requests_before, self.snapshots_before = len(st.requests), len(st.snapshots)
        self.aborted_before = len(st.aborted_steps)

    def into(self, s: ReplaySummary, st) -> None:
        """Add the tally to ``s``; ``st`` is the state the fold reached."""
        c = self.counts
        s.events += sum(c.values())
        s.steps_sealed += c[StepSealed]
        s.steps_aborted += c[StepAborted]
        # every abort names one step and takes the later steps in flight with it; the fold records them all
        s.steps_aborted_in_cascade += len(st.aborted_steps) - self.aborted_before - c[StepAborted]
        s.step_completions += c[StepCompleted]
        s.sanitizer_violations += c[SanitizerViolation]
        s.commits += c[PagesCommitted]
        s.publishes += c[PagesPublished]
        s.shares += c[PagesShared]
        s.evictions += c[PagesEvicted]
        s.requests_finished += c[RequestFinished]
        s.requests_cancelled += c[RequestCancelled]
        s.snapshots_released += c[SnapshotReleased]
        s.restores_started += c[RestoreStarted]
        s.restores_completed += c[RestoreCompleted]
        s.pages_cleared += self.pages_cleared
        s.plans_with_clears += self.plans_with_clears
        s.commits_listing += self.commits_listing
        s.pages_committed += self.pages_committed
        s.pages_published += self.pages_published
        s.pages_shared += self.pages_shared
        s.pages_evicted += self.pages_evicted
        s.invariant_checks += self.invariant_checks
        # every request incarnation ends (finish / cancel) or is still open; same for snapshots
        s.requests_admitted += c[RequestFinished] + c[RequestCancelled] + len(st.requests) - self.requests_before
        s.snapshots_aliased += c[SnapshotReleased] + len(st.snapshots) - self.snapshots_before


# ---------------------------------------------------------------------- the human summary


def exit_code(summary: ReplaySummary) -> int:
    if summary.error is None:
        return EXIT_OK
    return EXIT_CORRUPT if summary.error.kind == "corrupt" else EXIT_MISMATCH


def _n(x: int) -> str:
    return f"{x:,}"


def render(s: ReplaySummary) -> str:
    """The human summary: one ``key  value`` line each."""
    rows = _head_rows(s) + _count_rows(s) + [
        ("checkpoints", f"{_n(s.checkpoints_compared)} recorded digests compared with the replay"),
        ("invariants", (f"checked {_n(s.invariant_checks)} times ("
                        + ("at sealed steps" if s.mode == "checked" else "at checkpoints") + " and at the end)")
                       if s.invariant_checks else "not checked"),
        ("digest", s.digest or "-"),
        ("chain head", s.chain_head or "-"),
        ("result", _result(s)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _head_rows(s: ReplaySummary) -> list[tuple[str, str]]:
    rows = [
        ("log", f"{s.path}"),
        ("format", f"version {s.format_version}, log id {s.log_id}, {_n(s.num_pages)} pages x "
                   f"{s.page_tokens} tokens, policy {s.policy}"),
    ]
    if s.format_version >= 2:
        rows.append(("segments", f"{_n(s.files)} from {os.path.basename(s.first_file)} (first seq {_n(s.first_seq)})"))
    rows.append(("records", f"{_n(s.records)} ({_n(s.event_records)} event batches, {_n(s.checkpoint_records)} "
                            f"checkpoints, {_n(s.close_records)} close)"))
    if s.torn_at is not None:
        rows.append(("tail", f"torn: {_n(s.torn_bytes)} bytes from offset {_n(s.torn_at)} not replayed "
                             "(a crash mid-append; opening the log truncates it)"))
    else:
        rows.append(("tail", "closed cleanly" if s.closed_cleanly else "intact, not closed (a live log or a crash)"))
    how = ("checked: every event validated, every recorded plan compared" if s.mode == "checked" else
           "trusted: CRCs and hash chain verified, events applied without re-validation, digests compared "
           "at checkpoints")
    rows.append(("mode", how))
    return rows


def _count_rows(s: ReplaySummary) -> list[tuple[str, str]]:
    start = f"from the checkpoint at seq {_n(s.from_checkpoint)}" if s.from_checkpoint is not None else "from seq 0"
    cascade = f" ({_n(s.steps_aborted_in_cascade)} more in a cascade)" if s.steps_aborted_in_cascade else ""
    return [
        ("events", f"{_n(s.events)} folded {start}" + (f", up to seq {_n(s.last_seq)}" if s.events else "")
                   + (f" (--until {s.until})" if s.until is not None else "")),
        ("steps", f"{_n(s.steps_sealed)} sealed, {_n(s.steps_aborted)} aborted{cascade}; {_n(s.step_completions)} "
                  f"completions from {_n(s.ranks)} ranks; {_n(s.sanitizer_violations)} sanitizer violations"),
        ("pages", f"{_n(s.pages_cleared)} cleared in {_n(s.plans_with_clears)} step plans; {_n(s.commits)} commits "
                  f"of {_n(s.pages_committed)} pages, {_n(s.commits_listing)} listed marked pages"),
        ("prefix", f"{_n(s.pages_published)} blocks published in {_n(s.publishes)} events, "
                   f"{_n(s.pages_shared)} pages shared in {_n(s.shares)}, {_n(s.pages_evicted)} evicted "
                   f"in {_n(s.evictions)}"),
        ("requests", f"{_n(s.requests_admitted)} admitted, {_n(s.requests_finished)} finished, "
                     f"{_n(s.requests_cancelled)} cancelled, {_n(s.requests_open)} open at the end"),
        ("snapshots", f"{_n(s.snapshots_aliased)} aliased, {_n(s.snapshots_released)} released, "
                      f"{_n(s.snapshots_live)} live at the end"),
        ("restores", f"{_n(s.restores_started)} started, {_n(s.restores_completed)} completed"),
    ]


def _result(s: ReplaySummary) -> str:
    if s.error is None:
        return f"OK ({s.seconds:.2f} s)"
    e = s.error
    where = []
    if e.file is not None and s.format_version >= 2:  # a log directory: which segment
        where.append(os.path.basename(e.file))
    if e.offset is not None:
        where.append(f"offset {e.offset}")
    if e.seq is not None:
        where.append(f"seq {e.seq}")
    at = f", {', '.join(where)}" if where else ""
    return f"FAILED ({e.kind}{at}): {e.message}"
