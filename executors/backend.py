"""Clear backends: what zeroes a step's clear list in every local cache plane of a rank.

    StepPlan(step, clear_list) ──► backend.clear(clear_list)
                                     │ 1. check_page_ids: every id an int < num_pages,
                                     │    no duplicates (else raise, touch nothing)
                                     └ 2. enqueue zeroing of each listed page in each
                                          plane, on the backend's stream

A backend is built once per rank from that rank's planes (torch tensors shaped
``[num_pages, ...]``, contiguous, any dtype; planes may differ in bytes per page)
and the rank's model stream. The registry below names the implementations; it maps
names to ``"module:Class"`` strings and imports nothing until a backend is made,
so importing this module never pulls in torch, triton or CUDA.

    name     class                                               where it runs
    torch    kvledger.executors.torch_backend:TorchClearBackend  any torch device (CPU default)
    cuda     kvledger.executors.cuda_backend:CudaClearBackend    cuMemsetD8Async per run of pages
    triton   kvledger.executors.triton_backend:TritonClearBackend one launch for all planes
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from ..core.errors import (
    BackendUnavailableError,
    ConfigurationError,
    DuplicatePageError,
    InvalidArgumentError,
    PageOutOfRangeError,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "BACKENDS",
    "ClearBackend",
    "backend_class",
    "check_page_ids",
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
    "torch": "kvledger.executors.torch_backend:TorchClearBackend",
    "cuda": "kvledger.executors.cuda_backend:CudaClearBackend",
    "triton": "kvledger.executors.triton_backend:TritonClearBackend",
}

BACKENDS: tuple[str, ...] = tuple(_REGISTRY)


def backend_class(name: str) -> type:
    """Import and return the class registered as ``name``.

    Raises ``ConfigurationError`` for a name not in ``BACKENDS`` and
    ``BackendUnavailableError`` (a ``ConfigurationError``) when its module cannot be
    imported here. Nothing is left behind either way.
    """
    target = _REGISTRY.get(name) if type(name) is str else None
    if target is None:
        raise ConfigurationError(f"unknown clear backend {name!r}; one of {BACKENDS}")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError, OSError) as exc:
        raise BackendUnavailableError(name, target, exc) from exc


def make_backend(name: str, planes: Sequence["torch.Tensor"], *, stream: Any = None) -> ClearBackend:
    """Build the backend registered as ``name`` over ``planes`` (``Cls(planes, stream=stream)``).

    Raises what ``backend_class`` raises, and ``ConfigurationError`` from the backend
    for planes it cannot use (not contiguous, first dimensions that disagree, ...).
    """
    return backend_class(name)(planes, stream=stream)


def check_page_ids(page_ids: Sequence[int], num_pages: int) -> tuple[int, ...]:
    """Validate a clear list against ``num_pages``; return it as a tuple of ints.

    Accepts any iterable of ints (also numpy / torch integer scalars, converted with
    ``operator.index``). Raises ``InvalidArgumentError`` for something that is not a
    sequence of integers, ``PageOutOfRangeError`` naming every id outside
    ``[0, num_pages)`` and ``DuplicatePageError`` naming every repeated id. Pure.
    """
    if type(page_ids) is tuple:
        ids = page_ids
    else:
        try:
            ids = tuple(page_ids)
        except TypeError:
            raise InvalidArgumentError(f"page ids must be an iterable of ints, got {page_ids!r}") from None
    if not ids:
        return ids
    kinds = set(map(type, ids))
    if kinds != {int}:
        ids = _coerce_ints(ids)
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= num_pages:
        raise PageOutOfRangeError([p for p in ids if not 0 <= p < num_pages], num_pages)
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        dups = sorted({p for p in ids if p in seen or seen.add(p)})
        raise DuplicatePageError(dups)
    return ids


def _coerce_ints(ids: tuple) -> tuple[int, ...]:
    import operator

    out = []
    for p in ids:
        if type(p) is bool:
            raise InvalidArgumentError(f"page ids must be ints, got {p!r}")
        try:
            out.append(operator.index(p))
        except TypeError:
            raise InvalidArgumentError(f"page ids must be ints, got {p!r}") from None
    return tuple(out)


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
