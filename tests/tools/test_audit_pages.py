"""``kvledger audit --page N``: the fold of one page against the checked engine, its default window
(the log's last segment), segments and ``--since`` as starting points, and the new holders' rows.

The differential test is the proof behind ``pages.PageFold``: for every page of
logs that use every event and holder, under every clear policy, from seq 0, from
a middle segment and over ``--since`` / ``--until`` windows, its rows equal the
rows of the checked engine, which folds and validates every event. Each test
names the mutant it kills.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
import pytest

from kvledger import CLEAR_POLICIES, Geometry, InvalidArgumentError
from kvledger.options import LogOptions
from kvledger.durable import open_ledger
from kvledger.tools.audit import MIN_WINDOW_EVENTS, audit_log, render

from test_audit_workload import GEOMETRY, QUIET, build
from test_cli import kvledger


@pytest.fixture(scope="module", params=CLEAR_POLICIES)
def logdir(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp("pages") / "log", policy=request.param, seed=f"pages-{request.param}")


def _same(a, b) -> bool:
    keep = ("rows", "start_seq", "end_seq", "events", "window", "checkpoint_seq", "first_file", "error")
    return all(msgspec.to_builtins(getattr(a, k)) == msgspec.to_builtins(getattr(b, k)) for k in keep)


def test_the_fold_of_one_page_gives_the_checked_engines_rows_for_every_page(logdir):
    """Kills: a projection that forgets a request's tenant (cross_tenant commits of the tenant's own bytes),
    an abort that looks at the last plan only, a request end that still counts a page it returned, a
    shared page's other holders dropped from the projection."""
    mid = logdir["files"][len(logdir["files"]) // 2]
    first = int(os.path.basename(mid)[4:24])
    windows: list[tuple[str, dict[str, Any]]] = [(logdir["path"], {"since": 0}), (mid, {}),
                                                 (logdir["path"], {"since": first + 50, "until": 1000})]
    compared = rows = 0
    for path, kw in windows:
        for p in range(GEOMETRY.num_pages):
            fast = audit_log(path, page=p, **kw)
            full = audit_log(path, page=p, trusted=False, **kw)
            assert fast.mode == "trusted" and full.mode == "checked"
            assert _same(fast, full), (path, kw, p)
            compared += 1
            rows += len(fast.rows)
    assert rows > 5 * compared  # the windows hold real histories
    for trusted in (None, False):
        with pytest.raises(InvalidArgumentError, match="before the first event"):
            audit_log(mid, page=0, trusted=trusted, until=first - 1)
    print(f"{compared} page timelines, {rows} rows: the fold of one page equals the checked engine")


def test_the_default_window_is_the_last_segment_from_its_checkpoint(tmp_path):
    """Kills: a default window that folds the whole log, or one that drops the page's state at the window's start."""
    g = Geometry(num_pages=16, page_tokens=4)
    d = tmp_path / "long"
    with open_ledger(d, g, logger=QUIET, log_options=LogOptions(segment_bytes=4096, checkpoint_every=None)) as led:
        for i in range(MIN_WINDOW_EVENTS // 4 + 400):  # four events a step: several segments of enough events
            led.reserve(i, 1, tenant="a")
            led.commit(i, i, 1)
            led.seal_step(i)
            if i >= 2:
                led.finish(i - 2)
        seq = led.seq
    segs = sorted(n for n in os.listdir(d) if n.endswith(".kvlog"))
    rep = audit_log(d, page=2)
    first = int(segs[-1][4:24])
    assert seq - first >= MIN_WINDOW_EVENTS or rep.first_file != str(d / segs[-1])
    assert rep.checkpoint_seq == rep.start_seq == int(os.path.basename(rep.first_file)[4:24]) > 0
    assert rep.events == seq - rep.start_seq and rep.end_seq == seq
    assert rep.rows[0].event == "window_start" and rep.rows[0].seq == rep.start_seq
    assert f"from the checkpoint at seq {rep.start_seq:,} that opens" in rep.window
    text = render(rep)
    assert "window: from the checkpoint" in text and "--since SEQ starts earlier" in text
    whole = audit_log(d, page=2, since=0)
    assert whole.start_seq == 0 and whole.rows[0].event != "window_start"
    assert [r for r in whole.rows if r.seq >= rep.start_seq] == rep.rows[1:]


def test_a_short_last_segment_brings_the_one_before_it(tmp_path):
    """Kills: a window of a just-rotated (almost empty) last segment."""
    d = tmp_path / "short"
    info = build(d, steps=60)
    rep = audit_log(d, page=5)
    files = info["files"]
    assert info["seq"] < MIN_WINDOW_EVENTS and rep.start_seq == 0 and rep.first_file == files[0]
    later = audit_log(files[-2], page=5)  # a segment given as the path: the window starts there, however short
    assert later.first_file == files[-2] and later.start_seq == int(os.path.basename(files[-2])[4:24])


def test_the_new_holders_and_events_in_a_page_timeline(tmp_path):
    """Kills: notes that miss a share, a page going cached, an eviction or a sanitizer violation."""
    g = Geometry(num_pages=8, page_tokens=4)
    p = tmp_path / "story.kvlog"
    with open_ledger(p, g, logger=QUIET) as led:
        assert led.reserve(1, 2, tenant="a") == (0, 1)  # seq 1
        led.commit(1, 0, 2)  # 2
        led.seal_step(0)  # 3
        led.complete_step(0, 0)  # 4
        led.publish(1, [100, 101], list(range(8)))  # 5
        led.share(2, [100, 101], tenant="a")  # 6: kv({1,2})
        led.finish(1)  # 7: kv(2)
        led.finish(2)  # 8: cached
        led.evict(pages=[1])  # 9
        led.alias_snapshot(7, pages=[1])  # 10
        led.release_snapshot(7)  # 11: marked
        assert led.reserve(3, 1, tenant="a") == (1,)  # 12
        led.commit(3, 1, 1)  # 13: listed
        led.seal_step(1)  # 14
        led.record_violation(1, 0, 2, 1, "not_zero")  # 15
        led.abort_step(1, "sanitizer")  # 16
    got = [(r.seq, r.event, r.holder_before, r.holder_after, r.note) for r in audit_log(p, page=1).rows]
    assert got[:5] == [
        (1, "pages_reserved", "free", "reserved(1)", ""),
        (2, "pages_committed", "reserved(1)", "kv(1)", "not marked: nothing to zero"),
        (5, "pages_published", "kv(1)", "kv(1)", "published as block 101: other requests may share it"),
        (6, "pages_shared", "kv(1)", "kv({1,2})", "shared into request 2: read-only, never listed"),
        (7, "request_finished", "kv({1,2})", "kv(2)", "request 1 let go: still held by the others"),
    ]
    assert got[5] == (8, "request_finished", "kv(2)", "cached(101)",
                      "request 2 let go, the last holder: cached, its KV kept for reuse")
    assert got[6] == (9, "pages_evicted", "cached(101)", "free", "evicted from the cache: block removed, free")
    assert got[-2] == (15, "sanitizer_violation", "kv(3)", "kv(3)",
                       "SANITIZER: rank 0 plane 2 found it not zeroed before step 1's graph")
    assert got[-1][:2] == (16, "step_aborted") and got[-1][4] == "step 1 aborted: listed again for the next step"
    checked = audit_log(p, page=1, trusted=False)
    assert msgspec.to_builtins(checked.rows) == msgspec.to_builtins(audit_log(p, page=1).rows)
    out = kvledger("audit", p, "--page", 1)
    assert out.returncode == 0 and "kv({1,2})" in out.stdout and "SANITIZER" in out.stdout


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return build(tmp_path_factory.mktemp("plain") / "log", seed="plain", steps=80)


def test_page_json_and_the_checked_flag(plain):
    """Kills: --checked ignored (the CLI always folding one page), or the JSON losing the window."""
    logdir = plain
    a = json.loads(kvledger("audit", logdir["path"], "--page", 7, "--json").stdout)
    b = json.loads(kvledger("audit", logdir["path"], "--page", 7, "--json", "--checked").stdout)
    assert a["mode"] == "trusted" and b["mode"] == "checked"
    assert a["rows"] == b["rows"] and a["window"] == b["window"] and a["ok"] and b["ok"]
    out = kvledger("audit", logdir["path"], "--request", 1, "--checked")
    assert out.returncode == 2 and "--checked goes with --page" in out.stderr
    with pytest.raises(Exception, match="only a page view"):
        audit_log(logdir["path"], check=True, trusted=True)
