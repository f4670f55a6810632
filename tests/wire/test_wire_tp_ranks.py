"""examples/tp_ranks.py under torchrun: 2 and 4 ranks in separate processes over
loopback TCP, meeting through torch.distributed's rendezvous store.

Every rank clears its own torch CPU planes and answers each LAUNCH with COMPLETE;
the leader records every rank's completion of every step from those frames
(the "recorded" column), compares the ranks' clear digests through the store,
and the NaN check looks for stale snapshot bytes in the pages requests wrote.
``--skip-clear`` is the negative control: the same run without clearing must be
caught and exit non-zero on every rank. The quick profile runs 2 ranks (the wire's
many-peer schedules run in process: test_wire_drivers.py, test_wire_protocol.py);
``KVLEDGER_HYPOTHESIS=heavy`` adds 4 (each torchrun pays a torch import per process).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import HEAVY

pytest.importorskip("torch.distributed.run")  # torchrun, and the ranks' torch planes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tp_ranks.py"


def _torchrun(nproc: int, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
        str(EXAMPLE), *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _table(out: str) -> list[list[str]]:
    rows = []
    for line in out.splitlines():
        m = re.match(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\[.*\]\s+([0-9a-f]{32})\s*$", line)
        if m:
            rows.append(list(m.groups()))
    return rows


@pytest.mark.parametrize("nproc", [2, 4] if HEAVY else [2])
def test_tp_ranks_agree_over_loopback_tcp(nproc):
    steps = 25
    res = _torchrun(nproc, "--steps", str(steps), "--pages", "96")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    rows = _table(res.stdout)
    assert [int(r[0]) for r in rows] == list(range(nproc)), out[-4000:]
    assert len({r[6] for r in rows}) == 1  # one clear digest on every rank
    # every rank launched every step, and the leader recorded each rank's completion of each
    assert all(int(r[1]) == steps and int(r[2]) == steps and int(r[5]) == 0 for r in rows)
    assert int(rows[0][4]) > 0  # pages were actually cleared
    assert "verdict: ranks agree, every completion recorded" in res.stdout
    head = next(line for line in res.stdout.splitlines() if line.startswith("tp_ranks:"))
    assert f"COMPLETE frames counted: {steps * (nproc - 1)}" in head
    print(head)
    print("clear digest", rows[0][6], "pages cleared per rank", rows[0][4])


def test_tp_ranks_without_clearing_is_caught():
    res = _torchrun(2, "--steps", "25", "--pages", "96", "--skip-clear")
    assert res.returncode != 0
    rows = _table(res.stdout)
    assert len(rows) == 2 and all(int(r[5]) > 0 for r in rows), (res.stdout + res.stderr)[-3000:]
    assert "FAILED" in res.stdout
    print("without clearing: NaN pages seen per rank", [int(r[5]) for r in rows])
