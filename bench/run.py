"""Run kvledger's benchmarks: every ``bench/bench_*.py`` module, in name order.

    python bench/run.py [--quick] [--json PATH] [--only NAME ...] [--figures] [--list]

Each module exposes ``run(quick: bool) -> dict`` (a flat dict of named figures:
int, float, str or bool) and prints its own table, including a ratio against a
baseline timed in the same run. A module that cannot run here returns
``{"skipped": "<reason>"}``. An optional ``TARGETS = {figure: (op, value)}``
(op one of ``>= > <= < ==``) declares targets: the runner prints PASS or MISS
for each and never fails the run on a miss (targets are reported, not asserted).

A module that fails to import, raises, or returns something other than a flat
dict is reported with its traceback and the runner goes on with the next one;
the exit status is then 1. ``--json PATH`` writes, machine-readably::

    {"machine": {python, platform, cpu_count, date, ...},
     "quick": bool,
     "benchmarks": {name: figures},          # name: "fold" for bench_fold.py
     "targets": {name: {figure: {"op", "value", "measured", "met"}}},
     "errors": {name: traceback text},
     "seconds": {name: wall seconds of the module}}

Non-finite floats are written as null. Exit status: 0 when every selected
module ran (or skipped), 1 when any failed, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import operator
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

from _common import machine_info, print_table  # noqa: E402

PREFIX = "bench_"
OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}
FIGURE_TYPES = (bool, int, float, str)


class BenchModuleError(Exception):
    """A benchmark module broke the runner's contract (no ``run``, bad figures or targets)."""


def discover(bench_dir: Path = BENCH_DIR) -> dict[str, Path]:
    """``{name: path}`` for every ``bench_*.py`` in ``bench_dir``, sorted by name."""
    return {p.stem[len(PREFIX) :]: p for p in sorted(bench_dir.glob(PREFIX + "*.py")) if p.is_file()}


def load(path: Path):
    """Import a benchmark module from ``path`` under its file name (``bench_fold``).

    Raises whatever the module raises at import; leaves nothing in ``sys.modules``
    when it does.
    """
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BenchModuleError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def check_figures(name: str, figures: Any) -> dict:
    """Raise ``BenchModuleError`` unless ``figures`` is a flat dict of str -> int/float/str/bool."""
    if not isinstance(figures, dict):
        raise BenchModuleError(f"{name}.run() returned {type(figures).__name__}, not a dict")
    for key, value in figures.items():
        if not isinstance(key, str):
            raise BenchModuleError(f"{name}: figure name {key!r} is not a str")
        if not isinstance(value, FIGURE_TYPES):
            raise BenchModuleError(
                f"{name}: figure {key!r} is a {type(value).__name__}; figures are int, float, str or bool"
            )
    return figures


def check_targets(name: str, targets: Any) -> dict:
    """Raise ``BenchModuleError`` unless ``targets`` maps figure names to (op, number)."""
    if not isinstance(targets, dict):
        raise BenchModuleError(f"{name}.TARGETS must be a dict, got {type(targets).__name__}")
    for key, spec in targets.items():
        ok = (
            isinstance(key, str)
            and isinstance(spec, tuple)
            and len(spec) == 2
            and spec[0] in OPS
            and isinstance(spec[1], (int, float))
            and not isinstance(spec[1], bool)
        )
        if not ok:
            raise BenchModuleError(
                f"{name}.TARGETS[{key!r}] = {spec!r}; want (op, number) with op one of {sorted(OPS)}"
            )
    return targets


def evaluate_targets(targets: dict, figures: dict) -> dict:
    """``{figure: {"op", "value", "measured", "met"}}``; a missing or non-numeric figure is not met."""
    out = {}
    for key, (op, value) in targets.items():
        measured = figures.get(key)
        numeric = isinstance(measured, (int, float)) and not isinstance(measured, bool)
        met = bool(numeric and not (isinstance(measured, float) and math.isnan(measured)) and OPS[op](measured, value))
        out[key] = {"op": op, "value": value, "measured": measured, "met": met}
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str, report: dict) -> None:
    """Write ``report`` to ``path`` atomically (a temporary file, then rename)."""
    target = Path(path)
    if target.parent and not target.parent.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_jsonable(report), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, target)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run_one(name: str, path: Path, quick: bool, show_figures: bool) -> dict:
    """Import and run one module; never raises for the module's own failures.

    Returns ``{"status": "ok"|"skipped"|"failed", "figures", "targets", "error", "seconds"}``.
    """
    result: dict = {"status": "failed", "figures": None, "targets": {}, "error": None, "seconds": 0.0}
    t0 = time.perf_counter()
    try:
        module = load(path)
        run = getattr(module, "run", None)
        if not callable(run):
            raise BenchModuleError(f"{path.name} has no run(quick) function")
        targets = check_targets(name, getattr(module, "TARGETS", {}))
        figures = check_figures(name, run(quick))
    except (Exception, SystemExit):
        result["error"] = traceback.format_exc()
        result["seconds"] = time.perf_counter() - t0
        sys.stdout.flush()
        print(f"FAILED: {name}", file=sys.stderr)
        print(result["error"], file=sys.stderr, end="")
        sys.stderr.flush()
        return result
    result["seconds"] = time.perf_counter() - t0
    result["figures"] = figures
    if "skipped" in figures:
        result["status"] = "skipped"
        print("SKIPPED: {}".format(figures["skipped"]))
        return result
    result["status"] = "ok"
    if show_figures:
        print_table(f"figures: {name}", ("figure", "value"), [(k, _fmt(v)) for k, v in figures.items()])
    result["targets"] = evaluate_targets(targets, figures)
    for key, t in result["targets"].items():
        print(
            f"target {key} {t['op']} {_fmt(t['value'])}: measured {_fmt(t['measured'])}  "
            + ("PASS" if t["met"] else "MISS")
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller repeat counts (CI smoke run)")
    parser.add_argument("--json", metavar="PATH", help="write every figure machine-readably to PATH")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these modules (fold or bench_fold)")
    parser.add_argument("--figures", action="store_true", help="also print every figure of each module")
    parser.add_argument("--list", action="store_true", help="list the benchmark modules and exit")
    args = parser.parse_args(argv)

    found = discover()
    if args.list:
        for name, path in found.items():
            print(f"{name:<12} {path.relative_to(BENCH_DIR.parent)}")
        return 0
    selected = found
    if args.only:
        wanted = [n[len(PREFIX) :] if n.startswith(PREFIX) else n for n in args.only]
        wanted = [n[:-3] if n.endswith(".py") else n for n in wanted]
        unknown = [n for n in wanted if n not in found]
        if unknown:
            parser.error(f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(found) or 'none'}")
        selected = {n: found[n] for n in found if n in wanted}
    if not selected:
        print(f"no benchmark modules found in {BENCH_DIR}", file=sys.stderr)
        return 1

    report: dict = {
        "machine": machine_info(),
        "quick": args.quick,
        "benchmarks": {},
        "targets": {},
        "errors": {},
        "seconds": {},
    }
    m = report["machine"]
    print(
        f"machine: Python {m['python']} on {m['platform']}, {m['cpu_count']} CPUs ({m['cpu_usable']} usable), "
        f"{m['date']}"
    )
    results = {}
    for name, path in selected.items():
        print("\n== {} ({}){} ==".format(name, path.relative_to(BENCH_DIR.parent), " --quick" if args.quick else ""))
        sys.stdout.flush()
        res = run_one(name, path, args.quick, args.figures)
        results[name] = res
        report["seconds"][name] = res["seconds"]
        if res["figures"] is not None:
            report["benchmarks"][name] = res["figures"]
        if res["targets"]:
            report["targets"][name] = res["targets"]
        if res["error"] is not None:
            report["errors"][name] = res["error"]

    rows = []
    for name, res in results.items():
        t = res["targets"]
        rows.append(
            (
                name,
                res["status"],
                "{:.1f} s".format(res["seconds"]),
                f"{sum(1 for v in t.values() if v['met'])}/{len(t)}" if t else "-",
            )
        )
    print()
    print_table("summary", ("benchmark", "status", "time", "targets met"), rows)
    if args.json:
        write_json(args.json, report)
        print(f"figures written to {args.json}")
    return 1 if any(r["status"] == "failed" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
