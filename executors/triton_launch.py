"""Launching a compiled Triton kernel with as little host work as possible.

Three ways, fastest first (``launch=`` of the Triton backend):

    "driver"  cuLaunchKernel through kvledger's driver adapter, with the kernel's
              parameter block built once (ctypes values + a void* array); a launch
              changes one pointer value and makes one driver call
    "triton"  the compiled kernel's own launcher, ``compiled[grid](*args, stream=s)``
              (no argument binding or specialization per call)
    "jit"     ``kernel[grid](...)``: Triton binds, specializes and looks up the cache
              on every call

:class:`DirectLaunch` reads the parameter list from the compiled kernel
(``compiled.src.signature``: constexprs are not passed; every other parameter is
passed by address, then Triton's two scratch pointers, both null for kernels
that use no scratch). It refuses (``ConfigurationError``) kernels it cannot
launch exactly as Triton would: clusters, cooperative or PDL launches, scratch
memory, dynamic shared memory over 48 KiB, parameter types it does not know.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from ..core.errors import ConfigurationError
from . import cuda_driver

__all__ = ["DirectLaunch", "compile_kernel"]

_CTYPES = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
           "i64": ctypes.c_int64, "u1": ctypes.c_uint8, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16,
           "u32": ctypes.c_uint32, "u64": ctypes.c_uint64}


def compile_kernel(kernel: Any, args: Sequence[Any], constants: dict[str, Any], num_warps: int) -> Any:
    """Compile ``kernel`` for these arguments without launching it; return the loaded ``CompiledKernel``.

    ``args``: the runtime arguments in order (tensors for pointers); ``constants``:
    the constexprs by name. Loads the module into the current CUDA context.
    """
    compiled = kernel.warmup(*args, grid=(1,), num_warps=num_warps, **constants)
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
        compiled = compiled.result()
    compiled._init_handles()
    return compiled


class DirectLaunch:
    """One compiled kernel, launched through ``cuda_driver.launch_kernel`` with a preset parameter block.

    ``args``: every runtime argument in order (tensors or ints for pointers, ints
    for integers), as the kernel was compiled for. :meth:`set_pointer` changes a
    pointer argument (by runtime index) before a launch. ``block_from``: the runtime
    arguments from that index on (all int32) live side by side in one ctypes array,
    :attr:`block`, which a caller fills with one ``struct.pack_into`` per launch (the
    page lists that travel by value: ``triton_kernels.param_fill_kernel``).
    """

    def __init__(self, compiled: Any, args: Sequence[Any], *, block_from: int | None = None) -> None:
        md = compiled.metadata
        unsupported = [
            what for what, bad in (
                ("clusters", getattr(md, "num_ctas", 1) != 1),
                ("global scratch", getattr(md, "global_scratch_size", 0)),
                ("profile scratch", getattr(md, "profile_scratch_size", 0)),
                ("cooperative grid", getattr(md, "launch_cooperative_grid", False)),
                ("PDL", getattr(md, "launch_pdl", False)),
                ("shared memory over 48 KiB", md.shared > 48 * 1024),
            ) if bad
        ]
        if unsupported:
            raise ConfigurationError(f"kernel {compiled.name} needs {', '.join(unsupported)}: no direct launch")
        names = list(compiled.src.fn.arg_names)
        sig = compiled.src.signature
        runtime = [n for n in names if sig[n] != "constexpr"]
        if len(runtime) != len(args):
            raise ConfigurationError(f"kernel {compiled.name} takes {len(runtime)} runtime arguments "
                                     f"({runtime}), got {len(args)}")
        cut = len(runtime) if block_from is None else block_from
        self._values: list[Any] = [_cvalue(sig[n], a, n) for n, a in zip(runtime[:cut], args[:cut], strict=True)]
        tail = runtime[cut:]
        if any(sig[n] != "i32" for n in tail):
            raise ConfigurationError(f"kernel {compiled.name}: the block arguments must all be int32, got "
                                     f"{[sig[n] for n in tail]}")
        self.block = (ctypes.c_int32 * max(1, len(tail)))(*[int(a) for a in args[cut:]])
        addrs = [ctypes.addressof(v) for v in self._values]
        addrs += [ctypes.addressof(self.block) + 4 * i for i in range(len(tail))]
        self._scratch = [ctypes.c_uint64(0), ctypes.c_uint64(0)]  # global_scratch, profile_scratch
        addrs += [ctypes.addressof(v) for v in self._scratch]
        self._array = (ctypes.c_void_p * len(addrs))(*addrs)
        self.params = ctypes.addressof(self._array)
        self.function = cuda_driver.as_cufunction(compiled.function)
        self.threads = 32 * md.num_warps
        self.shared = int(md.shared)
        self.name = compiled.name

    def set_pointer(self, index: int, ptr: int) -> None:
        """Runtime argument ``index`` (a pointer) := ``ptr`` for the following launches."""
        self._values[index].value = ptr

    def __call__(self, grid: int, stream: Any) -> None:
        """Enqueue one launch of ``grid`` programs on ``stream`` (a CUstream)."""
        cuda_driver.launch_kernel(self.function, grid, self.threads, self.shared, stream, self.params)


def _cvalue(ty: str, arg: Any, name: str) -> Any:
    if ty.startswith("*"):
        ptr = arg.data_ptr() if hasattr(arg, "data_ptr") else arg
        return ctypes.c_uint64(int(ptr))
    cls = _CTYPES.get(ty)
    if cls is None:
        raise ConfigurationError(f"argument {name}: type {ty!r} cannot be launched directly")
    return cls(int(arg))
