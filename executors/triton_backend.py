"""The ``triton`` clear backend: one kernel launch zeroes every listed page in every plane.

One piece: the eager, graph and sanitizer paths share the rings, the tables and the
context handling; splitting the class would split that state. The kernels, the launch, the list
ring and the tuning table are modules of their own.

Device-side state, built once per backend (planes never move): the fill kernels'
plane tables (``triton_kernels.plane_tables``; one set of device tables, the kernel
shape's blocking per shape), a ring of page lists for eager clears that do not travel
by value (``page_lists.ListRing``: pinned host rows, device rows, events; it grows
rather than wait), one static graph page list, and a ring of clear graphs for
``graph_clear``. Per card, ``triton_tuning`` says which kernel shape serves a clear of
a given size and where a list of a given length lives::

    eager    clear(ids)   n <= ids.param_max: the ids travel in the kernel's parameters
                          (``param_fill_kernel``): pack + one launch, nothing else (the
                          driver copies the parameters at the launch call)
                          longer: pack into a pinned row, copy it to the slot's device row
                          ("side": on a copy stream, the model stream waits for it on the
                          device; "stream": on the model stream), launch the list kernel,
                          record the slot's event ("mapped", measured only: no copy, the
                          kernel reads the pinned row over PCIe)
    graph    stage(ids)   H2D copy into the static graph list, on the model stream
             clear_staged()  inside the engine's own CUDA graph capture: the kernel
                          over the static list, then count := 0 (the list is consumed)
             capture(step): a ready-made use of the two
             graph_clear(ids): a ring of captured graphs, one per pinned row and list
                          size class, each [copy its row to the static list -> clear ->
                          count := 0 -> its row's event]: pack + one graph launch

Host work per eager clear: the id check (``clear``; ``clear_checked`` trusts a sealed
plan), one ``struct.pack_into``, and one driver call for a list that travels by value
(the launch), four or five for a longer one (copy, [event, wait], launch, event)
through ``cuda_driver``; kernels are launched with ``cuLaunchKernel`` and a preset
parameter block (``triton_launch``, ``launch="driver"``; the other launch modes copy
every list). Nothing synchronizes the host with the device. A replay consumes the
graph list, so a replay with nothing staged zeroes nothing and ids are never zeroed
twice by a stale list.

The sanitizer (``kvledger.executors.sanitize``): ``poison(ids)`` is the same
kernel filling 0xFF bytes; ``start_verify`` / ``verify`` run
``triton_verify.TritonVerifier``. This module imports torch and triton at import
time; the backend registry imports it by name only when "triton" is asked for."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core import checks
from ..core.errors import ConfigurationError, CudaDriverError
from . import cuda_driver
from .backend import ClearBackendBase
from .cuda_planes import describe_planes, stream_handle
from .page_lists import ListRing, ListSlot, packer
from .sanitize import SanitizerCheck, Violation
from .triton_kernels import (
    FillConfig,
    PlaneTables,
    fill_constants,
    fill_pages_kernel,
    fill_work,
    param_fill_kernel,
    plane_tables,
)
from .triton_launch import DirectLaunch, compile_kernel
from .triton_tuning import CardTuning, IdsPlan, tuning_for

__all__ = ["FillConfig", "IdsPlan", "StagedClear", "TritonClearBackend"]

LAUNCH_MODES = ("driver", "triton", "jit")
_PLANS_CACHED = 4096  # list lengths whose clear plan is kept (a longer list's pack dwarfs making it)
_SIZE_CLASS_MIN = 16  # words: graph_clear's smallest copy (size classes are powers of two)
GRAPH_ROWS = 8  # graph_clear's pinned rows, each with its graphs (busy rows: the staged path)


class _Fill:
    """The fill kernels for one kernel shape and one fill value: the list kernel (launched the
    way ``mode`` says) and, with direct launches, the by-value kernels (one per slot count, made
    on first use)."""

    def __init__(self, b: TritonClearBackend, tables: PlaneTables, config: FillConfig, fill: int, meta: torch.Tensor,
                 device_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        anchor, deltas, strides, lengths = device_tables  # the backend's, made once
        self.tables, self.config = tables, config
        self.consts = fill_constants(tables, config, fill)
        self.head: list[Any] = [anchor, deltas, strides, lengths, b.num_planes, tables.chunks]
        self.args: list[Any] = [anchor, meta, deltas, strides, lengths, b.num_planes, tables.chunks]
        self.num_warps = config.num_warps
        self.mode = b.launch
        self.compiled = compile_kernel(fill_pages_kernel, self.args, self.consts, self.num_warps)
        self.direct = DirectLaunch(self.compiled, self.args) if self.mode == "driver" else None
        self.work_per_page = fill_work(tables, 1, b.num_planes)
        self.max_programs = b.sms * config.programs_per_sm
        self._by_value: dict[int, DirectLaunch] = {}
        self.launches = 0

    def by_value(self, k: int) -> DirectLaunch:
        """The direct launcher of ``param_fill_kernel(k)`` for these planes (compiled on first use)."""
        d = self._by_value.get(k)
        if d is None:
            args = [*self.head, 0, *([0] * k)]
            compiled = compile_kernel(param_fill_kernel(k), args, self.consts, self.num_warps)
            d = self._by_value[k] = DirectLaunch(compiled, args, block_from=len(self.head))
        return d

    def grid(self, n: int) -> int:
        return min(n * self.work_per_page, self.max_programs)

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
    current stream at each call. ``config``: one kernel shape for every clear
    (``FillConfig``; ``programs_per_sm`` / ``num_warps`` override its fields); not
    given, the card's shapes by clear size (``triton_tuning.tuning_for``, or
    ``tuning``). ``ids``: where eager lists live (``IdsPlan``); not given, the card's
    plan, with lists past its ``param_max`` copied on a side copy stream, or on the
    model stream with ``prefetch=False``. ``launch``: "driver", "triton" or "jit"
    (``triton_launch``; ``fast_launch=False`` means "jit"); when not given,
    ``$KVLEDGER_TRITON_LAUNCH`` or "driver". Only "driver" passes lists by value.

    Raises ConfigurationError for bad planes or knobs, CudaUnavailableError
    without cuda-python, CudaDriverError if the driver cannot be initialised.
    """

    name = "triton"
    can_sanitize = True

    def __init__(self, planes: Sequence[torch.Tensor], stream: Any = None, *, config: FillConfig | None = None,
                 programs_per_sm: int | None = None, num_warps: int | None = None, launch: str | None = None,
                 prefetch: bool = True, fast_launch: bool = True, ids: IdsPlan | None = None,
                 tuning: CardTuning | None = None) -> None:
        if launch is None:
            launch = os.environ.get("KVLEDGER_TRITON_LAUNCH", "driver") if fast_launch else "jit"
        if launch not in LAUNCH_MODES:
            raise ConfigurationError(f"launch must be one of {LAUNCH_MODES}, got {launch!r}")
        if ids is not None and not isinstance(ids, IdsPlan):
            raise ConfigurationError(f"ids must be an IdsPlan, got {ids!r}")
        layout = describe_planes(planes)
        self.layout, self.launch = layout, launch
        self.planes = tuple(planes)  # keep the tensors (and their memory) alive
        self.num_pages = self.capacity = layout.num_pages
        self.num_planes = len(layout.ptrs)
        cuda_driver.driver()
        dev = self._device = torch.device("cuda", layout.device)
        self._index = layout.device
        props = torch.cuda.get_device_properties(dev)
        self.card, self.sms = props.name, props.multi_processor_count
        card = tuning if tuning is not None else tuning_for(self.card)
        if config is not None:
            shapes: tuple[tuple[float, FillConfig], ...] = ((float("inf"), _config(config, programs_per_sm,
                                                                                    num_warps)),)
        else:
            shapes = tuple((up_to, _config(c, programs_per_sm, num_warps)) for up_to, c in card.shapes)
        plan = ids if ids is not None else card.ids
        if ids is None and not prefetch and plan.longer == "side":
            plan = dataclasses.replace(plan, longer="stream")
        self.ids = plan if launch == "driver" else dataclasses.replace(plan, param_max=0)
        self.prefetch = self.ids.longer == "side"
        self._stream, self._cu = _model_stream(stream, dev)
        self._anchor = self.planes[0].reshape(-1).view(torch.uint8)
        anchor = int(self._anchor.data_ptr())
        self._shapes = [(up_to, cfg, plane_tables(anchor, layout.ptrs, layout.page_bytes, layout.page_bytes, cfg))
                        for up_to, cfg in shapes]
        self.config, t = self._shapes[-1][1], self._shapes[-1][2]  # the largest clears' shape (and the graphs')
        self.tables = t
        self._bytes_per_page = sum(layout.page_bytes)
        self._deltas = torch.tensor(t.deltas, dtype=torch.int64, device=dev)
        self._strides = torch.tensor(t.strides, dtype=torch.int64, device=dev)
        self._lengths = torch.tensor(t.lengths, dtype=torch.int64, device=dev)
        self._graph_list = torch.zeros(1 + self.capacity, dtype=torch.int32, device=dev)
        self._graph_ptr = int(self._graph_list.data_ptr())
        with torch.cuda.device(dev):
            self._ring = ListRing(torch, 1 + self.capacity, dev)
            self._graph_ring: ListRing | None = None
            self._copy = torch.cuda.Stream(dev) if self.ids.longer == "side" else None
        self._copy_cu = cuda_driver.as_custream(self._copy.cuda_stream) if self._copy is not None else None
        self._graph_programs = min(fill_work(t, self.capacity, self.num_planes), self.sms * self.config.programs_per_sm)
        torch.cuda.synchronize(dev)  # tables and rows are on the device before any stream reads them
        self._fills: dict[tuple[int, int], _Fill] = {}  # (shape index, fill value) -> kernels
        self._plans: dict[int, tuple[_Fill, int, DirectLaunch | None]] = {}  # n (poison: -n) -> _plan's
        self._verifier: Any = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graphs: list[Any] = []  # graph_clear's captured graphs (kept alive)
        self._capture_stream: torch.cuda.Stream | None = None
        self._staged_exec: Any = None  # graph_clear's clear-only graph over the static list
        self._slot_graphs: bool | None = None  # graph_clear: per-row graphs work here (None: not tried yet)
        self._clears = self._pages = self._copies = self._by_value = 0
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

    def _shape_index(self, n: int | None) -> int:
        """The shape that serves a clear of ``n`` pages (None: the largest clears' shape)."""
        shapes = self._shapes
        if n is None or len(shapes) == 1:
            return len(shapes) - 1
        nbytes = n * self._bytes_per_page
        for j, (up_to, _, _) in enumerate(shapes):
            if nbytes <= up_to:
                return j
        return len(shapes) - 1

    def _fill(self, ones: bool, n: int | None = None) -> _Fill:
        """The kernels of the shape that serves a clear of ``n`` pages (made on first use)."""
        key = (self._shape_index(n), -1 if ones else 0)
        f = self._fills.get(key)
        if f is None:
            _, cfg, tables = self._shapes[key[0]]
            with torch.cuda.device(self._device):
                f = self._fills[key] = _Fill(self, tables, cfg, key[1], self._graph_list,
                                             (self._anchor, self._deltas, self._strides, self._lengths))
        return f

    def warmup(self) -> None:
        """Compile and load the clear kernels now: every shape's list kernel, and the by-value
        kernel of the shortest lists; nothing is launched."""
        k = self.ids.slots_for(1)
        for i in range(len(self._shapes)):
            key = (i, 0)
            f = self._fills.get(key)
            if f is None:
                _, cfg, tables = self._shapes[i]
                with torch.cuda.device(self._device):
                    f = self._fills[key] = _Fill(self, tables, cfg, 0, self._graph_list,
                                                 (self._anchor, self._deltas, self._strides, self._lengths))
            if k and f.direct is not None:
                with torch.cuda.device(self._device):
                    f.by_value(k)

    # ------------------------------------------------------------------ eager

    def clear(self, page_ids: Sequence[int]) -> None:
        """Enqueue zeroing of every listed page in every plane: one kernel launch (and, for a list
        too long to travel by value, one list copy).

        Raises InvalidArgumentError / PageOutOfRangeError / DuplicatePageError
        before anything is enqueued. An empty list enqueues nothing.
        """
        ids = checks.page_ids(page_ids, self.num_pages)
        if ids:
            self._eager(ids, False)
            self._clears += 1
            self._pages += len(ids)

    def clear_checked(self, page_ids: tuple[int, ...]) -> None:
        """``clear`` for ids known good: a tuple of distinct ints in ``[0, num_pages)``, as the clear
        list of a plan the ledger sealed is (the executor calls this only for jobs the engine marks
        ``checked``). Skips the check that dominates the host cost; never call it with user input."""
        if page_ids:
            self._eager(page_ids, False)
            self._clears += 1
            self._pages += len(page_ids)

    def poison(self, page_ids: Sequence[int]) -> None:
        """Fill every plane of the listed pages with 0xFF bytes (the sanitizer); raises what ``clear`` raises."""
        ids = checks.page_ids(page_ids, self.num_pages)
        if ids:
            self._eager(ids, True)

    def _eager(self, ids: tuple[int, ...], ones: bool) -> None:
        n = len(ids)
        plan = self._plans.get(-n if ones else n)
        if plan is None:
            plan = self._plan(n, ones)
        fill, grid, by_value = plan
        cu = self._cu if self._stream is not None else self._streams()[1]
        pushed = threading.get_ident() not in self._ctx_threads and self._enter()
        try:
            if by_value is not None:  # the list travels in the kernel's parameters
                packer(n + 1).pack_into(by_value.block, 0, n, *ids)
                by_value(grid, cu)
                fill.launches += 1
                self._by_value += 1
            else:
                self._eager_row(ids, fill, grid, cu)
        finally:
            if pushed:
                cuda_driver.pop_context()

    def _plan(self, n: int, ones: bool) -> tuple[_Fill, int, DirectLaunch | None]:
        """How a list of ``n`` ids is cleared (or poisoned): its kernels, grid and by-value
        launcher (None: a ring row); made once per length."""
        fill = self._fill(ones, n)
        k = self.ids.slots_for(n)
        by_value = None
        if k and fill.direct is not None:
            with torch.cuda.device(self._device):
                by_value = fill.by_value(k)
        plan = (fill, fill.grid(n), by_value)
        if n <= _PLANS_CACHED:
            self._plans[-n if ones else n] = plan
        return plan

    def _eager_row(self, ids: tuple[int, ...], fill: _Fill, grid: int, cu: Any) -> None:
        """A list in a ring slot's row: copied to the device row (side or model stream), or read
        where it is ("mapped"); the slot's event follows the kernel."""
        n = len(ids)
        slot = self._ring.acquire()
        packer(n + 1).pack_into(slot.host_np, 0, n, *ids)
        longer = self.ids.longer
        if longer == "mapped" and slot.host_dptr is not None and fill.direct is not None:
            fill(slot.host, slot.host_dptr, grid, cu)  # the kernel reads the pinned row (PCIe)
        else:
            nbytes = 4 * (n + 1)
            if self._copy_cu is not None:
                cuda_driver.memcpy_htod_async(slot.dptr, slot.host_ptr, nbytes, self._copy_cu)
                cuda_driver.event_record(slot.copied, self._copy_cu)
                cuda_driver.stream_wait_event(cu, slot.copied)
            else:
                cuda_driver.memcpy_htod_async(slot.dptr, slot.host_ptr, nbytes, cu)
            self._copies += 1
            if fill.mode == "jit":
                stream = self._stream if self._stream is not None else self._streams()[0]
                with torch.cuda.device(self._device), torch.cuda.stream(stream):
                    fill(slot.device, slot.dptr, grid, cu)
            else:
                fill(slot.device, slot.dptr, grid, cu)
        cuda_driver.event_record(slot.done, cu)  # the slot (either row) is reused once this completed

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
            self._stage_checked(ids, cu)
        finally:
            if pushed:
                cuda_driver.pop_context()
        return len(ids)

    def stage_checked(self, ids: tuple[int, ...]) -> None:
        """``stage`` for ids known good (a sealed plan's tuple: see ``clear_checked``)."""
        _, cu = self._streams()
        pushed = threading.get_ident() not in self._ctx_threads and self._enter()
        try:
            self._stage_checked(ids, cu)
        finally:
            if pushed:
                cuda_driver.pop_context()

    def _stage_checked(self, ids: tuple[int, ...], cu: Any) -> None:
        slot: ListSlot = self._ring.acquire()
        n = len(ids)
        packer(n + 1).pack_into(slot.host_np, 0, n, *ids)
        cuda_driver.memcpy_htod_async(self._graph_ptr, slot.host_ptr, 4 * (n + 1), cu)
        cuda_driver.event_record(slot.done, cu)
        self._copies += 1

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
        """Replay a captured clear graph over ``page_ids`` on the model stream.

        Host work: the id check, one ``struct.pack_into`` and one graph launch, whatever
        the list length: each of ``GRAPH_ROWS`` pinned rows has its own graphs, one per size
        class (16, 32, ... words, up to the list's capacity), each ``[copy the row's first
        words to its device row -> its row's event (an external event node) -> the clear
        kernel over that row, a grid for the class's longest list]``, all captured through
        the driver on a private stream at the first call (no host wait, no capture later).
        When every row is still in use, the list is staged (:meth:`stage`) and a clear-only
        graph over the static list replays it (two driver calls more). Where the per-row
        capture is refused (a launch mode other than "driver", or a driver without external
        event nodes), always the latter, through torch's capture. Raises what :meth:`stage`
        raises, before anything is enqueued.
        """
        self.graph_clear_checked(checks.page_ids(page_ids, self.num_pages))

    def graph_clear_checked(self, ids: tuple[int, ...]) -> None:
        """``graph_clear`` for ids known good (a sealed plan's tuple: see ``clear_checked``)."""
        n = len(ids)
        cu = self._cu if self._stream is not None else self._streams()[1]
        pushed = threading.get_ident() not in self._ctx_threads and self._enter()
        try:
            ring = self._graph_ring
            if ring is None and self._slot_graphs is None:
                self._slot_graphs = self._make_row_graphs()
                ring = self._graph_ring
            slot = ring.try_acquire() if ring is not None else None
            if slot is not None:
                words = n + 1
                packer(words).pack_into(slot.host_np, 0, n, *ids)
                cls = _SIZE_CLASS_MIN if words <= _SIZE_CLASS_MIN else 1 << (words - 1).bit_length()
                cuda_driver.graph_launch(slot.graphs[cls if cls <= self.capacity else 1 + self.capacity], cu)
            else:
                self._stage_checked(ids, cu)
                if self._staged_exec is None:
                    self._graph = self.capture()
                    self._staged_exec = cuda_driver.as_cugraphexec(self._graph.raw_cuda_graph_exec())
                cuda_driver.graph_launch(self._staged_exec, cu)
        finally:
            if pushed:
                cuda_driver.pop_context()
        self._clears += 1
        self._pages += n

    def _make_row_graphs(self) -> bool:
        """graph_clear's rows and their graphs (``graph_clear``), and the staged graph; False (and
        nothing kept) where the driver refuses a capture."""
        if self._fill(False).direct is None:
            return False
        with torch.cuda.device(self._device):
            ring = ListRing(torch, 1 + self.capacity, self._device, slots=GRAPH_ROWS)
            self._capture_stream = torch.cuda.Stream(self._device)
        most = 1 + self.capacity
        classes = [c for c in (1 << b for b in range(4, most.bit_length() + 1)) if c < most] + [most]
        for cls in classes:  # compile and load every shape's kernel now: nothing may load during a capture
            self._fill(False, cls - 1)
        try:
            for slot in ring.slots():
                for cls in classes:
                    slot.graphs[cls] = self._capture(functools.partial(self._row_nodes, slot, cls))
            self._staged_exec = self._capture(self._staged_nodes)
        except (CudaDriverError, RuntimeError):
            self._graphs.clear()
            for slot in ring.slots():
                slot.graphs.clear()
            return False
        self._graph_ring = ring
        return True

    def _row_nodes(self, slot: ListSlot, words: int, cs: Any) -> None:
        """Row ``slot`` -> its device row (``words`` int32), its event, the clear over that row."""
        fill = self._fill(False, words - 1)  # the shape of the class's longest list
        direct = fill.direct
        assert direct is not None
        cuda_driver.memcpy_htod_async(slot.dptr, slot.host_ptr, 4 * words, cs)
        cuda_driver.event_record_external(slot.done, cs)
        direct.set_pointer(1, slot.dptr)
        direct(fill.grid(words - 1), cs)  # (not counted as a launch: it runs on replays, never from the host)

    def _staged_nodes(self, cs: Any) -> None:
        """The clear over the static list (what :meth:`stage` put there), then count := 0."""
        direct = self._fill(False).direct
        assert direct is not None
        direct.set_pointer(1, self._graph_ptr)
        direct(self._graph_programs, cs)
        cuda_driver.memset_d32_async(self._graph_ptr, 0, 1, cs)

    def _capture(self, nodes: Callable[[Any], None]) -> Any:
        """``nodes(stream)`` captured through the driver on the private capture stream; the
        executable graph (kept alive with the backend)."""
        assert self._capture_stream is not None
        cs = cuda_driver.as_custream(self._capture_stream.cuda_stream)
        cuda_driver.stream_begin_capture(cs)
        try:
            nodes(cs)
        except BaseException:
            cuda_driver.stream_end_capture(cs, discard=True)
            raise
        graph = cuda_driver.stream_end_capture(cs)
        exe = cuda_driver.graph_instantiate(graph)
        self._graphs.append((graph, exe))
        return exe

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
        launches = sum(f.launches for f in self._fills.values())
        g = self._graph_ring
        return {"clears": self._clears, "pages": self._pages, "kernel_launches": launches,
                "by_value_launches": self._by_value, "list_copies": self._copies, "ring_slots": len(self._ring),
                "ring_grown": self._ring.grown, "graph_rows": len(g) if g is not None else 0,
                "graphs_captured": len(self._graphs)}

    def __repr__(self) -> str:
        return (f"TritonClearBackend(planes={self.num_planes}, num_pages={self.num_pages}, "
                f"unit={self.tables.unit}, shapes={[c.tag() for _, c, _ in self._shapes]!r}, ids={self.ids}, "
                f"launch={self.launch!r}, card={self.card!r})")


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

    def clear_checked(self, page_ids: tuple[int, ...]) -> None:
        """Stage a sealed plan's list (no id check: ``TritonClearBackend.stage_checked``)."""
        self.backend.stage_checked(page_ids)


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
