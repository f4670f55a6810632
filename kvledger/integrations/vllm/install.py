"""``install()``: every vLLM ``BlockPool`` made afterwards is a ``LedgerBlockPool``.

vLLM's ``KVCacheCoordinator`` builds its pool by calling the name ``BlockPool``
it imported from ``vllm.v1.core.block_pool``; ``install`` rebinds that name (in
both modules, in memory: nothing on disk changes) to a ``LedgerBlockPool``
subclass carrying the options, so every ``KVCacheManager`` made afterwards,
including the one vLLM's ``Scheduler`` makes, runs on a ledger pool, as does
code that builds a ``BlockPool`` itself. It also wraps
``KVCacheManager.take_new_block_ids``, which the scheduler calls once per
``schedule()``, so that each scheduler step seals the pool's ledger step (with
``zeroing=True`` the ledger's clear list replaces vLLM's list of new blocks to
zero). ``uninstall`` (or leaving the ``with`` block) restores vLLM's names and
closes the pools' logs.

    with kvledger.integrations.vllm.install(log="vllm.kvlog") as inst:
        manager = KVCacheManager(kv_cache_config, max_model_len=..., ...)
        ...
    pool = inst.pools[0]          # its .ledger, .log_path, .take_block_ids_to_zero()

Subclasses of ``BlockPool`` vLLM defines (the HiSparse host pool) keep vLLM's
pool: their modules are imported before the names are rebound.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

from ...core.errors import ConfigurationError

__all__ = ["Installation", "install"]

_PATCHED_MODULES = ("vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_coordinator")
_active: list[Installation] = []


class Installation:
    """An installed ledger pool: ``pool_class``, the ``pools`` made since (oldest first),
    ``uninstall()``. A context manager (``uninstall`` on exit)."""

    def __init__(self, pool_class: type, zeroing: bool) -> None:
        self.pool_class = pool_class
        self.zeroing = zeroing
        self._pools: list[weakref.ref] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self.installed = False

    @property
    def pools(self) -> list:
        """The ledger pools made since ``install`` that are still alive, oldest first."""
        return [p for p in (r() for r in self._pools) if p is not None]

    def track(self, pool: Any) -> None:
        """Count ``pool`` among ``pools`` (a weak reference: a pool vLLM drops is gone from it)."""
        self._pools.append(weakref.ref(pool))

    def patch(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name`` to ``value``, remembering what was there for ``uninstall``."""
        self._restore.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def forget_pools(self) -> list:
        """The pools made since ``install`` (or the last call) that are still alive; forgets them all."""
        pools = self.pools
        self._pools.clear()
        return pools

    def uninstall(self) -> None:
        """Restore vLLM's ``BlockPool`` names and ``take_new_block_ids``, and close every pool's
        log. Idempotent. Pools made before keep working (on their ledgers, logs closed)."""
        if not self.installed:
            return
        for owner, name, value in reversed(self._restore):
            setattr(owner, name, value)
        self._restore.clear()
        self.installed = False
        if self in _active:
            _active.remove(self)
        for pool in self.pools:
            pool.close()

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def install(*, log: str | os.PathLike | None = None, fsync: str = "background",
            policy: str = "released_aliases", per_page: bool | None = None, zeroing: bool = False,
            check: bool = False, verify: bool = False) -> Installation:
    """Make every vLLM ``BlockPool`` built from now on a ledger pool. Returns the ``Installation``.

    ``log``: None (each pool keeps an in-memory ledger), a log file (for one
    pool: a second pool on the same file raises ``LogLockedError``), or an
    existing directory (one log per pool); written with ``fsync`` ("background":
    a writer thread syncs, the scheduler never waits for the disk). ``policy``:
    the clear policy; ``"all_reused"`` lists every reused block, the pages vLLM
    zeroes for Mamba and mixed-precision caches, less the never-used ones.
    ``zeroing``: the ledger's clear list replaces vLLM's ``new_block_ids_to_zero``
    (keep False with KV connectors that load blocks asynchronously: the ledger
    does not know those writes). ``per_page``, ``check``, ``verify``: see
    ``PoolOptions``. Raises ``ConfigurationError`` when an installation is already
    active or an option is bad, ``ImportError`` without vLLM; nothing is patched then.
    """
    _check_options(log, fsync, policy, per_page)
    import importlib

    for name in _PATCHED_MODULES:  # (imports vLLM's own BlockPool subclasses first)
        importlib.import_module(name)
    kv_cache_manager = importlib.import_module("vllm.v1.core.kv_cache_manager")

    from .pool import LedgerBlockPool, PoolOptions

    options = PoolOptions(log=log, fsync=fsync, policy=policy, per_page=per_page, check=check, verify=verify)
    inst = Installation(type("LedgerBlockPool", (LedgerBlockPool,), {"options": options}), bool(zeroing))
    original_init = LedgerBlockPool.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        inst.track(self)

    cls = inst.pool_class
    cls.__init__ = __init__  # type: ignore[misc]
    cls.__module__ = LedgerBlockPool.__module__
    cls.__qualname__ = "LedgerBlockPool"
    for name in _PATCHED_MODULES:
        inst.patch(sys.modules[name], "BlockPool", cls)
    _wrap_take_new_block_ids(inst, kv_cache_manager.KVCacheManager, LedgerBlockPool)
    inst.installed = True
    _active.append(inst)
    return inst


def _check_options(log: Any, fsync: str, policy: str, per_page: bool | None) -> None:
    if _active:
        raise ConfigurationError("kvledger's vLLM pool is already installed: uninstall it first")
    if fsync not in ("background", "per_step", "per_event", "none"):
        raise ConfigurationError(f"unknown fsync policy {fsync!r}")
    from ...core.events import CLEAR_POLICIES

    if policy not in CLEAR_POLICIES:
        raise ConfigurationError(f"unknown clear policy {policy!r}; one of {CLEAR_POLICIES}")
    if per_page is False and policy != "released_aliases":
        raise ConfigurationError(f"per_page=False needs the released_aliases policy, not {policy!r}")
    if log is not None and not isinstance(log, (str, os.PathLike)):
        raise ConfigurationError(f"log must be a path or None, got {log!r}")


def _wrap_take_new_block_ids(inst: Installation, manager_cls: Any, pool_cls: type) -> None:
    """Each scheduler step seals the pool's ledger step; with ``zeroing`` its clear list is the answer."""
    take = manager_cls.take_new_block_ids

    def take_new_block_ids(self: Any) -> list[int]:
        ids = take(self)
        pool = self.block_pool
        if not isinstance(pool, pool_cls):
            return ids
        ledger_ids = pool.take_block_ids_to_zero()  # type: ignore[attr-defined]
        pool.last_block_ids_to_zero = ledger_ids  # type: ignore[attr-defined]
        return ledger_ids if inst.zeroing else ids

    take_new_block_ids.__doc__ = take.__doc__
    inst.patch(manager_cls, "take_new_block_ids", take_new_block_ids)
