"""``CudaRank``: what a CUDA rank keeps from one plan to the next, made once (no per-plan lookups).

    switch      a ``StreamSwitch``: the model stream made current around a plan's enqueued
                work (copies that torch makes, poison, clear, check, a sync graph), then the
                streams as they were; a plan never runs nested in another on one rank
    copy(s, d)  one input copy on the model stream: one driver call (``cuMemcpyHtoDAsync`` /
                ``cuMemcpyDtoDAsync``) for a plain pair of tensors, torch's ``copy_`` else
    done        the completion event, recorded after the graph and awaited without blocking
                the loop (``executor.wait_cuda_event``); timed only with ``timings``
    marks       with ``timings``: start, copied, poisoned, cleared, checked (the poisoned and
                checked ones recorded in sanitize mode only); ``phases()`` reads them

Host costs that shaped this (the H200 host, 2026-12-02, median per call): torch's
``with torch.cuda.stream(s)`` 11 to 17 us (``torch.cuda.current_stream()`` alone 5 us: a
new Stream object each time), the switch here 0.5 to 1 us; ``dst.copy_(src,
non_blocking=True)`` 7 us (18 us inside torch's stream context), one driver copy 2.9 us.

A pair found plain is remembered (the last few pairs, by identity, the tensors held): the
next step's copy of the same pair re-reads only both addresses, byte counts and
contiguity (what an in-place ``resize_`` or ``set_`` could change) instead of every
property, about 2 us less on the H200 host.

The direct copy is taken for a pair of plain tensors (not subclasses) of one dtype (not
complex) and one shape, both contiguous, neither requiring grad, the destination on the
rank's device and the source on the host or on that device: exactly what ``copy_`` would
copy, byte for byte, on the same stream. Torch's pinned-memory allocator is not told of
the copy (``copy_`` records an event there): the engine waits for every plan to complete
before ``run_step`` returns, so a source is never reused while its copy runs. Anything
else goes through ``copy_`` (under the switch, so on the model stream).

``import torch`` happens here, when a CUDA rank is built: ``import kvledger.executors``
never imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["CudaRank", "StreamSwitch"]

_KNOWN_PAIRS = 16  # plain pairs remembered per rank (forgotten all at once past it)


class StreamSwitch:
    """``with switch:`` makes ``stream`` current (and its device, as ``torch.cuda.stream``
    does), then restores the current streams (and device) on exit. Not re-entrant: one
    object per user that never nests its own uses (a rank's plans, a backend's fills).

    Through torch's stream-id calls (``torch._C._cuda_getCurrentStream`` /
    ``_cuda_setStream`` / ``_cuda_getDevice``, what ``torch.cuda.set_stream`` and
    ``current_stream`` call), which make no Stream or device object per use; a torch
    without them gets its own ``torch.cuda.stream(stream)`` context instead."""

    __slots__ = ("_ids", "_index", "_get_stream", "_set_stream", "_get_device", "_ctx", "_src", "_dst")

    def __init__(self, torch: Any, stream: Any) -> None:
        self._ids = (stream.stream_id, stream.device_index, stream.device_type)
        self._index: int = stream.device_index
        self._ctx: Any = None
        self._src: Any = None
        self._dst: Any = None
        try:
            c = torch._C
            self._get_stream = c._cuda_getCurrentStream
            self._set_stream = c._cuda_setStream
            self._get_device = c._cuda_getDevice
        except AttributeError:  # (a torch without them: its own context, about 11 us a use)
            self._ctx = torch.cuda.stream(stream)

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()
            return
        dev = self._get_device()
        self._src = self._get_stream(dev)
        self._dst = None if dev == self._index else self._get_stream(self._index)
        self._set_stream(*self._ids)

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            return
        if self._dst is not None:
            self._set_stream(*self._dst)
        self._set_stream(*self._src)


class CudaRank:
    """A CUDA rank's model stream, its switch, its events and its copies (module docstring).
    ``stream`` None: the device's current stream now is the model stream."""

    __slots__ = ("stream", "index", "switch", "done", "marks", "driver_copies", "_tensor", "_cu", "_htod", "_dtod",
                 "_threads", "_known")

    def __init__(self, device: Any, stream: Any, *, sanitize: bool, timings: bool) -> None:
        import torch

        if stream is None:
            stream = torch.cuda.current_stream(device)
        self.stream = stream
        self.index: int = stream.device_index
        self.switch = StreamSwitch(torch, stream)
        self.done = torch.cuda.Event(enable_timing=timings)
        self.marks: tuple[Any, ...] | None = None
        if timings:
            self.marks = tuple(torch.cuda.Event(enable_timing=True) for _ in range(5))
        self._tensor = torch.Tensor
        self.driver_copies = 0  # input copies made by the driver (the rest went through copy_)
        self._cu: Any = None  # the model stream as a CUstream, when the driver copies can be used
        self._threads: set[int] = set()  # threads seen with the rank's context current (checked once each)
        self._known: dict[tuple[int, int], tuple[Any, Any, int, bool]] = {}  # plain pairs: (src, dst, bytes, dtod)
        try:
            from . import cuda_driver

            self._cu = cuda_driver.as_custream(stream.cuda_stream)
            self._htod = cuda_driver.memcpy_htod_async
            self._dtod = cuda_driver.memcpy_dtod_async
        except Exception:  # no cuda-python, no driver: every copy is torch's  # noqa: BLE001
            self._cu = None

    def copy_all(self, copies: Sequence[tuple[Any, Any]]) -> None:
        """Enqueue every ``(src, dst)`` copy on the model stream, in order (module docstring).
        Call it under ``switch`` (torch's copies go to the current stream)."""
        direct = self._cu is not None and self._context_ok()
        known = self._known
        for src, dst in copies:
            if direct:
                seen = known.get((id(src), id(dst)))
                if (seen is not None and seen[0] is src and seen[1] is dst and src.nbytes == seen[2] == dst.nbytes
                        and src.is_contiguous() and dst.is_contiguous()):
                    n, on_device = seen[2], seen[3]
                elif type(src) is self._tensor and type(dst) is self._tensor and self._plain(src, dst):
                    n, on_device = dst.nbytes, src.is_cuda
                    if len(known) >= _KNOWN_PAIRS:
                        known.clear()
                    known[(id(src), id(dst))] = (src, dst, n, on_device)
                else:
                    dst.copy_(src, non_blocking=True)
                    continue
                if n:
                    if on_device:
                        self._dtod(dst.data_ptr(), src.data_ptr(), n, self._cu)
                    else:
                        self._htod(dst.data_ptr(), src.data_ptr(), n, self._cu)
                    self.driver_copies += 1
            else:
                dst.copy_(src, non_blocking=True)

    def _plain(self, src: Any, dst: Any) -> bool:
        """Whether ``dst.copy_(src)`` is a byte copy the driver can make (module docstring)."""
        if not dst.is_cuda or dst.get_device() != self.index:
            return False
        dtype = dst.dtype
        if src.dtype != dtype or dtype.is_complex or src.shape != dst.shape:
            return False
        if src.requires_grad or dst.requires_grad or not (src.is_contiguous() and dst.is_contiguous()):
            return False
        if src.is_cuda:
            return src.get_device() == self.index
        return bool(src.is_cpu)

    def _context_ok(self) -> bool:
        """Whether this thread's current CUDA context is the rank's device's (checked once per
        thread; under ``switch`` torch keeps it so)."""
        me = threading.get_ident()
        if me in self._threads:
            return True
        from . import cuda_driver

        try:
            ok = cuda_driver.device_of_current_context() == self.index
        except Exception:  # noqa: BLE001  (a driver that cannot say: torch copies)
            return False
        if ok:
            self._threads.add(me)
        return ok

    def phases(self, sanitize: bool) -> tuple[float, float, float, float]:
        """``(copies_s, clear_s, graph_s, sanitize_s)`` of the plan just completed, from the marks
        (device time on the model stream); zeros without ``timings``. Call after ``done`` completed."""
        marks = self.marks
        if marks is None:
            return 0.0, 0.0, 0.0, 0.0
        start, copied, poisoned, cleared, checked = marks
        done = self.done
        copies_s = start.elapsed_time(copied) * 1e-3
        if not sanitize:
            return copies_s, copied.elapsed_time(cleared) * 1e-3, cleared.elapsed_time(done) * 1e-3, 0.0
        sanitize_s = (copied.elapsed_time(poisoned) + cleared.elapsed_time(checked)) * 1e-3
        return copies_s, poisoned.elapsed_time(cleared) * 1e-3, checked.elapsed_time(done) * 1e-3, sanitize_s
