"""The demo's output: a rich progress bar while it runs, a short table when it ends."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["progress_bars", "render_table"]


@contextlib.contextmanager
def progress_bars(console: Console,
                  enabled: bool = True) -> Iterator[Callable[[str, int], Callable[[int], None]] | None]:
    """A ``progress(label, total) -> advance(n)`` factory drawing one bar per run
    (``None`` when disabled)."""
    if not enabled:
        yield None
        return
    columns = (TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("requests"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bars:

        def factory(label: str, total: int) -> Callable[[int], None]:
            task = bars.add_task(label, total=total)

            def advance(n: int) -> None:
                bars.advance(task, n)

            return advance

        yield factory


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def render_table(report) -> Table:
    """The final table of a ``DemoReport``: one column for the run, one for the reference."""
    c = report.config
    run, ref = report.run, report.reference
    t = Table(title=_title(c), title_justify="left", header_style="bold")
    t.add_column("")
    t.add_column(run.label, no_wrap=True)
    t.add_column("reference (no pressure)", no_wrap=True, style="dim")

    def row(name: str, fn, ref_too: bool = True) -> None:
        t.add_row(name, fn(run), fn(ref) if (ref is not None and ref_too) else "-")

    row("requests passed", lambda r: f"{r.passed} / {r.requests}")
    row("INVALID_SPECULATION (6)", lambda r: str(r.invalid_speculation))
    row("clear backend", lambda r: r.backend)
    row("page budget", lambda r: f"{r.page_budget} pages")
    row("released pages as tails", lambda r: str(r.tails_released))
    row("pages listed / cleared", lambda r: f"{r.pages_listed} / {r.pages_zeroed}")
    row("bytes zeroed", lambda r: f"{r.bytes_zeroed:,}")
    row("time clearing", _clear_time)
    row("step time, mean", lambda r: f"{_ms(r.step_s / r.steps if r.steps else 0.0)} ({r.steps} steps)")
    row("clearing adds to step", lambda r: f"{_added(r):.3f} %" if r.pages_zeroed else "-")
    t.add_row("per step, mean / max:", "", "")
    row("  clear, host", lambda r: _mean_max(r.clear_host_sum_s, r.clear_host_max_s, r.steps_with_clears))
    row("  clear, device" if c.device == "cuda" else "  clear, device (=host)",
        lambda r: _mean_max(r.clear_dev_sum_s, r.clear_dev_max_s, r.steps_with_clears))
    row("  engine overhead", _engine_overhead)
    row("  bare loop overhead", lambda r: _mean_max(r.bare_overhead_s, r.bare_overhead_max_s, r.bare_steps),
        ref_too=False)
    if c.prefix_cache:
        row("prefix cache hit rate", _hit_rate, ref_too=False)
        row("pages shared / published", lambda r: f"{r.pages_shared} / {r.pages_published}", ref_too=False)
        row("cached pages evicted", lambda r: str(r.pages_evicted), ref_too=False)
        row("pages cached at end", lambda r: str(r.pages_cached_end), ref_too=False)
    if c.sanitize:
        row("sanitizer violations", _violations, ref_too=False)
        row("  poison + check, per step", lambda r: _mean_max(r.sanitize_sum_s, r.sanitize_max_s, r.steps),
            ref_too=False)
    row("snapshots made / freed", lambda r: f"{r.snapshots_made} / {r.snapshots_released + r.snapshots_dropped}")
    row("rows intact at release", lambda r: f"{r.snapshot_rows_intact} / {r.snapshots_released}")
    row("FP8 NaN bytes via rows", lambda r: f"{r.nan_bytes_written:,}")
    if report.oracle is None:
        eq = "not checked"
    else:
        o = report.oracle
        eq = f"{'yes' if o['equal'] else 'no'} ({o['requests_equal']}/{o['requests']} identical)"
    t.add_row("logits == reference", eq, "-")
    row("events / digest", lambda r: f"{r.events} / {r.digest[:12]}")
    row("wall time", lambda r: f"{r.wall_s:.1f} s")
    return t


def _title(c) -> str:
    """The table's title: the workload, the model and the cache."""
    title = (
        f"kvledger demo: {c.requests} requests, {c.short_tokens}/{c.long_tokens}-token prompts alternating, "
        f"{c.gen_tokens} tokens out\n"
        f"hybrid decoder: {c.layers} layers, {c.heads} heads x {c.head_dim} + gated linear recurrence\n"
        f"FP8 e4m3fn KV, {c.page_tokens}-token pages, {c.device}, {c.ranks} rank{'' if c.ranks == 1 else 's'}, "
        f"policy {c.policy}\n"
        "attention: torch scaled_dot_product_attention, masked over valid tokens"
    )
    if c.prefix_cache:
        title += (f"\nprefix cache: {c.tenants} tenants, {c.system_prompt_tokens()}-token system prompts "
                  f"({c.prefix_tokens() // c.page_tokens} shared pages each)")
    return title


def _mean_max(total: float, most: float, n: int) -> str:
    """``X / Y µs (n)``: the mean and the max of a per-step figure over ``n`` steps (``-``: none)."""
    if not n:
        return "-"
    mean = total / n
    if most < 1e-3:
        return f"{mean * 1e6:.1f} / {most * 1e6:.1f} µs ({n})"
    return f"{mean * 1e3:.2f} / {most * 1e3:.2f} ms ({n})"


def _engine_overhead(r) -> str:
    """Step wall time less the graph's own, on the steps also run bare (all steps if none were)."""
    if r.bare_steps:
        return _mean_max(r.bare_engine_overhead_s, r.bare_engine_overhead_max_s, r.bare_steps)
    return _mean_max(r.overhead_sum_s, r.overhead_max_s, r.steps)


def _violations(r) -> str:
    """``--sanitize``: violations found, and the steps and requests they stopped."""
    if not r.sanitizer_steps:
        return "0"
    return f"{r.sanitizer_violations} ({r.sanitizer_steps} steps, {r.sanitizer_stopped} req. stopped)"


def _hit_rate(r) -> str:
    rate = r.prefix_hit_tokens / r.prefix_tokens_looked if r.prefix_tokens_looked else 0.0
    return f"{100 * rate:.1f} % ({r.prefix_hits}/{r.prefix_requests} req.)"


def _clear_time(r) -> str:
    if r.pages_listed and not r.pages_zeroed:
        return "none (not zeroed)"
    return f"{_ms(r.clear_s)} ({r.steps_with_clears} steps)"


def _added(r) -> float:
    """Clearing's share of step time, as the percentage it adds to the rest of the step."""
    rest = r.step_s - r.clear_s
    return 100.0 * r.clear_s / rest if rest > 0 else 0.0
