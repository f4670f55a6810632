"""The ``torch`` clear backend: zero listed pages of cache planes held as torch tensors.

Works on any torch device (the CPU is the embedded default) and any plane dtype
(``float8_e4m3fn``, ``bfloat16``, ``uint8``, ...). Each plane ``[num_pages, ...]``
is viewed as raw page rows ``[num_pages, plane_page_bytes]`` (as the widest integer
type that divides a page: ``int64`` where possible, down to ``uint8``), and zeroing
a page is zeroing its row. Two ways to zero a clear list, chosen per plane:

    runs   sort the ids, coalesce adjacent ones: one ``rows[a:b].zero_()`` per run
           (a memset per run; one launch per run on CUDA)
    index  one ``rows.index_fill_(0, ids, 0)`` per plane (one launch per plane; the
           id tensor is built once per clear and, on CUDA, copied from pinned memory
           without blocking the host)

``strategy="auto"`` (the default) picks per plane and per list, from a cost model
whose constants ``bench/bench_clear_torch.py`` measured (see ``_COST``, and
bench/README.md for the figures). On the CPU a run is one slice assignment into
a ``memoryview`` of the plane's memory from a buffer of zero (or 0xFF) bytes,
about 0.45 us (``_HOST_RUN``; a torch slice fill costs about 2.3 us of dispatch;
a run longer than ``_HOST_CHUNK`` bytes is one torch fill, a memset whose
dispatch no longer matters); an indexed fill about 8 us plus a little per row,
writing bytes about 2.5 times slower than a memset: adjacent ids (few runs) and
short scattered lists go by runs, long scattered lists of narrow pages by one
indexed fill. On CUDA every call is a launch, so a list of more than three runs
takes one indexed fill per plane.

``clear_checked(ids)`` (a sealed plan's clear list: distinct ids in range, a tuple)
skips the id check, which is most of a small clear's host cost on the CPU.

On CUDA planes the work is enqueued on ``stream`` (the rank's model stream; the
current stream when ``None``) and ``clear`` returns without waiting for it.

The sanitizer's device side (``kvledger.executors.sanitize``): ``poison(page_ids)``
fills pages with 0xFF bytes by the same two ways; ``start_verify`` / ``verify``
check with :class:`~kvledger.executors.sanitize.TorchVerifier`.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from operator import sub as _sub
from typing import Any, NamedTuple

from ..core import checks
from ..core.errors import ConfigurationError
from .backend import ClearBackendBase, coalesce_runs
from .cuda_rank import StreamSwitch
from .sanitize import SanitizerCheck, TorchVerifier, Violation

__all__ = ["STRATEGIES", "TorchClearBackend"]

STRATEGIES: tuple[str, ...] = ("auto", "runs", "index")

# Cost model for strategy="auto", in units of one slice fill's fixed cost, per plane:
#   runs   costs  R                    + k * page_bytes * memset_per_byte
#   index  costs  fixed + k * per_row  + k * page_bytes * indexed_per_byte
# so runs wins while  R <= fixed + k * (per_row + page_bytes * extra_per_byte),
# extra_per_byte = indexed_per_byte - memset_per_byte. R: runs in the list, k: pages.
# Constants: (fixed, per_row, extra_per_byte), measured with bench/bench_clear_torch.py
# (figures in bench/README.md).
_COST = {
    # CPU, one intra-op thread: a slice fill ~2.3 us; index_fill_ ~8 us fixed per plane
    # plus ~0.2 us per row; it writes at ~7 GB/s where a memset does ~18 GB/s.
    "cpu": (3.5, 0.09, 1.0 / 26_000.0),
    # CUDA: every call is a kernel launch (~5 us from Python); an indexed fill is one
    # bandwidth-bound launch plus a non-blocking copy of the ids.
    "cuda": (3.0, 0.0, 0.0),
}
_WIDE = ((8, "int64"), (4, "int32"), (2, "int16"))
_HOST_CHUNK = 256 * 1024  # CPU runs up to this many bytes: a slice assignment from these buffers
_HOST_RUN = 0.2  # a CPU run by slice assignment (about 0.45 us), in units of a torch slice fill (about 2.3 us)
_HOST_ZEROS = memoryview(bytes(_HOST_CHUNK))
_HOST_ONES = memoryview(b"\xff" * _HOST_CHUNK)


class _PageRows(NamedTuple):
    """The planes seen as raw page rows: what ``clear`` zeroes."""

    num_pages: int
    device: Any  # torch.device
    rows: list[Any]  # per non-empty plane, [num_pages, row elements] of its widest integer type
    page_bytes: list[int]  # per non-empty plane, bytes of one page


class TorchClearBackend(ClearBackendBase):
    """Zeroes pages of torch-tensor planes. ``TorchClearBackend(planes, stream=None)``.

    Raises ``ConfigurationError`` (and builds nothing) when ``planes`` is empty, a
    plane is not a contiguous tensor with at least one dimension, the planes
    disagree on ``num_pages`` (their first dimension) or on the device, a plane
    requires grad, or a ``stream`` is given for planes that are not on CUDA.
    """

    name = "torch"
    can_sanitize = True

    def __init__(self, planes: Sequence[Any], stream: Any = None, *, strategy: str = "auto") -> None:
        import torch

        if strategy not in STRATEGIES:
            raise ConfigurationError(f"unknown clear strategy {strategy!r}; one of {STRATEGIES}")
        planes = tuple(planes)
        layout = _page_rows(torch, planes)
        self.planes = planes
        self.num_pages: int = layout.num_pages
        self.device = layout.device
        self.plane_page_bytes: tuple[int, ...] = tuple(layout.page_bytes)
        self._page_bytes_total = sum(layout.page_bytes)
        self.strategy = strategy
        self._rows = layout.rows
        self._torch = torch
        self._cuda = layout.device.type == "cuda"
        if stream is not None and not self._cuda:
            raise ConfigurationError(f"a stream was given but the planes are on {layout.device}, not CUDA")
        self.stream = stream
        # one stream switch, made once and entered around each fill (never nested: no lookup per clear)
        self._on_model_stream: StreamSwitch | None = StreamSwitch(torch, stream) if stream is not None else None
        fixed, per_row, per_byte = _COST["cuda" if self._cuda else "cpu"]
        self._fixed = fixed
        self._per_page = tuple(per_row + pb * per_byte for pb in layout.page_bytes)
        self._calls = self._pages = self._bytes = self._slice_fills = self._index_fills = 0
        self._verifier: TorchVerifier | None = None
        # CPU planes, filled by runs: (the plane's bytes as a memoryview, bytes a page, its rows) per plane
        self._host: tuple[tuple[memoryview, int, Any], ...] | None = None
        if not self._cuda:
            self._host = tuple((_bytes_of(r, layout.num_pages * pb), pb, r)
                               for r, pb in zip(self._rows, layout.page_bytes, strict=True))

    # ------------------------------------------------------------------ the hot path

    def clear(self, page_ids: Sequence[int]) -> None:
        """Zero every listed page in every plane (enqueued on ``stream`` for CUDA planes).

        Raises ``PageOutOfRangeError`` / ``DuplicatePageError`` / ``InvalidArgumentError``
        before touching any plane. An empty list does nothing.
        """
        ids = checks.page_ids(page_ids, self.num_pages)
        if not ids:
            return
        self._on_stream(ids, False)
        self._calls += 1
        self._pages += len(ids)
        self._bytes += len(ids) * self._page_bytes_total

    def clear_checked(self, page_ids: tuple[int, ...]) -> None:
        """``clear`` for ids known good (a sealed plan's clear list: a tuple of distinct ids in
        range); the check is skipped. Never call it with the caller's input."""
        if not page_ids:
            return
        self._on_stream(page_ids, False)
        self._calls += 1
        self._pages += len(page_ids)
        self._bytes += len(page_ids) * self._page_bytes_total

    def _on_stream(self, ids: tuple[int, ...], ones: bool) -> None:
        if self._on_model_stream is not None:  # CUDA planes with a named model stream
            with self._on_model_stream:
                self._fill(ids, ones)
        else:  # the CPU, or CUDA on the current stream
            self._fill(ids, ones)

    def _fill(self, ids: tuple[int, ...], ones: bool) -> None:
        """Every byte of the listed pages := 0 (``ones`` false) or 0xFF, by runs or one indexed fill per plane."""
        k = len(ids)
        host = self._host
        if host is not None and self.strategy != "index" and k * _HOST_RUN <= self._fixed:
            # a short CPU list: by runs whatever they are (no cost model to consult)
            self._host_runs(_short_runs(ids) if k <= 2 else coalesce_runs(sorted(ids)), ones)
            return
        srt = sorted(ids)
        # runs = pages - adjacent pairs (C-level: no Python loop over the ids)
        nruns = k - list(map(_sub, srt[1:], srt[:-1])).count(1) if k > 1 else 1
        strategy = self.strategy
        fixed = self._fixed
        run_cost = nruns * (_HOST_RUN if host is not None else 1.0)
        runs = index = None
        slices = fills = 0
        for i, (rows, per_page) in enumerate(zip(self._rows, self._per_page, strict=True)):
            if strategy == "runs" or (strategy == "auto" and run_cost <= fixed + k * per_page):
                if runs is None:
                    runs = coalesce_runs(srt)
                if host is not None:
                    self._host_plane(host[i], runs, ones)
                else:
                    value = _ones(rows) if ones else 0
                    for a, b in runs:
                        rows[a:b].fill_(value)
                slices += nruns
            else:
                if index is None:
                    index = self._index(srt)
                rows.index_fill_(0, index, _ones(rows) if ones else 0)
                fills += 1
        self._slice_fills += slices
        self._index_fills += fills

    def _host_runs(self, runs: Sequence[tuple[int, int]], ones: bool) -> None:
        """CPU planes: ``runs`` of every plane by slice assignment (``_host_plane``, inlined)."""
        src = _HOST_ONES if ones else _HOST_ZEROS
        for mv, pb, rows in self._host or ():
            for a, b in runs:
                n = (b - a) * pb
                if n <= _HOST_CHUNK:
                    start = a * pb
                    mv[start:start + n] = src[:n]
                else:
                    rows[a:b].fill_(_ones(rows) if ones else 0)
        self._slice_fills += len(runs) * len(self._rows)

    @staticmethod
    def _host_plane(plane: tuple[memoryview, int, Any], runs: Sequence[tuple[int, int]], ones: bool) -> None:
        """Every byte of ``runs`` of one CPU plane := 0 (or 0xFF): a slice assignment from a
        buffer of such bytes per run, a torch fill for a run longer than ``_HOST_CHUNK``."""
        mv, pb, rows = plane
        src = _HOST_ONES if ones else _HOST_ZEROS
        for a, b in runs:
            n = (b - a) * pb
            if n <= _HOST_CHUNK:
                mv[a * pb:b * pb] = src[:n]
            else:
                rows[a:b].fill_(_ones(rows) if ones else 0)

    def _index(self, srt: list[int]) -> Any:
        torch = self._torch
        host = torch.frombuffer(array("q", srt), dtype=torch.int64)  # no per-id Python objects
        if not self._cuda:
            return host
        # Non-blocking from pinned memory: the host never waits for the model stream.
        return host.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ the sanitizer

    def poison(self, page_ids: Sequence[int]) -> None:
        """Fill every plane of the listed pages with 0xFF bytes (enqueued on ``stream`` for CUDA).

        Raises what ``clear`` raises, before touching any plane.
        """
        ids = checks.page_ids(page_ids, self.num_pages)
        if ids:
            self._on_stream(ids, True)

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        """Enqueue the sanitizer's check (``kvledger.executors.sanitize``); returns the pending check."""
        if self._verifier is None:
            self._verifier = TorchVerifier(self.planes, self.stream)
        return self._verifier.start(cleared_ids, committed_ids)

    def verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> tuple[Violation, ...]:
        """The check's violations, sorted (waits for the device on CUDA: not for an event loop)."""
        return self.start_verify(cleared_ids, committed_ids).result()

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> dict[str, int]:
        """Counters since construction: clear calls, pages and bytes zeroed, slice fills
        (one per run per plane) and indexed fills (one per plane)."""
        return {
            "calls": self._calls,
            "pages": self._pages,
            "bytes": self._bytes,
            "slice_fills": self._slice_fills,
            "index_fills": self._index_fills,
        }

    def __repr__(self) -> str:
        return (
            f"TorchClearBackend(planes={len(self.planes)}, num_pages={self.num_pages}, device={self.device}, "
            f"page_bytes={self.plane_page_bytes!r}, strategy={self.strategy})"
        )


def _page_rows(torch: Any, planes: tuple[Any, ...]) -> _PageRows:
    """Check ``planes`` and view each non-empty one as ``[num_pages, page]`` rows (no copy).

    Raises ``ConfigurationError`` naming the first bad plane; nothing is kept.
    """
    if not planes:
        raise ConfigurationError("a clear backend needs at least one plane")
    num_pages, device = _plane_shape(torch, planes[0], 0)
    if num_pages == 0:
        raise ConfigurationError("planes have no pages")
    rows: list[Any] = []
    page_bytes: list[int] = []
    for i, plane in enumerate(planes):
        n, dev = _plane_shape(torch, plane, i)
        if n != num_pages:
            raise ConfigurationError(
                f"plane {i} has {n} pages, plane 0 has {num_pages}: "
                "page ids are global, every plane of a rank needs the same number of pages"
            )
        if dev != device:
            raise ConfigurationError(f"plane {i} is on {dev}, plane 0 on {device}")
        nbytes = plane.numel() * plane.element_size()
        if nbytes == 0:
            continue  # nothing to zero in a zero-width plane
        u8 = plane.reshape(num_pages, -1).view(torch.uint8)
        rows.append(_widest(torch, u8))
        page_bytes.append(nbytes // num_pages)
    return _PageRows(num_pages, device, rows, page_bytes)


def _plane_shape(torch: Any, plane: Any, i: int) -> tuple[int, Any]:
    """``(num_pages, device)`` of one usable plane; ``ConfigurationError`` naming plane ``i`` otherwise."""
    if not isinstance(plane, torch.Tensor):
        raise ConfigurationError(f"plane {i} is not a torch.Tensor: {type(plane).__name__}")
    if plane.dim() < 1:
        raise ConfigurationError(f"plane {i} needs a page dimension first, got a 0-d tensor")
    if not plane.is_contiguous():
        raise ConfigurationError(f"plane {i} (shape {tuple(plane.shape)}) is not contiguous")
    if plane.requires_grad:
        raise ConfigurationError(f"plane {i} requires grad; cache planes must not")
    return int(plane.shape[0]), plane.device


def _bytes_of(rows: Any, nbytes: int) -> memoryview:
    """A writable memoryview of the ``nbytes`` bytes of a contiguous CPU tensor (no copy, no numpy).
    The backend keeps the tensor (and so the memory) alive for as long as the view."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(int(rows.data_ptr()))).cast("B")


def _short_runs(ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The runs of one or two distinct ids (``coalesce_runs(sorted(ids))`` without the sort)."""
    a = ids[0]
    if len(ids) == 1:
        return ((a, a + 1),)
    b = ids[1]
    if a > b:
        a, b = b, a
    return ((a, b + 1),) if b == a + 1 else ((a, a + 1), (b, b + 1))


def _ones(rows: Any) -> int:
    """The fill value whose bytes are all 0xFF in ``rows``' dtype (-1 signed, 255 for uint8)."""
    return -1 if rows.dtype.is_signed else 255


def _widest(torch: Any, u8: Any) -> Any:
    """The page rows as the widest integer dtype that divides a page (faster fills)."""
    width = u8.shape[1]
    for size, dtype_name in _WIDE:
        if width % size == 0 and u8.storage_offset() % size == 0:
            try:
                return u8.view(getattr(torch, dtype_name))
            except RuntimeError:
                continue
    return u8
