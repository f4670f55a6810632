"""Cache planes on CUDA virtual memory, with snapshot rows aliasing the same physical pages.

A hybrid model keeps recurrent-state snapshots in *rows* that alias KV pages:
the row is a second virtual address range mapped onto the physical memory of
some pages. Writing through a row writes those pages; releasing the snapshot
(and unmapping the row) leaves the bytes there. This module builds exactly that
with the driver's VMM API (every call through :mod:`kvledger.executors.cuda_driver`)::

    plane k, physical chunks (cuMemCreate, G bytes each; G = 2 MiB on an H200)
        [ chunk 0 ][ chunk 1 ][ chunk 2 ][ chunk 3 ] ...
    plane k, virtual range (cuMemAddressReserve; cuMemMap each chunk in order)
        [ p0 p1 ... | ...             | ...         | ...   p(n-1) ]
    snapshot row of plane k (a second reservation; cuMemMap chunks 1..2 again)
                    [ ...           | ...         ]   same bytes, second address

Rows map whole chunks, so a row covers pages ``[first, first + count)`` where
both bounds are multiples of :attr:`VmmCachePlanes.row_pages` (the smallest page
count that is a whole number of chunks in every plane). Planes and rows are
exposed as torch tensors through ``__cuda_array_interface__`` (no copy).

Lifetime: :meth:`VmmCachePlanes.unmap_rows` and :meth:`VmmCachePlanes.close`
synchronize the device, then unmap, release and free; tensors made from the
unmapped ranges must not be used afterwards (as after ``cudaFree``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..core.errors import ConfigurationError, InvalidArgumentError
from . import cuda_driver

__all__ = ["AliasRows", "DeviceRange", "VmmCachePlanes"]


class DeviceRange:
    """``nbytes`` of device memory at ``ptr``, exported as a byte array (``__cuda_array_interface__``)."""

    __slots__ = ("ptr", "nbytes")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        """A uint8 tensor over the range (shares memory; keeps this object alive)."""
        t = torch.as_tensor(self, device=device)
        if t.data_ptr() != self.ptr or t.numel() != self.nbytes:
            raise ConfigurationError(f"torch did not wrap device range 0x{self.ptr:x} (+{self.nbytes}) in place")
        return t

    def __repr__(self) -> str:
        return f"DeviceRange(0x{self.ptr:x}, {self.nbytes})"


class _Mapping:
    """One reserved virtual range and the chunks mapped into it (in order)."""

    __slots__ = ("ptr", "size", "mapped")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size
        self.mapped = 0  # chunks mapped so far, each granularity bytes


class AliasRows:
    """The snapshot rows of pages ``[first_page, first_page + num_pages)``: one alias range per plane.

    ``tensors[k]`` views plane k's row through its alias address, shaped like
    the plane (``[num_pages, ...]``, same dtype); ``ptrs[k]`` is that address.
    """

    __slots__ = ("first_page", "num_pages", "ptrs", "tensors", "mappings", "live")

    def __init__(self, first_page: int, num_pages: int, mappings: list[_Mapping],
                 tensors: Sequence[torch.Tensor]) -> None:
        self.first_page = first_page
        self.num_pages = num_pages
        self.mappings = mappings  # the driver mappings behind ptrs (the planes that made them unmap them)
        self.ptrs = tuple(m.ptr for m in mappings)
        self.tensors = tuple(tensors)
        self.live = True

    @property
    def page_ids(self) -> range:
        return range(self.first_page, self.first_page + self.num_pages)

    def __repr__(self) -> str:
        last = self.first_page + self.num_pages - 1
        return f"AliasRows(pages {self.first_page}..{last}, planes={len(self.ptrs)}, live={self.live})"


class VmmCachePlanes:
    """Cache planes backed by ``cuMemCreate`` chunks, plus alias rows onto the same chunks.

    ``num_pages`` pages; ``page_bytes[k]`` bytes per page in plane k; ``dtypes``
    (one dtype for all planes, or one per plane; default uint8) is how
    :attr:`planes` present the bytes. ``device``: CUDA ordinal (default torch's
    current device).

    Raises ConfigurationError for a bad layout, CudaUnavailableError without
    cuda-python, CudaDriverError when a driver call fails; on any failure
    everything mapped or created so far is unmapped and released again.
    """

    def __init__(self, num_pages: int, page_bytes: Sequence[int], *,
                 dtypes: torch.dtype | Sequence[torch.dtype] = torch.uint8, device: int | None = None) -> None:
        if type(num_pages) is not int or num_pages < 1:
            raise ConfigurationError(f"num_pages must be a positive int, got {num_pages!r}")
        page_bytes = tuple(page_bytes)
        if not page_bytes or any(type(b) is not int or b < 1 for b in page_bytes):
            raise ConfigurationError(f"page_bytes must be positive ints, one per plane, got {page_bytes!r}")
        if isinstance(dtypes, torch.dtype):
            dtypes = (dtypes,) * len(page_bytes)
        dtypes = tuple(dtypes)
        if len(dtypes) != len(page_bytes):
            raise ConfigurationError(f"{len(dtypes)} dtypes for {len(page_bytes)} planes")
        for k, (pb, dt) in enumerate(zip(page_bytes, dtypes, strict=True)):
            size = torch.empty((), dtype=dt).element_size()
            if pb % size:
                raise ConfigurationError(f"plane {k}: {pb} bytes per page is not a whole number of {dt}")
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", int(device))
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.cuda.current_stream(self.device)  # the primary context is current on this thread
            cuda_driver.driver()
            self.granularity = cuda_driver.allocation_granularity(self.device.index)
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.dtypes = dtypes
        g = self.granularity
        self.row_pages = math.lcm(*(g // math.gcd(g, pb) for pb in page_bytes))
        self._handles: list[list] = []  # per plane, the chunk handles in address order
        self._planes: list[_Mapping] = []
        self._rows: list[AliasRows] = []
        self._closed = False
        tensors = []
        try:
            with torch.cuda.device(self.device):
                for pb, dt in zip(page_bytes, dtypes, strict=True):
                    size = num_pages * pb
                    chunks = -(-size // g)
                    handles: list = []
                    self._handles.append(handles)
                    m = _Mapping(cuda_driver.address_reserve(chunks * g, g), chunks * g)
                    self._planes.append(m)
                    for _ in range(chunks):
                        handles.append(cuda_driver.mem_create(g, self.device.index))
                    self._map_chunks(m, handles)
                    tensors.append(self._wrap(m.ptr, num_pages, pb, dt))
        except BaseException:
            self.close()
            raise
        self.planes = tuple(tensors)

    # ------------------------------------------------------------------ internals

    def _map_chunks(self, m: _Mapping, handles: Sequence) -> None:
        g = self.granularity
        dev = self.device.index
        for h in handles:
            cuda_driver.mem_map(m.ptr + m.mapped * g, g, 0, h)
            m.mapped += 1
            cuda_driver.set_access(m.ptr + (m.mapped - 1) * g, g, dev)

    def _unmap(self, m: _Mapping) -> None:
        g = self.granularity
        while m.mapped:
            cuda_driver.mem_unmap(m.ptr + (m.mapped - 1) * g, g)
            m.mapped -= 1
        if m.size:
            cuda_driver.address_free(m.ptr, m.size)
            m.size = 0

    def _wrap(self, ptr: int, pages: int, pb: int, dt: torch.dtype) -> torch.Tensor:
        t = DeviceRange(ptr, pages * pb).as_tensor(self.device).view(pages, pb)
        return t if dt == torch.uint8 else t.view(dt)

    # ------------------------------------------------------------------ rows

    def map_rows(self, first_page: int, num_pages: int) -> AliasRows:
        """Map snapshot rows over pages ``[first_page, first_page + num_pages)`` of every plane.

        Both bounds must be multiples of :attr:`row_pages`. Raises
        InvalidArgumentError (bad range; nothing mapped) or CudaDriverError (what
        this call mapped is unmapped again).
        """
        if self._closed:
            raise InvalidArgumentError("these cache planes are closed")
        for v, what in ((first_page, "first_page"), (num_pages, "num_pages")):
            if type(v) is not int or v < 0:
                raise InvalidArgumentError(f"{what} must be a non-negative int, got {v!r}")
        if num_pages < 1 or first_page + num_pages > self.num_pages:
            raise InvalidArgumentError(
                f"rows over pages [{first_page}, {first_page + num_pages}) do not fit {self.num_pages} pages"
            )
        if first_page % self.row_pages or num_pages % self.row_pages:
            raise InvalidArgumentError(
                f"rows must start and end on multiples of {self.row_pages} pages ({self.granularity}-byte chunks; "
                f"page bytes {self.page_bytes}), got pages [{first_page}, {first_page + num_pages})"
            )
        g = self.granularity
        mappings: list[_Mapping] = []
        tensors = []
        try:
            with torch.cuda.device(self.device):
                for k, (pb, dt) in enumerate(zip(self.page_bytes, self.dtypes, strict=True)):
                    c0 = first_page * pb // g
                    nchunks = num_pages * pb // g
                    m = _Mapping(cuda_driver.address_reserve(nchunks * g, g), nchunks * g)
                    mappings.append(m)
                    self._map_chunks(m, self._handles[k][c0:c0 + nchunks])
                    tensors.append(self._wrap(m.ptr, num_pages, pb, dt))
        except BaseException:
            for m in mappings:
                self._unmap(m)
            raise
        rows = AliasRows(first_page, num_pages, mappings, tensors)
        self._rows.append(rows)
        return rows

    def unmap_rows(self, rows: AliasRows) -> None:
        """Synchronize the device, then unmap and free ``rows``' alias ranges (the pages keep their bytes).

        Unmapping rows that are already unmapped does nothing. Raises
        InvalidArgumentError for rows of other planes, CudaDriverError if a driver call fails.
        """
        if rows not in self._rows:
            if isinstance(rows, AliasRows) and not rows.live:
                return
            raise InvalidArgumentError(f"{rows!r} are not rows of these cache planes")
        torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            for m in rows.mappings:
                self._unmap(m)
        rows.live = False
        self._rows.remove(rows)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Synchronize, unmap every row and plane, release every chunk, free the ranges. Idempotent.

        On a CudaDriverError, what is left stays recorded and a second close() retries it.
        """
        if self._closed:
            return
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        with torch.cuda.device(self.device):
            for rows in list(self._rows):
                for m in rows.mappings:
                    self._unmap(m)
                rows.live = False
                self._rows.remove(rows)
            for m in self._planes:
                self._unmap(m)
            for handles in self._handles:
                while handles:
                    cuda_driver.mem_release(handles[-1])
                    handles.pop()
        self._closed = True
        self.planes = ()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        """Physical bytes held (whole chunks)."""
        return sum(len(h) for h in self._handles) * self.granularity

    def __enter__(self) -> VmmCachePlanes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"VmmCachePlanes(num_pages={self.num_pages}, page_bytes={self.page_bytes}, "
            f"granularity={self.granularity}, closed={self._closed})"
        )
