"""A log directory with more segments than the file-descriptor limit (issue 32, finding 4).

e388c64 mapped every segment of a directory at once and kept the mappings for the whole
view, and a mapping holds a file descriptor: a healthy log of more segments than
``RLIMIT_NOFILE`` could no longer be reopened, replayed, audited or exported
(``EMFILE``). Now a view holds at most ``segments.MAPPED_SEGMENTS`` mapped and maps the
others again when it reads their records.

The directory is written by the real writer (a roll every few steps), then each reader
runs in a child process whose soft ``RLIMIT_NOFILE`` is 256: reopening for appending (the
same digest, and it appends), ``kvledger replay`` (exit 0, the digest), ``kvledger audit
--check`` (exit 0) and ``kvledger events``. 600 segments in the quick profile, 5,000 in
the heavy one (``KVLEDGER_HYPOTHESIS=heavy``). Figures are printed (``-s``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest

from support import HEAVY
from support.cli import SCRIPT

from kvledger import Geometry
from kvledger.core.log import list_segments, open_view
from kvledger.core.log.segments import MAPPED_SEGMENTS
from kvledger.durable import open_ledger

SEGMENTS = 5000 if HEAVY else 600
LIMIT = 256
G = Geometry(num_pages=16, page_tokens=4)


def _segmented(path: str, n: int) -> tuple[str, int]:
    """A log directory of ``n`` segments written by the real writer: (its digest, its seq)."""
    led = open_ledger(path, G, segment_bytes=4096)
    r = 0
    try:
        while _count(path) < n:
            for _ in range(20):
                led.reserve(r, 1, tenant=f"t{r % 3}")
                step = led.open_step
                led.commit(r, step, 1)
                led.seal_step(step)
                led.complete_step(step, 0)
                led.finish(r)
                r += 1
            led.flush()
        return led.digest(), led.seq
    finally:
        led.close()


def _count(path: str) -> int:
    return sum(1 for n in os.listdir(path) if n.endswith(".kvlog"))


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


_REOPEN = textwrap.dedent("""
    import json, os, sys
    from kvledger.durable import open_ledger
    with open_ledger(sys.argv[1]) as led:
        digest, seq = led.digest(), led.seq
        led.reserve(10**6, 1)  # and it appends
        fds = len(os.listdir("/proc/self/fd"))
        after = led.digest()
    print(json.dumps({"digest": digest, "seq": seq, "fds": fds, "after": after}))
""")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, preexec_fn=_limited)


def test_a_directory_of_more_segments_than_the_fd_limit_reopens_replays_and_audits(tmp_path):
    if SCRIPT is None:
        pytest.skip("the kvledger console script is not installed")
    path = str(tmp_path / "many")
    t0 = time.monotonic()
    digest, seq = _segmented(path, SEGMENTS)
    built = time.monotonic() - t0
    n = _count(path)
    assert n >= SEGMENTS > LIMIT
    took = {}
    t0 = time.monotonic()
    reopen = _run([sys.executable, "-c", _REOPEN, path])
    took["reopen"] = time.monotonic() - t0
    assert reopen.returncode == 0, reopen.stderr[-2000:]
    got = json.loads(reopen.stdout)
    assert got["digest"] == digest and got["seq"] == seq
    for name, args in (("replay", ["replay", path, "--json"]), ("audit", ["audit", path, "--check"]),
                       ("events", ["events", path, "-o", str(tmp_path / "events.jsonl")])):
        t0 = time.monotonic()
        res = _run([SCRIPT, *args])
        took[name] = time.monotonic() - t0
        assert res.returncode == 0, (name, res.stdout[-1500:], res.stderr[-1500:])
        if name == "replay":
            assert json.loads(res.stdout)["digest"] == got["after"]
    with open_view(path) as view:  # here (no limit): the view mapped at most MAPPED_SEGMENTS at a time
        assert len(view.paths) == n and view.scan.error is None
    print(f"{n} segments (written in {built:.1f} s), RLIMIT_NOFILE {LIMIT}: reopened (same digest, "
          f"{got['fds']} fds open after it) in {took['reopen']:.1f} s, replay {took['replay']:.1f} s, "
          f"audit --check {took['audit']:.1f} s, events {took['events']:.1f} s; at most {MAPPED_SEGMENTS} mapped")
    assert got["fds"] < 64


def test_a_view_maps_a_segment_again_only_if_it_still_holds_what_was_verified(tmp_path):
    """Past ``MAPPED_SEGMENTS`` a view maps a segment again to read it: a deleted one is a clear
    ``LogError`` (retention outran the reader), a replaced one ``CorruptLogError``; a log of at most
    ``MAPPED_SEGMENTS`` segments keeps every one mapped (a reader keeps its view whole)."""
    from kvledger import CorruptLogError, LogError
    from kvledger.core.log import fold_records, start_state
    from kvledger.core.log.files import default_layer

    path = str(tmp_path / "d")
    digest, _ = _segmented(path, MAPPED_SEGMENTS + 8)
    paths = list_segments(default_layer, path)
    with open_view(path) as view:  # a whole fold from segment 0: each of the first segments mapped again
        st, start, _ = start_state(view, at=0)
        fold_records(view, st, start)
        assert st.digest() == digest
        first = next(r for r in view.records if r.segment == 0 and r.kind == 1)
        view.events(first)
    with open_view(path) as view:
        os.unlink(paths[0])  # "retention" deletes the first segment while the view is open
        first = next(r for r in view.records if r.segment == 0 and r.kind == 1)
        with pytest.raises(LogError, match="deleted"):
            view.events(first)
    with open_view(path) as view:
        victim = view.paths[1]
        with open(victim, "rb") as f:
            data = f.read()
        os.unlink(victim)
        with open(victim, "wb") as f:  # replaced by other bytes after it was verified
            f.write(data[:100])
        rec = next(r for r in view.records if r.segment == 1 and r.kind == 1)
        with pytest.raises(CorruptLogError, match="no longer holds"):
            view.events(rec)
