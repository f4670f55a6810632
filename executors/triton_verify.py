"""The sanitizer's check on CUDA planes: one ``verify_pages_kernel`` launch per step.

    start(cleared, committed), on the model stream:
        pack [nc, nk, cleared..., committed...] into a pinned row (ring slot)
        H2D copy of the lists             -> the slot's device row
        result count := 0                 (cuMemsetD32Async)
        verify_pages_kernel               one task per (listed page, plane); a violating
                                          task appends (plane, page, kind) with one atomic
        D2H copy of the result            [count, up to MAX_OUT triples] -> pinned row
        event                             the SanitizerCheck waits on it

Each slot of the ring (``page_lists.ListRing``) holds the lists and, behind them
at a 16-byte aligned offset, the result. Decode a check (``result()``) before
starting the one after next on the same verifier: a slot is reused once its
event completed, and its result region is overwritten by the next use's copy.
The kernel's tables are in bytes (plane base - anchor, page stride, page
length); with every one a multiple of 8 it reads 8-byte words, else bytes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ..core import checks
from . import cuda_driver
from .cuda_planes import describe_planes
from .page_lists import ListRing
from .sanitize import SanitizerCheck, decode_triples
from .triton_kernels import VERIFY_BLOCK, verify_pages_kernel
from .triton_launch import DirectLaunch, compile_kernel

__all__ = ["MAX_OUT", "TritonVerifier"]

MAX_OUT = 256  # violations returned per check (the count says how many the device found)


class TritonVerifier:
    """The sanitizer's device check over CUDA ``planes`` (module docstring).

    ``stream``: the model stream (a torch stream) or None for torch's current
    stream at each call; ``launch``: "driver" (cuLaunchKernel with a preset
    parameter block; the default, or ``$KVLEDGER_TRITON_LAUNCH``) or anything else
    for Triton's own launcher. Raises
    ConfigurationError for planes the backends refuse.
    """

    def __init__(self, planes: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None, *,
                 launch: str | None = None) -> None:
        layout = describe_planes(planes)
        self.planes = tuple(planes)
        self.num_pages = layout.num_pages
        self.num_planes = len(layout.ptrs)
        dev = self._device = torch.device("cuda", layout.device)
        self._stream = stream
        anchor = self._anchor = self.planes[0].reshape(-1).view(torch.uint8)
        base = int(anchor.data_ptr())
        deltas = [p - base for p in layout.ptrs]
        self._wide = all(v % 8 == 0 for v in (base, *layout.ptrs, *layout.page_bytes))
        self._tables = [torch.tensor(v, dtype=torch.int64, device=dev)
                        for v in (deltas, list(layout.page_bytes), list(layout.page_bytes))]
        self._result_at = -(-(2 + 2 * self.num_pages) // 4) * 4  # words; 16-byte aligned
        self._result_words = 1 + 3 * MAX_OUT
        with torch.cuda.device(dev):
            self._ring = ListRing(torch, self._result_at + self._result_words, dev, slots=2)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self._max_programs = 8 * sms
        slot = self._ring.acquire()
        slot.used = False
        self._args: list[Any] = [anchor, slot.device, *self._tables, self.num_planes,
                                 slot.device[self._result_at:], MAX_OUT]
        self._consts = {"WIDE": self._wide, "BLOCK": VERIFY_BLOCK}
        with torch.cuda.device(dev):
            self._compiled = compile_kernel(verify_pages_kernel, self._args, self._consts, 4)
        launch = launch or os.environ.get("KVLEDGER_TRITON_LAUNCH", "driver")
        self._direct = DirectLaunch(self._compiled, self._args) if launch == "driver" else None
        torch.cuda.synchronize(dev)
        self.checks = 0

    def start(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        """Enqueue the check of ``cleared_ids`` (all zero) and ``committed_ids`` (no poison); see the module.

        Validates both lists (``kvledger.core.checks.page_ids``) before enqueuing
        anything. Returns a :class:`SanitizerCheck` waitable like a CUDA event.
        """
        cleared = checks.page_ids(cleared_ids, self.num_pages)
        committed = checks.page_ids(committed_ids, self.num_pages)
        if not cleared and not committed:
            return SanitizerCheck.done()
        stream = self._stream if self._stream is not None else torch.cuda.current_stream(self._device)
        cu = cuda_driver.as_custream(stream.cuda_stream)
        pushed = cuda_driver.device_of_current_context() != self._device.index
        if pushed:
            cuda_driver.push_primary_context(self._device.index)
        try:
            slot = self._ring.acquire()
            nbytes = ListRing.pack2(slot, cleared, committed)
            out = slot.dptr + 4 * self._result_at
            cuda_driver.memcpy_htod_async(slot.dptr, slot.host_ptr, nbytes, cu)
            cuda_driver.memset_d32_async(out, 0, 1, cu)
            grid = max(1, min((len(cleared) + len(committed)) * self.num_planes, self._max_programs))
            self._launch(slot.device, slot.dptr, out, grid, stream, cu)
            cuda_driver.memcpy_dtoh_async(slot.host_ptr + 4 * self._result_at, out, 4 * self._result_words, cu)
            cuda_driver.event_record(slot.done, cu)
        finally:
            if pushed:
                cuda_driver.pop_context()
        self.checks += 1
        done, at, words = slot.done, self._result_at, self._result_words
        host = slot.host_np
        return SanitizerCheck(lambda: cuda_driver.event_query(done), lambda: cuda_driver.event_synchronize(done),
                              lambda: decode_triples(host[at:at + words].tolist(), MAX_OUT))

    def _launch(self, lists: torch.Tensor, lists_ptr: int, out_ptr: int, grid: int, stream: Any, cu: Any) -> None:
        direct = self._direct
        if direct is not None:
            direct.set_pointer(1, lists_ptr)
            direct.set_pointer(6, out_ptr)
            direct(grid, cu)
            return
        args = self._args
        args[1] = lists_ptr
        args[6] = out_ptr
        with torch.cuda.device(self._device):
            self._compiled[(grid, 1, 1)](*args, *self._consts.values(), stream=int(cu))
