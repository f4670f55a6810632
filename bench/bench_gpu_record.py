"""The GPU runs on record in ``bench/README.md``, per card: compare a run with the last one on its card.

``scripts/gpu-check`` ends with ``python bench/bench_gpu_record.py --compare OUT``: it reads the
run's JSON files in ``OUT`` (``bench_gpu.json``, ``bench_steps_cuda.json``, ``bench_demo.json``),
finds the newest record for the same card in ``bench/README.md`` and prints each figure then
and now (or says that no run is recorded for this card). ``--emit`` prints the run as a record
to paste into the README's "GPU runs on record" section. A record is a fenced block::

    ```gpu-record
    card: NVIDIA H100 80GB HBM3
    date: 2026-12-07
    commit: 0123abc
    command: OUT=... bash scripts/gpu-check --round
    p128_n16_sc_triton_device_us: 14.70
    ...
    ```

Only the standard library: it runs where the benches ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "README.md")
FILES = ("bench_gpu.json", "bench_steps_cuda.json", "bench_demo.json")
_FENCE = re.compile(r"^```gpu-record\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _keep(name: str) -> bool:
    """The figures a record keeps: the clear per case (kvledger, vLLM, memset ratios), host costs,
    the step path, the demo's overheads."""
    if name.startswith(("host_n", "floor_")) and name.endswith("_us") and not name.startswith("ctypes_"):
        return True
    if re.match(r"p\d+_n\d+_(adj|sc)_(triton|vllm|triton_graph)_device_us$", name):
        return True
    if re.match(r"p\d+_n\d+_(adj|sc)_triton_x_(vllm|memset)$", name):
        return True
    return name in ("engine_overhead_us", "bare_overhead_us", "overhead_minus_bare_us", "engine_overhead_us_mean",
                    "bare_overhead_us_mean", "demo_overhead_minus_bare_us", "ceiling_memset_bytes_per_s")


def figures(out_dir: str) -> tuple[str | None, dict[str, float]]:
    """``(card, figures)`` of a run's JSON files (the demo's overheads under ``demo_*``)."""
    card = None
    got: dict[str, float] = {}
    for name in FILES:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        card = card or res.get("card")
        prefix = "demo_" if name == "bench_demo.json" else ""
        for k, v in res.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and _keep(k):
                got[prefix + k] = float(v)
        if prefix and "engine_overhead_us_mean" in res and "bare_overhead_us_mean" in res:
            got["demo_overhead_minus_bare_us"] = res["engine_overhead_us_mean"] - res["bare_overhead_us_mean"]
    return card, got


def records(text: str) -> list[dict[str, Any]]:
    """Every record in the README's text, in order."""
    out = []
    for block in _FENCE.findall(text):
        rec: dict[str, Any] = {"figures": {}}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                continue
            key, value = key.strip(), value.strip()
            if key in ("card", "date", "commit", "command"):
                rec[key] = value
            else:
                try:
                    rec["figures"][key] = float(value)
                except ValueError:
                    continue
        out.append(rec)
    return out


def last_on(card: str, text: str) -> dict[str, Any] | None:
    """The newest record (by date, then position) for ``card``."""
    mine = [(r.get("date", ""), i, r) for i, r in enumerate(records(text)) if r.get("card") == card]
    return max(mine)[2] if mine else None


def compare(out_dir: str, readme: str = README) -> int:
    card, now = figures(out_dir)
    if card is None:
        print("gpu record: no GPU figures in", out_dir)
        return 0
    with open(readme, encoding="utf-8") as f:
        prev = last_on(card, f.read())
    if prev is None:
        print(f"gpu record: no earlier run on {card} is recorded in bench/README.md")
        return 0
    then = prev["figures"]
    rows = [(k, then[k], now[k]) for k in sorted(now) if k in then]
    print(f"against the last run recorded on {card} ({prev.get('date')}, {prev.get('commit')}): then / now / now "
          "over then")
    for k, a, b in rows:
        print(f"  {k:48} {a:10.2f} {b:10.2f} {b / a if a else float('nan'):7.2f}")
    missing = sorted(set(then) - set(now))
    if missing:
        print(f"  not in this run: {', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}")
    return 0


def emit(out_dir: str, date: str, commit: str, command: str) -> int:
    card, now = figures(out_dir)
    print("```gpu-record")
    print(f"card: {card}\ndate: {date}\ncommit: {commit}\ncommand: {command}")
    for k in sorted(now):
        print(f"{k}: {now[k]:.2f}")
    print("```")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", metavar="OUT", help="a run's output folder: compare with the card's last record")
    ap.add_argument("--emit", metavar="OUT", help="print a run's record block")
    ap.add_argument("--date", default="")
    ap.add_argument("--commit", default="")
    ap.add_argument("--command", default="")
    ap.add_argument("--readme", default=README)
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare, args.readme)
    if args.emit:
        return emit(args.emit, args.date, args.commit, args.command)
    ap.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
