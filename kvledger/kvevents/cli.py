"""``kvledger events LOG``: export a recorded log's KV events (vLLM's format), offline.

    kvledger events LOG [--jsonl] [-o PATH]                  JSON lines (default; to stdout)
    kvledger events LOG --zmq ENDPOINT [--replay ENDPOINT]   msgpack batches on a ZMQ PUB socket
                        [--topic T] [--wait S] [--linger S]
    common: [--layout array|map] [--medium GPU] [--dp-rank N] [--until SEQ]

The batches are those the live publisher sent (``export``); with ``--zmq`` the
export waits ``--wait`` seconds after binding so that subscribers can connect
(a PUB socket drops what it sends before they do), and keeps the replay socket
answering for ``--linger`` seconds after the last batch. A one-line summary goes
to stderr. Exit status: 0 exported; 2 bad usage, an unreadable file, a bad
endpoint or no pyzmq; 3 a corrupt log (offset and seq printed).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import IO

from kvledger.core.errors import ConfigurationError, CorruptLogError, InvalidArgumentError, LogError

from .export import ExportSummary, JsonLinesSink, export_log
from .schema import LAYOUTS, MEDIUM_GPU

__all__ = ["main", "EXIT_OK", "EXIT_USAGE", "EXIT_CORRUPT"]

EXIT_OK, EXIT_USAGE, EXIT_CORRUPT = 0, 2, 3


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Export a log's KV events (vLLM's msgpack format) as "
                                 "JSON lines or on a ZMQ PUB socket.")
    ap.add_argument("log", metavar="LOG", help="the event log")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--jsonl", action="store_true", help="JSON lines, one batch a line (the default)")
    out.add_argument("--zmq", metavar="ENDPOINT", help="publish on a PUB socket bound at ENDPOINT (tcp://*:5557)")
    ap.add_argument("-o", "--output", metavar="PATH", help="JSON lines: write to PATH instead of stdout")
    ap.add_argument("--replay", metavar="ENDPOINT", help="with --zmq: a replay (ROUTER) socket bound at ENDPOINT")
    ap.add_argument("--topic", default="", help="with --zmq: the topic frame (default: empty)")
    ap.add_argument("--wait", type=float, default=0.5, metavar="S",
                    help="with --zmq: seconds between binding and the first batch (default 0.5)")
    ap.add_argument("--linger", type=float, default=0.0, metavar="S",
                    help="with --zmq: seconds to keep answering replays after the last batch (default 0)")
    ap.add_argument("--layout", choices=tuple(LAYOUTS), default="array",
                    help="msgpack layout of the events (default: array; --jsonl always names fields)")
    ap.add_argument("--medium", default=MEDIUM_GPU, help="the events' medium (default: GPU)")
    ap.add_argument("--dp-rank", type=int, default=0, metavar="N", help="data_parallel_rank of every batch")
    ap.add_argument("--until", type=int, default=None, metavar="SEQ", help="stop after the event with this seq")
    return ap


def _to_jsonl(ns: argparse.Namespace) -> ExportSummary:
    out: IO[bytes]
    if ns.output in (None, "-"):
        out = sys.stdout.buffer
        return export_log(ns.log, JsonLinesSink(out), layout="map", medium=ns.medium,
                          data_parallel_rank=ns.dp_rank, until=ns.until)
    with open(ns.output, "wb") as out:
        return export_log(ns.log, JsonLinesSink(out), layout="map", medium=ns.medium,
                          data_parallel_rank=ns.dp_rank, until=ns.until)


def _to_zmq(ns: argparse.Namespace) -> ExportSummary:
    from .publisher import KVEventPublisher

    pub = KVEventPublisher(ns.zmq, replay_endpoint=ns.replay, topic=ns.topic, layout=ns.layout,
                           medium=ns.medium, data_parallel_rank=ns.dp_rank, auto_flush=False)
    with pub:
        time.sleep(max(0.0, ns.wait))
        summary = export_log(ns.log, pub.publish, layout=ns.layout, medium=ns.medium,
                             data_parallel_rank=ns.dp_rank, until=ns.until)
        pub.wait_sent(pub.statistics().last_seq, timeout=60)
        time.sleep(max(0.0, ns.linger))
    return summary


def main(argv=None, prog: str = "kvledger events") -> int:
    """Run the export; returns the exit status (module docstring)."""
    ns = _parser(prog).parse_args(sys.argv[1:] if argv is None else list(argv))
    if ns.zmq is None and (ns.replay is not None or ns.topic):
        print(f"{prog}: --replay and --topic need --zmq", file=sys.stderr)
        return EXIT_USAGE
    if ns.zmq is not None and ns.output is not None:
        print(f"{prog}: --output is for JSON lines, not --zmq", file=sys.stderr)
        return EXIT_USAGE
    try:
        summary = _to_zmq(ns) if ns.zmq is not None else _to_jsonl(ns)
    except CorruptLogError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    except (LogError, ConfigurationError, InvalidArgumentError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    torn = "" if summary.torn_at is None else f"; torn tail at offset {summary.torn_at} left out"
    print(f"{prog}: {summary.batches} batches, {summary.kv_events} KV events from {summary.events} log events "
          f"(seq 0..{summary.last_seq}){torn}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
