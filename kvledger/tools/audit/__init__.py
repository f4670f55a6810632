"""``kvledger audit LOG``: page, request and snapshot lifecycles, and lifecycle faults.

    kvledger audit LOG --page N        every transition of page N: seq, step, event,
                                       holder before -> after (free, reserved(r), kv(r),
                                       kv({r,..}) shared, alias({s,..}), cached(h)), mark
                                       and restoring flags, the step whose plan zeroed
                                       it, shares, evictions, sanitizer violations.
                                       Default window: the log's last segment, from the
                                       checkpoint it opens with (the page's state there,
                                       then every transition), so it answers in about
                                       the same time on any length of log
    kvledger audit LOG --request R     R's events, the pages its commits listed and
                                       the step plans that zeroed them
    kvledger audit LOG --snapshot S    S's aliases, restores and release, then what
                                       became of every page the release marked
    kvledger audit LOG --steps         every step: the ranks that completed it, its
                                       abort, and the steps in flight aborted with it
    kvledger audit LOG --check         lifecycle faults over the whole log
    ... --json                         machine-readable output
    ... --svg OUT                      a page x seq timeline (pages of the chosen
                                       page / request / snapshot, or --pages)
    ... --since SEQ / --until SEQ      a window; --since starts from the nearest
                                       checkpoint at or before SEQ (--since 0: the
                                       log's first event)
    ... --checked                      --page: validate every event of the window

LOG is a log file, a log directory, or one segment of a directory (the audit
starts at the checkpoint that segment opens with). An error names the file.

How ``--check`` decides, independently of the fold's own bookkeeping
(it folds the log for holders, and keeps its own model of page *contents*):

    contents     every page holds ZERO (fresh, or zeroed by a step plan), ROW(s)
                 (snapshot rows: a page ever aliased by a snapshot, or restored
                 into one) or KV(request incarnation, tenant) (a request's own
                 bytes, from its first step on or from a restore into it)
    a read       a request first reads a committed page when the step it was
                 committed for is sealed (after that step's clears); an aborted
                 step undoes its clears and its reads, which move to the next step
    foreign      ROW under every policy; KV of another tenant under cross_tenant;
                 KV of another request under all_reused

Faults (exit status 1):
    unzeroed_read            a request read a page holding foreign bytes
    needless_clear           (released_aliases) a plan zeroed a page that held no
                             row bytes: only released rows are ever zeroed
    redundant_clear          a plan zeroed a page that no one held or wrote since
                             it was last zeroed (the other policies clear pages a
                             request held, even if its step never ran: by design)
    plan_mismatch            a sealed step's recorded clear list differs from the
                             one the fold derives (the plan the ranks ran is the
                             recorded one; the audit goes on with it)
    leak                     a page the request's own events gave it is still held by
                             it (or by a holder that makes no sense) after it ended
    double_release / double_finish / unknown_snapshot / unknown_request /
    rejected_event           an event the fold refuses (a ledger never writes
                             one; the audit records it, skips it and goes on)
    restore_never_completed  (cleanly closed log) a restore still in flight at close
    step_never_completed     a rank skipped a sealed step (not aborted, by name or in
                             a cascade), or (cleanly closed log) never completed one;
                             only for logs whose ranks report completions
    marked_cached_page       a cached page (KV kept for reuse) carries a mark: a
                             request sharing it would read it unzeroed
    shared_page_listed       a plan zeroes a page that is shared or published: KV
                             other requests read (or will share) wiped
    sanitizer_violation      the engine's sanitizer recorded a page that was not
                             zeroed, or still held poison, before a step's graph

Open at the end (reported, not faults): requests holding pages, live snapshots,
marked free pages, and on a log that was not closed (live or crashed) restores
in flight and steps not yet completed.

Exit status: 0 no faults; 1 faults; 2 bad usage or an unreadable file; 3 corrupt log.

The rooms:

    run.py      audit_log: the window, the start, the engine
    checked.py  the checked engine: the library's fold loop, every event validated, every watcher
    pages.py    the page timeline's rows, and the fold of one page (--page's default engine)
    model.py    the content model behind --check
    ending.py   the end-of-log pass (what is open, faults of a closed log)
    steps.py    steps and ranks (--steps, and the --check summary line)
    views.py    the request / snapshot timelines, and the text report
    svg.py      the SVG timeline: collected during the fold, drawn from the report
    report.py   the report's values (Finding, Row, Segment, StepStatus, AuditReport)
    cli.py      ``kvledger audit``'s arguments, JSON and exit status
"""

from .cli import main, report_json
from .report import FAULT_KINDS, AuditReport, Finding, Row, Segment, StepStatus
from .run import MIN_WINDOW_EVENTS, audit_log
from .svg import COLORS, render_svg
from .views import render

__all__ = ["COLORS", "FAULT_KINDS", "MIN_WINDOW_EVENTS", "AuditReport", "Finding", "Row", "Segment", "StepStatus",
           "audit_log", "main", "render", "render_svg", "report_json"]
