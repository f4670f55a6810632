"""The ``cuda`` clear backend: ``cuMemsetD8Async`` on the model stream, one call per run.

A clear list is sorted once and cut into runs of adjacent page ids; each run
is one ``cuMemsetD8Async`` per plane over ``run_length * plane_page_bytes``
bytes, enqueued on the rank's model stream (so it lands after the step's input
copies and before its graph, in stream order)::

    clear([7, 3, 4, 5, 9])  ->  runs (3, 3) (7, 1) (9, 1)
    plane k:  memset(base_k + 3 * pb_k, 0, 3 * pb_k)
              memset(base_k + 7 * pb_k, 0, 1 * pb_k)
              memset(base_k + 9 * pb_k, 0, 1 * pb_k)

``mode="per_page"`` reproduces the seed's mechanism (helios PR #181): one
``cuMemsetD8Async`` per listed page per plane, in list order. It is the
baseline the benchmarks compare against.

All driver calls go through :mod:`kvledger.executors.cuda_driver`. This module
imports torch at import time; ``import kvledger`` never imports it (the backend
registry loads it by name).

The page ids are checked by ``kvledger.core.checks.page_ids`` before anything is
enqueued; the planes are described by ``cuda_planes.describe_planes``, as the Triton
backend's and its check's are.

The sanitizer (``kvledger.executors.sanitize``): ``poison(ids)`` is the same
memset with 0xFF; ``start_verify`` / ``verify`` run the Triton check kernel when
triton is importable, else the torch check, on the model stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..core import checks
from ..core.errors import ConfigurationError
from . import cuda_driver
from .backend import ClearBackendBase, coalesce_runs
from .cuda_planes import describe_planes, stream_handle
from .sanitize import SanitizerCheck, TorchVerifier, Violation

__all__ = ["CudaClearBackend"]


class CudaClearBackend(ClearBackendBase):
    """Zero listed pages of every plane with ``cuMemsetD8Async`` on the model stream.

    ``planes``: contiguous CUDA tensors ``[num_pages, ...]`` of one device (any
    dtype; bytes per page may differ per plane). ``stream``: the rank's model
    stream (``torch.cuda.Stream``, ``CUstream`` or raw handle); ``None`` means
    torch's current stream of the planes' device *at each clear* (the backend
    follows ``with torch.cuda.stream(s):``). ``mode``: ``"coalesced"`` (one call per run of adjacent
    ids per plane) or ``"per_page"`` (the seed's loop: one call per page per
    plane).

    Raises ConfigurationError for bad planes, CudaUnavailableError without
    cuda-python, CudaDriverError if the driver cannot be initialised.
    """

    MODES = ("coalesced", "per_page")
    can_sanitize = True

    def __init__(self, planes: Sequence[torch.Tensor], stream: Any = None, *, mode: str = "coalesced") -> None:
        if mode not in self.MODES:
            raise ConfigurationError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.layout = describe_planes(planes)
        self.planes = tuple(planes)  # keep the tensors (and their memory) alive
        self.mode = mode
        self.name = "cuda" if mode == "coalesced" else "cuda-per-page"
        self.num_pages = self.layout.num_pages
        cuda_driver.driver()
        self._device = self.layout.device
        self._pairs = tuple(zip(self.layout.ptrs, self.layout.page_bytes, strict=True))
        self._stream = None if stream is None else cuda_driver.as_custream(stream_handle(stream))
        self._clears = 0
        self._pages = 0
        self._calls = 0
        self._verifier: Any = None
        self._stream_arg = stream

    def _current_stream(self) -> Any:
        return cuda_driver.as_custream(torch.cuda.current_stream(self._device).cuda_stream)

    def clear(self, page_ids: Sequence[int]) -> None:
        """Enqueue zeroing of every listed page in every plane on the model stream.

        Raises InvalidArgumentError / PageOutOfRangeError / DuplicatePageError
        before anything is enqueued. A CudaDriverError from a later call leaves
        the earlier memsets of this clear enqueued (the list must then be
        cleared again; zeroing twice is harmless).
        """
        ids = checks.page_ids(page_ids, self.num_pages)
        if not ids:
            return
        self._calls += self._memset(ids, 0)
        self._clears += 1
        self._pages += len(ids)

    def clear_checked(self, page_ids: tuple[int, ...]) -> None:
        """``clear`` for ids known good (a sealed plan's clear list): the id check is skipped."""
        if page_ids:
            self._calls += self._memset(page_ids, 0)
            self._clears += 1
            self._pages += len(page_ids)

    def _memset(self, ids: tuple[int, ...], value: int) -> int:
        """Enqueue ``value`` over every listed page of every plane; returns the driver calls made."""
        stream = self._stream if self._stream is not None else self._current_stream()
        pushed = cuda_driver.device_of_current_context() != self._device
        if pushed:
            cuda_driver.push_primary_context(self._device)
        try:
            memset = cuda_driver.memset_d8_async
            calls = 0
            if self.mode == "per_page":
                for ptr, pb in self._pairs:
                    for p in ids:
                        memset(ptr + p * pb, value, pb, stream)
                    calls += len(ids)
            else:
                runs = coalesce_runs(sorted(ids))
                for ptr, pb in self._pairs:
                    for start, stop in runs:
                        memset(ptr + start * pb, value, (stop - start) * pb, stream)
                    calls += len(runs)
        finally:
            if pushed:
                cuda_driver.pop_context()
        return calls

    # ------------------------------------------------------------------ the sanitizer

    def poison(self, page_ids: Sequence[int]) -> None:
        """Fill every plane of the listed pages with 0xFF bytes (memsets); raises what ``clear`` raises."""
        ids = checks.page_ids(page_ids, self.num_pages)
        if ids:
            self._memset(ids, 0xFF)

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        """Enqueue the sanitizer's check on the model stream (Triton kernel, else torch); the pending check."""
        if self._verifier is None:
            self._verifier = _verifier(self.planes, self._stream_arg)
        check: SanitizerCheck = self._verifier.start(cleared_ids, committed_ids)
        return check

    def verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> tuple[Violation, ...]:
        """The check's violations, sorted (waits for the device: not for an event loop)."""
        return self.start_verify(cleared_ids, committed_ids).result()

    def statistics(self) -> dict[str, int]:
        """Counters since construction: clears, pages listed, driver memset calls."""
        return {"clears": self._clears, "pages": self._pages, "driver_calls": self._calls}

    def __repr__(self) -> str:
        return f"CudaClearBackend(planes={len(self._pairs)}, num_pages={self.num_pages}, mode={self.mode!r})"


def _verifier(planes: tuple[torch.Tensor, ...], stream: Any) -> Any:
    """The Triton check over ``planes`` when triton imports here, else the torch one (same results)."""
    device = planes[0].device
    ts = None
    if stream is not None:
        ts = stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.ExternalStream(
            stream_handle(stream), device=device)
    try:
        from .triton_verify import TritonVerifier
    except ImportError:
        return TorchVerifier(planes, ts)
    return TritonVerifier(planes, ts)
