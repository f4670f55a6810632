"""The hybrid probe: vLLM's own scheduler over overlaid KV cache groups, byte by byte, on the CPU.

Who reads bytes someone else left? vLLM's hybrid KV cache overlays its groups on the
same memory (attention KV, Mamba state, or two precisions), and a block moves
between them. The probe drives vLLM's own ``Scheduler`` (built with vLLM's test
utilities, ``tests/v1/core/utils.py``) over a serving trace, backs it with real CPU
tensors laid out by vLLM's own planner and allocator (``get_kv_cache_config_from_groups``,
``allocate_kv_cache``), emulates the workers, and checks every read:

    configs.py   the hybrid configurations (attention + Mamba "align" with prefix caching,
                 attention + Mamba "none", fp16 + fp32 attention groups) and the scheduler
    memory.py    the tagged cache: every write fills its bytes with the id of a record
                 (group, precision, content, request, step); every read classifies what it finds
    driver.py    the trace (shared prefixes, aborts with immediate retries, preemption,
                 sync or async scheduling, dropped work) and the worker, step by step
    __main__     ``python -m kvledger.integrations.vllm.probe``: the table, per rule and config

A read is **stale** when it finds bytes last written under another group or
precision (the seed's NaN: reinterpreted bytes), or poison, or, for a recurrent
state, bytes its own history did not write; **unwritten** when a prefix-cache hit
finds bytes whose writing step did not run; masked reads of another request's KV
of the same group and precision are counted apart (finite values; the reason vLLM
does not zero uniform caches).

Needs vLLM and its test files (run it with the conformance environment's python,
from the folder holding vLLM's ``tests/``: ``scripts/vllm-conformance --probe``).
"""

from __future__ import annotations

__all__ = ["CONFIGS", "RULES", "ProbeStats", "run_probe"]

CONFIGS = ("align", "none", "mixed")
RULES = ("vllm", "groups", "all_reused", "sanitizer")


def __getattr__(name: str):
    if name in ("run_probe", "ProbeStats"):
        from . import driver

        return getattr(driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
