"""``kvledger demo``: the seed's KV-pressure failure, reproduced and fixed.

    kvledger demo                       # 143 requests, clears on: 0 failures, logits == reference
    kvledger demo --no-clear            # the seed's failure: INVALID_SPECULATION > 0
    kvledger demo --prefix-cache        # tenants' system prompts shared: hit rate, pages shared / evicted
    kvledger demo --sanitize            # the sanitizer's debug mode: 0 violations (with --no-clear: > 0)
    kvledger demo --metrics-port 9400   # Prometheus metrics on 127.0.0.1:9400 while it runs
    python -m kvledger.demo --requests 12 --prompt-tokens 128,256

``main(argv, prog="kvledger demo") -> int`` follows the ``kvledger`` CLI's
subcommand convention (a list of arguments in, the exit status out; register it as
``"demo": ("kvledger.demo.cli:main", ...)`` in ``kvledger.tools.cli.COMMANDS``); it also
takes an ``argparse.Namespace`` already parsed by a parser that ran
``add_arguments``. ``python -m kvledger.demo`` runs the same on its own.
Importing this module does not import torch.

Exit status: 0 when the demo ran and, with clears on, every request passed and its
logits equal the reference (with ``--no-clear`` the failures are the point: 0 too);
1 when clears were on and a request failed or logits differ, or the run itself
failed; 2 for bad arguments or a configuration this machine cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import tempfile

from kvledger.core.errors import ConfigurationError, InvalidArgumentError, KVLedgerError
from kvledger.core.events import CLEAR_POLICIES

from .workload import DemoConfig

__all__ = ["add_arguments", "build_parser", "config_from_args", "main"]

_D = DemoConfig()


def _pair(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SHORT,LONG (two token counts), got {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return a, b


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags (the ``kvledger demo`` subcommand and ``python -m kvledger.demo``)."""
    w = parser.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=_D.requests, help="requests in the trace (default %(default)s)")
    w.add_argument("--prompt-tokens", type=_pair, default=(_D.short_tokens, _D.long_tokens), metavar="SHORT,LONG",
                   help=f"alternating prompt lengths (default {_D.short_tokens},{_D.long_tokens}; "
                        "the seed: 16384,32768)")
    w.add_argument("--gen-tokens", type=int, default=_D.gen_tokens,
                   help="tokens generated per request (default %(default)s)")
    w.add_argument("--page-tokens", type=int, default=_D.page_tokens, help="tokens per page (default %(default)s)")
    w.add_argument("--page-budget", type=int, default=None,
                   help=f"pages in the cache under pressure (default: {_D.pressure:.2f} x the pages of "
                        "--max-running average requests)")
    w.add_argument("--max-running", type=int, default=_D.max_running,
                   help="requests decoding at once (default %(default)s)")
    w.add_argument("--snapshot-cache", type=int, default=None,
                   help="cap on live snapshots (default: none; snapshots are evicted under page pressure)")
    w.add_argument("--snapshot-every", type=int, default=_D.snapshot_every,
                   help="prefill snapshots the recurrent state every this many tokens and at the prompt's end "
                        "(default %(default)s)")
    w.add_argument("--seed", type=int, default=_D.seed, help="model weights and prompts (default %(default)s)")
    w.add_argument("--prefix-cache", action="store_true",
                   help="every prompt starts with its tenant's system prompt, whose full pages the tenant's "
                        "requests share through the ledger's prefix cache (cached, evicted under pressure)")
    w.add_argument("--system-tokens", type=int, default=None, metavar="N",
                   help="--prefix-cache: tokens of each tenant's system prompt (default: half the short prompt)")
    k = parser.add_argument_group("ledger and executors")
    k.add_argument("--no-clear", action="store_true",
                   help="the seed's failure: the ledger lists pages but the executors do not zero them")
    k.add_argument("--sanitize", action="store_true",
                   help="the engine's sanitizer (debug mode): poison marked pages, check after every clear; "
                        "a violation stops the step before its graph reads a stale byte")
    k.add_argument("--keep-going", action="store_true",
                   help="count INVALID_SPECULATION but keep decoding (the schedule then matches a run with "
                        "clears on: for step-time comparisons)")
    k.add_argument("--policy", choices=CLEAR_POLICIES, default=_D.policy, help="clear policy (default %(default)s)")
    k.add_argument("--device", choices=("cpu", "cuda"), default=_D.device, help="where planes and model live")
    k.add_argument("--backend", default=_D.backend, help="clear backend: torch, cuda, triton (default %(default)s)")
    k.add_argument("--ranks", type=int, default=_D.ranks, help="in-process tensor-parallel ranks (default %(default)s)")
    k.add_argument("--threads", type=int, default=_D.threads,
                   help="torch intra-op threads on the CPU (default %(default)s; 0: leave torch's setting)")
    m = parser.add_argument_group("model")
    m.add_argument("--layers", type=int, default=_D.layers)
    m.add_argument("--heads", type=int, default=_D.heads)
    m.add_argument("--head-dim", type=int, default=_D.head_dim)
    o = parser.add_argument_group("output")
    o.add_argument("--log", metavar="PATH", default=None,
                   help="event log to write (a new file; default: a fresh temporary file, printed at the end)")
    o.add_argument("--json", metavar="PATH", default=None, help="also write the figures as JSON")
    o.add_argument("--no-reference", action="store_true", help="skip the reference run (no logits oracle)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("--bare-every", type=int, default=_D.bare_every, metavar="N",
                   help="every N steps also run the step's graph bare, without the engine, for the engine's "
                        "overhead figure (default %(default)s; 0: never)")
    x = parser.add_argument_group("metrics (pip install kvledger[metrics])")
    x.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics while the demo runs "
                        "(0: a free port, printed)")
    x.add_argument("--metrics-linger", type=float, default=0.0, metavar="SECONDS",
                   help="after the run, keep serving until one more scrape, at most SECONDS (default 0)")


def build_parser(prog: str = "python -m kvledger.demo") -> argparse.ArgumentParser:
    """The demo's parser: its flags plus the ``kvledger`` CLI's ``--log-level`` / ``--log-json``."""
    from kvledger.tools.cli import add_logging_arguments

    p = argparse.ArgumentParser(prog=prog,
                                description="kvledger demo: the seed's KV-pressure failure, reproduced and fixed.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    add_logging_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """A validated ``DemoConfig``; raises ``InvalidArgumentError`` / ``ConfigurationError``."""
    short, long = args.prompt_tokens
    return DemoConfig(
        requests=args.requests,
        short_tokens=short,
        long_tokens=long,
        gen_tokens=args.gen_tokens,
        page_tokens=args.page_tokens,
        page_budget=args.page_budget,
        max_running=args.max_running,
        snapshot_cache=args.snapshot_cache,
        snapshot_every=args.snapshot_every,
        policy=args.policy,
        clear=not args.no_clear,
        keep_going=args.keep_going,
        device=args.device,
        backend=args.backend,
        ranks=args.ranks,
        seed=args.seed,
        threads=args.threads or None,
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        d_model=max(_D.d_model, args.heads * args.head_dim),
        prefix_cache=args.prefix_cache,
        system_tokens=args.system_tokens,
        bare_every=args.bare_every,
        sanitize=args.sanitize,
    ).validate()


def _log_path(arg: str | None) -> str:
    if arg is None:
        return os.path.join(tempfile.mkdtemp(prefix="kvledger-demo-"), "events.kvlog")
    if os.path.exists(arg):
        raise InvalidArgumentError(f"--log {arg} exists: the demo writes a new log (give a new path)")
    parent = os.path.dirname(os.path.abspath(arg))
    if not os.path.isdir(parent):
        raise InvalidArgumentError(f"--log {arg}: directory {parent} does not exist")
    return arg


def _logging_configured(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The CLI configures logging (the library never does): the ``kvledger`` CLI's
    ``--log-level`` / ``--log-json`` when the parser has them, put back as it was on the
    way out (an in-process caller keeps its own). A ``Namespace`` without them leaves
    logging to the application (configured nowhere: warnings reach stderr)."""
    if hasattr(args, "log_level"):
        from kvledger.tools.cli import logging_configured

        return logging_configured(args)
    return contextlib.nullcontext()


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def main(args=None, prog: str = "kvledger demo") -> int:
    """Run the demo; print the table; return the exit status.

    ``args``: a list of command-line arguments (``None``: ``sys.argv[1:]``), parsed with
    ``build_parser(prog)``, or a ``Namespace`` from a parser that ran ``add_arguments``.
    """
    from rich.console import Console

    if not isinstance(args, argparse.Namespace):
        args = build_parser(prog).parse_args(args)

    out, err = Console(), Console(stderr=True)
    try:
        config = config_from_args(args)
        log_path = _log_path(args.log)
    except KVLedgerError as exc:
        err.print(f"kvledger demo: error: {exc}", markup=False, highlight=False)
        return 2
    with _logging_configured(args):
        return _run(args, config, log_path, out, err)


def _start_metrics(args: argparse.Namespace, err):
    """``--metrics-port``: a ``LedgerMetrics`` on a fresh registry and its ``MetricsServer``
    (``(None, None)`` without the flag). Raises ``ConfigurationError`` (no prometheus-client,
    port taken) or ``InvalidArgumentError`` (bad port or linger); nothing is left running then."""
    port = getattr(args, "metrics_port", None)
    if port is None:
        return None, None
    linger = getattr(args, "metrics_linger", 0.0)
    if not linger >= 0:
        raise InvalidArgumentError(f"--metrics-linger must be >= 0 seconds, got {linger}")
    from kvledger.metrics import LedgerMetrics, MetricsServer, prometheus

    registry = prometheus().CollectorRegistry()
    metrics = LedgerMetrics(registry)
    server = MetricsServer(registry, port=port)
    err.print(f"metrics: serving {server.url}", markup=False, highlight=False, soft_wrap=True)
    return metrics, server


def _stop_metrics(server, args: argparse.Namespace, err) -> None:
    """``--metrics-linger``: serve until one more scrape (or the time is up), then stop. The scrape
    waited for began after the run was over (not one in flight then), so it holds the final figures."""
    linger = getattr(args, "metrics_linger", 0.0)
    try:
        if linger > 0:
            err.print(f"metrics: the run is over; serving {server.url} until one more scrape "
                      f"(at most {linger:g} s)", markup=False, highlight=False, soft_wrap=True)
            server.wait_fresh_scrape(linger)
    finally:
        server.close()


def _run(args: argparse.Namespace, config: DemoConfig, log_path: str, out, err) -> int:
    try:
        metrics, server = _start_metrics(args, err)
    except KVLedgerError as exc:
        err.print(f"kvledger demo: error: {exc}", markup=False, highlight=False)
        return 2
    try:
        return _run_and_report(args, config, log_path, out, err, metrics)
    finally:
        if server is not None:
            _stop_metrics(server, args, err)


def _run_and_report(args: argparse.Namespace, config: DemoConfig, log_path: str, out, err, metrics) -> int:
    import anyio

    from .run import run_demo
    from .table import progress_bars, render_table

    try:
        with progress_bars(err, enabled=not args.no_progress) as progress:
            report = anyio.run(functools.partial(run_demo, config, log_path=log_path,
                                                 reference=not args.no_reference, progress=progress,
                                                 metrics=metrics))
    except ConfigurationError as exc:
        err.print(f"kvledger demo: error: {exc}", markup=False, highlight=False)
        return 2
    except KVLedgerError as exc:
        err.print(f"kvledger demo: the run failed: {type(exc).__name__}: {exc}", markup=False, highlight=False)
        return 1
    out.print(render_table(report))
    if report.run.sanitizer_first:
        out.print(f"sanitizer, first violation: {report.run.sanitizer_first}", markup=False, highlight=False)
    out.print(f"event log: {log_path}", markup=False, highlight=False)
    out.print(f"  kvledger replay {log_path}", markup=False, highlight=False)
    out.print(f"  kvledger audit --check {log_path}", markup=False, highlight=False)
    if args.json:
        data = report.to_dict()
        data["log_path"] = log_path
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(_json_safe(data), f, indent=2, sort_keys=True)
            f.write("\n")
    if not report.ok:
        bad = report.run.requests - (report.oracle or {}).get("requests_equal", report.run.passed)
        err.print(f"kvledger demo: clears were on but {bad} request(s) failed or logits differ from the reference",
                  markup=False, highlight=False)
        return 1
    return 0
