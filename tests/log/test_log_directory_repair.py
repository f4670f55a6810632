"""Log directories that always reopen, and never roll back in silence (issue 32, finding 7).

* A torn opening checkpoint in the last segment (made by hand: a crash no longer leaves one,
  test_log_crash.py's F1) was "repaired" by truncating the segment to its header: appends went
  on in a segment without its checkpoint, and every later open, replay and audit refused the
  log ("a segment must open with a checkpoint"). Now the repair removes that segment (it held
  nothing else; the head moves back first) and appends continue in the one before it: the log
  reopens, again and again, after a crash before any checkpoint too, and replays and audits.
* Deleting the last segment *together with* its sync stamp rolled the log back in silence (the
  stamp was the only witness). Now the directory's head (``HEAD.sync``, written at every roll)
  names the newest segment: open, a view and replay report the loss; a directory of an older
  kvledger gets a head the first time a writer opens it; a reader listing just before a roll
  is not fooled (the head's segment exists by then).

Each case runs on real files and on the simulated disk. Mutants killed (scripts/mutants):
"torn opening checkpoint truncated, not removed", "lost last segment judged by its stamp
only", "roll does not move the head".
"""

from __future__ import annotations

import os
import shutil

import pytest

from support import QUIET
from support.cli import kvledger
from support.simdisk import SimulatedDisk
from support.workload import GEOMETRY, drive

from kvledger import CorruptLogError
from kvledger.core.log import list_segments, open_view
from kvledger.core.log.files import default_layer
from kvledger.core.log.format import SEGMENT_HEADER_SIZE
from kvledger.core.log.segments import HEAD_NAME, head
from kvledger.durable import open_ledger

SEG = {"segment_bytes": 4096}


def _directory(layer, path: str, steps: int = 60) -> tuple[str, int]:
    """A log directory of at least three segments, left as a crash leaves it (no close):
    (its digest, its seq)."""
    led = open_ledger(path, GEOMETRY, layer=layer, logger=QUIET, checkpoint_every=None, **SEG)
    drive(led, "dir", steps, ranks=1)
    led.flush()
    digest, seq = led.digest(), led.seq
    led.log.abandon()
    assert len(list_segments(layer, path)) >= 3
    return digest, seq


def _tear_opening_checkpoint(layer, path: str) -> str:
    """Cut the last segment inside its opening checkpoint and drop its stamp (by hand)."""
    last = list_segments(layer, path)[-1]
    data = bytes(layer.read(last))
    keep = data[: SEGMENT_HEADER_SIZE + 20]
    if isinstance(layer, SimulatedDisk):
        layer.put(last, keep)
    else:
        os.unlink(last)
        with open(last, "wb") as f:
            f.write(keep)
        os.chmod(last, 0o600)
    layer.remove_stamp(last)
    return last


@pytest.mark.parametrize("where", ["files", "simulated disk"])
def test_a_torn_opening_checkpoint_is_repaired_into_a_log_that_reopens(tmp_path, where):
    layer = default_layer if where == "files" else SimulatedDisk()
    path = str(tmp_path / "d") if where == "files" else "d"
    _directory(layer, path)
    torn = _tear_opening_checkpoint(layer, path)
    first = int(os.path.basename(torn)[4:24])
    with open_ledger(path, layer=layer, logger=QUIET, **SEG) as led:
        assert led.seq == first  # what the segment before it ends with: nothing of the torn one was whole
        assert led.recovery.truncated_bytes == 20  # reported as the torn tail it was
        assert not layer.exists(torn)
        drive(led, "after", 3, ranks=1)
        led.flush()
        digest2, seq2 = led.digest(), led.seq
        led.log.abandon()  # a crash before any checkpoint: the case that stayed refused for good
    for _ in range(2):
        with open_ledger(path, layer=layer, logger=QUIET, **SEG) as led:
            assert (led.digest(), led.seq) == (digest2, seq2)
    if where == "files":
        assert kvledger("replay", path).returncode == 0
        assert kvledger("audit", path, "--steps").returncode == 0
    with open_view(path, layer=layer) as view:
        assert view.scan.error is None and view.scan.torn_at is None


@pytest.mark.parametrize("where", ["files", "simulated disk"])
def test_losing_the_last_segment_with_its_stamp_is_reported_not_a_silent_rollback(tmp_path, where):
    layer = default_layer if where == "files" else SimulatedDisk()
    path = str(tmp_path / "d") if where == "files" else "d"
    _directory(layer, path)
    segs = list_segments(layer, path)
    first_lost = int(os.path.basename(segs[-1])[4:24])
    assert head(layer, path, _log_id(layer, segs[-1])).first_seq == first_lost  # the roll moved the head
    layer.remove(segs[-1])
    layer.remove_stamp(segs[-1])  # the stamp goes with it: only the head says what should follow
    with pytest.raises(CorruptLogError, match="missing.*HEAD") as info:
        open_ledger(path, layer=layer, logger=QUIET, **SEG)
    assert info.value.seq == first_lost and os.path.basename(segs[-1]) in str(info.value)
    with open_view(path, layer=layer) as view:
        assert isinstance(view.scan.error, CorruptLogError) and "HEAD" in str(view.scan.error)
    if where == "files":
        out = kvledger("replay", path)
        assert out.returncode == 3 and "HEAD" in out.stdout + out.stderr
    print(f"{where}: last segment and its stamp deleted: {str(info.value)[:160]}")


def test_a_directory_of_an_older_kvledger_gets_a_head_and_readers_during_a_roll_are_not_fooled(tmp_path):
    path = str(tmp_path / "d")
    _directory(default_layer, path)
    os.unlink(os.path.join(path, f"{HEAD_NAME}.sync"))  # as an older kvledger left it: no head
    segs = list_segments(default_layer, path)
    log_id = _log_id(default_layer, segs[-1])
    assert head(default_layer, path, log_id) is None
    with open_ledger(path, logger=QUIET, **SEG) as led:  # a writer opens it: the head names its live segment
        assert head(default_layer, path, log_id).first_seq == int(os.path.basename(segs[-1])[4:24])
        before = len(list_segments(default_layer, path))
        while len(list_segments(default_layer, path)) == before:
            drive(led, "roll", 2, ranks=1)
            led.flush()
        newest = list_segments(default_layer, path)[-1]
        assert head(default_layer, path, log_id).first_seq == int(os.path.basename(newest)[4:24])
        # a reader that listed the segments before that roll: the head names one that exists
        with open_view(path, since=0) as view:
            assert view.scan.error is None
    # another log's head proves nothing about this one
    other = str(tmp_path / "other")
    _directory(default_layer, other)
    shutil.copy(os.path.join(other, f"{HEAD_NAME}.sync"), os.path.join(path, f"{HEAD_NAME}.sync"))
    assert head(default_layer, path, log_id) is None
    with open_ledger(path, logger=QUIET, **SEG):
        pass


def _log_id(layer, segment: str) -> bytes:
    from kvledger.core.log.format import decode_header

    data = layer.read(segment)
    try:
        return decode_header(data, segment, max_pages=1 << 32).log_id
    finally:
        getattr(data, "close", lambda: None)()
