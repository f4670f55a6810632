"""``kvledger events LOG``: export a recorded log's KV events (vLLM's format), offline.

    kvledger events LOG [--jsonl [--objects]] [-o PATH]       JSON lines (default; to stdout)
    kvledger events LOG --zmq ENDPOINT [--bind | --connect] [--replay ENDPOINT]
                        [--topic T] [--wait S] [--linger S]   msgpack batches on a ZMQ PUB socket
    common: [--layout map|array] [--hashes u64|raw] [--replay-format vllm|legacy]
            [--medium GPU] [--dp-rank N] [--until SEQ]

LOG is a log file, a log directory (from the first segment retention kept) or one
segment of one (from that segment on): the fold starts at the checkpoint such a
segment opens with, as ``kvledger replay`` does. The batches are those the live
publisher sent (``export``). JSON lines are vLLM's subscriber shape,
``[ts, [events], data_parallel_rank]`` per line (``--objects``: one object per
line with ``seq``, ``ts``, ``data_parallel_rank``, ``events``).

With ``--zmq`` the PUB socket binds or connects by vLLM's rule (``--bind`` /
``--connect`` override; the endpoint is offset by ``--dp-rank`` as vLLM does);
the export waits ``--wait`` seconds after opening it so that subscribers can
connect (a PUB socket drops what it sends before they do), and keeps the replay
socket answering for ``--linger`` seconds after the last batch. The endpoints as
a subscriber dials them, and a one-line summary, go to stderr. Exit status: 0
exported; 2 bad usage, an unreadable file, a bad endpoint or no pyzmq; 3 a
corrupt log (file, offset and seq printed).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import IO

from kvledger.core.errors import ConfigurationError, CorruptLogError, InvalidArgumentError, LogError

from .batcher import OMITTABLE
from .export import ExportSummary, JsonLinesSink, export_log
from .schema import HASH_FORMS, LAYOUTS, MEDIUM_GPU, REPLAY_FORMATS

__all__ = ["main", "EXIT_OK", "EXIT_USAGE", "EXIT_CORRUPT"]

EXIT_OK, EXIT_USAGE, EXIT_CORRUPT = 0, 2, 3


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Export a log's KV events (vLLM's msgpack format) as "
                                 "JSON lines or on a ZMQ PUB socket.")
    ap.add_argument("log", metavar="LOG", help="the event log: a file, a log directory or one of its segments")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--jsonl", action="store_true", help="JSON lines, one batch a line (the default)")
    out.add_argument("--zmq", metavar="ENDPOINT", help="publish on a PUB socket at ENDPOINT (tcp://127.0.0.1:5557)")
    ap.add_argument("--objects", action="store_true",
                    help="JSON lines: an object per batch with its seq, not vLLM's [ts, events, dp_rank]")
    ap.add_argument("-o", "--output", metavar="PATH", help="JSON lines: write to PATH instead of stdout")
    side = ap.add_mutually_exclusive_group()
    side.add_argument("--bind", dest="bind", action="store_const", const=True, default=None,
                      help="with --zmq: bind ENDPOINT (default: vLLM's rule, bind for *, ::, ipc://, inproc://)")
    side.add_argument("--connect", dest="bind", action="store_const", const=False,
                      help="with --zmq: connect to ENDPOINT (a subscriber or proxy that binds)")
    ap.add_argument("--replay", metavar="ENDPOINT", help="with --zmq: a replay (ROUTER) socket bound at ENDPOINT")
    ap.add_argument("--topic", default="", help="with --zmq: the topic frame (default: empty)")
    ap.add_argument("--wait", type=float, default=0.5, metavar="S",
                    help="with --zmq: seconds between opening the socket and the first batch (default 0.5)")
    ap.add_argument("--linger", type=float, default=0.0, metavar="S",
                    help="with --zmq: seconds to keep answering replays after the last batch (default 0)")
    ap.add_argument("--layout", choices=tuple(LAYOUTS), default="map",
                    help="msgpack layout of the events (default: map, vLLM >= 0.26; JSON lines always map)")
    ap.add_argument("--hashes", choices=HASH_FORMS, default="u64",
                    help="block hashes: u64 (vLLM's fold, the default) or raw (as the ledger holds them)")
    ap.add_argument("--replay-format", choices=REPLAY_FORMATS, default="vllm",
                    help="with --replay: answers as vLLM 0.33 frames them (default) or legacy [seq, payload]")
    ap.add_argument("--medium", default=MEDIUM_GPU, help="the events' medium (default: GPU)")
    ap.add_argument("--dp-rank", type=int, default=0, metavar="N", help="data_parallel_rank of every batch")
    ap.add_argument("--until", type=int, default=None, metavar="SEQ", help="stop after the event with this seq")
    ap.add_argument("--allow-remote", action="store_true",
                    help="with --zmq: allow a bind other hosts can reach (a wildcard or routable address); the "
                    "events name tenants, token ids and cache salts, and ZMQ authenticates no subscriber")
    ap.add_argument("--omit", action="append", choices=OMITTABLE, default=[],
                    help="leave this field out of every event (repeatable): token_ids, tenant, salt")
    return ap


def _to_jsonl(ns: argparse.Namespace) -> ExportSummary:
    def run(out: IO[bytes]) -> ExportSummary:
        return export_log(ns.log, JsonLinesSink(out, objects=ns.objects), layout="map", medium=ns.medium,
                          data_parallel_rank=ns.dp_rank, until=ns.until, hashes=ns.hashes, omit=ns.omit)

    if ns.output in (None, "-"):
        return run(sys.stdout.buffer)
    with open(ns.output, "wb") as out:
        return run(out)


def _to_zmq(ns: argparse.Namespace, prog: str) -> ExportSummary:
    from .publisher import KVEventPublisher

    pub = KVEventPublisher(ns.zmq, replay_endpoint=ns.replay, topic=ns.topic, layout=ns.layout, bind=ns.bind,
                           hashes=ns.hashes, replay_format=ns.replay_format, medium=ns.medium,
                           data_parallel_rank=ns.dp_rank, auto_flush=False, allow_remote=ns.allow_remote)
    with pub:
        side = "bound at" if pub.binds else "connected to"
        replay = f", replay at {pub.replay_endpoint}" if pub.replay_endpoint else ""
        print(f"{prog}: PUB {side} {pub.endpoint}{replay}", file=sys.stderr, flush=True)
        time.sleep(max(0.0, ns.wait))
        summary = export_log(ns.log, pub.publish, layout=ns.layout, medium=ns.medium,
                             data_parallel_rank=ns.dp_rank, until=ns.until, hashes=ns.hashes, omit=ns.omit)
        pub.wait_sent(pub.statistics().last_seq, timeout=60)
        time.sleep(max(0.0, ns.linger))
    return summary


def main(argv=None, prog: str = "kvledger events") -> int:
    """Run the export; returns the exit status (module docstring)."""
    ns = _parser(prog).parse_args(sys.argv[1:] if argv is None else list(argv))
    if ns.zmq is None and (ns.replay is not None or ns.topic or ns.bind is not None or ns.allow_remote):
        print(f"{prog}: --replay, --topic, --bind, --connect and --allow-remote need --zmq", file=sys.stderr)
        return EXIT_USAGE
    if ns.zmq is not None and (ns.output is not None or ns.objects):
        print(f"{prog}: --output and --objects are for JSON lines, not --zmq", file=sys.stderr)
        return EXIT_USAGE
    try:
        summary = _to_zmq(ns, prog) if ns.zmq is not None else _to_jsonl(ns)
    except CorruptLogError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_CORRUPT
    except (LogError, ConfigurationError, InvalidArgumentError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    torn = "" if summary.torn_at is None else f"; torn tail at offset {summary.torn_at} left out"
    start = "" if summary.from_checkpoint is None else f" from the checkpoint at seq {summary.from_checkpoint}"
    print(f"{prog}: {summary.batches} batches, {summary.kv_events} KV events from {summary.events} log events "
          f"(seq {summary.first_seq}..{summary.last_seq}{start}){torn}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
