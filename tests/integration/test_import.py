"""``import kvledger`` stays light: no torch, no triton, no CUDA bindings; and the engine,
executor and wire tests run without torch (``scripts/no-torch``: only GPU and torch modules skip).

Each check runs in a fresh interpreter. Besides ``sys.modules`` after the import,
a meta-path finder records every import *attempted* (so a guarded
``try: import torch`` that happens to succeed or fail is caught too).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = r"""
import json, sys

HEAVY = ("torch", "triton", "cuda")

def heavy(name):
    return any(name == h or name.startswith(h + ".") for h in HEAVY)

attempted = []

class Recorder:
    def find_spec(self, name, path=None, target=None):
        if heavy(name):
            attempted.append(name)
        return None  # let the real finders do the work

sys.meta_path.insert(0, Recorder())
for name in sys.argv[1:]:
    __import__(name)
print(json.dumps({
    "loaded": sorted(m for m in sys.modules if heavy(m)),
    "attempted": sorted(set(attempted)),
}))
"""

MODULES = ["kvledger", "kvledger.core", "kvledger.core.events", "kvledger.core.state", "kvledger.core.ledger"]


def probe(*modules: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_import_kvledger_leaves_torch_triton_and_cuda_out():
    got = probe(*MODULES)
    assert got == {"loaded": [], "attempted": []}


def test_the_probe_sees_heavy_imports():
    """The control: the same probe does report torch when something imports it."""
    pytest.importorskip("torch")
    got = probe("kvledger", "torch")
    assert "torch" in got["loaded"] and "torch" in got["attempted"]


# The rooms that must run without torch: only the modules that put torch (or a GPU) itself under
# test may skip there when it is missing (issue 33).
TORCH_FREE_ROOMS = ["tests/engine", "tests/executors", "tests/wire"]
TORCH_MODULES = {"test_torch_backend.py", "test_sanitizer_backend.py", "test_sdpa_proof.py",  # torch's own code
                 "test_wire_tp_ranks.py"}  # torchrun and torch.distributed's rendezvous store


def test_the_engine_executor_and_wire_rooms_collect_without_torch():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "scripts" / "no-torch"), *TORCH_FREE_ROOMS], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = out.stdout.strip().splitlines()[-1]
    skipped = set(re.findall(r"SKIPPED \[\d+\] \S*/(\S+?\.py):\d+: could not import", out.stdout))
    assert skipped, summary  # the control: the GPU modules do skip, so the block took
    assert {m for m in skipped if not m.startswith("test_gpu_")} <= TORCH_MODULES, summary
    assert int(re.search(r"(\d+) tests collected", summary).group(1)) > 300, summary


def test_every_event_is_exported_and_resolves():
    import kvledger
    from kvledger.core.events import EVENT_TYPES

    missing = [t.__name__ for t in EVENT_TYPES if t.__name__ not in kvledger.__all__]
    assert not missing, missing
    for name in kvledger.__all__:  # every exported name resolves (the lazy ones load)
        assert getattr(kvledger, name) is not None, name


def test_one_name_for_the_opener_the_old_one_warns_and_a_star_import_keeps_open():
    import kvledger
    from kvledger.engine import open_engine

    assert kvledger.open_engine is open_engine and "open" not in kvledger.__all__
    with pytest.warns(DeprecationWarning, match="kvledger.open_engine") as record:
        old = kvledger.open
    assert old is open_engine and record[0].filename == __file__
    code = "import builtins; from kvledger import *; assert open is builtins.open"
    subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], check=True, timeout=120)


def _imports_of(folder: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (every import statement, lazy ones too)."""
    import ast

    mods = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [f"{package}.{node.module}"] if node.module else [f"{package}.{a.name}" for a in node.names]
                found.update(t for t in targets if t in mods and t != name)
        out[name] = found
    return out


@pytest.mark.parametrize("folder", ["executors", "wire"])
def test_no_module_imports_one_that_imports_it_back(folder):
    """(cuda_backend <-> triton_verify was such a circle: the plane description they share lives
    in cuda_planes.py now.)"""
    root = Path(__file__).resolve().parents[2]
    graph = _imports_of(root / folder, f"kvledger.{folder}")
    assert len(graph) > 5 and any(graph.values())  # the control: the folder was read

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            for n in graph.get(m, ()):
                if n == goal:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False

    circles = sorted(m for m in graph if reaches(m, m))
    assert not circles, circles
