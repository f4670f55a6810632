"""A pytest plugin that runs vLLM's own tests on kvledger's pool.

    pytest -p kvledger.integrations.vllm.pytest_plugin ...

It installs the ledger pool when pytest configures, before any test module is
imported, so every ``BlockPool`` the tests build (directly, or through
``KVCacheManager`` and ``Scheduler``) is a ``LedgerBlockPool``; with ``verify``
every pool call is followed by a page-by-page comparison of vLLM's blocks and
the ledger, and with ``check`` every ledger invariant runs after every event.
``scripts/vllm-conformance`` uses it. Environment:

    KVLEDGER_VLLM_POLICY   the clear policy (default groups)
    KVLEDGER_VLLM_VERIFY   0 to skip verify() after every pool call (default 1)
    KVLEDGER_VLLM_CHECK    0 to skip the ledger's invariants after every event (default 1)

At the end it prints how many ledger pools the run made and how many events
they folded.
"""

from __future__ import annotations

import os

from . import install

_state: dict = {}


def pytest_configure(config) -> None:
    verify = os.environ.get("KVLEDGER_VLLM_VERIFY", "1") != "0"
    check = os.environ.get("KVLEDGER_VLLM_CHECK", "1") != "0"
    policy = os.environ.get("KVLEDGER_VLLM_POLICY", "groups")
    # on_error="fail": a transition the ledger refuses is the test's failure, never a silent detach
    _state["inst"] = install(policy=policy, check=check, verify=verify, on_error="fail")
    _state["events"] = 0
    _state["pools"] = 0


def pytest_runtest_teardown(item) -> None:
    inst = _state.get("inst")
    if inst is None:
        return
    for pool in inst.forget_pools():
        _state["events"] += pool.ledger.seq
        _state["pools"] += 1
        pool.close()


def pytest_terminal_summary(terminalreporter) -> None:
    inst = _state.get("inst")
    if inst is not None:
        terminalreporter.write_line(f"kvledger pool ({inst.pool_class.options.policy}): {_state['pools']} pools, "
                                    f"{_state['events']} ledger events")


def pytest_unconfigure(config) -> None:
    inst = _state.pop("inst", None)
    if inst is not None:
        inst.uninstall()
