"""RELIABILITY.md R18: readers run while a writer appends, recovers a torn tail and closes.

A reader process maps the log again and again (``open_view``, every record
decoded, the fold: every byte touched) while this process, round after round,
puts a log with a large torn tail at the path (by rename, as a crash would leave
it), reopens it (recovery cuts the torn tail), appends and closes. Readers must
see a consistent prefix or a clear error: a reader killed by a signal (SIGBUS,
from touching pages a writer cut off under its mapping) is a crash.

``KVLEDGER_HYPOTHESIS=heavy`` runs ten times as many rounds, with two readers and 8 MiB torn tails
(quick: one reader, 1 MiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


from support import HEAVY, QUIET
from kvledger.durable import open_ledger
from kvledger.options import LogOptions

from support.workload import GEOMETRY, drive

ROUNDS = 200 * (10 if HEAVY else 1)
READERS = 2 if HEAVY else 1  # processes reading all the while (each keeps a core busy)
TORN = (8 if HEAVY else 1) << 20  # bytes of torn tail per round

_READER = r"""
import json, sys, time
from kvledger import KVLedgerError
from kvledger.core.log import open_view
from kvledger.core.log.fold import rebuild_state
path, stop = sys.argv[1], sys.argv[2]
import os
seen = {"reads": 0, "torn": 0, "clean": 0, "errors": {}}
while not os.path.exists(stop):
    try:
        with open_view(path) as v:
            rebuild_state(v)
            seen["reads"] += 1
            seen["torn" if v.scan.torn_at is not None else "clean"] += 1
            if v.scan.error is not None:
                raise v.scan.error
    except KVLedgerError as exc:
        seen["errors"][type(exc).__name__] = seen["errors"].get(type(exc).__name__, 0) + 1
json.dump(seen, sys.stdout)
"""


def test_r18_readers_while_a_writer_recovers_appends_and_closes(tmp_path):
    """Mutant killed: ``_OsHandle.truncate`` cutting the file in place (``os.ftruncate``) instead of
    renaming a copy over it: the reader processes die of SIGBUS."""
    path = str(tmp_path / "live.kvlog")
    with open_ledger(path, GEOMETRY, logger=QUIET, log_options=LogOptions(checkpoint_every=50)) as led:
        drive(led, "r18", 40)
    stop = str(tmp_path / "stop")
    readers = [subprocess.Popen([sys.executable, "-c", _READER, path, stop], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(READERS)]
    garbage = os.urandom(1 << 20) * (TORN >> 20)
    t0 = time.perf_counter()
    recovered = appended = 0
    try:
        for i in range(ROUNDS):
            with open(path, "rb") as f:
                good = f.read()
            tmp = f"{path}.put"
            with open(tmp, "wb") as f:  # a crash image: the good records, then a large torn tail
                f.write(good + garbage)
            os.replace(tmp, path)  # (the test itself never cuts a file in place either)
            if os.path.exists(f"{path}.sync"):
                os.unlink(f"{path}.sync")  # as if the writer had crashed before it stamped
            with open_ledger(path, logger=QUIET, log_options=LogOptions(checkpoint_every=50)) as led:
                recovered += led.recovery.truncated_at is not None
                drive(led, f"r18-{i}", 1)
                appended += 1
            if any(r.poll() is not None for r in readers):
                break
    finally:
        open(stop, "w").close()
    outs = [r.communicate(timeout=120) for r in readers]
    crashes = sum(r.returncode != 0 for r in readers)
    seen = [json.loads(o) for o, _ in outs if o.strip()]
    reads = sum(s["reads"] for s in seen)
    errors: dict = {}
    for s in seen:
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    print(f"R18 readers vs writer: rounds {recovered} (torn tails of {TORN >> 20} MiB recovered while {READERS} reader "
          f"processes read, {appended} appends + closes); reads {reads} "
          f"(torn {sum(s['torn'] for s in seen)}, clean {sum(s['clean'] for s in seen)}), errors {errors}; "
          f"reader crashes {crashes} (return codes {[r.returncode for r in readers]}); "
          f"{time.perf_counter() - t0:.1f} s")
    assert crashes == 0, [e[-2000:] for _, e in outs]
    assert recovered >= 200 and reads > 0
    assert not errors  # a consistent prefix every time: a torn tail is reported, never an error
