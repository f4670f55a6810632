"""Byte planes for the engine and wire tests: the ``bytes`` clear backend's (no torch).

    make_planes(num_pages)      K and V planes of one rank (32 and 64 bytes a page, as an FP8
                                [4, 8] K and a bf16 [4, 8] V would be), every byte non-zero
    filled_planes(n, widths, byte)  one plane per width, every byte ``byte``
    page(plane, p)              page p's bytes, a writable memoryview (an input copy's target)
    page_is_zero(plane, p)      whether every byte of page p is zero
    fill_pages(plane, pages, byte)  every byte of those pages := byte (byte planes, or a GPU test's tensors)
    write_rows(planes, pages)   what a snapshot row does through its alias: ROW bytes into pages
    pages_are_zero(planes, pages)   every byte of those pages zero, in every plane
    pages_hold_rows(planes, pages)  every byte of those pages still ROW, in every plane
    plane_bytes(plane)          a copy of the whole plane's bytes (to compare before and after)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvledger.executors.backend import is_buffer
from kvledger.executors.bytes_backend import byte_plane, flat_bytes

__all__ = ["ROW", "fill_pages", "filled_planes", "make_planes", "page", "page_is_zero", "pages_are_zero",
           "pages_hold_rows", "plane_bytes", "write_rows"]

ROW = 0x7F  # an FP8 e4m3fn NaN byte, what released snapshot rows leave behind


def filled_planes(num_pages: int, widths: Sequence[int], byte: int = 0xAB) -> list[memoryview]:
    """One plane per width (bytes a page), every byte ``byte``."""
    return [byte_plane(num_pages, w, fill=byte) for w in widths]


def make_planes(num_pages: int) -> list[memoryview]:
    """K and V planes of one rank: 32-byte K pages (0x11 bytes), 64-byte V pages (bf16 1.5 is
    0x3FC0: bytes C0 3F); every byte non-zero to start with."""
    k = byte_plane(num_pages, 32, fill=0x11)
    v = byte_plane(num_pages, 64)
    flat_bytes(v)[:] = b"\xc0\x3f" * (num_pages * 32)
    return [k, v]


def page(plane: memoryview, p: int) -> memoryview:
    """Page ``p`` of ``plane``: a writable view of its bytes."""
    flat = flat_bytes(plane)
    width = flat.nbytes // plane.shape[0]
    return flat[p * width:(p + 1) * width]


def page_is_zero(plane: memoryview, p: int) -> bool:
    return not any(page(plane, p))


def fill_pages(plane, pages: Iterable[int], byte: int) -> None:
    """Every byte of ``pages`` := ``byte``: a byte plane's through its bytes, a tensor's (a GPU
    test's planes) through its uint8 view, on its device."""
    pages = list(pages)
    if not pages:
        return
    if is_buffer(plane):
        for p in pages:
            view = page(plane, p)
            view[:] = bytes([byte]) * len(view)
        return
    import torch

    plane.view(torch.uint8)[pages] = byte


def write_rows(planes: Iterable, pages: Iterable[int], byte: int = ROW) -> None:
    """What a snapshot row does through its VMM alias: raw bytes into the pages (byte planes or
    tensors: ``fill_pages``)."""
    pages = list(pages)
    for plane in planes:
        fill_pages(plane, pages, byte)


def pages_are_zero(planes: Iterable[memoryview], pages: Iterable[int]) -> bool:
    pages = list(pages)
    return all(page_is_zero(plane, p) for plane in planes for p in pages)


def pages_hold_rows(planes: Iterable[memoryview], pages: Iterable[int], byte: int = ROW) -> bool:
    """Every byte of ``pages`` still holds the snapshot row byte, in every plane."""
    pages = list(pages)
    return all(page(plane, p).tobytes() == bytes([byte]) * page(plane, p).nbytes for plane in planes for p in pages)


def plane_bytes(plane: memoryview) -> bytes:
    return flat_bytes(plane).tobytes()
