"""Smoke test of the fold benchmark's trace: the ledger and the baseline agree on it."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

import bench_fold  # noqa: E402


def test_fold_trace_agrees_with_ledger_and_baseline():
    for variant in bench_fold.VARIANTS:
        tr = bench_fold.make_trace(variant, steps=45)
        out = bench_fold.verify(tr, windows=((0.0, 1.0),))  # every command's holder changes counted
        assert out["events"] == len(tr.ops) and out["cleared_pages"] > 0
