"""The ``kvledger`` console script: one subcommand per module, loaded only when used.

    kvledger replay LOG [--trusted] [--until SEQ] [--from-checkpoint] [--json]
    kvledger audit LOG (--page N | --request R | --snapshot S | --steps | --check) [--json] [--svg OUT]
    kvledger demo [--no-clear] ...

``COMMANDS`` maps a subcommand to ``"module:function"`` and a one-line help. The
function is called as ``function(argv, prog="kvledger NAME")`` with the
arguments after the subcommand and returns the exit status; it builds its own
``argparse`` parser, calls ``add_logging_arguments`` and runs inside
``logging_configured``. Adding a subcommand is one entry in ``COMMANDS``;
nothing is imported until the subcommand runs, so ``kvledger --help`` stays
fast and torch-free.

This is the only place (with the examples) that configures logging: the
``kvledger`` stdlib logger gets a stderr handler whose structlog
``ProcessorFormatter`` renders the library's events (``kvledger.logs``) for the
console, or as JSON lines with ``--log-json``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["COMMANDS", "main", "add_logging_arguments", "configure_logging", "logging_configured"]

COMMANDS: dict[str, tuple[str, str]] = {
    "replay": ("kvledger.tools.replay_cli:main",
               "fold a log (checked, or --trusted) and compare it with what the live run recorded"),
    "audit": ("kvledger.tools.audit.cli:main",
              "page / request / snapshot lifecycles, steps per rank, lifecycle faults (--check), SVG timelines"),
    "events": ("kvledger.kvevents.cli:main",
               "export a recorded log's KV events (vLLM format) as JSON lines or on a ZMQ PUB socket"),
    "demo": ("kvledger.demo.cli:main",
             "the seed's KV-pressure failure (FP8 NaN from released snapshot rows), reproduced and fixed"),
}

_LEVELS = ("debug", "info", "warning", "error")


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """``--log-json`` and ``--log-level`` for a subcommand's parser."""
    g = parser.add_argument_group("logging (the kvledger logger, to stderr)")
    g.add_argument("--log-json", action="store_true", help="log events as JSON lines instead of the console renderer")
    g.add_argument("--log-level", choices=_LEVELS, default="warning", help="lowest level to log (default: warning)")


def configure_logging(ns: argparse.Namespace) -> None:
    """Send the ``kvledger`` logger's events to stderr, from ``add_logging_arguments``' options.

    Replaces the ``kvledger`` logger's handlers and level and stops it propagating
    (other libraries' loggers are left alone). ``logging_configured`` undoes it.
    """
    import structlog

    level = getattr(logging, getattr(ns, "log_level", "warning").upper())
    renderer: Any
    if getattr(ns, "log_json", False):
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
    ))
    logger = logging.getLogger("kvledger")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


@contextlib.contextmanager
def logging_configured(ns: argparse.Namespace) -> Iterator[None]:
    """``configure_logging(ns)`` for the block, then the ``kvledger`` logger as it was.

    An in-process caller (a test, a notebook) keeps its own logging setup.
    """
    logger = logging.getLogger("kvledger")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    configure_logging(ns)
    try:
        yield
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv=None) -> int:
    """Entry point of the ``kvledger`` script. Returns the subcommand's exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    from kvledger import __version__

    epilog = "commands:\n" + "\n".join(f"  {name:<8} {help}" for name, (_, help) in COMMANDS.items())
    epilog += "\n\nrun 'kvledger COMMAND --help' for a command's options."
    ap = argparse.ArgumentParser(prog="kvledger", description="kvledger: the KV-page ledger's tools.",
                                 epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"kvledger {__version__}")
    ap.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help=f"one of: {', '.join(COMMANDS)}")
    ap.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    fn = _resolve(COMMANDS[ns.command][0])
    try:
        return int(fn(ns.args, prog=f"kvledger {ns.command}") or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvledger ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
