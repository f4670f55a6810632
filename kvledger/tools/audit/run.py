"""``audit_log``: open the window of the log the question needs, pick the start, run an engine.

    open_view (a file; a directory from the segment the window starts in; a segment from there on)
      ─► start_state: seq 0, or the last checkpoint at or before the window's start
      ─► the engine:  PageFold (pages.py; --page, the default): the fold of one page, trusted
                      CheckedAudit (checked.py; everything else, and --page --checked):
                      every event validated, every watcher
      ─► the report (report.py), with the window it covers in words

The window: ``--since SEQ`` starts at SEQ (the fold from the last checkpoint at
or before it); ``--until SEQ`` ends after SEQ. Without ``--since``, ``--page``
looks at the log's last segment (from the checkpoint it opens with; when that
holds fewer than ``MIN_WINDOW_EVENTS`` events, from the segment holding the seq
that many events before the end),
so it answers in about the same time on any length of log; every other view
starts at the first event the log holds.
"""

from __future__ import annotations

import os
import time

from kvledger.core.errors import CorruptLogError, InvalidArgumentError, KVLedgerError
from kvledger.core.log import LogView, open_view
from kvledger.core.log.fold import fold_records, start_state, without_gc
from kvledger.core.state import LedgerState

from .checked import CheckedAudit
from .pages import PageFold
from .report import AuditReport

__all__ = ["MIN_WINDOW_EVENTS", "audit_log"]

MIN_WINDOW_EVENTS = 10_000
_LAST = 1 << 62


def audit_log(path, *, page: int | None = None, request: int | str | None = None, snapshot: int | None = None,
              steps: bool = False, check: bool = False, svg_pages: list[int] | None = None,
              since: int | None = None, until: int | None = None, trusted: bool | None = None, layer=None,
              state_factory=LedgerState) -> AuditReport:
    """Audit the log at ``path`` (a file, a log directory or one of its segments; see
    ``kvledger.tools.audit``); never raises for what is in the records.

    ``request``: a ledger request id, or a label (a str: an engine's name for its requests,
    ``RequestLabelled``; every ledger request with it). ``trusted``: the engine of a page
    view without ``check`` or ``svg_pages``
    (None: the fold of one page; False: the checked engine). ``state_factory``
    builds the fold the checked engine watches from seq 0 (``LedgerState``; a
    test hands it a deliberately broken one to show the independent checks
    catch it).

    Raises ``LogError`` for an unreadable file, ``CorruptLogError`` for a bad
    header, ``InvalidArgumentError`` for a page id out of range, for ``trusted``
    with anything but a page view, or for an ``until`` before the first event
    the log holds. A corrupt record ends the audit with ``report.error`` set.
    """
    t0 = time.perf_counter()
    fast = page is not None and not check and not svg_pages and trusted is not False
    if trusted and not fast:
        raise InvalidArgumentError("trusted: only a page view (--page without --check or --svg) folds trusted")
    with _open_window(path, layer, until, since, page is not None and since is None) as view, without_gc():
        rep = _report(view, page, request, snapshot, steps, check)
        _check_pages(page, svg_pages, rep.num_pages)
        try:
            st, start, ck = _start(view, since or 0, fast, state_factory)
        except KVLedgerError as exc:
            rep.error = _err(exc)
            rep.seconds = time.perf_counter() - t0
            return rep
        rep.start_seq = max(st.seq, since or 0)
        rep.checkpoint_seq = None if ck is None else ck.seq
        rep.window = _window_text(view, rep, since, until)
        if fast:
            assert page is not None
            _run_page(view, st, start, rep, page, until)
        else:
            _run_checked(view, st, start, rep, dict(page=page, request=request, snapshot=snapshot, check=check,
                                                    svg_pages=svg_pages or [], since=rep.start_seq), until, steps)
        sc = view.scan
        if rep.error is None and sc.error is not None and (until is None or sc.error.seq is None
                                                           or until >= sc.error.seq):
            rep.error = _err(sc.error)
        rep.seconds = time.perf_counter() - t0
    return rep


def _open_window(path, layer, until: int | None, since: int | None, page_default: bool) -> LogView:
    """The view the window needs: from the segment holding ``since``; for a page's default window the
    last segment (or the one holding ``until``), from an earlier one when that holds fewer than
    ``MIN_WINDOW_EVENTS`` events (the segment holding the seq that many events before the end)."""
    if not page_default:
        view = open_view(path, layer=layer, until=until, since=since)
    else:
        view = open_view(path, layer=layer, until=until, since=_LAST if until is None else until)
        end = view.scan.next_seq if until is None else until + 1
        given = os.path.basename(view.paths[0]) == os.path.basename(os.fspath(path))  # a segment as the path
        if view.first_seq > 0 and end - view.first_seq < MIN_WINDOW_EVENTS and not given:
            view.close()
            view = open_view(path, layer=layer, until=until, since=max(0, end - MIN_WINDOW_EVENTS))
    if until is not None and until < view.first_seq:
        first = view.first_seq
        view.close()
        raise InvalidArgumentError(f"until {until} is before the first event {path} holds (seq {first})")
    return view


def _report(view: LogView, page, request, snapshot, steps: bool, check: bool) -> AuditReport:
    sc, hdr = view.scan, view.header
    subject = (f"page {page}" if page is not None else f"request {request}" if request is not None
               else f"snapshot {snapshot}" if snapshot is not None else "steps" if steps else "check")
    return AuditReport(path=view.path, num_pages=hdr.geometry.num_pages, page_tokens=hdr.geometry.page_tokens,
                       policy=hdr.policy, start_seq=0, end_seq=0, events=0, closed_cleanly=sc.closed,
                       torn_at=sc.torn_at, torn_bytes=sc.torn_bytes, subject=subject, first_file=view.paths[0])


def _start(view: LogView, since: int, trusted: bool, state_factory) -> tuple:
    """``(state, first record index, checkpoint or None)``: the last checkpoint at or before the window's
    start (``since``, or the first seq the view holds), else a fresh state at seq 0."""
    at = max(since, view.first_seq)
    if at == 0:
        return state_factory(), 0, None
    st, start, ck = start_state(view, at=at, trusted=trusted)
    if ck is None:
        if view.first_seq > 0:
            raise CorruptLogError(view.paths[0], view.header.size, view.first_seq, "the view holds no checkpoint "
                                  f"at or before seq {at} to start from")
        return state_factory(), 0, None  # no checkpoint that early: the watched fold from seq 0
    return st, start, ck


def _window_text(view: LogView, rep: AuditReport, since: int | None, until: int | None) -> str:
    """The window in words (the help says how to change it)."""
    end = f" to seq {until:,}" if until is not None else " to the end"
    ck = rep.checkpoint_seq
    if since is None and ck is not None:
        files = len(view.paths)
        which = (f"{os.path.basename(view.paths[0])}" + (f" and the {files - 1} segment(s) after it" if files > 1
                                                         else " (the last segment)"))
        text = f"from the checkpoint at seq {ck:,} that opens {which}{end}"
        return text + ("; --since SEQ starts earlier" if rep.subject.startswith("page") else "")
    if ck is not None:
        return f"from seq {rep.start_seq:,} (folded from the checkpoint at seq {ck:,}){end}"
    return f"from seq {rep.start_seq:,}{end}" + ("" if rep.start_seq else " (the log's first event)")


def _run_page(view: LogView, st: LedgerState, start: int, rep: AuditReport, page: int, until: int | None) -> None:
    """The fold of one page (``pages.PageFold``); ``st`` stays the window's start state."""
    fold = PageFold(st, page, rep.start_seq, view)
    rep.mode = "trusted"
    first = st.seq
    try:
        rep.events = fold_records(view, st, start, until=until, apply=fold.apply)
    except KVLedgerError as exc:
        rep.error = _err(exc)
        rep.events = max(0, (getattr(exc, "seq", None) or first) - first)
    else:
        fold.start()
    rep.rows, rep.end_seq = fold.rows, first + rep.events


def _run_checked(view: LogView, st: LedgerState, start: int, rep: AuditReport, kw: dict, until: int | None,
                 steps: bool) -> None:
    audit = CheckedAudit(st, rep, **kw)
    try:
        fold_records(view, st, start, until=until, apply=audit.apply)
    except KVLedgerError as exc:
        rep.error = _err(exc)
    audit.finish(closed=view.scan.closed and rep.error is None and until is None, steps_table=steps)


def _check_pages(page: int | None, svg_pages: list[int] | None, n: int) -> None:
    if page is not None and not 0 <= page < n:
        raise InvalidArgumentError(f"page {page} is out of range [0, {n})")
    if svg_pages:
        bad = [p for p in svg_pages if not 0 <= p < n]
        if bad:
            raise InvalidArgumentError(f"pages {bad[:8]} are out of range [0, {n})")


def _err(exc: KVLedgerError) -> dict:
    return {"kind": "corrupt" if isinstance(exc, CorruptLogError) else "error", "error": type(exc).__name__,
            "seq": getattr(exc, "seq", None), "offset": getattr(exc, "offset", None), "message": str(exc),
            "file": getattr(exc, "path", None)}
