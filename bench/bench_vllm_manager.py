"""Cost inside vLLM: one serving trace through vLLM 0.33's KVCacheManager, on vLLM's pool and on kvledger's.

    $(python scripts/vllm-conformance --version 0.33.0 --python) bench/bench_vllm_manager.py [--quick]
    (the venv ``scripts/vllm-conformance`` builds; elsewhere the module reports itself skipped)

Workload (fixed seed, generated before any clock runs; ``driver.make_trace``): 300
requests (100 with --quick) whose prompts are one of 6 shared system prefixes of
64-512 tokens (or none, one in five) plus 16-384 tokens of their own, 8-192 output
tokens, about one arrival per step; 16-token blocks; a pool of 2,000 blocks (some
eviction of cached blocks when caching is on). ``driver.run_trace`` plays it the way
vLLM's scheduler calls the manager: per step ``new_step_starts``, running requests'
``allocate_slots`` (decode token or next prefill chunk of <= 512, preempting the
newest when full), waiting requests' ``get_computed_blocks`` + ``allocate_slots``
under a 2,048-token budget, ``take_new_block_ids``, then the tokens advance, one is
appended per finished prefill or decode, and finished requests are ``free``d.

    vllm      vLLM's own ``BlockPool`` (the baseline)
    kvledger  ``install(log=..., fsync="background")``: ``LedgerBlockPool`` writing
              the durable log (a fresh file per run; the writer thread syncs in the
              background, closing it is not timed)

Both run with prefix caching off and on. Each run builds its manager untimed and
times ``run_trace`` alone (the collector disabled, as bench/_common's ``time_call``);
runs alternate, best of N after a discarded warm-up. Untimed check: both pools hand
out the same block ids at every allocation. ratio = vLLM time / kvledger time
(kvledger's throughput as a fraction of vLLM's; goal >= 1.0).

The trace is this module's own (``kvledger.integrations.vllm.driver``), not the core
issue's ``bench/serving_trace.py``, which is not on main yet.
"""

from __future__ import annotations

import os
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _common import interleaved, print_table, time_call  # noqa: E402

TARGETS = {"ratio_caching_on": (">=", 1.0), "ratio_caching_off": (">=", 1.0)}
NUM_BLOCKS = 2000


def _vllm_missing() -> str | None:
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except ImportError as exc:
        return f"vLLM is not installed here ({exc}); run it with the venv scripts/vllm-conformance builds"
    return None


def _case(trace, caching: bool, ledger: bool, tmp: str, stats: dict):
    from kvledger.integrations.vllm import install
    from kvledger.integrations.vllm.driver import make_manager, run_trace

    def one() -> float:
        if not ledger:
            manager = make_manager(NUM_BLOCKS, enable_caching=caching)
            seconds, _ = time_call(run_trace, manager, trace)
            return seconds
        log = tempfile.mktemp(suffix=".kvlog", dir=tmp)
        with install(log=log, fsync="background"):
            manager = make_manager(NUM_BLOCKS, enable_caching=caching)
            seconds, _ = time_call(run_trace, manager, trace)
            stats["events"] = manager.block_pool.ledger.seq
        os.unlink(log)
        return seconds

    return one


def _check_same_blocks(trace, caching: bool) -> int:
    from kvledger.integrations.vllm import install
    from kvledger.integrations.vllm.driver import make_manager, run_trace

    base = run_trace(make_manager(NUM_BLOCKS, enable_caching=caching), trace, collect_blocks=True)
    with install():
        led = run_trace(make_manager(NUM_BLOCKS, enable_caching=caching), trace, collect_blocks=True)
    if led.block_ids != base.block_ids:
        raise AssertionError("kvledger's pool handed out other blocks than vLLM's")
    return base.allocations


def run(quick: bool) -> dict:
    missing = _vllm_missing()
    if missing:
        print(f"bench_vllm_manager: skipped: {missing}")
        return {"skipped": missing}
    from kvledger.integrations.vllm.driver import make_trace

    trace = make_trace(seed=11, requests=100 if quick else 300)
    repeats = 3 if quick else 7
    out: dict = {"requests": len(trace), "blocks": NUM_BLOCKS, "repeats": repeats}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        for caching in (False, True):
            allocations = _check_same_blocks(trace, caching)
            stats: dict = {}
            res = interleaved({"vllm": _case(trace, caching, False, tmp, stats),
                               "kvledger": _case(trace, caching, True, tmp, stats)}, repeats)
            tag = "on" if caching else "off"
            ratio = res["vllm"].best / res["kvledger"].best
            out[f"ratio_caching_{tag}"] = ratio
            out[f"vllm_s_caching_{tag}"] = res["vllm"].best
            out[f"kvledger_s_caching_{tag}"] = res["kvledger"].best
            out[f"allocations_caching_{tag}"] = allocations
            out[f"ledger_events_caching_{tag}"] = stats["events"]
            for name, t in res.items():
                rows.append([f"caching {tag}", name, f"{t.best * 1e3:.0f}", f"{t.median * 1e3:.0f}", f"{t.spread:.0%}",
                             f"{allocations / t.best:,.0f}", f"{ratio:.2f}x" if name == "kvledger" else "1.00x"])
            rows.append([f"caching {tag}", "ledger events", str(stats["events"]), "", "", "", ""])
    print_table(f"vLLM KVCacheManager, {len(trace)} requests, {NUM_BLOCKS} blocks of 16 tokens; kvledger pool with its "
                f"durable log (background fsync); best of {repeats}, alternated",
                ["caching", "pool", "best ms", "median ms", "spread", "allocate_slots/s", "vs vLLM"], rows)
    return out


if __name__ == "__main__":
    run("--quick" in sys.argv[1:])
