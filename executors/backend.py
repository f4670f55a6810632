"""Clear backends: what zeroes a step's clear list in every local cache plane of a rank.

    StepPlan(step, clear_list) ──► backend.clear(clear_list)
                                     │ 1. checks.page_ids: every id an int < num_pages,
                                     │    no duplicates (else raise, touch nothing)
                                     └ 2. enqueue zeroing of each listed page in each
                                          plane, on the backend's stream

A backend is built once per rank from that rank's planes (torch tensors shaped
``[num_pages, ...]``, contiguous, any dtype, or plain byte buffers whose first
dimension is the page's; planes may differ in bytes per page) and the rank's
model stream. The registry below names the implementations; it maps
names to ``"module:Class"`` strings (modules of this package) and imports nothing
until a backend is made, so importing this module never pulls in torch, triton or
CUDA.

    name     class                               where it runs
    bytes    bytes_backend:BytesClearBackend     byte buffers on the host (no torch)
    torch    torch_backend:TorchClearBackend     any torch device (CPU default)
    cuda     cuda_backend:CudaClearBackend       cuMemsetD8Async per run of pages
    triton   triton_backend:TritonClearBackend   one launch for all planes

``default_backend(planes)`` is the name a rank gets when it names none: ``bytes`` for
buffer planes (a bytearray, a memoryview), ``torch`` for anything else.

Page ids are checked by ``kvledger.core.checks.page_ids``, the one implementation.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..core.errors import BackendUnavailableError, ConfigurationError
from .sanitize import SanitizerCheck

__all__ = [
    "BACKENDS",
    "ClearBackend",
    "ClearBackendBase",
    "as_clear_backend",
    "backend_class",
    "coalesce_runs",
    "default_backend",
    "is_buffer",
    "make_backend",
    "page_bytes_of",
    "plane_device",
]


@runtime_checkable
class ClearBackend(Protocol):
    """What the engine and the executors use of a clear backend (every member; typed, no lookups).

    ``clear(page_ids)`` enqueues zeroing of every listed page in every plane on the
    backend's stream (for CUDA: the rank's model stream; on the CPU it is done when
    the call returns). It validates the ids first (``< num_pages``, distinct) and
    raises a ``KVLedgerError`` subclass (``PageOutOfRangeError``,
    ``DuplicatePageError``, ``InvalidArgumentError``) before touching any plane.

    ``clear_checked(page_ids)``: the same for ids known good (the clear list of a plan
    the ledger sealed: a tuple of distinct ints in range); it may skip the check.
    ``poison`` / ``start_verify``: the sanitizer's device side
    (``kvledger.executors.sanitize``), usable when ``can_sanitize`` is True.
    ``num_pages``: pages in every plane (the geometry's, checked when a rank opens).

    Subclass :class:`ClearBackendBase` to get ``clear_checked`` (it calls ``clear``)
    and a refusing sanitizer side; any other object with ``clear`` (and maybe
    ``poison`` and ``start_verify``) is adapted by :func:`as_clear_backend`.
    """

    name: str
    num_pages: int
    can_sanitize: bool

    def clear(self, page_ids: Sequence[int]) -> None: ...

    def clear_checked(self, page_ids: tuple[int, ...]) -> None: ...

    def poison(self, page_ids: Sequence[int]) -> None: ...

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck: ...


class ClearBackendBase:
    """The base of a clear backend: subclasses implement ``clear`` (and set ``num_pages``);
    ``clear_checked`` calls ``clear``; the sanitizer's side refuses with ``ConfigurationError``
    unless a subclass implements ``poison`` and ``start_verify`` and sets ``can_sanitize``."""

    name: str = "custom"
    num_pages: int
    can_sanitize: bool = False

    def clear(self, page_ids: Sequence[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement clear(page_ids)")

    def clear_checked(self, page_ids: tuple[int, ...]) -> None:
        """``clear`` for ids known good; a backend whose check costs something skips it here."""
        self.clear(page_ids)

    def poison(self, page_ids: Sequence[int]) -> None:
        raise ConfigurationError(f"clear backend {self.name!r} cannot poison pages (no sanitizer support)")

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        raise ConfigurationError(f"clear backend {self.name!r} cannot check pages (no sanitizer support)")


@runtime_checkable
class _ClearsPages(Protocol):
    """The least a caller's backend object offers: ``clear(page_ids)``."""

    def clear(self, page_ids: Sequence[int]) -> None: ...


@runtime_checkable
class _ClearsAndChecks(_ClearsPages, Protocol):
    """A caller's object with the sanitizer's side too: ``poison`` and ``start_verify``."""

    def poison(self, page_ids: Sequence[int]) -> None: ...

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck: ...


class _Adapted(ClearBackendBase):
    """A caller's object that is no ``ClearBackend`` as one: its ``clear`` (and ``clear_checked``
    calls it); its ``poison`` and ``start_verify`` when it has both (``can_sanitize``), else the
    base's refusals."""

    def __init__(self, inner: _ClearsPages, num_pages: int) -> None:
        self.inner = inner
        self.num_pages = num_pages
        self._checks: _ClearsAndChecks | None = inner if isinstance(inner, _ClearsAndChecks) else None
        self.can_sanitize = self._checks is not None
        self.name = f"{type(inner).__name__} ({'adapted' if self.can_sanitize else 'clear only'})"

    def clear(self, page_ids: Sequence[int]) -> None:
        self.inner.clear(page_ids)

    def poison(self, page_ids: Sequence[int]) -> None:
        if self._checks is None:
            super().poison(page_ids)
        else:
            self._checks.poison(page_ids)

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        if self._checks is None:
            return super().start_verify(cleared_ids, committed_ids)
        return self._checks.start_verify(cleared_ids, committed_ids)

    def __repr__(self) -> str:
        return f"_Adapted({self.inner!r})"


def as_clear_backend(backend: object, num_pages: int) -> ClearBackend:
    """``backend`` as a ``ClearBackend``: itself when it is one (every member present), else
    an adapter around an object with ``clear`` (``num_pages`` then the geometry's): it
    sanitizes through the object's ``poison`` and ``start_verify`` when it has both, and
    cannot otherwise. Raises ``ConfigurationError`` for anything without ``clear``."""
    if isinstance(backend, ClearBackend):
        return backend
    if isinstance(backend, _ClearsPages):
        return _Adapted(backend, num_pages)
    raise ConfigurationError(f"backend {backend!r} has no clear(page_ids)")


_REGISTRY: dict[str, str] = {
    "bytes": "bytes_backend:BytesClearBackend",
    "torch": "torch_backend:TorchClearBackend",
    "cuda": "cuda_backend:CudaClearBackend",
    "triton": "triton_backend:TritonClearBackend",
}

BACKENDS: tuple[str, ...] = tuple(_REGISTRY)


def is_buffer(plane: object) -> bool:
    """Whether ``plane`` exports the buffer protocol (a bytearray, a memoryview, an array): a
    plane for the ``bytes`` backend, never a torch tensor (which does not). Imports nothing."""
    try:
        memoryview(plane)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def default_backend(planes: Sequence[object]) -> str:
    """The backend a rank with ``planes`` gets when it names none: ``"bytes"`` when its first
    plane is a byte buffer (the buffer protocol), else ``"torch"``."""
    return "bytes" if planes and is_buffer(planes[0]) else "torch"


def plane_device(plane: Any) -> Any:
    """Where a plane lives: ``None`` for a byte buffer (the host), else its ``device`` (a tensor's)."""
    return None if is_buffer(plane) else plane.device

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


def page_bytes_of(plane: Any) -> int:
    """Bytes one page of ``plane`` takes (0 for a plane without pages): a byte buffer's bytes over
    its first dimension, a tensor's elements a page times their size."""
    if is_buffer(plane):
        mv = memoryview(plane)
        return mv.nbytes // mv.shape[0] if mv.shape and mv.shape[0] else 0
    n = plane.shape[0]
    return plane.numel() // n * plane.element_size() if n else 0


def make_backend(name: str, planes: Sequence[Any], *, stream: Any = None) -> ClearBackend:
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
