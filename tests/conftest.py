"""The suite's shared settings: hypothesis profiles, parallel runs, where temporary files live.

Profiles: ``quick`` (CI and the default) and ``heavy`` (``KVLEDGER_HYPOTHESIS=heavy``: the
RELIABILITY.md heavy counts; ``scripts/heavy`` runs it on a many-core host).
``KVLEDGER_HYPOTHESIS_EXAMPLES=N`` sets the loaded profile's examples per test (how
``scripts/heavy`` shards one state machine over processes, each with its own seed).

Parallel by default: ``python -m pytest`` over the whole suite (no test paths named) runs on
every core with pytest-xdist when it is installed (``-n auto --dist loadgroup``: tests dealt
out one at a time, except that a module with a costly module-scoped fixture marks itself
``xdist_group`` to stay on one worker). Serially: ``-n 0`` or ``-p no:xdist``. Naming files
or node ids runs them serially unless ``-n`` is given, so that one module starts at once. The
suite is correct either way: tests bind ephemeral ports, write under their own ``tmp_path``
and wait on conditions, never on the clock.

Temporary files: ``tmp_path`` lies on tmpfs (``/dev/shm``) where there is one, since no test's
subject is the latency of a real disk's fsync, and on a shared disk that latency made the
suite's time a matter of what the neighbours did (a log test spent half its time in fsync).
What the tests check of durability they check at the system-call level (tests/support/
syscalls.py, simdisk.py), which tmpfs runs for real. A test that wants the real disk asks for
``disk_tmp_path``. ``KVLEDGER_TEST_TMP=disk`` (or pytest's ``--basetemp``) puts it all back.
"""

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Quick profile in CI and by default; KVLEDGER_HYPOTHESIS=heavy selects the heavy one.
settings.register_profile("quick", max_examples=100, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("heavy", max_examples=2000, stateful_step_count=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVLEDGER_HYPOTHESIS", "quick"))
if os.environ.get("KVLEDGER_HYPOTHESIS_EXAMPLES"):
    settings.register_profile("sharded", settings.default,
                              max_examples=int(os.environ["KVLEDGER_HYPOTHESIS_EXAMPLES"]))
    settings.load_profile("sharded")


def _tmpfs() -> str | None:
    """/dev/shm when it is a writable folder with room to spare (1 GiB), else None."""
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    return shm if os.access(shm, os.W_OK) and st.f_bavail * st.f_frsize >= 1 << 30 else None


# pytest's own knob for the root of its temporary folders (read when the first one is made);
# xdist workers get their folders under the controller's.
_SHM = _tmpfs() if os.environ.get("KVLEDGER_TEST_TMP", "shm") != "disk" else None
if _SHM is not None and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
    os.environ["PYTEST_DEBUG_TEMPROOT"] = _SHM


@pytest.fixture
def disk_tmp_path() -> Iterator[Path]:
    """A fresh folder on the disk that holds the system's temporary files (``tmp_path`` may be on
    tmpfs: see the module docstring); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvledger-disk-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def needs_cuda() -> None:
    """Skip unless torch sees a CUDA device (``support.gpu.REQUIRES_CUDA`` asks for it): the
    test is set up, never failed, where there is none, and torch is imported only here."""
    from support.gpu import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")


class _Groups:
    """On the xdist controller: tells each worker to honour ``xdist_group`` (a worker parses only
    the command line, so ``--dist loadgroup`` set here would not reach it)."""

    def pytest_configure_node(self, node) -> None:
        node.workerinput["kvledger_loadgroup"] = True


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``-n auto --dist loadgroup`` for a whole-suite run (before xdist's own hook resolves "auto")."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        if worker.get("kvledger_loadgroup"):
            config.option.loadgroup = True
        return
    if not config.pluginmanager.hasplugin("xdist"):
        return  # -p no:xdist, or not installed: serial
    if config.option.numprocesses is not None or config.getoption("usepdb", False):
        return  # -n given (-n 0: serial), or --pdb
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and not config.option.collectonly:
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadgroup"
            config.pluginmanager.register(_Groups(), "kvledger-xdist-groups")
