"""Clear backends: what zeroes a step's clear list in every local cache plane of a rank.

    StepPlan(step, clear_list) ──► backend.clear(clear_list)
                                     │ 1. checks.page_ids: every id an int < num_pages,
                                     │    no duplicates (else raise, touch nothing)
                                     └ 2. enqueue zeroing of each listed page in each
                                          plane, on the backend's stream

A backend is built once per rank from that rank's planes (torch tensors shaped
``[num_pages, ...]``, contiguous, any dtype; planes may differ in bytes per page)
and the rank's model stream. The registry below names the implementations; it maps
names to ``"module:Class"`` strings (modules of this package) and imports nothing
until a backend is made, so importing this module never pulls in torch, triton or
CUDA.

    name     class                               where it runs
    torch    torch_backend:TorchClearBackend     any torch device (CPU default)
    cuda     cuda_backend:CudaClearBackend       cuMemsetD8Async per run of pages
    triton   triton_backend:TritonClearBackend   one launch for all planes

Page ids are checked by ``kvledger.core.checks.page_ids``, the one implementation.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..core import checks
from ..core.errors import BackendUnavailableError, ConfigurationError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "BACKENDS",
    "ClearBackend",
    "backend_class",
    "coalesce_runs",
    "make_backend",
]


@runtime_checkable
class ClearBackend(Protocol):
    """Zeroes listed pages in every plane it was built with.

    ``clear(page_ids)`` enqueues zeroing of every listed page in every plane on the
    backend's stream (for CUDA: the rank's model stream; on the CPU it is done when
    the call returns). It validates the ids first (``< num_pages``, distinct) and
    raises a ``KVLedgerError`` subclass (``PageOutOfRangeError``,
    ``DuplicatePageError``, ``InvalidArgumentError``) before touching any plane.
    """

    name: str

    def clear(self, page_ids: Sequence[int]) -> None: ...


_REGISTRY: dict[str, str] = {
    "torch": "torch_backend:TorchClearBackend",
    "cuda": "cuda_backend:CudaClearBackend",
    "triton": "triton_backend:TritonClearBackend",
}

BACKENDS: tuple[str, ...] = tuple(_REGISTRY)

# Kept for kvledger/demo/run.py until it calls kvledger.core.checks.page_ids itself;
# not part of this module's API (no second implementation: the same function).
check_page_ids = checks.page_ids


def backend_class(name: str) -> type:
    """Import and return the class registered as ``name``.

    Raises ``ConfigurationError`` for a name not in ``BACKENDS`` and
    ``BackendUnavailableError`` (a ``ConfigurationError``) when its module cannot be
    imported here. Nothing is left behind either way.
    """
    entry = _REGISTRY.get(name) if type(name) is str else None
    if entry is None:
        raise ConfigurationError(f"unknown clear backend {name!r}; one of {BACKENDS}")
    module_name, _, attr = entry.partition(":")
    target = f"{__package__}.{entry}"
    try:
        module = importlib.import_module(f".{module_name}", __package__)
        cls: type = getattr(module, attr)
    except (ImportError, AttributeError, OSError) as exc:
        raise BackendUnavailableError(name, target, exc) from exc
    return cls


def make_backend(name: str, planes: Sequence[torch.Tensor], *, stream: Any = None) -> ClearBackend:
    """Build the backend registered as ``name`` over ``planes`` (``Cls(planes, stream=stream)``).

    Raises what ``backend_class`` raises, and ``ConfigurationError`` from the backend
    for planes it cannot use (not contiguous, first dimensions that disagree, ...).
    """
    backend: ClearBackend = backend_class(name)(planes, stream=stream)
    return backend


def coalesce_runs(sorted_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Runs ``[(start, stop), ...]`` of adjacent ids in a sorted, duplicate-free sequence.

    ``[3, 4, 5, 9, 11, 12]`` -> ``[(3, 6), (9, 10), (11, 13)]``. Pure; helper for
    backends that zero one run of pages per call.
    """
    runs: list[tuple[int, int]] = []
    it = iter(sorted_ids)
    try:
        start = prev = next(it)
    except StopIteration:
        return runs
    for p in it:
        if p != prev + 1:
            runs.append((start, prev + 1))
            start = p
        prev = p
    runs.append((start, prev + 1))
    return runs
