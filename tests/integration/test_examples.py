"""The examples the README points at run as a user would run them, and say what they claim; one
that needs an optional dependency exits 2 with the install command where it is missing."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


# An example that needs an optional dependency says so and exits 2 where it is missing (the
# dependency blocked in a child interpreter, as if it were not installed): the one-line install
# command, never a bare ModuleNotFoundError.
_BLOCKED = r"""
import importlib.abc, runpy, sys
blocked = sys.argv[1].split(",")
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_torch_examples_without_torch_exit_2_naming_the_install():
    for example in ("examples/async_engine.py", "examples/tp_ranks.py"):
        out = subprocess.run([sys.executable, "-c", _BLOCKED, "torch", example], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 2, (example, out.stderr)
        assert "pip install 'kvledger[torch]'" in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_the_examples_that_need_nothing_optional_run_without_torch_or_pyzmq():
    plain = (("examples/kv_pressure.py", ["--steps", "3"]), ("examples/prefix_cache.py", ["--pages", "24"]))
    for example, args in plain:
        out = subprocess.run([sys.executable, "-c", _BLOCKED, "torch,triton,zmq", example, *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr


def test_prefix_cache_example_shares_prefixes_and_evicts_under_pressure():
    text = _run("examples/prefix_cache.py", "--pages", "24", "--policy", "all_reused")
    m = re.search(r"(\d+) blocks shared, (\d+) pages computed, (\d+) requests refused; "
                  r"KV events: (\d+) batches, (\d+) BlockStored, (\d+) BlockRemoved", text)
    assert m, text
    shared, computed, refused, batches, stored, removed = map(int, m.groups())
    assert shared > computed > 0 and refused == 0
    assert stored > 0 and removed > 0 and batches > 0


def test_kv_pressure_example_lists_released_rows():
    text = _run("examples/kv_pressure.py", "--steps", "12")
    assert re.search(r"^\s*\d+\s+\d+\s+\d+\s+\d+\s+\[\d", text, re.M), text


@pytest.mark.parametrize("example", ["vllm_prefix_audit.py", "vllm_hybrid.py"])
def test_vllm_examples_without_vllm_exit_2_with_the_install_command(example):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment: the example runs instead")
    out = subprocess.run([sys.executable, f"examples/{example}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"{example} needs vLLM, which is not installed here: pip install 'kvledger[vllm]'"]
