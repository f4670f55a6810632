"""kvledger: an event-sourced ledger of KV-cache pages.

Bytes a page held for someone else (a released snapshot row, another tenant)
are zeroed exactly once, on every rank, before any request reads them.

``import kvledger`` is light: it never imports torch, triton or CUDA.
"""

from kvledger.core.errors import *  # noqa: F401,F403
from kvledger.core.errors import __all__ as _errors_all
from kvledger.core.events import (
    CLEAR_POLICIES,
    ClearPages,
    Geometry,
    StepPlan,
)
from kvledger.core.ledger import Ledger, replay
from kvledger.core.state import LedgerState, check_invariants

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``kvledger.open`` (the async engine) is resolved lazily: it needs anyio, and the
    # engine module imports torch only when a rank has planes.
    if name == "open":
        from kvledger.engine import open_engine

        return open_engine
    raise AttributeError(f"module 'kvledger' has no attribute {name!r}")

__all__ = [
    *_errors_all,
    "CLEAR_POLICIES",
    "ClearPages",
    "Geometry",
    "Ledger",
    "LedgerState",
    "StepPlan",
    "check_invariants",
    "replay",
    "__version__",
]
