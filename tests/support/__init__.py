"""Test support shared by every folder of tests/ (one copy of each helper).

    HEAVY       True under ``KVLEDGER_HYPOTHESIS=heavy`` (the heavy profile's counts; scripts/heavy)
    QUIET       a structlog logger that drops everything, for tests that open many logs
    workload    the seeded serving workload of the log, tools and crash tests (``drive``)
    simdisk     the simulated disk and its fault injector (power loss, failed writes and syncs)
    syscalls    a system-call recorder with a simulated page cache, over real files
    craft       log bytes built by hand, checksums and chain forged to match
    crashes     R4 and R5 as functions of a kill or seed range (the heavy profile shards them)
    upstream    vLLM 0.33.0's wheel and sdist, fetched once and cached
"""

from __future__ import annotations

import logging
import os

import structlog

__all__ = ["HEAVY", "QUIET"]

HEAVY = os.environ.get("KVLEDGER_HYPOTHESIS") == "heavy"
QUIET = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
