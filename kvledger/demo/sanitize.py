"""``--sanitize``: the run under pressure in the engine's sanitizer mode (SPEC "The sanitizer").

    open      engine_options(config, reference): ``{"extras": ExtraOptions(sanitize=True)}``
              (``{"sanitize": True}`` for an engine of before the option groups) for the run under
              pressure (the reference never reuses a page: nothing is ever marked), or
              ``ConfigurationError`` when this kvledger's ``open_engine`` has no sanitizer
              (raised before any log exists)
    a step    every rank poisons the pages marked since the last plan (0xFF), clears,
              then checks on the device that every listed page is zero and that no page
              committed this step holds poison, before the graph reads anything
              (``RankExecutor(sanitize=True)``; ``--no-clear``'s ``SkipClearBackend``
              poisons and checks like a real backend and only skips the zeroing)
    stopped   ``run_step`` raises ``SanitizerError`` (rank, plane, page, request, step,
              the page's lifecycle): the engine recorded the violations and aborted the
              step, so the graph read nothing. ``SanitizerTally.stopped`` counts the
              violations, keeps the first error's text, and fails every request of the
              step (none of them got its token); the run goes on without them

With clears on the sanitizer finds nothing and the run is the plain run plus the
check's cost (``sanitize_s`` per step). With ``--no-clear`` it stops the first step
that lists a page it did not zero, before any request reads it, where the plain run
fails only when the stale bytes happen to decode as NaN.

Ranks that share a step meet in ``ranks.AllReduce``: a rank whose check failed never
starts its graph, so the others wait for it until the all-reduce times out. With the
demo's ranks that does not happen (every rank holds the same listed pages, all poisoned),
but a rank that skips a plane on purpose would show it.
"""

from __future__ import annotations

import inspect
from typing import Any

from kvledger.core.errors import ConfigurationError
from kvledger.engine import ExtraOptions, open_engine

from .workload import DemoConfig

__all__ = ["engine_options", "has_sanitizer"]


def has_sanitizer() -> bool:
    """Does this kvledger's ``open_engine`` have the sanitizer (``ExtraOptions.sanitize``, or the
    ``sanitize=`` keyword of before the option groups)?"""
    params = inspect.signature(open_engine).parameters
    return "extras" in params or "sanitize" in params


def engine_options(config: DemoConfig, reference: bool) -> dict[str, Any]:
    """The ``open_engine`` options of ``--sanitize``: none without it or for the reference.

    Raises ``ConfigurationError`` when the engine has no sanitizer (nothing opened)."""
    if not config.sanitize or reference:
        return {}
    if not has_sanitizer():
        raise ConfigurationError("--sanitize needs the engine's sanitizer: this kvledger's open_engine has no "
                                 "sanitize=True (run without --sanitize)")
    if "extras" in inspect.signature(open_engine).parameters:
        return {"extras": ExtraOptions(sanitize=True)}
    return {"sanitize": True}

