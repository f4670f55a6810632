"""libcuda's hot functions through ctypes, for :mod:`kvledger.executors.cuda_driver` only.

An opt-in (``KVLEDGER_CUDA_CTYPES=1``): the few calls a clear makes every step,
loaded from ``libcuda.so.1`` with fixed argument types (the symbols ``cuda.h``
maps the API names to: ``cuMemcpyHtoDAsync`` is ``cuMemcpyHtoDAsync_v2``, ...).
``cuda_driver`` calls them and checks each ``CUresult`` exactly as it checks the
binding's. Off by default because it measured slower than cuda-python 13.3's
binding on the H200 host (2026-12-01, fresh processes, medians of 300 calls:
cuLaunchKernel 6.4 vs 4.8 us, cuMemcpyHtoDAsync 2.6 vs 2.2 us, a 16-id Triton
clear 19.5 vs 14.7 us): ctypes' argument conversion and GIL release cost more
than the binding's Cython wrappers. Kept for bindings or hosts where that turns
around. Not set, a missing library or a missing symbol: ``load()`` returns None
and every call goes through the binding.
"""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace
from typing import Any

__all__ = ["load"]


def load() -> SimpleNamespace | None:
    """The functions, or None when they cannot (or must not) be used here."""
    if os.environ.get("KVLEDGER_CUDA_CTYPES", "0") != "1":
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u64, u32, size, vp = ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p

    def fn(name: str, *argtypes: Any) -> Any:
        f = getattr(lib, name)
        f.argtypes = argtypes
        f.restype = ctypes.c_int
        return f

    try:
        return SimpleNamespace(
            memcpy_htod=fn("cuMemcpyHtoDAsync_v2", u64, vp, size, vp),
            memcpy_dtoh=fn("cuMemcpyDtoHAsync_v2", vp, u64, size, vp),
            memset_d8=fn("cuMemsetD8Async", u64, ctypes.c_ubyte, size, vp),
            launch=fn("cuLaunchKernel", vp, u32, u32, u32, u32, u32, u32, u32, vp, vp, vp),
            event_record=fn("cuEventRecord", vp, vp),
            event_query=fn("cuEventQuery", vp),
            stream_wait=fn("cuStreamWaitEvent", vp, vp, u32),
            graph_launch=fn("cuGraphLaunch", vp, vp),
            ctx_get_device=fn("cuCtxGetDevice", ctypes.POINTER(ctypes.c_int)),
        )
    except AttributeError:  # a libcuda without one of these symbols: use the binding
        return None
