"""Test support shared by every folder of tests/ (one copy of each helper).

    HEAVY       True under ``KVLEDGER_HYPOTHESIS=heavy`` (the heavy profile's counts; scripts/heavy)
    QUIET       a structlog logger that drops everything, for tests that open many logs
    wait_for    poll a condition until it holds or a (generous) deadline passes: never a fixed sleep
    workload    the seeded serving workload of the log, tools and crash tests (``drive``)
    simdisk     the simulated disk and its fault injector (power loss, failed writes and syncs)
    syscalls    a system-call recorder with a simulated page cache, over real files
    craft       log bytes built by hand, checksums and chain forged to match
    crashes     R4 and R5 as functions of a kill or seed range (the heavy profile shards them)
    upstream    vLLM 0.33.0's wheel and sdist, fetched once and cached
    cli         the kvledger console script (``kvledger(*args)``), found beside the interpreter or on PATH
    wirekeys    the wire's handshake under a job key, for the sans-I/O pair tests
    planes      byte planes for the engine and wire tests (the ``bytes`` backend: no torch)
    engine      what the engine tests share: events_of, assert_consistent, last_abort, step_events,
                released_then_committed
    gpu         what the GPU tests share: REQUIRES_CUDA, as_bytes, random_planes, the torch references
                of a clear and of the sanitizer's check, gpu_backend (nothing imports torch at import)
    demo        simulate_demo: one in-process run of the demo
    r8          R8's models: the reference model, the byte oracle, invalid commands, prefix rules
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import structlog

__all__ = ["HEAVY", "QUIET", "wait_for"]

HEAVY = os.environ.get("KVLEDGER_HYPOTHESIS") == "heavy"
QUIET = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def wait_for(cond: Callable[[], object], timeout: float) -> bool:
    """Whether ``cond()`` became true within ``timeout`` seconds (polled every 5 ms)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
