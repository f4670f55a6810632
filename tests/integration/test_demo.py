"""``kvledger demo`` scaled down: the seed's failure reproduced (clears off) and fixed
(clears on: zero failures, logits bit-identical to a run that never reuses a page),
on torch's own scaled_dot_product_attention. The log the demo writes replays to the
live digest. Budget: about 15 s on 2 shared cores (three CLI subprocesses included).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import anyio
import pytest

torch = pytest.importorskip("torch")

from support.demo import simulate_demo  # noqa: E402

from kvledger import PageOutOfRangeError, replay  # noqa: E402
from kvledger.core.events import SnapshotReleased  # noqa: E402
from kvledger.core.log import open_view  # noqa: E402
from kvledger.demo import INVALID_SPECULATION, DemoConfig  # noqa: E402
from kvledger.demo.cli import build_parser, main  # noqa: E402
from kvledger.demo.model import FP8, ModelConfig, RankModel, fp8_nan_bytes  # noqa: E402
from kvledger.demo.ranks import SkipClearBackend  # noqa: E402
from kvledger.demo.results import compare_logits  # noqa: E402
from kvledger.demo.run import run_demo, simulate  # noqa: E402
from support.cli import SCRIPT, kvledger  # noqa: E402

SMALL = DemoConfig(requests=12, short_tokens=128, long_tokens=256)


@pytest.fixture(scope="module", name="reference")
def small_reference():
    ref = simulate_demo(SMALL, reference=True)
    assert ref.passed == ref.requests == 12 and ref.invalid_speculation == 0
    assert ref.page_reuses == 0 and ref.pages_listed == 0  # no pressure: nothing reused, nothing stale
    return ref


# ---------------------------------------------------------------------- the model pieces


def test_snapshot_rows_alias_the_kv_planes_and_carry_fp8_nan_bytes():
    mc = ModelConfig()
    planes = [torch.zeros(6, 16, mc.heads, mc.head_dim, dtype=FP8) for _ in range(2 * mc.layers)]
    state = torch.randn(mc.layers, mc.heads, mc.head_dim, mc.head_dim, generator=torch.Generator().manual_seed(3))
    rows = RankModel.snapshot_rows(planes, [4, 1])
    nan = RankModel.write_snapshot(state, rows)
    # the rows are the planes' bytes: pages 4 and 1 of every plane changed, nothing else
    for plane in planes:
        u8 = plane.view(torch.uint8)
        assert u8[4].count_nonzero() > 0 and u8[1].count_nonzero() > 0
        assert u8[[0, 2, 3, 5]].count_nonzero() == 0
    assert nan == sum(fp8_nan_bytes(plane.view(torch.uint8)) for plane in planes) > 0
    assert any(torch.isnan(plane[4].to(torch.float32)).any() for plane in planes)
    assert RankModel.snapshot_matches(state, rows)
    planes[1].view(torch.uint8)[4, 0, 0, 0] ^= 1  # one flipped bit in a live row is seen
    assert not RankModel.snapshot_matches(state, rows)


def test_skip_clear_backend_validates_like_a_real_one_and_zeroes_nothing():
    plane = torch.full((4, 8), 0x7F, dtype=torch.uint8)
    b = SkipClearBackend([plane])
    b.clear([0, 3])
    assert b.pages_skipped == 2 and int((plane == 0x7F).sum()) == 32
    with pytest.raises(PageOutOfRangeError):
        b.clear([4])


# ---------------------------------------------------------------------- the demo both ways


def test_clears_on_no_failures_and_logits_equal_reference(tmp_path, reference):
    log = str(tmp_path / "demo.kvlog")
    run = simulate_demo(SMALL, log_path=log)
    assert run.passed == 12 and run.invalid_speculation == 0
    # the pressure was real: released snapshot pages came back as tail pages, and were zeroed
    assert run.tails_released > 0 and run.pages_zeroed == run.pages_listed >= run.tails_released
    assert run.bytes_zeroed == run.pages_zeroed * 4 * 16 * 4 * 16  # 4 FP8 planes of [16 tokens, 4 heads, 16]
    assert run.nan_bytes_written > 0 and run.snapshot_rows_intact == run.snapshots_released > 0
    assert run.page_budget < reference.page_budget and run.page_reuses > 0
    oracle = compare_logits(run, reference)
    assert oracle == {"equal": True, "requests_equal": 12, "requests": 12, "max_abs_diff": 0.0}
    for rid, logits in reference.logits.items():
        assert logits.shape == (SMALL.gen_tokens, 256) and torch.isfinite(logits).all()
        assert torch.equal(run.logits[rid], logits)
    # the event log replays, from its first event, to the live digest
    with open_view(log) as view:
        assert view.scan.error is None and view.scan.torn_at is None
        events = [ev for _, ev, _ in view.iter_events()]
    assert len(events) == run.events
    assert sum(isinstance(e, SnapshotReleased) for e in events) == run.snapshots_released
    assert replay(events, check=True).digest() == run.digest


def test_clears_off_reproduces_invalid_speculation(reference):
    run = simulate_demo(dataclasses.replace(SMALL, clear=False))
    assert run.invalid_speculation >= 1 and run.passed + run.invalid_speculation == 12
    assert run.pages_listed > 0 and run.pages_zeroed == 0 and run.bytes_zeroed == 0  # listed, never zeroed
    assert sorted(run.failed_requests) == sorted(set(run.failed_requests))
    oracle = compare_logits(run, reference)
    assert not oracle["equal"] and oracle["requests_equal"] == run.passed
    assert INVALID_SPECULATION == 6


def test_clears_off_without_snapshots_is_harmless(reference):
    """The control: no snapshot rows, so no released alias pages. Pages finished
    requests leave behind still hold stale (finite) FP8 KV, never cleared, yet masked
    attention adds exactly 0 for them: no failure, logits still bit-identical."""
    run = simulate_demo(dataclasses.replace(SMALL, clear=False, snapshot_cache=0))
    assert run.snapshots_made == 0 and run.pages_listed == 0 and run.page_reuses > 0
    assert run.invalid_speculation == 0 and compare_logits(run, reference)["equal"]


@pytest.mark.parametrize("policy", ["cross_tenant", "all_reused"])
def test_other_policies_clear_more_and_still_match(policy, reference):
    base = simulate_demo(SMALL)
    run = simulate_demo(dataclasses.replace(SMALL, policy=policy))
    assert run.invalid_speculation == 0 and compare_logits(run, reference)["equal"]
    assert run.pages_zeroed > base.pages_zeroed


@pytest.mark.asyncio
async def test_two_ranks_through_the_engine_both_ways():
    cfg = dataclasses.replace(SMALL, requests=6, ranks=2)
    ref = await simulate(cfg, reference=True)
    on = await simulate(cfg)
    off = await simulate(dataclasses.replace(cfg, clear=False))
    assert on.invalid_speculation == 0 and compare_logits(on, ref)["equal"]
    assert off.invalid_speculation >= 1
    assert on.bytes_zeroed == on.pages_zeroed * 2 * (4 * 16 * 2 * 16)  # 2 ranks x 4 planes of 2 heads


# ---------------------------------------------------------------------- the command line


def _cli(*argv, cwd=None):
    # a wide console: rich wraps the table (and the log's path in it) at 80 columns otherwise
    env = {**os.environ, "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "kvledger.demo", *argv], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_cli_both_ways_table_json_and_exit_status(tmp_path):
    small = ["--requests", "12", "--prompt-tokens", "128,256", "--no-progress"]
    log, js = tmp_path / "on.kvlog", tmp_path / "on.json"
    p = _cli(*small, "--log", str(log), "--json", str(js))
    assert p.returncode == 0, p.stderr
    assert "INVALID_SPECULATION" in p.stdout and "yes (12/12" in p.stdout and str(log) in p.stdout
    for row in ("clear, host", "clear, device", "engine overhead", "bare loop overhead"):
        assert row in p.stdout
    assert "prefix cache hit rate" not in p.stdout
    data = json.loads(js.read_text())
    assert data["ok"] is True and data["run"]["invalid_speculation"] == 0 and data["oracle"]["equal"] is True
    run = data["run"]  # issue 15's figures: clear host and device time per step, the engine against a bare loop
    assert 0 < run["clear_host_mean_s"] <= run["clear_host_max_s"] and run["clear_dev_mean_s"] > 0
    assert run["bare_steps"] > 0 and run["bare_mismatch"] == 0
    assert run["bare_engine_overhead_mean_s"] > 0 and run["bare_overhead_mean_s"] > 0
    assert data["log_path"] == str(log) and os.path.getsize(log) > 0
    js_off = tmp_path / "off.json"
    p = _cli(*small, "--no-clear", "--no-reference", "--json", str(js_off))
    assert p.returncode == 0, p.stderr  # the failure is what --no-clear demonstrates
    off = json.loads(js_off.read_text())
    assert off["run"]["invalid_speculation"] >= 1 and off["oracle"] is None and off["run"]["pages_zeroed"] == 0


@pytest.mark.parametrize(
    "argv, what",
    [
        (["--prompt-tokens", "12"], "SHORT,LONG"),
        (["--ranks", "3"], "divide"),
        (["--policy", "nope"], "invalid choice"),
        (["--requests", "0"], "requests"),
    ],
)
def test_cli_bad_arguments_exit_2(argv, what, capsys):
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        status = exc.code
    assert status == 2
    assert what in capsys.readouterr().err


def test_cli_unknown_backend_exits_2_before_writing_a_log(tmp_path, capsys):
    log = tmp_path / "never.kvlog"
    assert main(["--backend", "nope", "--log", str(log), "--no-progress", "--requests", "2"]) == 2
    assert "unknown clear backend" in capsys.readouterr().err and not log.exists()


def test_cli_refuses_an_existing_log(tmp_path, capsys):
    log = tmp_path / "x.kvlog"
    log.write_bytes(b"not mine")
    args = build_parser().parse_args(["--log", str(log), "--no-progress"])  # a parsed Namespace works too
    assert main(args) == 2
    assert "exists" in capsys.readouterr().err and log.read_bytes() == b"not mine"


def test_run_demo_reports_ok_only_when_the_oracle_holds():
    rep = anyio.run(lambda: run_demo(SMALL))
    assert rep.ok and rep.oracle["equal"] and rep.to_dict()["run"]["passed"] == 12
    bad = anyio.run(lambda: run_demo(dataclasses.replace(SMALL, clear=False)))
    assert bad.ok  # clears off: the failure is the demonstration, not a broken demo
    assert not bad.oracle["equal"]


@pytest.mark.skipif(
    importlib.util.find_spec("kvledger.tools.cli") is None or SCRIPT is None,
    reason="the kvledger console script (replay/audit) is not installed",
)
def test_log_replays_and_audits_with_the_console_script(tmp_path):
    log = tmp_path / "demo.kvlog"
    run = simulate_demo(SMALL, log_path=str(log))
    p = kvledger("replay", str(log))
    assert p.returncode == 0, p.stdout + p.stderr
    assert run.digest in p.stdout
    p = kvledger("audit", "--check", str(log))
    assert p.returncode == 0, p.stdout + p.stderr


def test_keep_going_runs_the_same_schedule_with_clears_off():
    """The timing baseline: with keep_going, a run with clears off issues exactly the
    commands of a run with clears on (the scheduler never reads logits): same steps, same
    ledger digest; only the zeroing differs, and the stale bytes it leaves show up."""
    on = simulate_demo(SMALL)
    off = simulate_demo(dataclasses.replace(SMALL, clear=False, keep_going=True))
    assert (off.steps, off.events, off.digest, off.pages_listed) == (on.steps, on.events, on.digest, on.pages_listed)
    assert off.invalid_speculation >= 1 and off.passed == 12 - off.invalid_speculation
    assert on.pages_zeroed == on.pages_listed and off.pages_zeroed == 0


def test_importing_the_demo_and_its_cli_does_not_import_torch():
    code = "import sys, kvledger.demo, kvledger.demo.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_the_small_runs_events_and_digest_are_pinned():
    """The ledger's decisions on a fixed workload, pinned: a change to the allocator, the fold,
    the event set or the canonical digest shows up here first, and is made on purpose (the
    README's full-size demo printed 2,036 events, digest 36a2a8799320, before and after the
    2026-12-01 consolidation)."""
    run = simulate_demo(SMALL)
    assert (run.events, run.digest) == (105, "e8f8df579a19eda7f6d07a73101e0df8c3eb829442b6ef12f6e9fea064b59978")
