"""The ``bytes`` clear backend: zero listed pages of cache planes held in plain byte buffers.

No torch, no numpy: a plane is any writable, C-contiguous object with the buffer protocol
whose first dimension is the page dimension, as a tensor's is:

    byte_plane(num_pages, page_bytes)        a 2-D memoryview [num_pages, page_bytes] over a
                                             fresh bytearray (the usual way to make one)
    memoryview(buf).cast("B", (n, pb))       the same over a buffer you hold
    bytearray(n) / array.array("q", ...)     1-D: one element a page (rarely what you want)

A page is the ``nbytes // num_pages`` bytes at ``page * page_bytes`` of the plane's flat
bytes; planes may differ in bytes per page, never in pages. Zeroing a clear list is one
slice assignment from a buffer of zero bytes per run of adjacent ids per plane (a memset
in C); nothing is enqueued anywhere: a clear is done when the call returns. This is the
backend the engine picks for buffer planes (``default_backend``), and the one the engine
and wire tests run on: they exercise everything a rank does without a tensor library.

The sanitizer's side (``kvledger.executors.sanitize``) is here too, on the host:
``poison`` fills pages with 0xFF bytes, ``start_verify`` checks them at once (a
``SanitizerCheck`` that is already done) by the rule of the module's docstring: a
cleared page must be zero, a committed one must hold no 8-byte group of 0xFF.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core import checks
from ..core.errors import ConfigurationError
from .backend import ClearBackendBase, coalesce_runs
from .sanitize import NOT_ZERO, POISON, SanitizerCheck, Violation

__all__ = ["BytesClearBackend", "byte_plane", "copy_bytes", "flat_bytes", "holds_poison"]

_CHUNK = 256 * 1024  # a run is written from these buffers in pieces of at most this many bytes
_ZEROS = memoryview(bytes(_CHUNK))
_ONES = memoryview(b"\xff" * _CHUNK)
_GROUP = b"\xff" * 8


def byte_plane(num_pages: int, page_bytes: int, fill: int = 0) -> memoryview:
    """A fresh plane of ``num_pages`` pages of ``page_bytes`` bytes, every byte ``fill``: a 2-D
    memoryview ``[num_pages, page_bytes]`` over a new bytearray. Raises ``ConfigurationError``
    for a count below 1 or a fill that is not a byte."""
    if type(num_pages) is not int or num_pages < 1 or type(page_bytes) is not int or page_bytes < 1:
        raise ConfigurationError(f"a byte plane needs num_pages >= 1 and page_bytes >= 1, "
                                 f"got {num_pages!r}, {page_bytes!r}")
    if type(fill) is not int or not 0 <= fill <= 255:
        raise ConfigurationError(f"fill must be a byte (0 to 255), got {fill!r}")
    return memoryview(bytearray([fill]) * (num_pages * page_bytes)).cast("B", (num_pages, page_bytes))


def flat_bytes(plane: object) -> memoryview:
    """The plane's bytes as a flat, writable ``memoryview`` of format ``B`` (no copy).
    Raises ``ConfigurationError`` for an object without the buffer protocol, a read-only or
    non-contiguous one."""
    try:
        mv = memoryview(plane)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigurationError(f"{type(plane).__name__} is not a byte buffer (no buffer protocol)") from None
    if mv.readonly:
        raise ConfigurationError(f"a {type(plane).__name__} plane is read-only")
    if not mv.c_contiguous:
        raise ConfigurationError(f"a plane of shape {mv.shape} is not C-contiguous")
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


def copy_bytes(src: object, dst: object) -> None:
    """``dst``'s bytes := ``src``'s (both buffers, the same number of bytes): an input copy of a
    byte rank. Raises ``ConfigurationError`` for a buffer it cannot write, ``ValueError`` for
    lengths that differ (nothing written either way)."""
    out = flat_bytes(dst)
    out[:] = memoryview(src).cast("B")  # type: ignore[arg-type]


class BytesClearBackend(ClearBackendBase):
    """Zeroes pages of byte-buffer planes on the host. ``BytesClearBackend(planes, stream=None)``.

    Raises ``ConfigurationError`` (and keeps nothing) when ``planes`` is empty, a plane is
    not a writable C-contiguous buffer with a first (page) dimension, the planes disagree on
    the number of pages, a plane's bytes do not divide into its pages, or a ``stream`` is
    given (there is none on the host).
    """

    name = "bytes"
    can_sanitize = True

    def __init__(self, planes: Sequence[object], stream: object = None) -> None:
        if stream is not None:
            raise ConfigurationError("the bytes backend runs on the host: it takes no stream")
        planes = tuple(planes)
        if not planes:
            raise ConfigurationError("a clear backend needs at least one plane")
        num_pages = -1
        views: list[memoryview] = []
        widths: list[int] = []
        for i, plane in enumerate(planes):
            try:
                flat = flat_bytes(plane)
            except ConfigurationError as exc:
                raise ConfigurationError(f"plane {i}: {exc}") from None
            shape = memoryview(plane).shape  # type: ignore[arg-type]
            if not shape:
                raise ConfigurationError(f"plane {i} needs a page dimension first, got a 0-d buffer")
            n = shape[0]
            if num_pages < 0:
                if n == 0:
                    raise ConfigurationError("planes have no pages")
                num_pages = n
            elif n != num_pages:
                raise ConfigurationError(
                    f"plane {i} has {n} pages, plane 0 has {num_pages}: "
                    "page ids are global, every plane of a rank needs the same number of pages"
                )
            if flat.nbytes % num_pages:
                raise ConfigurationError(f"plane {i}'s {flat.nbytes} bytes do not divide into {num_pages} pages")
            views.append(flat)
            widths.append(flat.nbytes // num_pages)
        self.planes = planes
        self.num_pages: int = num_pages
        self.plane_page_bytes: tuple[int, ...] = tuple(widths)
        self._views = tuple(views)  # per plane, its flat bytes
        self._flats = tuple((v, pb) for v, pb in zip(views, widths, strict=True) if pb)  # those with bytes
        self._page_bytes_total = sum(widths)
        self._calls = self._pages = self._bytes = 0

    def clear(self, page_ids: Sequence[int]) -> None:
        """Zero every listed page in every plane. Raises ``PageOutOfRangeError`` /
        ``DuplicatePageError`` / ``InvalidArgumentError`` before touching any plane."""
        self._clear(checks.page_ids(page_ids, self.num_pages))

    def clear_checked(self, page_ids: tuple[int, ...]) -> None:
        """``clear`` for ids known good (a sealed plan's clear list); the check is skipped."""
        self._clear(page_ids)

    def _clear(self, page_ids: tuple[int, ...]) -> None:
        if not page_ids:
            return
        self._fill(coalesce_runs(sorted(page_ids)), _ZEROS)
        self._calls += 1
        self._pages += len(page_ids)
        self._bytes += len(page_ids) * self._page_bytes_total

    def _fill(self, runs: Sequence[tuple[int, int]], src: memoryview) -> None:
        for flat, pb in self._flats:
            for a, b in runs:
                start, stop = a * pb, b * pb
                while stop - start > _CHUNK:
                    flat[start:start + _CHUNK] = src
                    start += _CHUNK
                flat[start:stop] = src[:stop - start]

    # ------------------------------------------------------------------ the sanitizer

    def poison(self, page_ids: Sequence[int]) -> None:
        """Fill every plane of the listed pages with 0xFF bytes; raises what ``clear`` raises first."""
        ids = checks.page_ids(page_ids, self.num_pages)
        if ids:
            self._fill(coalesce_runs(sorted(ids)), _ONES)

    def start_verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        """The sanitizer's check, done here and now: every cleared page zero in every plane, no
        committed page holding poison. Validates both lists first (reads nothing otherwise)."""
        cleared = checks.page_ids(cleared_ids, self.num_pages)
        committed = checks.page_ids(committed_ids, self.num_pages)
        return SanitizerCheck.done(self._violations(cleared, committed))

    def verify(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> tuple[Violation, ...]:
        """The check's violations, sorted."""
        return self.start_verify(cleared_ids, committed_ids).result()

    def _violations(self, cleared: tuple[int, ...], committed: tuple[int, ...]) -> list[Violation]:
        found: list[Violation] = []
        for k, (flat, pb) in enumerate(zip(self._views, self.plane_page_bytes, strict=True)):
            if not pb:
                continue
            zero = bytes(pb)
            found += [Violation(plane=k, page=p, kind=NOT_ZERO) for p in cleared
                      if flat[p * pb:(p + 1) * pb] != zero]
            found += [Violation(plane=k, page=p, kind=POISON) for p in committed
                      if holds_poison(flat[p * pb:(p + 1) * pb].tobytes())]
        return found

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> dict[str, int]:
        """Counters since construction: clear calls, pages and bytes zeroed."""
        return {"calls": self._calls, "pages": self._pages, "bytes": self._bytes}

    def __repr__(self) -> str:
        return (f"BytesClearBackend(planes={len(self.planes)}, num_pages={self.num_pages}, "
                f"page_bytes={self.plane_page_bytes!r})")


def holds_poison(page: bytes) -> bool:
    """Whether one page's bytes hold poison: an 8-byte group (offsets ``8i .. 8i+7`` from the
    page's start, the last cut at the page's end) all 0xFF (``kvledger.executors.sanitize``)."""
    n = len(page)
    i = page.find(_GROUP)
    while i != -1:
        if i % 8 == 0:
            return True
        i = page.find(_GROUP, (i // 8 + 1) * 8)
    tail = n % 8
    return tail > 0 and page[n - tail:] == _GROUP[:tail]
