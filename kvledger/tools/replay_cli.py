"""``kvledger replay``'s command line: arguments, a progress bar, the summary, the exit status.

Exit status: 0 the log replays; 1 a replay mismatch, a broken invariant or an
event the fold rejects; 2 bad usage or an unreadable file; 3 a corrupt log.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import Any

import msgspec

from kvledger.core.errors import CorruptLogError, InvalidArgumentError, LogError
from kvledger.logs import get_logger

from .replay import replay_log
from .replay_report import EXIT_CORRUPT, EXIT_USAGE, INVARIANT_MODES, exit_code, render

__all__ = ["main"]


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
    """``kvledger replay``: parse ``argv``, replay, print; returns the exit status."""
    ap = _parser(prog)
    ns = ap.parse_args(argv)
    if ns.until is not None and ns.until < 0:
        ap.error("--until must be >= 0")
    from kvledger.tools.cli import logging_configured

    with logging_configured(ns):
        return _run(ns)


def _parser(prog: str) -> argparse.ArgumentParser:
    from kvledger.tools import replay
    from kvledger.tools.cli import add_logging_arguments

    ap = argparse.ArgumentParser(prog=prog, description=replay.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the log: a file, a log directory, or one segment of a directory (from there on)")
    ap.add_argument("--until", type=int, metavar="SEQ", help="stop after the event with this seq (inclusive)")
    ap.add_argument("--from-checkpoint", action="store_true",
                    help="start from the last checkpoint at or before --until instead of the first event")
    ap.add_argument("--trusted", action="store_true",
                    help="apply the verified records' events without each one's precondition (the fold's speed): "
                         "page ids, step numbers and recorded plans are still checked, digests and invariants at "
                         "checkpoints; a forged event that breaks only a precondition is not found. Default: checked")
    ap.add_argument("--invariants", choices=INVARIANT_MODES, default="auto",
                    help="when to run the O(num_pages) invariant checks (default auto: at a sealed step -- trusted: "
                         "a checkpoint -- every 16 x num_pages events, and at the end; steps: every sealed step -- "
                         "trusted: every checkpoint); a checked replay validates every event and compares every "
                         "recorded plan anyway")
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
                             invariants=ns.invariants, trusted=ns.trusted, progress=bar)
    except (LogError, InvalidArgumentError) as exc:  # unreadable, a bad header (CorruptLogError), a bad --until
        bar.close()
        log.error("replay_failed", error=str(exc))
        corrupt = isinstance(exc, CorruptLogError)
        _print_failure(ns, "corrupt" if corrupt else "unreadable" if isinstance(exc, LogError) else "usage", exc)
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
        log.error("replay_failed", kind=err.kind, seq=err.seq, offset=err.offset, file=err.file)
    return exit_code(summary)


def _print_failure(ns: argparse.Namespace, kind: str, exc: Exception) -> None:
    seq = getattr(exc, "seq", None)
    offset = getattr(exc, "offset", None)
    file = getattr(exc, "path", None)
    if ns.json:
        error = {"kind": kind, "seq": seq, "offset": offset, "error": type(exc).__name__, "message": str(exc),
                 "file": file}
        sys.stdout.write(msgspec.json.encode({"path": ns.log, "ok": False, "error": error}).decode() + "\n")
    else:
        print(f"result  FAILED ({kind}): {exc}")
