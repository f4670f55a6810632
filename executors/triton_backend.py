"""The ``triton`` clear backend: one kernel launch zeroes every listed page in every plane.

Device-side state, built once per backend (planes never move): the fill
kernel's plane tables (``triton_kernels.plane_tables``), a ring of page lists
for eager clears (``page_lists.ListRing``: pinned host rows, device rows,
events; it grows rather than wait), and one static graph page list. Every list
is ``[count, ids...]`` (int32) and the kernel reads the count on the device::

    eager    clear(ids)   pack ids into a pinned row -> one kernel launch on the model
                          stream; up to ``ZERO_COPY_IDS`` ids the kernel reads the pinned
                          row itself (mapped memory), a longer list is copied to the
                          device row first (on a side copy stream, the model stream waits
                          for it on the device: ``prefetch``)
    graph    stage(ids)   H2D copy into the static graph list, on the model stream
             clear_staged()  inside the engine's own CUDA graph capture: the kernel
                          over the static list, then count := 0 (the list is consumed)
             capture(step) / graph_clear(ids) / staged(): ready-made uses of the two

Host work per eager clear: the id check, one ``struct.pack_into``, and two driver
calls for a short list (launch, event), four or five for a long one (copy, [event,
wait], launch, event) through
``cuda_driver``; the kernel is launched with ``cuLaunchKernel`` and a preset
parameter block (``triton_launch``, ``launch="driver"``). Nothing synchronizes
the host with the device. A replay consumes the graph list, so a replay with
nothing staged zeroes nothing and ids are never zeroed twice by a stale list.

The sanitizer (``kvledger.executors.sanitize``): ``poison(ids)`` is the same
kernel filling 0xFF bytes; ``start_verify`` / ``verify`` run
``triton_verify.TritonVerifier``. This module imports torch and triton at import
time; the backend registry imports it by name only when "triton" is asked for.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core import checks
from ..core.errors import ConfigurationError
from . import cuda_driver
from .backend import ClearBackendBase
from .cuda_backend import describe_planes, stream_handle
from .page_lists import ListRing, ListSlot, packer
from .sanitize import SanitizerCheck, Violation
from .triton_kernels import FillConfig, fill_constants, fill_pages_kernel, fill_work, plane_tables
from .triton_launch import DirectLaunch, compile_kernel

__all__ = ["FillConfig", "StagedClear", "TritonClearBackend"]

LAUNCH_MODES = ("driver", "triton", "jit")
# Eager lists of at most this many ids are read by the kernel from the slot's pinned host row
# (mapped memory): no copy, no copy event, no stream wait (three driver calls fewer, about
# 5 us of host time on the H200 host); longer ones are copied to the device row first.
ZERO_COPY_IDS = 64


class _Fill:
    """The fill kernel for one backend and one fill value, launched the way ``mode`` says."""

    def __init__(self, b: TritonClearBackend, fill: int, meta: torch.Tensor,
                 device_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        anchor, deltas, strides, lengths = device_tables  # the backend's, made once
        self.consts = fill_constants(b.tables, b.config, fill)
        self.args: list[Any] = [anchor, meta, deltas, strides, lengths, b.num_planes, b.tables.chunks]
        self.num_warps = b.config.num_warps
        self.mode = b.launch
        self.compiled = compile_kernel(fill_pages_kernel, self.args, self.consts, self.num_warps)
        self.direct = DirectLaunch(self.compiled, self.args) if self.mode == "driver" else None
        self.launches = 0

    def __call__(self, meta: torch.Tensor, meta_ptr: int, grid: int, cu: Any) -> None:
        """Launch over the list at ``meta`` on the CUstream ``cu`` (torch's current stream for "jit")."""
        direct = self.direct
        if direct is not None:
            direct.set_pointer(1, meta_ptr)
            direct(grid, cu)
        else:
            args = self.args
            args[1] = meta
            if self.mode == "triton":
                self.compiled[(grid, 1, 1)](*args, *self.consts.values(), stream=int(cu))
            else:
                fill_pages_kernel[(grid,)](*args, **self.consts, num_warps=self.num_warps)
        self.launches += 1


class TritonClearBackend(ClearBackendBase):
    """Zero listed pages of every plane with one Triton launch on the model stream.

    ``planes``: contiguous CUDA tensors ``[num_pages, ...]`` of one device (any
    dtype; bytes per page may differ per plane). ``stream``: the model stream
    (``torch.cuda.Stream``, ``CUstream`` or raw handle); ``None`` means torch's
    current stream at each call. ``config``: the kernel's knobs (``FillConfig``;
    ``programs_per_sm`` / ``num_warps`` override its fields). ``launch``: "driver",
    "triton" or "jit" (``triton_launch``; ``fast_launch=False`` means "jit"); when
    not given, ``$KVLEDGER_TRITON_LAUNCH`` or "driver".
    ``prefetch``: eager lists travel on a side copy stream.

    Raises ConfigurationError for bad planes or knobs, CudaUnavailableError
    without cuda-python, CudaDriverError if the driver cannot be initialised.
    """

    name = "triton"
    can_sanitize = True

    def __init__(self, planes: Sequence[torch.Tensor], stream: Any = None, *, config: FillConfig | None = None,
                 programs_per_sm: int | None = None, num_warps: int | None = None, launch: str | None = None,
                 prefetch: bool = True, fast_launch: bool = True) -> None:
        config = _config(config, programs_per_sm, num_warps)
        if launch is None:
            launch = os.environ.get("KVLEDGER_TRITON_LAUNCH", "driver") if fast_launch else "jit"
        if launch not in LAUNCH_MODES:
            raise ConfigurationError(f"launch must be one of {LAUNCH_MODES}, got {launch!r}")
        layout = describe_planes(planes)
        self.layout, self.config, self.launch, self.prefetch = layout, config, launch, bool(prefetch)
        self.planes = tuple(planes)  # keep the tensors (and their memory) alive
        self.num_pages = self.capacity = layout.num_pages
        self.num_planes = len(layout.ptrs)
        cuda_driver.driver()
        dev = self._device = torch.device("cuda", layout.device)
        self._index = layout.device
        self._stream, self._cu = _model_stream(stream, dev)
        self._anchor = self.planes[0].reshape(-1).view(torch.uint8)
        t = self.tables = plane_tables(int(self._anchor.data_ptr()), layout.ptrs, layout.page_bytes,
                                       layout.page_bytes, config)
        self._deltas = torch.tensor(t.deltas, dtype=torch.int64, device=dev)
        self._strides = torch.tensor(t.strides, dtype=torch.int64, device=dev)
        self._lengths = torch.tensor(t.lengths, dtype=torch.int64, device=dev)
        self._graph_list = torch.zeros(1 + self.capacity, dtype=torch.int32, device=dev)
        self._graph_ptr = int(self._graph_list.data_ptr())
        with torch.cuda.device(dev):
            self._ring = ListRing(torch, 1 + self.capacity, dev)
            self._copy = torch.cuda.Stream(dev) if self.prefetch else None
        self._copy_cu = cuda_driver.as_custream(self._copy.cuda_stream) if self._copy is not None else None
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self._max_programs = sms * config.programs_per_sm
        self._work_per_page = fill_work(t, 1, self.num_planes)  # work items per listed page
        self._graph_programs = min(fill_work(t, self.capacity, self.num_planes), self._max_programs)
        torch.cuda.synchronize(dev)  # tables and rows are on the device before any stream reads them
        self._zero: _Fill | None = None
        self._ones: _Fill | None = None
        self._verifier: Any = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_exec: Any = None
        self._clears = self._pages = self._copies = 0
        self._ctx_threads: set[int] = set()

    # ------------------------------------------------------------------ plumbing

    @property
    def page_list(self) -> torch.Tensor:
        """The static graph page list (int32 ``[1 + capacity]``: count, then ids) that graphs read."""
        return self._graph_list

    def _streams(self) -> tuple[torch.cuda.Stream, Any]:
        if self._stream is not None:
            return self._stream, self._cu
        s = torch.cuda.current_stream(self._device)
        return s, cuda_driver.as_custream(s.cuda_stream)

    def _enter(self) -> bool:
        """Make the planes' context current on this thread if it is not; True when pushed (pop it).

        A thread seen with the planes' context current is remembered (one driver
        call saved per clear): kvledger never changes a thread's current context.
        """
        me = threading.get_ident()
        if me in self._ctx_threads:
            return False
        if cuda_driver.device_of_current_context() == self._index:
            self._ctx_threads.add(me)
            return False
        cuda_driver.push_primary_context(self._index)
        return True

    def _fill(self, ones: bool) -> _Fill:
        f = self._ones if ones else self._zero
        if f is None:
            with torch.cuda.device(self._device):
                f = _Fill(self, -1 if ones else 0, self._graph_list,
                          (self._anchor, self._deltas, self._strides, self._lengths))
            if ones:
                self._ones = f
            else:
                self._zero = f
        return f

    def warmup(self) -> None:
        """Compile and load the clear kernel now (nothing is launched)."""
        self._fill(False)

    # ------------------------------------------------------------------ eager

    def clear(self, page_ids: Sequence[int]) -> None:
        """Enqueue zeroing of every listed page in every plane: one list copy + one kernel launch.

        Raises InvalidArgumentError / PageOutOfRangeError / DuplicatePageError
        before anything is enqueued. An empty list enqueues nothing.
        """
        ids = checks.page_ids(page_ids, self.num_pages)
        if ids:
            self._eager(ids, self._zero or self._fill(False))
            self._clears += 1
            self._pages += len(ids)

    def clear_checked(self, page_ids: tuple[int, ...]) -> None:
        """``clear`` for ids known good: a tuple of distinct ints in ``[0, num_pages)``, as the clear
        list of a plan the ledger sealed is (the executor calls this only for jobs the engine marks
        ``checked``). Skips the check that dominates the host cost; never call it with user input."""
        if page_ids:
            self._eager(page_ids, self._zero or self._fill(False))
            self._clears += 1
            self._pages += len(page_ids)

    def poison(self, page_ids: Sequence[int]) -> None:
        """Fill every plane of the listed pages with 0xFF bytes (the sanitizer); raises what ``clear`` raises."""
        ids = checks.page_ids(page_ids, self.num_pages)
        if ids:
            self._eager(ids, self._ones or self._fill(True))

    def _eager(self, ids: tuple[int, ...], fill: _Fill) -> None:
        n = len(ids)
        stream, cu = (self._stream, self._cu) if self._stream is not None else self._streams()
        pushed = threading.get_ident() not in self._ctx_threads and self._enter()
        try:
            slot = self._ring.acquire()
            nbytes = 4 * (n + 1)
            packer(n + 1).pack_into(slot.host_np, 0, n, *ids)
            grid = min(n * self._work_per_page, self._max_programs)
            if n <= ZERO_COPY_IDS and slot.host_dptr is not None and fill.direct is not None:
                fill(slot.host, slot.host_dptr, grid, cu)  # the kernel reads the list from the pinned row
            else:
                if self._copy_cu is not None:
                    cuda_driver.memcpy_htod_async(slot.dptr, slot.host_ptr, nbytes, self._copy_cu)
                    cuda_driver.event_record(slot.copied, self._copy_cu)
                    cuda_driver.stream_wait_event(cu, slot.copied)
                else:
                    cuda_driver.memcpy_htod_async(slot.dptr, slot.host_ptr, nbytes, cu)
                self._copies += 1
                if fill.mode == "jit":
                    with torch.cuda.device(self._device), torch.cuda.stream(stream):
                        fill(slot.device, slot.dptr, grid, cu)
                else:
                    fill(slot.device, slot.dptr, grid, cu)
            cuda_driver.event_record(slot.done, cu)  # the slot (either row) is reused once this completed
        finally:
            if pushed:
                cuda_driver.pop_context()

    # ------------------------------------------------------------------ CUDA graphs

    def stage(self, page_ids: Sequence[int]) -> int:
        """Copy the list into the static graph list on the model stream; return its length.

        One host-to-device copy of ``4 * (1 + n)`` bytes, no kernel; the next replay
        of a graph holding :meth:`clear_staged` zeroes these pages. Raises
        InvalidArgumentError / PageOutOfRangeError / DuplicatePageError before
        anything is copied.
        """
        ids = checks.page_ids(page_ids, self.num_pages)
        _, cu = self._streams()
        pushed = self._enter()
        try:
            slot: ListSlot = self._ring.acquire()
            n = len(ids)
            packer(n + 1).pack_into(slot.host_np, 0, n, *ids)
            cuda_driver.memcpy_htod_async(self._graph_ptr, slot.host_ptr, 4 * (n + 1), cu)
            cuda_driver.event_record(slot.done, cu)
            self._copies += 1
        finally:
            if pushed:
                cuda_driver.pop_context()
        return len(ids)

    def clear_staged(self, *, consume: bool = True) -> None:
        """Enqueue, on torch's current stream, the clear kernel over the staged list (then count := 0).

        Call it inside your own ``torch.cuda.graph`` capture, where the step's
        kernels go: each replay then zeroes what :meth:`stage` put there before
        it. ``consume`` (default): the list is emptied after the kernel, so a
        replay with nothing staged zeroes nothing. Outside a capture it runs once.
        """
        fill = self._fill(False)
        stream = torch.cuda.current_stream(self._device)
        with torch.cuda.device(self._device):
            fill(self._graph_list, self._graph_ptr, self._graph_programs, cuda_driver.as_custream(stream.cuda_stream))
            if consume:
                self.consume_staged()

    def consume_staged(self) -> None:
        """Enqueue count := 0 for the staged list on torch's current stream (inside a capture: a graph node)."""
        self._graph_list[:1].zero_()

    def capture(self, step: Callable[[], None] | None = None, *, pool: Any = None) -> torch.cuda.CUDAGraph:
        """Capture ``[clear kernel over the staged list] -> step() -> count := 0`` into a CUDA graph.

        ``step`` must already be warmed up (CUDA graph rules) and may read
        :attr:`page_list`. Per step: :meth:`stage` the list, then replay the graph
        on the model stream. Raises what capture raises (torch's RuntimeError for
        uncapturable work in ``step``).
        """
        self.warmup()
        torch.cuda.current_stream(self._device).wait_stream(self._streams()[0])
        g = torch.cuda.CUDAGraph()
        with torch.cuda.device(self._device), torch.cuda.graph(g, pool=pool):
            self.clear_staged(consume=False)
            if step is not None:
                step()
            self.consume_staged()
        return g

    def graph_clear(self, page_ids: Sequence[int]) -> None:
        """Stage ``page_ids`` and replay a clear-only graph on the model stream (captured on first use).

        Host work: the id check, one list copy and one graph launch, whatever the
        list length. Raises what :meth:`stage` raises, before anything is enqueued.
        """
        if self._graph is None:
            self._graph = self.capture()
            raw = getattr(self._graph, "raw_cuda_graph_exec", None)
            self._graph_exec = cuda_driver.as_cugraphexec(raw()) if raw is not None else None
        n = self.stage(page_ids)
        stream, cu = self._streams()
        if self._graph_exec is not None:
            pushed = self._enter()
            try:
                cuda_driver.graph_launch(self._graph_exec, cu)
            finally:
                if pushed:
                    cuda_driver.pop_context()
        else:
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                self._graph.replay()
        self._clears += 1
        self._pages += n

    def staged(self) -> StagedClear:
        """A ``ClearBackend`` whose ``clear`` only stages: for an executor whose graph holds :meth:`clear_staged`."""
        return StagedClear(self)

    # ------------------------------------------------------------------ the sanitizer

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        """Enqueue the sanitizer's check on the model stream (``triton_verify``); returns the pending check."""
        if self._verifier is None:
            from .triton_verify import TritonVerifier

            self._verifier = TritonVerifier(self.planes, self._stream, launch=self.launch)
        check: SanitizerCheck = self._verifier.start(cleared_ids, committed_ids)
        return check

    def verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> tuple[Violation, ...]:
        """The check's violations, sorted (waits for the device: not for an event loop)."""
        return self.start_verify(cleared_ids, committed_ids).result()

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> dict[str, int]:
        """Counters since construction: clears, pages listed, kernel launches (host), list copies, ring slots."""
        launches = sum(f.launches for f in (self._zero, self._ones) if f is not None)
        return {"clears": self._clears, "pages": self._pages, "kernel_launches": launches,
                "list_copies": self._copies, "ring_slots": len(self._ring), "ring_grown": self._ring.grown}

    def __repr__(self) -> str:
        return (f"TritonClearBackend(planes={self.num_planes}, num_pages={self.num_pages}, "
                f"unit={self.tables.unit}, block={self.tables.block}, config={self.config.tag()!r}, "
                f"launch={self.launch!r})")


class StagedClear(ClearBackendBase):
    """The clear step of a rank whose step graph holds the Triton clear kernel (``clear_staged``).

    ``RankExecutor`` calls ``clear(clear_list)`` between the input copies and the
    graph; here that only stages the list (one H2D copy on the model stream) and
    the graph's replay zeroes it. An executor that skips empty lists is safe: the
    previous replay consumed the list. The sanitizer calls go to the backend.
    """

    name = "triton-graph"
    can_sanitize = True

    def __init__(self, backend: TritonClearBackend) -> None:
        self.backend = backend
        self.num_pages = backend.num_pages

    def poison(self, page_ids: Sequence[int]) -> None:
        self.backend.poison(page_ids)

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        return self.backend.start_verify(cleared_ids, committed_ids)

    def verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> tuple[Violation, ...]:
        return self.backend.verify(cleared_ids, committed_ids)

    def clear(self, page_ids: Sequence[int]) -> None:
        """Stage ``page_ids`` for the next replay; raises what ``TritonClearBackend.stage`` raises."""
        self.backend.stage(page_ids)


def _config(config: FillConfig | None, programs_per_sm: int | None, num_warps: int | None) -> FillConfig:
    """The knobs to use, checked; ``ConfigurationError`` for a bad one."""
    config = config or FillConfig()
    if programs_per_sm is not None:
        config = dataclasses.replace(config, programs_per_sm=programs_per_sm)
    if num_warps is not None:
        config = dataclasses.replace(config, num_warps=num_warps)
    if type(config.programs_per_sm) is not int or config.programs_per_sm < 1:
        raise ConfigurationError(f"programs_per_sm must be a positive int, got {config.programs_per_sm!r}")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise ConfigurationError(f"num_warps must be 1, 2, 4, 8 or 16, got {config.num_warps!r}")
    bb = config.block_bytes
    if type(bb) is not int or bb < 64 or bb & (bb - 1):
        raise ConfigurationError(f"block_bytes must be a power of two >= 64, got {bb!r}")
    return config


def _model_stream(stream: Any, dev: torch.device) -> tuple[torch.cuda.Stream | None, Any]:
    """The model stream as (torch stream, CUstream); (None, None) to follow torch's current stream."""
    if stream is None:
        return None, None
    if isinstance(stream, torch.cuda.Stream):
        return stream, cuda_driver.as_custream(stream.cuda_stream)
    handle = stream_handle(stream)
    return torch.cuda.ExternalStream(handle, device=dev), cuda_driver.as_custream(handle)
