"""The library logs through the standard ``logging`` module under the ``kvledger`` logger.

An application that configures nothing sees nothing on stdout and nothing below
WARNING on stderr (warnings reach stderr through Python's last-resort handler);
one that configures ``logging`` gets every event, as ``event key=value`` text or,
through structlog's ``ProcessorFormatter``, with every field. Each case runs in a
fresh interpreter, so no test's logging setup leaks into it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A durable ledger's life: created (info), commits that list pages and a seal (debug), closed (info).
LIFE = """
import sys
from kvledger import Geometry
from kvledger.durable import open_ledger

path = sys.argv[1]
with open_ledger(path, Geometry(num_pages=8, page_tokens=4)) as led:
    led.alias_snapshot(1, 2)
    led.release_snapshot(1)
    led.reserve(5, 2)
    led.commit(5, 0, 2)
    led.seal_step(0)
    led.finish(5)
"""

# Reopening a log with a torn tail: log_truncated (warning), log_opened (info).
TORN = """
import sys
from kvledger.durable import open_ledger

path = sys.argv[1]
with open(path, "ab") as f:
    f.write(b"\\x00" * 100)
open_ledger(path).close()
"""


def _run(code: str, *args: str, setup: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", setup + code, *args], capture_output=True, text=True, timeout=120)


def test_an_unconfigured_application_sees_nothing_below_warning(tmp_path):
    path = str(tmp_path / "a.kvlog")
    p = _run(LIFE, path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "" and p.stderr == ""  # log_created, pages_committed, step_sealed, log_closed: dropped
    p = _run(TORN, path)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("log_truncated ") and "bytes=100" in lines[0], p.stderr


def test_an_unconfigured_application_sees_an_aborted_step_as_a_warning():
    code = """
import anyio
from kvledger import Geometry, StepFailedError
from kvledger.engine import RankSpec, open_engine

def graph(ctx, step, inputs):
    raise RuntimeError("the graph broke")

async def main():
    async with open_engine(Geometry(num_pages=8, page_tokens=4), ranks=[RankSpec(graph=graph)]) as engine:
        try:
            await engine.run_step(0)
        except StepFailedError:
            pass

anyio.run(main)
"""
    p = _run(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""
    assert p.stderr.startswith("step_aborted step=0 reason='rank 0 failed: RuntimeError: the graph broke'"), p.stderr


def test_plain_logging_gets_every_event_as_text(tmp_path):
    setup = ("import logging, sys\n"
             "logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,\n"
             "                    format='%(name)s %(levelname)s %(filename)s %(message)s')\n")
    p = _run(LIFE, str(tmp_path / "b.kvlog"), setup=setup)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    events = [line.split()[3] for line in lines]
    assert events[0] == "log_created" and events[-1] == "log_closed"
    assert {"pages_committed", "step_sealed"} <= set(events)
    sealed = next(line for line in lines if " step_sealed " in line)
    # the record names the library's own call site (durable.py), not structlog's internals
    assert sealed.startswith("kvledger DEBUG durable.py step_sealed ") and "step=0" in sealed and "cleared=2" in sealed


@pytest.mark.parametrize("level, expect", [("INFO", {"log_created", "log_closed"}), ("WARNING", set())])
def test_structlog_processor_formatter_gets_the_fields(tmp_path, level, expect):
    setup = (
        "import logging, sys, structlog\n"
        "h = logging.StreamHandler(sys.stdout)\n"
        "h.setFormatter(structlog.stdlib.ProcessorFormatter(processors=["
        "structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.add_log_level, "
        "structlog.processors.JSONRenderer()]))\n"
        f"logging.getLogger('kvledger').addHandler(h)\nlogging.getLogger('kvledger').setLevel(logging.{level})\n"
    )
    path = str(tmp_path / "c.kvlog")
    p = _run(LIFE, path, setup=setup)
    assert p.returncode == 0, p.stderr
    records = [json.loads(line) for line in p.stdout.splitlines()]
    assert {r["event"] for r in records} == expect
    for r in records:
        assert r["log"] == path and r["level"] == "info"
    created = [r for r in records if r["event"] == "log_created"]
    assert not expect or created[0]["geometry"] == [8, 4]
