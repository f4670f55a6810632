"""``install()``: every vLLM ``BlockPool`` made afterwards is a ``LedgerBlockPool``, and vLLM's managers
and scheduler tell it who calls and when a step ran.

What it patches (in memory, restored by ``uninstall``; nothing on disk changes):

    vllm.v1.core.block_pool.BlockPool,            -> a LedgerBlockPool subclass carrying the options
      vllm.v1.core.kv_cache_coordinator.BlockPool    (every KVCacheManager, every Scheduler builds one)
    KVCacheCoordinator.__init__                   -> the pool learns the KV cache groups (tenants,
                                                     state groups); a group kind the policy does not
                                                     know is refused there, naming it
    SingleTypeKVCacheManager (and subclasses):    -> the pool's calls name the vLLM request and the
      allocate_new_blocks, free,                     group (``who``); a state group's request with no
      add_local_computed_blocks, ...                 state yet commits its block reading it whole
    KVCacheManager.take_new_block_ids             -> each scheduler step seals the ledger step; with
                                                     ``zeroing`` the ledger's clear list is vLLM's
                                                     ``new_block_ids_to_zero`` (vLLM's own when the
                                                     pool detached)
    Scheduler.__init__ / schedule /               -> the fence: one ledger step per schedule(), its
      update_from_output                             completion observed from update_from_output
    SimpleCPUOffloadScheduler.bind_gpu_block_pool -> the offload's CPU pool holds copies: no groups
                                                     (its _insert_block_hash calls are mirrored)

Before patching, it checks that the vLLM running is one of ``VLLM_VERSIONS`` and that
every method it overrides or wraps still has the parameters it was written for; it
fails closed (``ConfigurationError``) otherwise. ``zeroing=True`` is refused with a
policy that would zero less than vLLM needs.

    with kvledger.integrations.vllm.install(log="vllm.kvlog") as inst:
        scheduler = Scheduler(...)            # its KVCacheManager runs on a ledger pool
    pool = inst.pools[0]                      # its .ledger, .log_path, .take_block_ids_to_zero()

Subclasses of ``BlockPool`` vLLM defines (the HiSparse host pool) keep vLLM's pool:
their modules are imported before the names are rebound.
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
import sys
import weakref
from typing import Any

from ...core.errors import ConfigurationError

__all__ = ["Installation", "install"]

VLLM_VERSIONS: tuple[str, ...] = ("0.33.0", "0.34.0")
_PATCHED_MODULES = ("vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_coordinator")
# The single-type managers' methods that call the pool on behalf of one request (first argument:
# a request id, or a Request).
# (not ``cache_blocks`` / ``_cache_partial_tail_block``: the pool calls they make, ``cache_full_blocks``,
# ``cache_partial_block``, ``_maybe_evict_cached_block``, need no holder; vLLM calls ``cache_blocks`` for
# every running request every step, three wrapped calls each that were three quarters of the wrapper's cost)
_MANAGER_METHODS = ("allocate_new_blocks", "allocate_external_computed_blocks", "add_local_computed_blocks",
                    "free", "remove_skipped_blocks", "_remove_blocks_in_range", "_claim_ring_block")
# The parameters (after self) of every vLLM method kvledger overrides or wraps, as written for.
_SIGNATURES: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm.v1.core.block_pool:BlockPool": {
        "get_new_blocks": ("num_blocks",),
        "touch": ("blocks",),
        "free_blocks": ("ordered_blocks",),  # 0.34: + evict_first (passed through)
        "unpin_blocks": ("blocks", "on_reuse"),
        "get_cached_block": ("block_hash", "kv_cache_group_ids"),
        "cache_full_blocks": ("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
                              "kv_cache_group_id", "block_mask"),
        "cache_partial_block": ("request", "block", "num_tokens", "kv_cache_group_id", "block_size",
                                "replace_existing_hashes"),
        "move_block_hashes": ("src_block", "dst_block"),
        "_maybe_evict_cached_block": ("block",),
        "_insert_block_hash": ("block_hash_with_group_id", "block", "num_tokens"),
        "evict_blocks": ("block_ids",),
        "reset_prefix_cache": (),
    },
    "vllm.v1.core.kv_cache_manager:KVCacheManager": {"take_new_block_ids": ()},
    "vllm.v1.simple_kv_offload.manager:SimpleCPUOffloadScheduler": {"bind_gpu_block_pool": ("gpu_block_pool",)},
    "vllm.v1.core.sched.scheduler:Scheduler": {"update_from_output": ("scheduler_output", "model_runner_output")},
    "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager": {
        "allocate_new_blocks": ("request_id", "num_tokens", "num_tokens_main_model"),
        "free": ("request_id",),
        "remove_skipped_blocks": ("request_id", "processed_computed_tokens", "num_prompt_tokens"),
        "add_local_computed_blocks": ("request_id", "new_computed_blocks", "num_local_computed_tokens",
                                      "num_external_computed_tokens"),
    },
}
_VERSION_EXTRAS = {("0.34.0", "vllm.v1.core.block_pool:BlockPool", "free_blocks"): ("evict_first",)}
_active: list[Installation] = []
_IS_NULL = operator.attrgetter("is_null")


class Installation:
    """An installed ledger pool: ``pool_class``, the ``pools`` made since (oldest first),
    ``uninstall()``. A context manager (``uninstall`` on exit)."""

    def __init__(self, pool_class: type, zeroing: bool, vllm_block_pool: type) -> None:
        self.pool_class = pool_class
        self.zeroing = zeroing
        self.vllm_block_pool = vllm_block_pool
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
        self._restore.append((owner, name, owner.__dict__.get(name, _ABSENT) if isinstance(owner, type)
                              else getattr(owner, name)))
        setattr(owner, name, value)

    def forget_pools(self) -> list:
        """The pools made since ``install`` (or the last call) that are still alive; forgets them all."""
        pools = self.pools
        self._pools.clear()
        return pools

    def uninstall(self) -> None:
        """Restore everything ``install`` patched (and vLLM's ``BlockPool`` in any module that imported
        the ledger's meanwhile), and close every pool's log. Idempotent. Pools made before keep
        working (on their ledgers, logs closed)."""
        if not self.installed:
            return
        for owner, name, value in reversed(self._restore):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._restore.clear()
        for module in list(sys.modules.values()):  # (`from vllm.v1.core.block_pool import BlockPool` meanwhile)
            d = getattr(module, "__dict__", None)
            if d is not None and d.get("BlockPool") is self.pool_class:
                d["BlockPool"] = self.vllm_block_pool
        self.installed = False
        if self in _active:
            _active.remove(self)
        for pool in self.pools:
            try:
                pool.close()
            except Exception as exc:  # noqa: BLE001  (a log whose disk failed at the end: vLLM goes on)
                import logging

                logging.getLogger("kvledger.integrations.vllm").warning("closing a pool's log failed: %s", exc)

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


_ABSENT = object()


def install(*, log: str | os.PathLike | None = None, fsync: str = "background", policy: str = "groups",
            zeroing: bool = False, on_error: str = "detach", check: bool = False,
            verify: bool = False, layer: Any = None) -> Installation:
    """Make every vLLM ``BlockPool`` built from now on a ledger pool. Returns the ``Installation``.

    ``log``: None (each pool keeps an in-memory ledger), a log file (for one
    pool: a second pool on the same file raises ``LogLockedError``), or an
    existing directory (one log per pool); written with ``fsync`` ("background":
    a writer thread syncs, the scheduler never waits for the disk). ``policy``:
    "groups" (a block is zeroed when it moves to another KV cache group, or is a
    recurrent state's first block another request left), "all_reused" (every
    reused block), or "released_aliases" (records only: lists nothing in vLLM).
    ``zeroing``: the ledger's clear list replaces vLLM's ``new_block_ids_to_zero``
    (refused with "released_aliases"; keep False with KV connectors that load
    blocks asynchronously: the ledger does not know those writes). ``on_error``:
    "detach" (a log or ledger error stops the recording, never vLLM) or "fail".
    ``check``, ``verify``, ``layer``: see ``PoolOptions``. A log that already holds
    a run (a restart) goes on in a new epoch: what the earlier run left open is closed.

    Raises ``ConfigurationError`` when an installation is already active, an
    option is bad, the vLLM running is not one of ``VLLM_VERSIONS``, or a method
    kvledger patches does not have the parameters it was written for; ``ImportError``
    without vLLM. Nothing is patched then.
    """
    _check_options(log, fsync, policy, zeroing, on_error)
    import importlib

    vllm = importlib.import_module("vllm")
    version = getattr(vllm, "__version__", "?")
    if version not in VLLM_VERSIONS:
        raise ConfigurationError(f"kvledger's vLLM pool is written for vLLM {', '.join(VLLM_VERSIONS)}; this is vLLM "
                                 f"{version}: refusing to patch it (pip install 'kvledger[vllm]' pins a tested one)")
    for name in _PATCHED_MODULES:  # (imports vLLM's own BlockPool subclasses first)
        importlib.import_module(name)
    check_signatures(version)
    block_pool_mod = sys.modules["vllm.v1.core.block_pool"]
    kv_cache_manager = importlib.import_module("vllm.v1.core.kv_cache_manager")
    coordinator = sys.modules["vllm.v1.core.kv_cache_coordinator"]
    single = importlib.import_module("vllm.v1.core.single_type_kv_cache_manager")
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")

    from .pool import LedgerBlockPool, PoolOptions

    options = PoolOptions(log=log, fsync=fsync, policy=policy, on_error=on_error, check=check, verify=verify,
                          layer=layer)
    inst = Installation(type("LedgerBlockPool", (LedgerBlockPool,), {"options": options, "peers": weakref.WeakSet()}),
                        bool(zeroing),
                        block_pool_mod.BlockPool)
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
    _wrap_coordinator(inst, coordinator.KVCacheCoordinator, LedgerBlockPool)
    _wrap_managers(inst, single.SingleTypeKVCacheManager, LedgerBlockPool)
    _wrap_scheduler(inst, scheduler.Scheduler, LedgerBlockPool)
    offload = importlib.import_module("vllm.v1.simple_kv_offload.manager")
    _wrap_offload(inst, offload.SimpleCPUOffloadScheduler, LedgerBlockPool)
    inst.installed = True
    _active.append(inst)
    return inst


def check_signatures(version: str) -> None:
    """Every vLLM method kvledger overrides or wraps has the parameters it was written for (fail
    closed: ``ConfigurationError`` naming the first that does not)."""
    import importlib

    for where, methods in _SIGNATURES.items():
        modname, clsname = where.split(":")
        owner = getattr(importlib.import_module(modname), clsname)
        for name, params in methods.items():
            fn = getattr(owner, name, None)
            if fn is None:
                raise ConfigurationError(f"vLLM {version}'s {clsname}.{name} is gone: kvledger's pool was written "
                                         "for a vLLM that has it")
            want = params + _VERSION_EXTRAS.get((version, where, name), ())
            have = tuple(p for p in inspect.signature(fn).parameters if p != "self")
            if have != want:
                raise ConfigurationError(f"vLLM {version}'s {clsname}.{name} takes {have}; kvledger's pool was "
                                         f"written for {want}: refusing to patch a method it does not know")


def _check_options(log: Any, fsync: str, policy: str, zeroing: bool, on_error: str) -> None:
    if _active:
        raise ConfigurationError("kvledger's vLLM pool is already installed: uninstall it first")
    if fsync not in ("background", "per_step", "per_event", "none"):
        raise ConfigurationError(f"unknown fsync policy {fsync!r}")
    from .groups import STATE_KINDS  # noqa: F401  (the policy's own module: no vLLM)

    policies = ("groups", "all_reused", "released_aliases")
    if policy not in policies:
        raise ConfigurationError(f"unknown vLLM clear policy {policy!r}; one of {policies}")
    if zeroing and policy == "released_aliases":
        raise ConfigurationError("zeroing=True with policy 'released_aliases' would zero nothing vLLM needs zeroed "
                                 "(Mamba state blocks, blocks moving between precisions): use 'groups'")
    if on_error not in ("detach", "fail"):
        raise ConfigurationError(f"on_error must be 'detach' or 'fail', got {on_error!r}")
    if log is not None and not isinstance(log, (str, os.PathLike)):
        raise ConfigurationError(f"log must be a path or None, got {log!r}")


def _wrap_take_new_block_ids(inst: Installation, manager_cls: Any, pool_cls: type) -> None:
    """Each scheduler step seals the pool's ledger step; with ``zeroing`` its clear list is the answer."""
    take = manager_cls.take_new_block_ids

    @functools.wraps(take)
    def take_new_block_ids(self: Any) -> list[int]:
        ids = take(self)
        pool = self.block_pool
        if not isinstance(pool, pool_cls):
            return ids
        ledger_ids = pool.take_block_ids_to_zero()  # type: ignore[attr-defined]
        pool.last_block_ids_to_zero = ledger_ids  # type: ignore[attr-defined]
        if inst.zeroing and pool.detached is None:  # type: ignore[attr-defined]
            return ledger_ids
        return ids

    inst.patch(manager_cls, "take_new_block_ids", take_new_block_ids)


def _wrap_coordinator(inst: Installation, coordinator_cls: Any, pool_cls: type) -> None:
    """The pool learns the KV cache groups its coordinator serves."""
    init = coordinator_cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        pool = getattr(self, "block_pool", None)
        if isinstance(pool, pool_cls):
            pool.set_groups(self.kv_cache_config.kv_cache_groups)  # type: ignore[attr-defined]

    inst.patch(coordinator_cls, "__init__", __init__)


def _subclasses(cls: type) -> list[type]:
    out: list[type] = [cls]
    todo: list[type] = [cls]
    while todo:
        subs: list[type] = todo.pop().__subclasses__()
        for sub in subs:
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


def _wrap_managers(inst: Installation, base: type, pool_cls: type) -> None:
    """Every single-type manager's pool calls name the vLLM request and the group (``pool.who``)."""
    for cls in _subclasses(base):
        for name in _MANAGER_METHODS:
            if cls is base and name == "remove_skipped_blocks":
                # (the base's frees only through _remove_blocks_in_range, wrapped: vLLM calls it for every
                # running request every step, and for full attention it frees nothing)
                continue
            fn = cls.__dict__.get(name)
            if fn is not None and callable(fn):
                inst.patch(cls, name, _named_call(fn, pool_cls, name == "allocate_new_blocks"))


def _named_call(fn: Any, pool_cls: type, allocates: bool) -> Any:
    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = self.block_pool
        if not isinstance(pool, pool_cls) or pool.who is not None or pool.detached:  # type: ignore[attr-defined]
            return fn(self, *args, **kwargs)  # (not ours, nested (the outer call named it), or detached)
        first = args[0] if args else kwargs.get("request_id", kwargs.get("request"))
        rid = first if type(first) is str else getattr(first, "request_id", None)
        if rid is None:
            return fn(self, *args, **kwargs)
        gid = self.kv_cache_group_id
        pool.who = (rid, gid)  # type: ignore[attr-defined]
        if allocates and pool.holds.marking:  # type: ignore[attr-defined]
            _how_it_reads(self, pool, rid, gid, args, kwargs)
        try:
            return fn(self, *args, **kwargs)
        finally:
            pool.who = None  # type: ignore[attr-defined]
            pool.reads = "tail"  # type: ignore[attr-defined]
            pool.whole_blocks = 0  # type: ignore[attr-defined]

    return call


def _how_it_reads(manager: Any, pool: Any, rid: str, gid: int, args: tuple, kwargs: dict) -> None:
    """How the step reads the blocks ``allocate_new_blocks(rid, num_tokens, num_tokens_main_model)``
    hands out (``PagesCommitted.reads``):

        a state group, the request has no state yet       "whole"  (its first state is read first)
        a state group, a state copied in / a checkpoint   "none"   (written whole, then read)
        attention: the new blocks the step's tokens fill  "none"   (KV of every slot written first:
                                                                     ``pool.whole_blocks`` of them)
        the rest (a block the step fills in part)         "tail"
    """
    held = manager.req_to_blocks.get(rid)
    if gid in pool.holds.state_groups:
        if not held or all(map(_IS_NULL, held)):  # (align mode pads with null blocks: a C loop)
            pool.reads = "whole"
        elif not getattr(manager.kv_cache_spec, "num_speculative_blocks", 0):
            pool.reads = "none"
        return
    if rid in getattr(manager, "_partial_hit_reqs", ()):  # (a copy-on-write block comes first: keep it simple)
        return
    main = args[2] if len(args) > 2 else kwargs.get("num_tokens_main_model")
    if type(main) is int:
        pool.whole_blocks = max(0, main // manager.block_size - (len(held) if held else 0))


def _schedules_ahead(scheduler: Any) -> bool:
    """Async scheduling: step N+1 is scheduled before step N's output returns (vLLM's
    ``AsyncScheduler``, or ``scheduler_config.async_scheduling``)."""
    if any(c.__name__ == "AsyncScheduler" for c in type(scheduler).__mro__):
        return True
    return bool(getattr(getattr(scheduler, "scheduler_config", None), "async_scheduling", False))


def _wrap_offload(inst: Installation, offload_cls: Any, pool_cls: type) -> None:
    """vLLM's simple CPU offload: its CPU pool (a ledger pool too, built by its own coordinator)
    holds copies of the GPU pool's blocks, one CPU block serving every group that shares the GPU
    block's bytes; once the scheduler binds the GPU pool, the CPU pool's holds carry no group
    (``LedgerBlockPool.hold_copies``). Its ``_insert_block_hash`` calls are mirrored by the pool."""
    bind = offload_cls.bind_gpu_block_pool

    @functools.wraps(bind)
    def bind_gpu_block_pool(self: Any, gpu_block_pool: Any) -> Any:
        out = bind(self, gpu_block_pool)
        cpu = getattr(self, "cpu_block_pool", None)
        if isinstance(cpu, pool_cls):
            cpu.hold_copies()  # type: ignore[attr-defined]
        return out

    inst.patch(offload_cls, "bind_gpu_block_pool", bind_gpu_block_pool)


def _wrap_scheduler(inst: Installation, scheduler_cls: Any, pool_cls: type) -> None:
    """The fence: the scheduler's pool seals one ledger step per ``schedule()`` and completes it when
    ``update_from_output`` reports the step ran."""
    init, schedule, update = scheduler_cls.__init__, scheduler_cls.schedule, scheduler_cls.update_from_output

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        pool = getattr(getattr(self, "kv_cache_manager", None), "block_pool", None)
        if isinstance(pool, pool_cls):
            if inst.zeroing and getattr(self, "connector", None) is not None:
                raise ConfigurationError(
                    f"kvledger zeroing=True with a KV connector ({type(self.connector).__name__}): the ledger does "
                    "not see the blocks a connector loads asynchronously, so its clear list could zero one it is "
                    "writing; install with zeroing=False (kvledger still records every block)")
            pool.drive(_schedules_ahead(self))  # type: ignore[attr-defined]

    @functools.wraps(schedule)
    def schedule_(self: Any, *args: Any, **kwargs: Any) -> Any:
        pool = self.kv_cache_manager.block_pool
        if not isinstance(pool, pool_cls):
            return schedule(self, *args, **kwargs)
        pool.scheduling(True)  # type: ignore[attr-defined]
        try:
            out = schedule(self, *args, **kwargs)
        finally:
            pool.scheduling(False)  # type: ignore[attr-defined]
        pool.scheduled(out)  # type: ignore[attr-defined]
        return out

    @functools.wraps(update)
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        pool = self.kv_cache_manager.block_pool
        if isinstance(pool, pool_cls):
            pool.completed(scheduler_output, model_runner_output, self.requests)  # type: ignore[attr-defined]
        return update(self, scheduler_output, model_runner_output)

    inst.patch(scheduler_cls, "__init__", __init__)
    inst.patch(scheduler_cls, "schedule", schedule_)
    inst.patch(scheduler_cls, "update_from_output", update_from_output)
