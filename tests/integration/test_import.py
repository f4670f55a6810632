"""``import kvledger`` stays light: no torch, no triton, no CUDA bindings.

Each check runs in a fresh interpreter. Besides ``sys.modules`` after the import,
a meta-path finder records every import *attempted* (so a guarded
``try: import torch`` that happens to succeed or fail is caught too).
"""

from __future__ import annotations

import json
import subprocess
import sys

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
