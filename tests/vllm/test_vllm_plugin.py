"""kvledger as a vLLM plugin, loaded the way vLLM loads it (skips where vLLM is not installed).

Each test starts a fresh Python process that runs vLLM's own plugin loader
(``vllm.plugins.load_general_plugins``: every ``vllm.general_plugins`` entry point of
the installed packages, as ``vllm serve`` does in each of its processes) and then
builds vLLM's KV cache manager. Without configuration nothing changes: vLLM's own
``BlockPool``. With ``$KVLEDGER_VLLM`` (JSON) or ``$KVLEDGER_VLLM_CONFIG`` (a file),
the pool is kvledger's, writing its log where the configuration says, and with
``zeroing`` the workers' ``KVBlockZeroer`` is kvledger's. A configuration that cannot
be used stops the process with an error naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.plugins", exc_type=ImportError)

CHILD = r"""
import json, os, sys
from vllm.plugins import load_general_plugins
load_general_plugins()
from kvledger.integrations.vllm.driver import make_manager, make_trace, run_trace
manager = make_manager(64, enable_caching=True)
run_trace(manager, make_trace(seed=3, requests=6, prefixes=2, prefix_tokens=(16, 48), suffix_tokens=(4, 40),
                              output_tokens=(2, 12)), max_running=6)
pool = manager.block_pool
import vllm.v1.worker.utils as wu
out = {"pool": type(pool).__name__, "module": type(pool).__module__,
       "log": str(getattr(pool, "log_path", None)), "zeroer": wu.KVBlockZeroer.__name__,
       "events": getattr(getattr(pool, "ledger", None), "seq", 0)}
print("RESULT " + json.dumps(out))
"""


def child(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_VLLM")}
    env.update(VLLM_LOGGING_LEVEL="ERROR", VLLM_TARGET_DEVICE="cpu", **env_extra)
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_without_configuration_the_plugin_changes_nothing():
    got = result(child({}))
    assert got["pool"] == "BlockPool" and got["module"] == "vllm.v1.core.block_pool"
    assert got["zeroer"] == "KVBlockZeroer"


def test_configured_by_environment_the_pool_is_kvledgers_with_its_log(tmp_path):
    opts = {"log": str(tmp_path), "zeroing": True, "zeroer": "torch"}
    got = result(child({"KVLEDGER_VLLM": json.dumps(opts)}))
    assert got["pool"] == "LedgerBlockPool" and got["events"] > 0
    logs = sorted(p.name for p in tmp_path.glob("*.kvlog"))
    assert logs and all(name.startswith("pool-dp0-") for name in logs), logs
    assert got["log"].endswith(logs[0])
    assert got["zeroer"] == "LedgerBlockZeroer"  # the workers zero with kvledger's backends
    replay = subprocess.run([sys.executable, "-m", "kvledger", "replay", got["log"]], capture_output=True, text=True)
    assert replay.returncode == 0, replay.stdout + replay.stderr


def test_configured_by_file(tmp_path):
    conf = tmp_path / "kvledger.json"
    conf.write_text(json.dumps({"policy": "all_reused"}))
    got = result(child({"KVLEDGER_VLLM_CONFIG": str(conf)}))
    assert got["pool"] == "LedgerBlockPool" and got["log"] == "None"  # an in-memory ledger


@pytest.mark.parametrize("value,named", [("{not json", "not JSON"), ('{"logg": "/tmp"}', "unknown option"),
                                         ('{"policy": "released_aliases", "zeroing": true}', "zero nothing")])
def test_a_configuration_that_cannot_be_used_stops_the_process_naming_it(value, named):
    proc = child({"KVLEDGER_VLLM": value})
    assert proc.returncode != 0 and named in proc.stderr and "ConfigurationError" in proc.stderr
