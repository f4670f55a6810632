"""The ``triton`` clear backend: one kernel launch zeroes every listed page in every plane.

Device-side state, built once per backend (planes never move)::

    plane tables (int64, one entry per plane, in units of UNIT bytes)
        delta[k]   (plane k's base address - anchor) / UNIT, the anchor
                   being plane 0 (a pointer argument the compiler knows is
                   16-byte aligned, so stores become 16-byte vectors)
        stride[k]  bytes from one page to the next / UNIT
        length[k]  bytes to zero per page / UNIT
    page lists (int32, fixed capacity = num_pages; one for eager clears, one for graphs)
        list[0]          count of listed pages
        list[1 : 1+n]    the page ids

    kernel: tasks = count x num_planes (one task = one page of one plane),
            a persistent grid of programs strides over the tasks, each task
            stores zeros over [base + page * stride, + length) in BLOCK chunks.

UNIT is the largest of 16, 4, 1 dividing every base, stride and length; with
16 the stores are 16-byte vectors. The page list lives in device memory and the
kernel reads the count there, so the same launch, captured once in a CUDA
graph, clears whatever the current step lists::

    eager:   clear(ids)  = list copy [one H2D memcpy] + one kernel launch
    graph:   stage(ids) [one H2D memcpy] on the model stream, then replay a graph
             captured with capture(step) = [kernel -> step -> count := 0]:
             the clear costs zero extra host launches, and a replay with
             nothing staged zeroes nothing.

The kernel (``zero_pages_kernel``) is kept apart from its host launcher
(``launch_zero_pages``); the backend class only validates and stages. This
module imports torch and triton at import time; the backend registry imports it
by name only when the "triton" backend is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from ..core import checks
from ..core.errors import ConfigurationError
from . import cuda_driver
from .cuda_backend import describe_planes, stream_handle

__all__ = ["StagedClear", "TritonClearBackend", "launch_zero_pages", "plane_tables", "zero_pages_kernel"]


# --------------------------------------------------------------------------- the kernel

@triton.jit
def zero_pages_kernel(
    anchor_ptr,  # any 16-byte aligned device pointer: plane addresses are kept relative to it
    meta_ptr,  # int32 [1 + capacity]: count, then page ids
    delta_ptr,  # int64 [num_planes]: (plane base - anchor) / UNIT
    stride_ptr,  # int64 [num_planes]: page stride / UNIT
    length_ptr,  # int64 [num_planes]: bytes per page / UNIT
    num_planes,
    DTYPE: tl.constexpr,  # element type of the stores (int32 when UNIT >= 4, else int8)
    UNIT: tl.constexpr,  # bytes every base, stride and length is a multiple of
    EPU: tl.constexpr,  # elements per UNIT
    BLOCK: tl.constexpr,  # elements stored per inner iteration
    EVEN: tl.constexpr,  # every page length is a multiple of BLOCK elements: no mask
):
    # Addresses are formed as anchor + offset (not from integers) so the compiler
    # can prove 16-byte alignment and emit vector stores (st.global.v4 for UNIT 16).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = tl.load(meta_ptr) * num_planes
    lane = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], dtype=DTYPE)
    anchor = anchor_ptr.to(tl.pointer_type(DTYPE))
    for task in range(pid, total, nprog):
        slot = task // num_planes
        plane = task - slot * num_planes
        page = tl.load(meta_ptr + 1 + slot).to(tl.int64)
        delta = tl.load(delta_ptr + plane) * EPU
        stride = tl.load(stride_ptr + plane) * EPU
        length = tl.load(length_ptr + plane).to(tl.int32) * EPU
        dst = anchor + (delta + page * stride)
        for start in range(0, length, BLOCK):
            offs = start + lane
            if EVEN:
                tl.store(dst + offs, zeros)
            else:
                tl.store(dst + offs, zeros, mask=offs < length)


# --------------------------------------------------------------------------- host side

MAX_BLOCK = 2048  # elements per inner iteration (8 KiB of int32)
MIN_EVEN_BLOCK = 256


class PlaneTables:
    """Host description of the kernel's plane tables and compile-time choices."""

    __slots__ = ("unit", "dtype", "epu", "block", "even", "deltas", "strides", "lengths")

    def __init__(self, unit: int, dtype: Any, epu: int, block: int, even: bool,
                 deltas: list[int], strides: list[int], lengths: list[int]) -> None:
        self.unit, self.dtype, self.epu, self.block, self.even = unit, dtype, epu, block, even
        self.deltas, self.strides, self.lengths = deltas, strides, lengths


def plane_tables(anchor: int, ptrs: Sequence[int], strides: Sequence[int], lengths: Sequence[int]) -> PlaneTables:
    """Choose UNIT / store type / BLOCK for planes at ``ptrs`` and build the tables.

    ``anchor`` is the address of the kernel's ``anchor_ptr`` argument;
    ``strides[k]`` and ``lengths[k]`` are plane k's page stride and bytes to zero
    per page. Pure: returns host lists; the caller puts them on the device.
    """
    vals = [anchor] + list(ptrs) + list(strides) + list(lengths)
    if all(v % 16 == 0 for v in vals):
        unit, dtype, epu = 16, tl.int32, 4
    elif all(v % 4 == 0 for v in vals):
        unit, dtype, epu = 4, tl.int32, 1
    else:
        unit, dtype, epu = 1, tl.int8, 1
    elems = [n // unit * epu for n in lengths]
    pow2 = min(e & -e for e in elems)  # largest power of two dividing every length
    if pow2 >= MIN_EVEN_BLOCK:
        block, even = min(pow2, MAX_BLOCK), True
    else:  # small or odd pages: a masked block about the size of the smallest page
        block, even = min(MAX_BLOCK, max(128, 1 << (min(elems) - 1).bit_length())), False
    return PlaneTables(unit, dtype, epu, block, even, [(p - anchor) // unit for p in ptrs],
                       [s // unit for s in strides], [n // unit for n in lengths])


def launch_zero_pages(anchor: torch.Tensor, meta: torch.Tensor, deltas: torch.Tensor, strides: torch.Tensor,
                      lengths: torch.Tensor, tables: PlaneTables, grid: int, num_warps: int = 4) -> Any:
    """Launch ``zero_pages_kernel`` once on torch's current stream with ``grid`` programs; return the kernel.

    ``anchor``: the tensor whose address ``tables`` was built against;
    ``meta``: int32 ``[1 + capacity]`` (count, page ids); ``deltas``/``strides``/
    ``lengths``: int64 ``[num_planes]`` in units of ``tables.unit``. The caller
    has validated every id against the planes (the kernel does not check).
    """
    return zero_pages_kernel[(grid,)](
        anchor, meta, deltas, strides, lengths, deltas.shape[0],
        DTYPE=tables.dtype, UNIT=tables.unit, EPU=tables.epu, BLOCK=tables.block, EVEN=tables.even,
        num_warps=num_warps,
    )


def compiled_launcher(kernel: Any) -> Any:
    """The compiled kernel's direct launcher (``kernel[grid](*all_args, stream=handle)``), or None.

    Triton's JIT path binds and specializes the arguments on every launch; a
    kernel object returned by a first launch can be launched again directly
    with the same argument values (all parameters, constexprs included, in
    order) on an explicit stream. None when this Triton returns no such object.
    """
    if kernel is None or not hasattr(kernel, "run") or not callable(getattr(kernel, "__getitem__", None)):
        return None
    return kernel


class TritonClearBackend:
    """Zero listed pages of every plane with one Triton launch on the model stream.

    ``planes``: contiguous CUDA tensors ``[num_pages, ...]`` of one device (any
    dtype; bytes per page may differ per plane). ``stream``: the model stream
    (``torch.cuda.Stream``, ``CUstream`` or raw handle); ``None`` means torch's
    current stream at each call. ``programs_per_sm`` and ``num_warps`` size the
    persistent grid (tuning knobs; the defaults were measured on an H200).
    ``fast_launch``: eager clears launch the compiled kernel directly on the
    stream (no per-launch argument binding); False uses Triton's JIT path.

    Two device page lists, so the eager and the graph paths never see each other's ids:

        clear(ids)      eager: copy ids into the eager list, launch the kernel on it
        stage(ids)      copy ids into the graph list (:attr:`page_list`)
        capture(step)   a CUDA graph [kernel over the graph list -> step() -> count := 0]
        graph_clear(ids) stage(ids) + replay of a clear-only graph (captured on first use)

    Every replay consumes the graph list (the count is reset at its end), so a
    step that stages nothing replays as "zero nothing": ids are never cleared
    twice by a stale list. :meth:`staged` gives the ``ClearBackend`` to hand a
    ``RankExecutor`` whose step graph was captured with :meth:`capture`.

    Raises ConfigurationError for bad planes or knobs, CudaUnavailableError
    without cuda-python, CudaDriverError if the driver cannot be initialised.
    """

    name = "triton"
    RING = 8  # pinned staging rows in flight before a copy waits for the oldest one

    def __init__(self, planes: Sequence[torch.Tensor], stream: Any = None, *,
                 programs_per_sm: int = 4, num_warps: int = 4, fast_launch: bool = True) -> None:
        if type(programs_per_sm) is not int or programs_per_sm < 1:
            raise ConfigurationError(f"programs_per_sm must be a positive int, got {programs_per_sm!r}")
        if num_warps not in (1, 2, 4, 8, 16):
            raise ConfigurationError(f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps!r}")
        layout = describe_planes(planes)
        self.layout = layout
        self.planes = tuple(planes)  # keep the tensors (and their memory) alive
        self.num_pages = layout.num_pages
        self.capacity = layout.num_pages  # distinct ids < num_pages: a list never exceeds this
        self.num_planes = len(layout.ptrs)
        self.num_warps = num_warps
        cuda_driver.driver()
        dev = torch.device("cuda", layout.device)
        self._device = dev
        if stream is None:
            self._stream = None
            self._custream = None
        elif isinstance(stream, torch.cuda.Stream):
            self._stream = stream
            self._custream = cuda_driver.as_custream(stream.cuda_stream)
        else:
            handle = stream_handle(stream)
            self._stream = torch.cuda.ExternalStream(handle, device=dev)
            self._custream = cuda_driver.as_custream(handle)
        self._anchor = self.planes[0].reshape(-1).view(torch.uint8)
        t = plane_tables(int(self._anchor.data_ptr()), layout.ptrs, layout.page_bytes, layout.page_bytes)
        self.tables = t
        self._deltas = torch.tensor(t.deltas, dtype=torch.int64, device=dev)
        self._strides = torch.tensor(t.strides, dtype=torch.int64, device=dev)
        self._lengths = torch.tensor(t.lengths, dtype=torch.int64, device=dev)
        self._eager = torch.zeros(1 + self.capacity, dtype=torch.int32, device=dev)
        self._graph_list = torch.zeros(1 + self.capacity, dtype=torch.int32, device=dev)
        self._empty = torch.zeros(1, dtype=torch.int32, device=dev)
        self._host = torch.zeros((self.RING, 1 + self.capacity), dtype=torch.int32, pin_memory=True)
        self._host_np = self._host.numpy()
        self._host_ptr = int(self._host.data_ptr())
        self._row_bytes = 4 * (1 + self.capacity)
        self._events: list[torch.cuda.Event | None] = [None] * self.RING
        self._slot = 0
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self._max_programs = sms * programs_per_sm
        self._graph_programs = min(self.capacity * self.num_planes, self._max_programs)
        torch.cuda.synchronize(dev)  # the tables are on the device before any stream reads them
        self._graph: torch.cuda.CUDAGraph | None = None
        self._fast = bool(fast_launch)
        self._compiled: Any = None  # the compiled kernel, for direct launches
        self._index = layout.device
        self._clears = 0
        self._pages = 0
        self._launches = 0
        self._copies = 0

    # ------------------------------------------------------------------ plumbing

    @property
    def page_list(self) -> torch.Tensor:
        """The graph page list (int32 ``[1 + capacity]``: count, then ids) captured graphs read."""
        return self._graph_list

    def _torch_stream(self) -> torch.cuda.Stream:
        return self._stream if self._stream is not None else torch.cuda.current_stream(self._device)

    def _copy_list(self, ids: tuple[int, ...], dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Enqueue the copy of ``[len(ids), *ids]`` into ``dst`` on ``stream`` from a pinned ring row."""
        n = len(ids)
        slot = self._slot
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()  # the copy that last read this pinned row has finished
        row = self._host_np[slot]
        row[0] = n
        if n:
            row[1:1 + n] = ids
        cu = self._custream if self._custream is not None else cuda_driver.as_custream(stream.cuda_stream)
        cuda_driver.memcpy_htod_async(int(dst.data_ptr()), self._host_ptr + slot * self._row_bytes,
                                      4 * (1 + n), cu)
        if ev is None:
            ev = self._events[slot] = torch.cuda.Event()
        ev.record(stream)
        self._slot = (slot + 1) % self.RING
        self._copies += 1

    def _launch(self, meta: torch.Tensor, grid: int) -> None:
        """Launch the kernel over ``meta`` through Triton's JIT on torch's current stream (the caller set it)."""
        kernel = launch_zero_pages(self._anchor, meta, self._deltas, self._strides, self._lengths, self.tables,
                                   grid, self.num_warps)
        if self._compiled is None and self._fast:
            self._compiled = compiled_launcher(kernel)
            self._fast = self._compiled is not None
        self._launches += 1

    def _launch_direct(self, meta: torch.Tensor, grid: int, stream_handle: int) -> None:
        """Launch the compiled kernel over ``meta`` on ``stream_handle`` (same arguments as the JIT launch)."""
        t = self.tables
        self._compiled[(grid, 1, 1)](self._anchor, meta, self._deltas, self._strides, self._lengths,
                                     self.num_planes, t.dtype, t.unit, t.epu, t.block, t.even,
                                     stream=stream_handle)
        self._launches += 1

    # ------------------------------------------------------------------ eager

    def clear(self, page_ids: Sequence[int]) -> None:
        """Enqueue zeroing of every listed page in every plane: one list copy + one kernel launch.

        Raises InvalidArgumentError / PageOutOfRangeError / DuplicatePageError
        before anything is enqueued. An empty list enqueues nothing.
        """
        ids = checks.page_ids(page_ids, self.num_pages)
        if not ids:
            return
        n = len(ids)
        grid = min(n * self.num_planes, self._max_programs)
        if self._fast and self._compiled is None:
            self.warmup()  # compiles, and keeps the kernel for direct launches
        stream = self._torch_stream()
        if self._fast:
            if torch.cuda.current_device() == self._index:
                self._copy_list(ids, self._eager, stream)
                self._launch_direct(self._eager, grid, stream.cuda_stream)
            else:
                with torch.cuda.device(self._device):
                    self._copy_list(ids, self._eager, stream)
                    self._launch_direct(self._eager, grid, stream.cuda_stream)
        else:
            with torch.cuda.device(self._device), torch.cuda.stream(stream):
                self._copy_list(ids, self._eager, stream)
                self._launch(self._eager, grid)
        self._clears += 1
        self._pages += n

    # ------------------------------------------------------------------ CUDA graphs

    def stage(self, page_ids: Sequence[int]) -> int:
        """Copy the list into the graph page list on the model stream; return its length.

        One host-to-device copy of ``4 * (1 + n)`` bytes, no kernel; the next
        replay of a graph from :meth:`capture` zeroes these pages. Raises
        InvalidArgumentError / PageOutOfRangeError / DuplicatePageError before
        anything is copied.
        """
        ids = checks.page_ids(page_ids, self.num_pages)
        stream = self._torch_stream()
        if torch.cuda.current_device() == self._index:
            self._copy_list(ids, self._graph_list, stream)
        else:
            with torch.cuda.device(self._device):
                self._copy_list(ids, self._graph_list, stream)
        return len(ids)

    def warmup(self) -> None:
        """Compile and load the kernel without zeroing anything (a launch over an empty list)."""
        stream = self._torch_stream()
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            self._launch(self._empty, self._graph_programs)

    def capture(self, step: Callable[[], None] | None = None, *, pool: Any = None) -> torch.cuda.CUDAGraph:
        """Capture ``[clear kernel over the graph list] -> step() -> list count := 0`` into a CUDA graph.

        The kernel is warmed up first (over an empty list: nothing is zeroed);
        ``step`` must already be warmed up (CUDA graph rules) and may read
        :attr:`page_list`. Per step: :meth:`stage` the list, then replay the graph
        on the model stream; the clear costs no host launch of its own. Raises
        what capture raises (torch's RuntimeError for uncapturable work in ``step``).
        """
        self.warmup()
        torch.cuda.current_stream(self._device).wait_stream(self._torch_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.device(self._device), torch.cuda.graph(g, pool=pool):
            self._launch(self._graph_list, self._graph_programs)
            if step is not None:
                step()
            self._graph_list[:1].zero_()  # consumed: a replay with nothing staged zeroes nothing
        return g

    def graph_clear(self, page_ids: Sequence[int]) -> None:
        """Stage ``page_ids`` and replay a clear-only graph on the model stream (captured on first use).

        Host work: one list copy and one graph launch, whatever the list length.
        Raises what :meth:`stage` raises, before anything is enqueued.
        """
        if self._graph is None:
            self._graph = self.capture()
        n = self.stage(page_ids)
        if self._stream is None and torch.cuda.current_device() == self._index:
            self._graph.replay()  # on the current stream, which is the model stream
        else:
            with torch.cuda.device(self._device), torch.cuda.stream(self._torch_stream()):
                self._graph.replay()
        self._clears += 1
        self._pages += n

    def staged(self) -> StagedClear:
        """A ``ClearBackend`` whose ``clear`` only stages: for an executor whose graph came from :meth:`capture`."""
        return StagedClear(self)

    def statistics(self) -> dict[str, int]:
        """Counters since construction: clears, pages listed, kernel launches, list copies."""
        return {"clears": self._clears, "pages": self._pages, "kernel_launches": self._launches,
                "list_copies": self._copies}

    def __repr__(self) -> str:
        return (
            f"TritonClearBackend(planes={self.num_planes}, num_pages={self.num_pages}, "
            f"unit={self.tables.unit}, block={self.tables.block})"
        )


class StagedClear:
    """The clear step of a rank whose step graph holds the Triton clear kernel.

    ``RankExecutor`` calls ``clear(clear_list)`` between the input copies and the
    graph; here that only stages the list (one H2D copy on the model stream) and
    the graph's replay zeroes it. An executor that skips empty lists is safe: the
    previous replay consumed the list.
    """

    name = "triton-graph"

    def __init__(self, backend: TritonClearBackend) -> None:
        self.backend = backend

    def clear(self, page_ids: Sequence[int]) -> None:
        """Stage ``page_ids`` for the next replay; raises what ``TritonClearBackend.stage`` raises."""
        self.backend.stage(page_ids)
