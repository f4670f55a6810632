"""``kvledger audit``'s command line: arguments, the SVG's default pages, exit status.

Exit status: 0 no faults; 1 faults; 2 bad usage or an unreadable file; 3 corrupt log.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from kvledger.core.errors import CorruptLogError, InvalidArgumentError, LogError
from kvledger.logs import get_logger

from .report import AuditReport
from .run import audit_log
from .views import render

__all__ = ["EXIT_CORRUPT", "EXIT_FAULTS", "EXIT_OK", "EXIT_USAGE", "main"]

EXIT_OK, EXIT_FAULTS, EXIT_USAGE, EXIT_CORRUPT = 0, 1, 2, 3


def main(argv=None, *, prog: str = "kvledger audit") -> int:
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
    with logging_configured(ns):
        return _run(ns)


def _parser(prog: str) -> argparse.ArgumentParser:
    from kvledger.tools import audit
    from kvledger.tools.cli import add_logging_arguments

    ap = argparse.ArgumentParser(prog=prog, description=audit.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the log file")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--page", type=int, metavar="N", help="timeline of page N")
    what.add_argument("--request", type=int, metavar="R", help="timeline of request R")
    what.add_argument("--snapshot", type=int, metavar="S", help="timeline of snapshot S and the pages it marked")
    what.add_argument("--check", action="store_true", help="report lifecycle faults over the whole log")
    ap.add_argument("--since", type=int, metavar="SEQ", help="start at this seq (from the nearest checkpoint)")
    ap.add_argument("--until", type=int, metavar="SEQ", help="stop after the event with this seq")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--svg", metavar="OUT", help="also write a page x seq timeline as a standalone SVG")
    ap.add_argument("--pages", metavar="LIST", help="pages for --svg, e.g. 0-31,40 (default: the subject's pages)")
    add_logging_arguments(ap)
    return ap


def _run(ns: argparse.Namespace) -> int:
    log = get_logger("kvledger.audit").bind(log=ns.log)
    kw = dict(page=ns.page, request=ns.request, snapshot=ns.snapshot, check=ns.check, since=ns.since, until=ns.until)
    try:
        rep = audit_log(ns.log, **kw)
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
    if ns.json:
        data = msgspec.to_builtins(rep)
        for k in ("segments", "markers", "steps", "svg_pages", "marked_pages"):
            data.pop(k, None)
        data["ok"] = rep.ok
        sys.stdout.write(msgspec.json.encode(data).decode() + "\n")
    else:
        print(render(rep))
    if rep.error is not None:
        return EXIT_CORRUPT if rep.error["kind"] == "corrupt" else EXIT_FAULTS
    return EXIT_FAULTS if rep.faults else EXIT_OK


def _write_svg(ns: argparse.Namespace, rep: AuditReport, kw: dict) -> None:
    """The timeline of the subject's pages (or ``--pages``), from a check-mode audit (faults drawn)."""
    from .svg import render_svg

    pages = _svg_pages(rep, ns, rep.num_pages)
    if rep.subject == "check" or pages != rep.svg_pages:
        full = audit_log(ns.log, **{**kw, "check": True}, svg_pages=pages)
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
