"""kvledger: an event-sourced ledger of KV-cache pages.

Bytes a page held for someone else (a released snapshot row, another tenant)
are zeroed exactly once, on every rank, before any request reads them.

The public face:

* ``Ledger`` (in memory) and ``open_ledger`` (with a durable log): the
  synchronous command side; ``replay`` folds events into a ``LedgerState``.
* ``open`` (``kvledger.open(geometry, ranks=[RankSpec(...)])``), ``Engine``,
  ``RankSpec``, ``StepInputs``, ``StepResult``: the embedded async engine.
* ``Geometry``, ``StepPlan``, ``ClearPages`` and the events a ``Ledger.submit``
  caller builds.
* every error: ``KVLedgerError`` and its subclasses (``kvledger.core.errors``).

``import kvledger`` is light: it never imports torch, triton or CUDA, and the
engine (anyio) and the durable ledger load on first use.
"""

from .core.errors import *  # noqa: F403
from .core.errors import __all__ as _errors_all
from .core.events import (
    CLEAR_POLICIES,
    CacheConfigured,
    ClearPages,
    Geometry,
    PagesCommitted,
    PagesReserved,
    RequestCancelled,
    RequestFinished,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SanitizerViolation,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepPlan,
    StepSealed,
)
from .core.ledger import Ledger, replay
from .core.state import LedgerState, check_invariants

__version__ = "0.1.0"

# Loaded on first use: name -> (module, attribute).
_LAZY = {
    "open": ("kvledger.engine", "open_engine"),
    "Engine": ("kvledger.engine", "Engine"),
    "RankSpec": ("kvledger.engine", "RankSpec"),
    "StepInputs": ("kvledger.engine", "StepInputs"),
    "StepResult": ("kvledger.engine", "StepResult"),
    "open_ledger": ("kvledger.durable", "open_ledger"),
    "DurableLedger": ("kvledger.durable", "DurableLedger"),
}


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'kvledger' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    *_errors_all,
    *_LAZY,  # open, Engine, RankSpec, StepInputs, StepResult, open_ledger, DurableLedger
    "CLEAR_POLICIES",
    "CacheConfigured",
    "ClearPages",
    "Geometry",
    "Ledger",
    "LedgerState",
    "PagesCommitted",
    "PagesReserved",
    "RequestCancelled",
    "RequestFinished",
    "ReservationReturned",
    "RestoreCompleted",
    "RestoreStarted",
    "SanitizerViolation",
    "SnapshotAliased",
    "SnapshotReleased",
    "StepAborted",
    "StepCompleted",
    "StepPlan",
    "StepSealed",
    "check_invariants",
    "replay",
    "__version__",
]
