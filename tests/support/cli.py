"""The kvledger console script, run as a user runs it.

    SCRIPT      the script beside the interpreter running the tests (its venv's, so it runs this
                tree), else the first on PATH (scripts/device-env puts one there on a device host,
                where the interpreter's folder is not ours to write); None when there is neither
    kvledger    ``kvledger(*args, timeout=120)``: run it, output captured as text; the test fails,
                naming the fix, when no script is installed
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

__all__ = ["SCRIPT", "kvledger"]


def _script() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "kvledger")
    return here if os.path.exists(here) else shutil.which("kvledger")


SCRIPT = _script()


def kvledger(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    if SCRIPT is None:
        pytest.fail("the kvledger console script is not installed: run `python -m pip install -e . --no-deps`")
    return subprocess.run([SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=timeout)
