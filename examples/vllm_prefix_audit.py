"""vLLM's own KVCacheManager on kvledger's block pool: a serving trace with prefix caching, then the
audit of one block from the durable log.

    pip install 'kvledger[vllm]'            # or: python scripts/vllm-conformance (builds a vLLM venv)
    (without vLLM it exits 2, naming that install command)
    python examples/vllm_prefix_audit.py [--requests 120] [--blocks 400] [--log vllm.kvlog] [--policy all_reused]

``install()`` makes every vLLM ``BlockPool`` built afterwards a ``LedgerBlockPool``;
the manager below is vLLM's class, unchanged, driven as vLLM's scheduler drives
it (``kvledger.integrations.vllm.driver``: prompts that share system prefixes,
chunked prefill, decode, preemption). Every block transition is an event in the
log (background fsync: the scheduler never waits for the disk). At the end:
``kvledger replay`` and ``kvledger audit --check`` of the log, and the audit of
the first block of the first shared prefix: reserved, committed, published,
shared by later requests, cached, evicted.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile

from kvledger.integrations.vllm import install
from kvledger.integrations.vllm.driver import make_manager, make_trace, run_trace
from kvledger.tools.cli import main as kvledger_cli


INSTALL = "pip install 'kvledger[vllm]'"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--blocks", type=int, default=400, help="KV cache blocks (few: eviction and preemption)")
    ap.add_argument("--log", default=None, help="the log to write (default: a temporary file)")
    ap.add_argument("--policy", default="released_aliases", choices=["released_aliases", "all_reused"])
    args = ap.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(f"vllm_prefix_audit.py needs vLLM, which is not installed here: {INSTALL}", file=sys.stderr)
        raise SystemExit(2)
    log = pathlib.Path(args.log) if args.log else pathlib.Path(tempfile.mkdtemp(prefix="kvledger-vllm-")) / "vllm.kvlog"

    trace = make_trace(seed=7, requests=args.requests)
    with install(log=log, fsync="background", policy=args.policy) as inst:
        manager = make_manager(args.blocks, enable_caching=True, enable_kv_cache_events=True)
        cleared: list[int] = []
        pool = manager.block_pool
        stats = run_trace(manager, trace, collect_blocks=True, collect_events=True,
                          on_step=lambda step: cleared.extend(pool.last_block_ids_to_zero))
        events = pool.ledger.seq
        stored = sum(len(e.block_hashes) for step in stats.events for e in step if type(e).__name__ == "BlockStored")
    print(f"vLLM {type(manager).__name__} on {type(pool).__name__}: {stats.finished} requests in {stats.steps} "
          f"steps, {stats.hit_tokens} prompt tokens from the prefix cache, {stats.preempted} preemptions")
    print(f"ledger: {events} events in {log} ({len(inst.pools)} pool); vLLM's KV events stored {stored} block "
          f"hashes; clear lists ({args.policy}): {len(cleared)} block ids")
    page = stats.block_ids[0][1][0][0]  # the first block of the first request's prompt
    for argv in (["replay", str(log)], ["audit", str(log), "--check"], ["audit", str(log), "--page", str(page)]):
        print(f"\n$ kvledger {' '.join(argv).replace(str(log), 'LOG')}", flush=True)
        rc = kvledger_cli(argv)
        if rc:
            raise SystemExit(f"kvledger {argv[0]} exited {rc}")


if __name__ == "__main__":
    main()
