"""``kvledger audit``'s command line: arguments, the SVG's default pages, exit status.

Exit status: 0 no faults; 1 faults; 2 bad usage or an unreadable file; 3 corrupt log.
"""

from __future__ import annotations

import argparse
import gc
import sys

import msgspec

from kvledger.core.errors import CorruptLogError, InvalidArgumentError, LogError
from kvledger.logs import get_logger

from .report import AuditReport
from .run import audit_log
from .views import render

__all__ = ["EXIT_CORRUPT", "EXIT_FAULTS", "EXIT_OK", "EXIT_USAGE", "main", "report_json"]

EXIT_OK, EXIT_FAULTS, EXIT_USAGE, EXIT_CORRUPT = 0, 1, 2, 3


def main(argv=None, *, prog: str = "kvledger audit") -> int:
    """``kvledger audit``: parse ``argv``, audit, print; returns the exit status."""
    from kvledger.tools.cli import logging_configured

    ap = _parser(prog)
    ns = ap.parse_args(argv)
    for name in ("since", "until"):
        if getattr(ns, name) is not None and getattr(ns, name) < 0:
            ap.error(f"--{name} must be >= 0")
    if ns.pages:
        try:
            _parse_pages(ns.pages)
        except ValueError:
            ap.error(f"--pages: cannot parse {ns.pages!r} (ranges like 0-31,40)")
    if ns.checked and ns.page is None:
        ap.error("--checked goes with --page (the other views always validate every event)")
    with logging_configured(ns):
        return _run(ns)


def _parser(prog: str) -> argparse.ArgumentParser:
    from kvledger.tools import audit
    from kvledger.tools.cli import add_logging_arguments

    ap = argparse.ArgumentParser(prog=prog, description=audit.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the log: a file, a log directory, or one segment of a directory (from there on)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--page", type=int, metavar="N",
                      help="timeline of page N; by default over the log's last segment (from the checkpoint it "
                           "opens with: the page's state there, then every transition), the fold of that one page; "
                           "the report's 'window' line says what it covered; --since SEQ goes further back")
    what.add_argument("--request", type=_request_id, metavar="R",
                      help="timeline of request R (a ledger request id; anything else is a label, as --label)")
    what.add_argument("--label", metavar="ID", help="timeline of every ledger request an engine labelled ID (a vLLM "
                                                    "request id: its blocks in every KV cache group)")
    what.add_argument("--snapshot", type=int, metavar="S", help="timeline of snapshot S and the pages it marked")
    what.add_argument("--steps", action="store_true",
                      help="every step: the ranks that completed it, aborts and the steps aborted with them")
    what.add_argument("--check", action="store_true", help="report lifecycle faults over the whole log")
    ap.add_argument("--since", type=int, metavar="SEQ",
                    help="start at this seq (folded from the last checkpoint at or before it; a log directory is "
                         "read from the segment holding it); --since 0: from the log's first event")
    ap.add_argument("--until", type=int, metavar="SEQ", help="stop after the event with this seq")
    ap.add_argument("--checked", action="store_true",
                    help="--page: validate every event of the window (the whole fold; rejected events shown) "
                         "instead of folding the one page")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--svg", metavar="OUT", help="also write a page x seq timeline as a standalone SVG")
    ap.add_argument("--pages", metavar="LIST", help="pages for --svg, e.g. 0-31,40 (default: the subject's pages)")
    add_logging_arguments(ap)
    return ap


def _request_id(text: str) -> int | str:
    """``--request``'s value: a ledger request id when it is a number, else an engine's label."""
    return int(text) if text.isdigit() else text


def _run(ns: argparse.Namespace) -> int:
    log = get_logger("kvledger.audit").bind(log=ns.log)
    request = ns.label if ns.label is not None else ns.request
    kw = dict(page=ns.page, request=request, snapshot=ns.snapshot, steps=ns.steps, check=ns.check,
              since=ns.since, until=ns.until)
    gc.disable()  # a batch run: decoded events and the state hold no reference cycles
    try:
        rep = audit_log(ns.log, **kw, trusted=False if ns.checked else None)
        if ns.svg:
            _write_svg(ns, rep, kw)
    except CorruptLogError as exc:
        log.error("audit_failed", error=str(exc))
        print(f"FAILED (corrupt): {exc}")
        return EXIT_CORRUPT
    except (LogError, InvalidArgumentError, OSError) as exc:
        log.error("audit_failed", error=str(exc))
        print(f"FAILED: {exc}")
        return EXIT_USAGE
    finally:
        gc.enable()
    if ns.json:
        sys.stdout.write(msgspec.json.encode(report_json(rep)).decode() + "\n")
    else:
        print(render(rep))
    if rep.error is not None:
        return EXIT_CORRUPT if rep.error["kind"] == "corrupt" else EXIT_FAULTS
    return EXIT_FAULTS if rep.faults else EXIT_OK


def report_json(rep: AuditReport) -> dict:
    """What ``--json`` prints: the report less the SVG's data, plus ``ok``."""
    data = msgspec.to_builtins(rep)
    for k in ("segments", "markers", "steps", "svg_pages", "marked_pages"):
        data.pop(k, None)
    data["ok"] = rep.ok
    return data


def _write_svg(ns: argparse.Namespace, rep: AuditReport, kw: dict) -> None:
    """The timeline of the subject's pages (or ``--pages``), from a check-mode audit (faults drawn) over
    the report's window."""
    from .svg import render_svg

    pages = _svg_pages(rep, ns, rep.num_pages)
    if rep.subject == "check" or pages != rep.svg_pages:
        since = rep.start_seq if rep.start_seq else kw["since"]
        full = audit_log(ns.log, **{**kw, "check": True, "steps": False, "since": since}, svg_pages=pages)
    else:
        full = rep
    with open(ns.svg, "w", encoding="utf-8") as f:
        f.write(render_svg(full))


def _parse_pages(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b) if b else int(a)
        if hi < lo or hi - lo > 100_000:
            raise ValueError(part)
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


def _svg_pages(rep_view: AuditReport | None, ns: argparse.Namespace, num_pages: int) -> list[int]:
    if ns.pages:
        return _parse_pages(ns.pages)
    if ns.page is not None:
        lo = max(0, ns.page - 4)
        return list(range(lo, min(num_pages, lo + 9)))
    if rep_view is not None:
        seen: list[int] = []
        for r in rep_view.rows:
            for p in r.page_ids:
                if p not in seen:
                    seen.append(p)
        for f in rep_view.faults:
            for p in f.page_ids:
                if p not in seen:
                    seen.append(p)
        if seen:
            return sorted(seen[:48])
        if rep_view.marked_pages:
            return sorted(rep_view.marked_pages[:32])
    return list(range(min(num_pages, 32)))
