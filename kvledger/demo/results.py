"""What a demo run reports: ``RunResult`` per run, the logits oracle, and ``DemoReport``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .workload import DemoConfig

__all__ = ["DemoReport", "RunResult", "compare_logits"]


@dataclasses.dataclass
class RunResult:
    """What one run did (all counts are over the whole run)."""

    label: str
    requests: int = 0
    passed: int = 0
    invalid_speculation: int = 0
    steps: int = 0
    wall_s: float = 0.0
    step_s: float = 0.0  # sum of run_step wall times (seal -> every rank done)
    clear_s: float = 0.0  # sum over steps of the slowest rank's clear phase
    graph_s: float = 0.0
    steps_with_clears: int = 0
    clear_step_s: float = 0.0  # run_step wall time of the steps that had a clear list
    pages_listed: int = 0  # clear-list entries of completed steps
    pages_zeroed: int = 0  # listed pages a backend actually zeroed (0 with --no-clear)
    bytes_zeroed: int = 0  # over every plane of every rank
    tails_released: int = 0  # decode tail pages that were released snapshot pages (row bytes in them)
    page_reuses: int = 0  # reservations that got a page some request or snapshot held before
    snapshots_made: int = 0
    snapshots_released: int = 0
    snapshots_skipped: int = 0
    snapshots_dropped: int = 0  # --sanitize: made for a step it stopped, released unwritten
    snapshot_rows_intact: int = 0  # snapshots whose rows still held their state at release
    nan_bytes_written: int = 0  # FP8 NaN bytes (0x7F / 0xFF) written through snapshot rows
    # per step, the slowest rank's clear phase, over the steps with a clear list: host time
    # enqueuing it (RankTiming.clear_host_s) and its own time (clear_s: CUDA event time on a GPU)
    clear_host_sum_s: float = 0.0
    clear_host_max_s: float = 0.0
    clear_dev_sum_s: float = 0.0
    clear_dev_max_s: float = 0.0
    overhead_sum_s: float = 0.0  # every step: run_step wall time - the slowest rank's graph time
    overhead_max_s: float = 0.0
    bare_steps: int = 0  # steps also run bare, without the engine (bare.py)
    bare_graph_s: float = 0.0
    bare_engine_overhead_s: float = 0.0  # the engine's overhead on those steps
    bare_engine_overhead_max_s: float = 0.0
    bare_overhead_s: float = 0.0  # the bare loop's: its wall time - the graph's own time
    bare_overhead_max_s: float = 0.0
    bare_mismatch: int = 0  # requests whose bare-run logits differ from the engine's in any bit
    # --sanitize: the slowest rank's poison + check per completed step, and what it stopped
    sanitize_sum_s: float = 0.0
    sanitize_max_s: float = 0.0
    sanitizer_violations: int = 0  # (rank, plane, page) violations the checks found
    sanitizer_steps: int = 0  # steps the sanitizer stopped before their graph
    sanitizer_stopped: int = 0  # requests of those steps (failed: none got its token)
    sanitizer_first: str = ""  # the first SanitizerError: rank, plane, page, request, step, lifecycle
    # --prefix-cache
    prefix_requests: int = 0  # admitted with a prefix lookup
    prefix_hits: int = 0  # ... that shared the prefix
    prefix_tokens_looked: int = 0  # their prompt tokens
    prefix_hit_tokens: int = 0  # ... whose K/V came from shared pages
    pages_shared: int = 0
    pages_published: int = 0
    pages_evicted: int = 0  # cached pages evicted by reservations and snapshot aliases
    pages_cached_end: int = 0  # cached pages once every request ended
    page_budget: int = 0
    events: int = 0
    digest: str = ""
    log_path: str | None = None
    backend: str = ""
    logits: dict = dataclasses.field(default_factory=dict, repr=False)  # request -> [gen, vocab] float32
    clear_lists: list = dataclasses.field(default_factory=list, repr=False)  # each clearing step's list
    failed_requests: list = dataclasses.field(default_factory=list)

    def figures(self) -> dict:
        """The flat figures (no logits), for JSON and tables."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("logits", "failed_requests")}
        out["failed_requests"] = list(self.failed_requests)
        out["step_mean_s"] = self.step_s / self.steps if self.steps else 0.0
        out["clear_share"] = self.clear_s / self.step_s if self.step_s else 0.0
        cs, bs = self.steps_with_clears, self.bare_steps
        out["clear_host_mean_s"] = self.clear_host_sum_s / cs if cs else 0.0
        out["clear_dev_mean_s"] = self.clear_dev_sum_s / cs if cs else 0.0
        out["overhead_mean_s"] = self.overhead_sum_s / self.steps if self.steps else 0.0
        out["bare_engine_overhead_mean_s"] = self.bare_engine_overhead_s / bs if bs else 0.0
        out["bare_overhead_mean_s"] = self.bare_overhead_s / bs if bs else 0.0
        out["sanitize_mean_s"] = self.sanitize_sum_s / self.steps if self.steps else 0.0
        looked = self.prefix_tokens_looked
        out["prefix_hit_rate"] = self.prefix_hit_tokens / looked if looked else 0.0
        return out

    def add_step(self, result: Any) -> None:
        """Count one completed step (a ``StepResult``): its wall, clear and graph times."""
        self.steps += 1
        self.step_s += result.wall_s
        clear_dev = max(t.clear_s for t in result.ranks)
        graph = max(t.graph_s for t in result.ranks)
        self.clear_s += clear_dev
        self.graph_s += graph
        over = result.wall_s - graph
        checked = max(t.sanitize_s for t in result.ranks)
        self.sanitize_sum_s += checked
        self.sanitize_max_s = max(self.sanitize_max_s, checked)
        self.overhead_sum_s += over
        self.overhead_max_s = max(self.overhead_max_s, over)
        if result.clear_list:
            clear_host = max(t.clear_host_s for t in result.ranks)
            self.steps_with_clears += 1
            self.clear_step_s += result.wall_s
            self.pages_listed += len(result.clear_list)
            self.clear_host_sum_s += clear_host
            self.clear_host_max_s = max(self.clear_host_max_s, clear_host)
            self.clear_dev_sum_s += clear_dev
            self.clear_dev_max_s = max(self.clear_dev_max_s, clear_dev)
            self.clear_lists.append(result.clear_list)

    def add_stop(self, error: Any, requests: int) -> None:
        """Count a step the sanitizer stopped with ``error`` (a ``SanitizerError``) before its
        graph read anything, and its ``requests`` (all failed); keep the first error's text."""
        self.sanitizer_violations += max(1, len(error.violations))
        self.sanitizer_steps += 1
        self.sanitizer_stopped += requests
        if not self.sanitizer_first:
            self.sanitizer_first = str(error)


def compare_logits(run: RunResult, ref: RunResult) -> dict:
    """The oracle: per request, are the logits bit-identical to the reference's?

    Returns ``{"equal": bool, "requests_equal": n, "requests": n, "max_abs_diff": float}``;
    a request that failed (no logits) counts as different.
    """
    equal = 0
    max_diff = 0.0
    for rid, want in ref.logits.items():
        got = run.logits.get(rid)
        if got is None or got.shape != want.shape:
            continue
        if torch.equal(got, want):
            equal += 1
        else:
            d = (got - want).abs()
            d = d[torch.isfinite(d)]
            if d.numel():
                max_diff = max(max_diff, float(d.max()))
    return {
        "equal": equal == ref.requests and len(ref.logits) == ref.requests,
        "requests_equal": equal,
        "requests": ref.requests,
        "max_abs_diff": max_diff,
    }


@dataclasses.dataclass
class DemoReport:
    """A demo: the run under pressure, the reference run (optional) and the oracle."""

    config: DemoConfig
    run: RunResult
    reference: RunResult | None
    oracle: dict | None
    wall_s: float

    @property
    def ok(self) -> bool:
        """With clears on: every request passed and (when checked) logits equal the
        reference. With clears off the demo shows the failure, so always True."""
        if not self.config.clear:
            return True
        return self.run.passed == self.run.requests and (self.oracle is None or self.oracle["equal"])

    def to_dict(self) -> dict:
        """Everything but the logits, JSON-ready."""
        return {
            "config": dataclasses.asdict(self.config),
            "run": self.run.figures(),
            "reference": self.reference.figures() if self.reference is not None else None,
            "oracle": self.oracle,
            "ok": self.ok,
            "wall_s": self.wall_s,
        }
