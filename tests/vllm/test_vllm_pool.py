"""LedgerBlockPool under vLLM 0.33's own KVCacheManager (skips where vLLM is not installed).

The oracle is vLLM's own pool: the same serving trace (prefix-sharing prompts,
chunked prefill, decode, preemption) driven through two ``KVCacheManager``s, one
on vLLM's ``BlockPool`` and one on kvledger's, must hand out the same block ids
at every allocation and return the same ``take_events()`` sequence, event by
event, with ``verify()`` (vLLM's blocks against the ledger, page by page) and
every ledger invariant checked after every call. The durable log of such a run
replays and passes ``kvledger audit --check``; its published and evicted hashes
are vLLM's. Under ``all_reused`` the clear list of each step is exactly the
blocks handed out again after an earlier use. ``scripts/vllm-conformance`` runs
this file in its vLLM environment; CI's main suite skips it.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager", exc_type=ImportError)

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from kvledger.integrations.vllm import install  # noqa: E402
from kvledger.integrations.vllm.driver import make_manager, make_request, make_trace, run_trace  # noqa: E402
from kvledger.integrations.vllm.pool import LedgerBlockPool, PoolOptions  # noqa: E402

TRACE = make_trace(seed=23, requests=40, prefixes=3, prefix_tokens=(32, 160), suffix_tokens=(8, 120),
                   output_tokens=(4, 48), arrivals_per_step=2.0)
NUM_BLOCKS = 80  # tight: eviction of cached blocks and preemption both happen


def run(caching: bool, **install_options):
    kw = dict(enable_caching=caching, enable_kv_cache_events=True)
    if not install_options:
        manager = make_manager(NUM_BLOCKS, **kw)
        return manager, run_trace(manager, TRACE, collect_events=True, collect_blocks=True, max_running=16)
    with install(**install_options):
        manager = make_manager(NUM_BLOCKS, **kw)
        assert isinstance(manager.block_pool, LedgerBlockPool)
        stats = run_trace(manager, TRACE, collect_events=True, collect_blocks=True, max_running=16)
        return manager, stats


@pytest.mark.parametrize("caching", [False, True])
def test_same_blocks_and_kv_events_as_vllms_pool(caching):
    base_manager, base = run(caching)
    led_manager, led = run(caching, verify=True, check=True)
    assert led.block_ids == base.block_ids  # every allocation, block id for block id
    assert (led.finished, led.preempted, led.hit_tokens) == (base.finished, base.preempted, base.hit_tokens)
    assert led.events == base.events  # take_events(), step by step, event by event
    flat = [e for step in base.events for e in step]
    if caching:
        assert led.hit_tokens > 0 and led.preempted > 0
        assert any(isinstance(e, BlockStored) for e in flat) and any(isinstance(e, BlockRemoved) for e in flat)
        base_manager.reset_prefix_cache()
        led_manager.reset_prefix_cache()
        tail = led_manager.take_events()
        assert tail == base_manager.take_events() and isinstance(tail[-1], AllBlocksCleared)
        assert led_manager.block_pool.ledger.cached_count == 0
    led_manager.block_pool.verify()


def test_an_eviction_vllms_managers_make_by_hand_is_mirrored():
    """vLLM's Mamba manager calls the pool's ``_maybe_evict_cached_block`` itself (a checkpoint
    block it overwrites): the ledger evicts the page too, whether it is cached or held."""
    pool = LedgerBlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4,
                           ledger_options=PoolOptions(check=True, verify=True))
    request = make_request("r", list(range(8)), 1, block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, 4, 0)
    assert pool.ledger.block_hash(blocks[0].block_id) is not None
    assert pool._maybe_evict_cached_block(blocks[1])  # held: its ledger hash goes when it is released
    pool.free_blocks(reversed(blocks))
    assert pool.ledger.cached_count == 1 and pool.ledger.block_hash(blocks[1].block_id) is None
    assert pool._maybe_evict_cached_block(blocks[0])  # cached: evicted at once
    assert pool.ledger.cached_count == 0
    pool.verify()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True, timeout=120)


def test_durable_log_replays_audits_and_records_vllms_hashes(tmp_path):
    log = tmp_path / "vllm.kvlog"
    manager, stats = run(True, log=log, fsync="background")
    vllm_stored = [h for step in stats.events for e in step if isinstance(e, BlockStored) for h in e.block_hashes]
    vllm_removed = [h for step in stats.events for e in step if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert manager.block_pool.log_path is not None
    replay = _cli("replay", str(log))
    assert replay.returncode == 0, replay.stdout + replay.stderr
    check = _cli("audit", str(log), "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    page = vllm_stored and stats.block_ids[0][1][0][0]
    audit = _cli("audit", str(log), "--page", str(page))
    assert audit.returncode == 0 and "cached(" in audit.stdout, audit.stdout
    exported = _cli("events", str(log), "--jsonl", "--objects", "--hashes", "raw")
    assert exported.returncode == 0, exported.stderr
    stored, removed = [], []
    parents: dict = {}  # stored hash -> the hash of the block before it in its request (None: the first)

    def vllm_hash(raw):
        # the ledger's hash is vLLM's BlockHashWithGroupId: the block hash, then 4 bytes of group id
        # (vLLM's events carry it as vLLM converts it: a u64 by default)
        return None if raw is None else maybe_convert_block_hash(base64.b64decode(raw)[:-4])

    for line in exported.stdout.splitlines():
        for ev in json.loads(line)["events"]:
            if ev["type"] in ("BlockStored", "BlockRemoved"):
                hashes = [vllm_hash(h) for h in ev["block_hashes"]]
                (stored if ev["type"] == "BlockStored" else removed).extend(hashes)
                if ev["type"] == "BlockStored":
                    parents.update(zip(hashes, [vllm_hash(ev["parent_block_hash"]), *hashes[:-1]], strict=True))
    assert stored == vllm_stored and removed == vllm_removed
    assert len(stored) > len(removed) > 0
    vllm_parents = {h: parent for step in stats.events for e in step if isinstance(e, BlockStored)
                    for h, parent in zip(e.block_hashes, [e.parent_block_hash, *e.block_hashes[:-1]], strict=True)}
    assert parents == vllm_parents  # each block's parent, as vLLM's own events give it


def test_example_drives_vllm_and_prints_the_audit_of_one_block(tmp_path):
    out = subprocess.run([sys.executable, "examples/vllm_prefix_audit.py", "--requests", "30", "--blocks", "120",
                          "--log", str(tmp_path / "ex.kvlog")], capture_output=True, text=True, timeout=300,
                         cwd=pathlib.Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "on LedgerBlockPool" in text and "result       OK" in text and "no lifecycle faults" in text
    assert "pages_published" in text and "pages_shared" in text, text


# --------------------------------------------------------------------------- a failing log disk

def _faults():
    import errno

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from support.simdisk import FaultInjector

    def err(code):
        return lambda op, n: OSError(code, f"injected {os.strerror(code)} on {op} #{n}")

    return {
        "eio_fsync": lambda: FaultInjector(fail_sync=2),
        "enospc_write": lambda: FaultInjector(fail_write=3, partial=True, error=err(errno.ENOSPC)),
        "erofs_write": lambda: FaultInjector(fail_write=3, error=err(errno.EROFS)),
    }


@pytest.mark.parametrize("fault", ["eio_fsync", "enospc_write", "erofs_write"])
def test_a_failing_log_disk_detaches_the_ledger_and_vllm_keeps_scheduling(tmp_path, fault, caplog):
    """A full disk, an EIO on fsync, a file system gone read-only, during a driven run: vLLM schedules
    exactly as on its own pool, the ledger stops recording with one ERROR and a metric, and what the
    log acknowledged replays and audits. Kills: a LogError raised into vLLM's scheduler."""
    import logging

    from prometheus_client import REGISTRY

    _, base = run(True)
    before = REGISTRY.get_sample_value("kvledger_vllm_detached_total", {"reason": "LogIOError"}) or 0
    path = tmp_path / "x.kvlog"
    caplog.set_level(logging.ERROR, logger="kvledger")
    with install(log=str(path), layer=_faults()[fault]()):
        manager = make_manager(NUM_BLOCKS, enable_caching=True, enable_kv_cache_events=True)
        stats = run_trace(manager, TRACE, collect_events=True, collect_blocks=True, max_running=16)
        pool = manager.block_pool
    # (the writer thread meets the fault in the background: the pool learns of it at the log's next
    # gate during the run, or at the close at the latest, which uninstall makes)
    assert pool.detached is not None and "LogIOError" in pool.detached, pool.detached
    assert stats.block_ids == base.block_ids and stats.events == base.events  # vLLM never noticed
    errors = [r for r in caplog.records if r.name.startswith("kvledger") and r.levelno >= logging.ERROR
              and "stopped recording" in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    after = REGISTRY.get_sample_value("kvledger_vllm_detached_total", {"reason": "LogIOError"})
    assert after == before + 1
    for args in (["replay", str(path)], ["audit", str(path), "--check"]):
        proc = subprocess.run([sys.executable, "-m", "kvledger", *args], capture_output=True, text=True)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])


def test_a_log_that_cannot_be_opened_leaves_vllm_on_its_own_pool(tmp_path):
    import errno

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from support.simdisk import FaultInjector

    layer = FaultInjector(fail_op=1, error=lambda op, n: OSError(errno.EROFS, "read-only file system"))
    with install(log=str(tmp_path / "x.kvlog"), layer=layer):
        manager = make_manager(NUM_BLOCKS, enable_caching=True)
        stats = run_trace(manager, TRACE, max_running=16)
        assert manager.block_pool.detached is not None and stats.finished == len(TRACE)


def test_a_restart_with_the_same_log_goes_on_in_a_new_epoch(tmp_path):
    """Kills: a reopened log whose old holds refuse the new process's first block (PageNotHeldError)."""
    path = tmp_path / "x.kvlog"
    for epoch in range(3):
        with install(log=str(path)):
            manager = make_manager(NUM_BLOCKS, enable_caching=True)
            run_trace(manager, TRACE[: 10 + epoch], max_running=8)
            if epoch == 1:
                manager.block_pool.ledger.close()  # (a crash: steps and requests left open)
    proc = subprocess.run([sys.executable, "-m", "kvledger", "audit", str(path), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
