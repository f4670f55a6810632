"""The ``kvledger`` console script, run for real in a subprocess on real log files."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from support import QUIET
from kvledger import Geometry
from kvledger.options import LogOptions
from kvledger.core.events.events import (
    CacheConfigured,
    PagesCommitted,
    PagesReserved,
    SnapshotAliased,
    SnapshotReleased,
    StepSealed,
)
from kvledger.core.log import EventLog
from kvledger.durable import open_ledger

from support.workload import GEOMETRY, drive
from support.cli import kvledger




@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    good = d / "good.kvlog"
    with open_ledger(good, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=50)) as led:
        drive(led, "cli", 30, ranks=1, restores=False)
        digest, seq = led.digest(), led.seq
    data = good.read_bytes()
    torn = d / "torn.kvlog"
    torn.write_bytes(data + b"\x00" * 333)
    corrupt = d / "corrupt.kvlog"
    bad = bytearray(data)
    bad[300] ^= 0x04
    corrupt.write_bytes(bytes(bad))
    mismatch = d / "mismatch.kvlog"
    g = Geometry(num_pages=8, page_tokens=4)
    with EventLog.create(mismatch, g) as log:
        for i, ev in enumerate([CacheConfigured(geometry=g), SnapshotAliased(snapshot=1, page_ids=(0,)),
                                SnapshotReleased(snapshot=1), PagesReserved(request=2, page_ids=(0,)),
                                PagesCommitted(request=2, step=0, page_ids=(0,)), StepSealed(step=0)]):
            log.append(i, ev)
    return {"good": good, "torn": torn, "corrupt": corrupt, "mismatch": mismatch, "digest": digest, "seq": seq,
            "dir": d}


def test_help_and_version():
    out = kvledger("--help")
    assert out.returncode == 0 and "replay" in out.stdout and "audit" in out.stdout
    out = kvledger("--version")
    assert out.returncode == 0 and out.stdout.startswith("kvledger ")
    out = kvledger("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr
    out = kvledger("replay", "--help")
    assert out.returncode == 0 and "--until" in out.stdout and "--log-json" in out.stdout
    out = kvledger("demo", "--help")  # registered from its own module, loaded only when asked for
    assert out.returncode == 0 and "--log-json" in out.stdout


def test_replay_ok_human_and_json(logs):
    out = kvledger("replay", logs["good"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "result       OK" in out.stdout and logs["digest"] in out.stdout
    out = kvledger("replay", logs["good"], "--json")
    rep = json.loads(out.stdout)
    assert out.returncode == 0 and rep["ok"] and rep["digest"] == logs["digest"] and rep["events"] == logs["seq"]
    out = kvledger("replay", logs["good"], "--json", "--until", 120, "--from-checkpoint", "--progress", "always")
    rep = json.loads(out.stdout)
    assert out.returncode == 0 and rep["last_seq"] == 120
    assert 50 <= rep["from_checkpoint"] <= 121 and rep["events"] == 121 - rep["from_checkpoint"]


def test_replay_exit_codes(logs, tmp_path):
    out = kvledger("replay", logs["corrupt"], "--json")
    rep = json.loads(out.stdout)
    assert out.returncode == 3 and rep["error"]["kind"] == "corrupt" and rep["error"]["offset"] is not None
    out = kvledger("replay", logs["corrupt"])
    assert out.returncode == 3 and "FAILED (corrupt, offset" in out.stdout
    out = kvledger("replay", logs["mismatch"])
    assert out.returncode == 1 and "FAILED (mismatch" in out.stdout and "seq 5" in out.stdout
    out = kvledger("replay", tmp_path / "missing.kvlog")
    assert out.returncode == 2 and "no such log" in out.stdout
    out = kvledger("replay", logs["good"], "--until", -1)
    assert out.returncode == 2


def test_replay_torn_tail_and_json_logging(logs):
    out = kvledger("replay", logs["torn"], "--log-json")
    assert out.returncode == 0 and "torn: 333 bytes" in out.stdout
    lines = [json.loads(x) for x in out.stderr.splitlines() if x.strip()]
    assert any(x["event"] == "log_torn_tail" and x["bytes"] == 333 and x["level"] == "warning" for x in lines)
    out = kvledger("replay", logs["torn"])
    assert "log_torn_tail" in out.stderr and not out.stderr.lstrip().startswith("{")


def test_audit_commands(logs, tmp_path):
    out = kvledger("audit", logs["good"], "--check")
    assert out.returncode == 0 and "no lifecycle faults" in out.stdout, out.stdout
    out = kvledger("audit", logs["good"], "--check", "--json")
    rep = json.loads(out.stdout)
    assert out.returncode == 0 and rep["ok"] and rep["faults"] == []
    out = kvledger("audit", logs["good"], "--page", 3)
    assert out.returncode == 0 and "holder" in out.stdout and "flags" in out.stdout
    out = kvledger("audit", logs["good"], "--request", 0, "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["subject"] == "request 0"
    svg = tmp_path / "t.svg"
    out = kvledger("audit", logs["good"], "--check", "--svg", svg)
    assert out.returncode == 0 and ET.parse(svg).getroot().tag.endswith("svg")
    out = kvledger("audit", logs["good"], "--page", 1000)
    assert out.returncode == 2 and "out of range" in out.stdout
    out = kvledger("audit", logs["good"])
    assert out.returncode == 2  # one of --page/--request/--snapshot/--check is required


def test_audit_reports_faults_with_exit_status_1(logs, tmp_path):
    # the mismatch log: its plan left out a released row page that request 2 then read
    out = kvledger("audit", logs["mismatch"], "--check", "--svg", tmp_path / "bad.svg")
    assert out.returncode == 1
    assert "unzeroed_read" in out.stdout and "plan_mismatch" in out.stdout
    out = kvledger("audit", logs["corrupt"], "--check")
    assert out.returncode == 3


def test_the_module_entry_point_matches_the_script(logs):
    a = kvledger("replay", logs["good"], "--json")
    b = subprocess.run([sys.executable, "-m", "kvledger", "replay", str(logs["good"]), "--json"],
                       capture_output=True, text=True, timeout=120)
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    ja.pop("seconds")
    jb.pop("seconds")
    assert ja == jb
