"""``kvledger audit --label ID``: an engine's name for its requests (``RequestLabelled``).

vLLM's pool labels each hold (a ledger request: one vLLM request in one KV cache group,
one incarnation) with the vLLM request id, so the audit follows a vLLM request through
all of them; the page timeline writes each labelled holder with its label and tenant.
"""

from __future__ import annotations

import subprocess
import sys

from kvledger import Geometry
from kvledger.durable import open_ledger
from kvledger.tools.audit import audit_log

G = Geometry(num_pages=16, page_tokens=4)


def _log(path):
    with open_ledger(path, G, policy="cross_tenant") as L:
        L.label(1, "cmpl-7")
        L.allocate(1, 0, pages=(0, 1), tenant="g0:full_attention:float16")
        L.label(2, "cmpl-7")  # the same vLLM request in its Mamba group
        L.allocate(2, 0, pages=(2,), tenant="g1:mamba:float32", reads="whole")
        L.label(3, "cmpl-8")
        L.allocate(3, 0, pages=(3,), tenant="g0:full_attention:float16")
        L.seal_step(0)
        L.complete_step(0, rank=0)
        L.release(1, (1,))
        L.finish(2)
        L.label(4, "cmpl-7")  # a new incarnation (after a preemption)
        L.allocate(4, 1, pages=(2,), tenant="g1:mamba:float32", reads="whole")
        L.seal_step(1)
        L.finish(1)
        L.finish(3)
        L.finish(4)


def test_a_label_follows_every_ledger_request_of_the_engines_request(tmp_path):
    path = tmp_path / "x.kvlog"
    _log(path)
    rep = audit_log(path, request="cmpl-7")
    events = [(r.event, tuple(r.page_ids)) for r in rep.rows]
    assert ("pages_committed", (0, 1)) in events and ("pages_committed", (2,)) in events
    assert ("pages_released", (1,)) in events and events.count(("request_labelled", ())) == 3
    assert not any(3 in ids for _, ids in events)  # cmpl-8's page is not followed
    assert rep.subject == "request cmpl-7"
    by_id = audit_log(path, request=1)
    assert {r.seq for r in by_id.rows} < {r.seq for r in rep.rows}


def test_the_cli_takes_a_label_and_names_holders_in_page_timelines(tmp_path):
    path = tmp_path / "x.kvlog"
    _log(path)
    out = subprocess.run([sys.executable, "-m", "kvledger", "audit", str(path), "--label", "cmpl-7"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "ledger request 4 is 'cmpl-7'" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-m", "kvledger", "audit", str(path), "--request", "cmpl-8"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "ledger request 3 is 'cmpl-8'" in out.stdout
    out = subprocess.run([sys.executable, "-m", "kvledger", "audit", str(path), "--page", "2"],
                         capture_output=True, text=True)
    assert "kv(2 cmpl-7 [g1:mamba:float32])" in out.stdout and "kv(4 cmpl-7 [g1:mamba:float32])" in out.stdout
