"""``kvledger replay``: checked and trusted modes, log directories and segments as starting points,
the summary's new counts, and its JSON pinned.

Logs are written by the real ledger (``open_ledger`` with 4 KiB segments) running
``test_audit_workload.serve``: prefix sharing, evictions, sanitizer violations,
aborts that take the next step with them. Each test names the mutant it kills.
"""

from __future__ import annotations

import json
import os

import msgspec
import pytest

from kvledger import InvalidArgumentError, replay
from kvledger.core.events.events import (
    PagesCommitted,
    PagesEvicted,
    PagesPublished,
    PagesShared,
    SanitizerViolation,
    StepAborted,
)
from kvledger.core.log import open_view
from kvledger.core.log.format import KIND_CHECKPOINT
from kvledger.tools.replay import exit_code, render, replay_log

from test_audit_workload import build
from test_cli import kvledger

# The summary's JSON keys, in order: a new field or a renamed one is a visible decision.
SUMMARY_KEYS = [
    "path", "format_version", "log_id", "num_pages", "page_tokens", "policy", "mode", "files", "first_file",
    "first_seq", "records", "event_records", "checkpoint_records", "close_records", "closed_cleanly", "torn_at",
    "torn_bytes", "start_seq", "from_checkpoint", "until", "events", "last_seq", "steps_sealed", "steps_aborted",
    "steps_aborted_in_cascade", "step_completions", "ranks", "sanitizer_violations", "pages_cleared",
    "plans_with_clears", "commits", "pages_committed", "commits_listing", "publishes", "pages_published", "shares",
    "pages_shared", "evictions", "pages_evicted", "requests_admitted", "requests_finished", "requests_cancelled",
    "requests_open", "snapshots_aliased", "snapshots_released", "snapshots_live", "restores_started",
    "restores_completed", "checkpoints_compared", "invariant_checks", "digest", "chain_head", "seconds", "ok", "error",
]
# what may differ between a checked and a trusted replay of one log
MODE_FIELDS = {"mode", "checkpoints_compared", "invariant_checks", "seconds"}
pytestmark = pytest.mark.xdist_group("replay-modes")  # the module's logs built once, on one xdist worker


@pytest.fixture(scope="module", params=["released_aliases", "cross_tenant"])
def logdir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("modes") / "log"
    info = build(d, policy=request.param, steps=140)
    with open_view(d) as v:
        info["events"] = [ev for _, ev, _ in v.iter_events()]
    assert len(info["files"]) >= 8  # small segments: the log rolled many times
    return info


def _builtins(s) -> dict:
    return msgspec.to_builtins(s)


def test_trusted_and_checked_agree_on_every_count_and_the_digest(logdir):
    """Kills: the trusted hook not refreshing the listed-page count after a seal (commits_listing drifts), or
    counting pages of publishes / shares / evictions differently from the checked hook."""
    checked = replay_log(logdir["path"])
    trusted = replay_log(logdir["path"], trusted=True)
    assert checked.ok and trusted.ok, (checked.error, trusted.error)
    assert checked.mode == "checked" and trusted.mode == "trusted"
    assert checked.digest == trusted.digest == logdir["digest"] == replay(logdir["events"]).digest()
    a, b = _builtins(checked), _builtins(trusted)
    assert {k for k in a if a[k] != b[k]} <= MODE_FIELDS
    assert trusted.checkpoints_compared >= 1 and trusted.invariant_checks >= 1


def test_the_new_counts_are_what_the_events_say(logdir):
    """Kills: steps aborted in a cascade counted as zero (or as the aborts), violations or prefix-cache pages
    not counted."""
    events = logdir["events"]
    s = replay_log(logdir["path"], trusted=True)

    def of(t):
        return [e for e in events if type(e) is t]

    assert s.sanitizer_violations == len(of(SanitizerViolation)) >= 1
    assert (s.publishes, s.pages_published) == (len(of(PagesPublished)),
                                                sum(len(e.page_ids) for e in of(PagesPublished)))
    assert (s.shares, s.pages_shared) == (len(of(PagesShared)), sum(len(e.page_ids) for e in of(PagesShared)))
    assert (s.evictions, s.pages_evicted) == (len(of(PagesEvicted)), sum(len(e.page_ids) for e in of(PagesEvicted)))
    assert s.pages_shared > 0 and s.pages_evicted > 0
    # every abort names one step; the cascade is the later steps in flight it took down
    st = replay(events)
    assert s.steps_aborted == len(of(StepAborted))
    assert s.steps_aborted_in_cascade == len(st.aborted_steps) - len(of(StepAborted)) >= 1
    assert s.commits == len(of(PagesCommitted))
    text = render(s)
    assert f"{s.steps_aborted_in_cascade} more in a cascade" in text
    assert f"{s.sanitizer_violations} sanitizer violations" in text
    assert "mode         trusted" in text and "segments" in text


def test_the_summary_json_is_pinned(logdir):
    """Kills: a summary field added, dropped or reordered without updating the pinned list."""
    out = kvledger("replay", logdir["path"], "--trusted", "--json")
    rep = json.loads(out.stdout)
    assert out.returncode == 0 and list(rep) == SUMMARY_KEYS
    assert rep["mode"] == "trusted" and rep["files"] == len(logdir["files"]) and rep["first_seq"] == 0
    assert rep["first_file"] == logdir["files"][0] and rep["error"] is None


@pytest.mark.parametrize("trusted", [False, True])
def test_a_middle_segment_is_a_starting_point(logdir, trusted):
    """Kills: folding a later segment from a fresh state (its first event is not CacheConfigured), or
    starting a segment anywhere but at the checkpoint it opens with."""
    files = logdir["files"]
    mid = files[len(files) // 2]
    first = int(os.path.basename(mid)[4:24])
    s = replay_log(mid, trusted=trusted)
    assert s.ok, s.error
    assert s.first_file == mid and s.files == len(files) - len(files) // 2
    assert s.first_seq == s.start_seq == s.from_checkpoint == first
    assert s.events == logdir["seq"] - first and s.digest == logdir["digest"]
    until = first + 40
    u = replay_log(mid, trusted=trusted, until=until)
    assert u.ok and u.last_seq == until and u.digest == replay(logdir["events"][: until + 1]).digest()
    with pytest.raises(InvalidArgumentError, match="before the first event"):
        replay_log(mid, until=first - 1)
    out = kvledger("replay", mid, "--until", first - 1)
    assert out.returncode == 2 and "before the first event" in out.stdout


def test_from_checkpoint_in_a_directory_starts_at_the_checkpoint_before_until(logdir):
    """Kills: --from-checkpoint ignoring --until in a directory (starting at the last segment)."""
    with open_view(logdir["path"]) as v:
        cps = [r.seq for r in v.records if r.kind == KIND_CHECKPOINT]
    until = cps[len(cps) // 2] + 5
    for trusted in (False, True):
        s = replay_log(logdir["path"], until=until, from_checkpoint=True, trusted=trusted)
        assert s.ok and s.from_checkpoint == cps[len(cps) // 2] and s.last_seq == until
        assert s.digest == replay(logdir["events"][: until + 1]).digest()


def test_an_error_names_the_segment_that_holds_the_bad_record(logdir, tmp_path):
    """Kills: an error that names the log directory (or the first segment) instead of the damaged segment."""
    import shutil

    d = tmp_path / "damaged"
    shutil.copytree(logdir["path"], d)
    victim = sorted(p for p in os.listdir(d) if p.endswith(".kvlog"))[3]
    data = bytearray((d / victim).read_bytes())
    data[200] ^= 0x20
    (d / victim).write_bytes(bytes(data))
    for trusted in (False, True):
        s = replay_log(d, trusted=trusted)
        assert s.error is not None and s.error.kind == "corrupt" and exit_code(s) == 3
        assert s.error.file == str(d / victim) and s.error.offset is not None
        assert f"{victim}, offset" in render(s)
    out = kvledger("replay", d, "--json")
    assert out.returncode == 3 and json.loads(out.stdout)["error"]["file"] == str(d / victim)


def test_progress_runs_across_segments(logdir):
    """Kills: progress reported per file (going back to zero at each segment)."""
    seen: list[tuple[int, int]] = []
    replay_log(logdir["path"], trusted=True, progress=lambda done, total: seen.append((done, total)))
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and len({t for _, t in seen}) == 1 and dones[-1] == seen[-1][1]


def test_a_trusted_replay_compares_checkpoints_and_reports_a_mismatch_like_a_checked_one(tmp_path):
    """Kills: a trusted replay that never compares a checkpoint digest (a forged state digest passes)."""
    from test_replay import SCENARIO, StepSealed, _hand_written

    disk, path = _hand_written(SCENARIO + [StepSealed(step=0, clear_list=(0, 1))], checkpoint=(3, "0" * 64))
    for trusted in (False, True):
        s = replay_log(path, layer=disk, trusted=trusted, invariants="steps")
        assert s.error is not None and s.error.kind == "mismatch" and s.error.seq == 3 and exit_code(s) == 1
