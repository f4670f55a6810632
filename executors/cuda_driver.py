"""The one adapter between kvledger and the CUDA driver API (one piece: every driver call
kvledger makes, checked the same way in one place; splitting it would split that rule).

Every driver call kvledger makes (``cuda.bindings.driver`` from cuda-python)
goes through a function of this module, and nowhere else. Each function checks
the ``CUresult`` the binding hands back and turns anything but ``CUDA_SUCCESS``
into a :class:`CudaDriverError` that names the call, the result code and the
arguments that matter; a binding that cannot reach the driver at all (no
``libcuda``) is reported the same way, with ``code=None``.

    backend / allocator ──► cuda_driver.<function> ──► cuda.bindings.driver.cuXxx
                                   │
                          CUresult != SUCCESS ──► CudaDriverError(call, code, name)

The binding is imported on first use, never at import time, so this module can
be imported (and its errors caught) on a machine without CUDA. Missing
cuda-python raises :class:`CudaUnavailableError`.

Hot calls (the ones a clear makes every step: copies, launches, events, stream
waits, memsets) can go straight to ``libcuda`` through ctypes
(``KVLEDGER_CUDA_CTYPES=1``, :mod:`cuda_direct`; off by default: it measured
slower than the binding on the H200); their results are checked the same way.
Handles may be cuda-python objects or raw ints.

What a failure leaves behind: a failed call changed nothing the driver reports
as changed, except where the CUDA documentation says an error is sticky (an
illegal address inside a kernel poisons the context); such errors surface at the
next checked call with their own code.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from ..core.errors import CudaDriverError, CudaUnavailableError

__all__ = [
    "address_free",
    "address_reserve",
    "allocation_granularity",
    "as_cufunction",
    "as_cugraphexec",
    "as_custream",
    "device_of_current_context",
    "driver",
    "event_create",
    "event_query",
    "event_record",
    "event_record_external",
    "event_synchronize",
    "graph_instantiate",
    "graph_launch",
    "launch_kernel",
    "mem_create",
    "mem_map",
    "mem_release",
    "mem_unmap",
    "host_device_pointer",
    "memcpy_dtod_async",
    "memcpy_dtoh_async",
    "memcpy_htod_async",
    "memset_d32_async",
    "memset_d8_async",
    "pop_context",
    "push_primary_context",
    "set_access",
    "stream_begin_capture",
    "stream_end_capture",
    "stream_synchronize",
    "stream_wait_event",
]

_D: Any = None  # the cuda.bindings.driver module, once loaded
_INIT_LOCK = threading.Lock()
_initialised = False


def driver() -> Any:
    """The ``cuda.bindings.driver`` module, loaded (and ``cuInit`` called) once.

    Raises CudaUnavailableError without cuda-python, CudaDriverError when
    ``cuInit`` fails (no driver, no device). Nothing is left half-initialised.
    """
    global _D, _initialised
    if _initialised:
        return _D
    with _INIT_LOCK:
        if _initialised:
            return _D
        try:
            from cuda.bindings import driver as mod  # cuda-python >= 12.6
        except ImportError:
            try:
                from cuda import cuda as mod  # older cuda-python layout
            except ImportError as exc:
                raise CudaUnavailableError(
                    "import cuda.bindings.driver", None, "ImportError",
                    f"install cuda-python (pip install 'kvledger[cuda]'): {exc}",
                ) from None
        _call_checked(mod, "cuInit", mod.cuInit, 0)
        _D = mod
        _initialised = True
        return _D


_C: Any = None  # libcuda's hot functions through ctypes (cuda_direct.load), False when off or unavailable
_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_EVENT_RECORD_EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


def _direct() -> Any:
    """libcuda's hot functions with ctypes argument types, or False (not asked for, or not loadable)."""
    global _C
    if _C is None:
        driver()  # cuInit first, through the binding
        from .cuda_direct import load

        _C = load() or False
    return _C


def _h(handle: Any) -> int:
    """The raw value of a handle (a cuda-python CUstream / CUevent / ... or an int)."""
    return handle if type(handle) is int else int(handle)


def _fail_code(call: str, code: int, detail: str) -> CudaDriverError:
    d = _D if _initialised else driver()
    try:
        return _fail(call, d.CUresult(code), detail)
    except ValueError:
        return CudaDriverError(call, code, "CUresult", detail)


def _fail(call: str, err: Any, detail: str) -> CudaDriverError:
    try:
        name = err.name
    except AttributeError:
        name = "CUresult"
    return CudaDriverError(call, int(err), name, detail)


def _call_checked(mod: Any, call: str, fn: Callable[..., Any], *args: Any, detail: str = "") -> Any:
    """Call ``fn(*args)``; check its CUresult; return the remaining outputs.

    One output -> that value; none -> None; several -> a tuple.
    """
    try:
        res = fn(*args)
    except RuntimeError as exc:  # the binding could not load libcuda / the symbol
        raise CudaDriverError(call, None, "RuntimeError", str(exc)) from None
    err = res[0]
    if err:
        raise _fail(call, err, detail)
    n = len(res)
    if n == 1:
        return None
    if n == 2:
        return res[1]
    return res[1:]


def _checked(call: str, *args: Any, detail: str = "") -> Any:
    d = _D if _initialised else driver()
    return _call_checked(d, call, getattr(d, call), *args, detail=detail)


# --------------------------------------------------------------------------- streams, contexts

def as_custream(handle: int) -> Any:
    """A ``CUstream`` for a raw stream handle (an int such as ``torch.cuda.Stream.cuda_stream``)."""
    d = _D if _initialised else driver()
    return d.CUstream(int(handle))


def device_of_current_context() -> int | None:
    """The device ordinal of this thread's current context, or None when it has none."""
    d = _D if _initialised else driver()
    c = _C if _C is not None else _direct()
    if c:
        dev = ctypes.c_int()
        code = c.ctx_get_device(ctypes.byref(dev))
        if code == _INVALID_CONTEXT:
            return None
        if code:
            raise _fail_code("cuCtxGetDevice", code, "")
        return dev.value
    try:
        err, dev = d.cuCtxGetDevice()
    except RuntimeError as exc:
        raise CudaDriverError("cuCtxGetDevice", None, "RuntimeError", str(exc)) from None
    if err:
        if err == d.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            return None
        raise _fail("cuCtxGetDevice", err, "")
    return int(dev)


def push_primary_context(device: int) -> None:
    """Make ``device``'s primary context current on this thread (pop it with :func:`pop_context`).

    The primary context is the one PyTorch and the runtime API use; retaining it
    here keeps it alive for the process (it is never released by kvledger).
    """
    dev = _checked("cuDeviceGet", int(device), detail=f"ordinal={device}")
    ctx = _checked("cuDevicePrimaryCtxRetain", dev, detail=f"device={device}")
    _checked("cuCtxPushCurrent", ctx, detail=f"device={device}")


def pop_context() -> None:
    """Pop the context :func:`push_primary_context` pushed."""
    _checked("cuCtxPopCurrent")


def stream_synchronize(stream: Any) -> None:
    """Block until every operation enqueued on ``stream`` (a CUstream) has finished."""
    _checked("cuStreamSynchronize", stream)


# --------------------------------------------------------------------------- events (hot path: no per-call lookups)

def event_create() -> Any:
    """A new ``CUevent`` without timing (``CU_EVENT_DISABLE_TIMING``): the cheapest to record and query."""
    d = _D if _initialised else driver()
    return _checked("cuEventCreate", d.CUevent_flags.CU_EVENT_DISABLE_TIMING)


def event_record(event: Any, stream: Any) -> None:
    """Enqueue ``event`` on ``stream`` (a CUstream); it completes when the work before it has."""
    c = _C if _C is not None else _direct()
    if c:
        code = c.event_record(_h(event), _h(stream))
        if code:
            raise _fail_code("cuEventRecord", code, "")
        return
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuEventRecord(event, stream)
    except RuntimeError as exc:
        raise CudaDriverError("cuEventRecord", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuEventRecord", err, "")


def event_query(event: Any) -> bool:
    """True when ``event`` has completed (or was never recorded); False while work before it runs.

    Never blocks. Raises CudaDriverError for any other result (a sticky error of the context).
    """
    c = _C if _C is not None else _direct()
    if c:
        code = c.event_query(_h(event))
        if not code:
            return True
        if code == _NOT_READY:
            return False
        raise _fail_code("cuEventQuery", code, "")
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuEventQuery(event)
    except RuntimeError as exc:
        raise CudaDriverError("cuEventQuery", None, "RuntimeError", str(exc)) from None
    if not err:
        return True
    if err == d.CUresult.CUDA_ERROR_NOT_READY:
        return False
    raise _fail("cuEventQuery", err, "")


def event_synchronize(event: Any) -> None:
    """Block the calling thread until ``event`` has completed (never call it on an event loop)."""
    _checked("cuEventSynchronize", event)


def stream_wait_event(stream: Any, event: Any) -> None:
    """Make later work on ``stream`` wait for ``event`` on the device (the host does not wait)."""
    c = _C if _C is not None else _direct()
    if c:
        code = c.stream_wait(_h(stream), _h(event), 0)
        if code:
            raise _fail_code("cuStreamWaitEvent", code, "")
        return
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuStreamWaitEvent(stream, event, 0)
    except RuntimeError as exc:
        raise CudaDriverError("cuStreamWaitEvent", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuStreamWaitEvent", err, "")


# --------------------------------------------------------------------------- launches

def as_cufunction(handle: int) -> Any:
    """A ``CUfunction`` for a raw function handle (an int, e.g. a compiled Triton kernel's ``function``)."""
    d = _D if _initialised else driver()
    return d.CUfunction(int(handle))


def as_cugraphexec(handle: int) -> Any:
    """A ``CUgraphExec`` for a raw executable-graph handle (``torch.cuda.CUDAGraph.raw_cuda_graph_exec()``)."""
    d = _D if _initialised else driver()
    return d.CUgraphExec(int(handle))


def launch_kernel(function: Any, grid: int, threads: int, shared: int, stream: Any, params: int) -> None:
    """Enqueue ``function`` on ``stream``: ``grid`` x 1 x 1 blocks of ``threads`` threads.

    ``params`` is the address of a ``void*[]`` holding one pointer per kernel
    parameter (the driver copies the values at the call, so the caller may change
    them afterwards). Raises CudaDriverError when the driver refuses the launch;
    nothing is enqueued then.
    """
    c = _C if _C is not None else _direct()
    if c:
        code = c.launch(_h(function), grid, 1, 1, threads, 1, 1, shared, _h(stream), params, None)
        if code:
            raise _fail_code("cuLaunchKernel", code, f"grid={grid} threads={threads} shared={shared}")
        return
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuLaunchKernel(function, grid, 1, 1, threads, 1, 1, shared, stream, params, 0)
    except RuntimeError as exc:
        raise CudaDriverError("cuLaunchKernel", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuLaunchKernel", err, f"grid={grid} threads={threads} shared={shared}")


def stream_begin_capture(stream: Any) -> None:
    """Begin capturing ``stream`` (a CUstream) into a graph, thread-local mode: work enqueued on it
    is recorded, not run, until :func:`stream_end_capture`; other threads are not affected."""
    d = _D if _initialised else driver()
    _checked("cuStreamBeginCapture", stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)


def stream_end_capture(stream: Any, *, discard: bool = False) -> Any:
    """End the capture of ``stream``; the captured ``CUgraph``. ``discard``: after a failure inside
    the capture, end it and drop what it holds, raising nothing."""
    if discard:
        d = _D if _initialised else driver()
        try:
            err, graph = d.cuStreamEndCapture(stream)
            if not err and graph:
                d.cuGraphDestroy(graph)
        except Exception:  # noqa: BLE001  (already failing: the first error is the one to report)
            pass
        return None
    return _checked("cuStreamEndCapture", stream)


def graph_instantiate(graph: Any) -> Any:
    """An executable graph (``CUgraphExec``) for a captured ``CUgraph``."""
    return _checked("cuGraphInstantiate", graph, 0)


def event_record_external(event: Any, stream: Any) -> None:
    """Inside a stream capture: an event record node for ``event`` (``CU_EVENT_RECORD_EXTERNAL``),
    so that each replay of the graph records it where the capture put it (a plain record there
    only orders the capture's own streams)."""
    _checked("cuEventRecordWithFlags", event, stream, _EVENT_RECORD_EXTERNAL)


def graph_launch(graph_exec: Any, stream: Any) -> None:
    """Enqueue one replay of an executable graph (a ``CUgraphExec``) on ``stream``."""
    c = _C if _C is not None else _direct()
    if c:
        code = c.graph_launch(_h(graph_exec), _h(stream))
        if code:
            raise _fail_code("cuGraphLaunch", code, "")
        return
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuGraphLaunch(graph_exec, stream)
    except RuntimeError as exc:
        raise CudaDriverError("cuGraphLaunch", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuGraphLaunch", err, "")


# --------------------------------------------------------------------------- memory operations

def memset_d8_async(dptr: int, value: int, nbytes: int, stream: Any) -> None:
    """Enqueue ``cuMemsetD8Async(dptr, value, nbytes, stream)``; raise CudaDriverError on failure.

    Hot path: no argument checks beyond the driver's own. ``stream`` should be a
    ``CUstream`` (see :func:`as_custream`) so the binding does not convert it per call.
    """
    c = _C if _C is not None else _direct()
    if c:
        code = c.memset_d8(dptr, value, nbytes, _h(stream))
        if code:
            raise _fail_code("cuMemsetD8Async", code, f"dptr=0x{dptr:x} nbytes={nbytes}")
        return
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuMemsetD8Async(dptr, value, nbytes, stream)
    except RuntimeError as exc:
        raise CudaDriverError("cuMemsetD8Async", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuMemsetD8Async", err, f"dptr=0x{dptr:x} nbytes={nbytes}")


def memset_d32_async(dptr: int, value: int, count: int, stream: Any) -> None:
    """Enqueue ``cuMemsetD32Async``: ``count`` 32-bit words at ``dptr`` (4-byte aligned) set to ``value``."""
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuMemsetD32Async(dptr, value, count, stream)
    except RuntimeError as exc:
        raise CudaDriverError("cuMemsetD32Async", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuMemsetD32Async", err, f"dptr=0x{dptr:x} count={count}")


def memcpy_dtoh_async(host_ptr: int, dptr: int, nbytes: int, stream: Any) -> None:
    """Enqueue a device-to-host copy of ``nbytes`` into ``host_ptr`` (pinned, or the copy is synchronous)."""
    c = _C if _C is not None else _direct()
    if c:
        code = c.memcpy_dtoh(host_ptr, dptr, nbytes, _h(stream))
        if code:
            raise _fail_code("cuMemcpyDtoHAsync", code, f"dptr=0x{dptr:x} nbytes={nbytes}")
        return
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuMemcpyDtoHAsync(host_ptr, dptr, nbytes, stream)
    except RuntimeError as exc:
        raise CudaDriverError("cuMemcpyDtoHAsync", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuMemcpyDtoHAsync", err, f"dptr=0x{dptr:x} nbytes={nbytes}")


def memcpy_htod_async(dptr: int, host_ptr: int, nbytes: int, stream: Any) -> None:
    """Enqueue a host-to-device copy of ``nbytes`` from ``host_ptr`` (pinned for true asynchrony)."""
    c = _C if _C is not None else _direct()
    if c:
        code = c.memcpy_htod(dptr, host_ptr, nbytes, _h(stream))
        if code:
            raise _fail_code("cuMemcpyHtoDAsync", code, f"dptr=0x{dptr:x} nbytes={nbytes}")
        return
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuMemcpyHtoDAsync(dptr, host_ptr, nbytes, stream)
    except RuntimeError as exc:
        raise CudaDriverError("cuMemcpyHtoDAsync", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuMemcpyHtoDAsync", err, f"dptr=0x{dptr:x} nbytes={nbytes}")


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: Any) -> None:
    """Enqueue a device-to-device copy of ``nbytes`` from ``src`` to ``dst`` (unified addresses)."""
    d = _D if _initialised else driver()
    try:
        (err,) = d.cuMemcpyDtoDAsync(dst, src, nbytes, stream)
    except RuntimeError as exc:
        raise CudaDriverError("cuMemcpyDtoDAsync", None, "RuntimeError", str(exc)) from None
    if err:
        raise _fail("cuMemcpyDtoDAsync", err, f"dst=0x{dst:x} src=0x{src:x} nbytes={nbytes}")


def host_device_pointer(host_ptr: int) -> int | None:
    """The address at which kernels read the pinned host memory at ``host_ptr``
    (``cuMemHostGetDevicePointer``; with unified addressing the same value), or None when
    the driver says it has none there (memory that is not pinned, or not mapped)."""
    d = _D if _initialised else driver()
    try:
        err, dptr = d.cuMemHostGetDevicePointer(host_ptr, 0)
    except RuntimeError:
        return None
    return None if err else int(dptr)


# --------------------------------------------------------------------------- virtual memory management

def _device_prop(device: int) -> Any:
    d = _D if _initialised else driver()
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(device)
    prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    return prop


def allocation_granularity(device: int) -> int:
    """The minimum physical-allocation granularity of ``device`` in bytes (2 MiB on an H200)."""
    d = _D if _initialised else driver()
    flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_checked("cuMemGetAllocationGranularity", _device_prop(device), flag,
                        detail=f"device={device}"))


def mem_create(size: int, device: int) -> Any:
    """Create ``size`` bytes of physical memory on ``device``; returns the allocation handle.

    ``size`` must be a multiple of :func:`allocation_granularity` (the driver says
    CUDA_ERROR_INVALID_VALUE otherwise). Release it with :func:`mem_release`.
    """
    return _checked("cuMemCreate", int(size), _device_prop(device), 0,
                    detail=f"size={size} device={device}")


def mem_release(handle: Any) -> None:
    """Release a handle from :func:`mem_create` (memory is freed once its last mapping goes)."""
    _checked("cuMemRelease", handle)


def address_reserve(size: int, alignment: int = 0) -> int:
    """Reserve ``size`` bytes of device virtual address space; returns the base address."""
    ptr = _checked("cuMemAddressReserve", int(size), int(alignment), 0, 0,
                   detail=f"size={size} alignment={alignment}")
    return int(ptr)


def address_free(ptr: int, size: int) -> None:
    """Give back a reservation made by :func:`address_reserve` (it must be unmapped)."""
    _checked("cuMemAddressFree", int(ptr), int(size), detail=f"ptr=0x{ptr:x} size={size}")


def mem_map(ptr: int, size: int, offset: int, handle: Any) -> None:
    """Map ``size`` bytes of ``handle`` starting at ``offset`` at virtual address ``ptr``."""
    _checked("cuMemMap", int(ptr), int(size), int(offset), handle, 0,
             detail=f"ptr=0x{ptr:x} size={size} offset={offset}")


def mem_unmap(ptr: int, size: int) -> None:
    """Unmap ``size`` bytes at ``ptr`` (a whole range mapped by :func:`mem_map` calls)."""
    _checked("cuMemUnmap", int(ptr), int(size), detail=f"ptr=0x{ptr:x} size={size}")


def set_access(ptr: int, size: int, device: int) -> None:
    """Grant ``device`` read-write access to the mapped range ``[ptr, ptr + size)``."""
    d = _D if _initialised else driver()
    desc = d.CUmemAccessDesc()
    desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = int(device)
    desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _checked("cuMemSetAccess", int(ptr), int(size), [desc], 1,
             detail=f"ptr=0x{ptr:x} size={size} device={device}")
