"""kvledger: an event-sourced ledger of KV-cache pages.

Bytes a page held for someone else (a released snapshot row, another tenant)
are zeroed exactly once, on every rank, before any request reads them.

The public face:

* ``Ledger`` (in memory) and ``open_ledger`` (with a durable log): the
  synchronous command side; ``replay`` folds events into a ``LedgerState``.
* ``open_engine`` (``kvledger.open_engine(geometry, ranks=[RankSpec(...)])``),
  ``Engine``, ``RankSpec``, ``StepInputs``, ``StepResult``, and ``open_engine``'s option
  groups (``LogOptions``, ``StepOptions``, ``ExtraOptions``, ``RemoteOptions``): the
  embedded async engine. (``kvledger.open``, its name before, still works for one
  release, with a DeprecationWarning.)
* ``Geometry``, ``StepPlan``, ``ClearPages`` and every event (``EVENT_TYPES``: the
  commands' events, the prefix cache's, the engine's labels), as a ``Ledger.submit``
  caller builds them and a log holds them.
* every error: ``KVLedgerError`` and its subclasses (``kvledger.core.errors``).

``import kvledger`` is light: it never imports torch, triton or CUDA, and the
engine (anyio) and the durable ledger load on first use.
"""

from .core.errors import *  # noqa: F403
from .core.errors import __all__ as _errors_all
from .core.events import (
    CLEAR_POLICIES,
    EVENT_TYPES,
    CacheConfigured,
    ClearPages,
    Geometry,
    PagesCommitted,
    PagesEvicted,
    PagesPublished,
    PagesReleased,
    PagesReserved,
    PagesShared,
    PagesUnwritten,
    RequestCancelled,
    RequestFinished,
    RequestLabelled,
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
    "open_engine": ("kvledger.engine", "open_engine"),
    "Engine": ("kvledger.engine", "Engine"),
    "RankSpec": ("kvledger.engine", "RankSpec"),
    "StepInputs": ("kvledger.engine", "StepInputs"),
    "StepResult": ("kvledger.engine", "StepResult"),
    "open_ledger": ("kvledger.durable", "open_ledger"),
    "DurableLedger": ("kvledger.durable", "DurableLedger"),
    "LogOptions": ("kvledger.options", "LogOptions"),
    "StepOptions": ("kvledger.engine", "StepOptions"),
    "ExtraOptions": ("kvledger.engine", "ExtraOptions"),
    "RemoteOptions": ("kvledger.engine", "RemoteOptions"),
}


def __getattr__(name: str) -> object:
    if name == "open":  # (open_engine's name before; not in __all__: a star import must not shadow open())
        import warnings

        warnings.warn("kvledger.open is deprecated: it is kvledger.open_engine (also kvledger.engine.open_engine); "
                      "the old name goes in the next release", DeprecationWarning, stacklevel=2)
        from .engine import open_engine

        return open_engine
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
    *_LAZY,  # open_engine, Engine, RankSpec, ..., open_ledger, DurableLedger, the option groups
    "CLEAR_POLICIES",
    "EVENT_TYPES",
    "CacheConfigured",
    "ClearPages",
    "Geometry",
    "Ledger",
    "LedgerState",
    "PagesCommitted",
    "PagesEvicted",
    "PagesPublished",
    "PagesReleased",
    "PagesReserved",
    "PagesShared",
    "PagesUnwritten",
    "RequestCancelled",
    "RequestFinished",
    "RequestLabelled",
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
