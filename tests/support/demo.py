"""The demo tests' one way to run the demo in process.

    simulate_demo(config, **kw)     ``kvledger.demo.run.simulate(config, **kw)`` under ``anyio.run``:
                                    the demo's RunResult (its model is torch's: the demo tests
                                    skip without it, and this imports it only when called)
"""

from __future__ import annotations

from typing import Any

__all__ = ["simulate_demo"]


def simulate_demo(config: Any, **kw: Any) -> Any:
    """One in-process run of the demo (``kvledger.demo.run.simulate``) on a fresh event loop."""
    import anyio

    from kvledger.demo.run import simulate

    return anyio.run(lambda: simulate(config, **kw))
