"""The Triton kernels of the GPU backends, apart from their host launchers.

    fill_pages_kernel    every listed page of every plane := FILL (0: the clear;
                         -1, all bytes 0xFF: the sanitizer's poison); the list in
                         device memory
    param_fill_kernel(k) the same fill with the list in the kernel's parameters
                         (``count`` and ``k`` id slots): no copy, no list memory; the
                         ids are read from the constant bank (generated source, one
                         kernel per ``k``)
    verify_pages_kernel  the sanitizer's check: listed pages all zero, committed
                         pages free of poison; violations appended to a small
                         device buffer with one atomic per violating (plane, page)

``fill_pages_kernel`` and the check read their page lists from device memory
(``count`` first, then the ids), so one launch, captured once in a CUDA graph,
handles whatever the host staged; ``param_fill_kernel(k)`` takes up to ``k`` ids
by value, for eager clears of short lists (the driver copies parameters at the
launch call, so the host may reuse its buffer at once).
Every kernel has a plain torch reference it is tested against on random data
(``kvledger.executors.sanitize`` for the check, ``plane[ids] = value`` for the fill).

The fill's work is ``count x planes`` tasks (one page of one plane), split into
chunks of ``BLOCK`` elements when every plane has the same page length
(``CHUNKED``); a persistent grid of programs strides over the work. Addresses are
``anchor + offset`` (the anchor a 16-byte aligned pointer argument) so the
compiler can prove alignment and store 16 bytes per thread per instruction.
:class:`FillConfig` holds the knobs (measured on an H200 with
``bench/bench_gpu_tune.py``). This module imports triton at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import linecache
from collections.abc import Sequence
from typing import Any

import triton
import triton.language as tl

__all__ = [
    "FillConfig",
    "PlaneTables",
    "PARAM_SLOTS",
    "fill_pages_kernel",
    "param_fill_kernel",
    "plane_tables",
    "verify_pages_kernel",
    "VERIFY_BLOCK",
]

VERIFY_BLOCK = 1024  # words (or 8-byte groups) checked per inner iteration


@triton.jit(do_not_specialize=["num_planes", "chunks"])
def fill_pages_kernel(
    anchor_ptr,  # any 16-byte aligned device pointer: plane addresses are kept relative to it
    meta_ptr,  # int32 [1 + capacity]: count, then page ids
    delta_ptr,  # int64 [num_planes]: (plane base - anchor) / UNIT
    stride_ptr,  # int64 [num_planes]: page stride / UNIT
    length_ptr,  # int64 [num_planes]: bytes per page / UNIT
    num_planes,
    chunks,  # CHUNKED: BLOCK-element chunks per page (the same in every plane)
    FILL: tl.constexpr,  # 0 or -1 (every byte 0xFF)
    DTYPE: tl.constexpr,  # store element type (int32 when UNIT >= 4, else int8)
    EPU: tl.constexpr,  # elements per UNIT
    BLOCK: tl.constexpr,  # elements per store
    EVEN: tl.constexpr,  # every page length is a multiple of BLOCK elements: no mask
    CHUNKED: tl.constexpr,  # work items are (task, chunk); else whole tasks with an inner loop
    PLANE_MAJOR: tl.constexpr,  # task order: plane-major (t = plane * count + slot) or page-major
    STREAMING: tl.constexpr,  # stores marked evict-first (.cs)
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    count = tl.load(meta_ptr)
    tasks = count * num_planes
    lane = tl.arange(0, BLOCK)
    values = tl.full([BLOCK], FILL, DTYPE)
    anchor = anchor_ptr.to(tl.pointer_type(DTYPE))
    total = tasks * chunks if CHUNKED else tasks
    for item in range(pid, total, nprog):
        if CHUNKED:
            task = item // chunks
            first = (item - task * chunks) * BLOCK
        else:
            task = item
            first = 0
        if PLANE_MAJOR:
            plane = task // count
            slot = task - plane * count
        else:
            slot = task // num_planes
            plane = task - slot * num_planes
        page = tl.load(meta_ptr + 1 + slot).to(tl.int64)
        delta = tl.load(delta_ptr + plane) * EPU
        stride = tl.load(stride_ptr + plane) * EPU
        dst = anchor + (delta + page * stride)
        if CHUNKED:
            if STREAMING:
                tl.store(dst + first + lane, values, cache_modifier=".cs")
            else:
                tl.store(dst + first + lane, values)
        else:
            length = tl.load(length_ptr + plane).to(tl.int32) * EPU
            for start in range(0, length, BLOCK):
                offs = start + lane
                if EVEN:
                    if STREAMING:
                        tl.store(dst + offs, values, cache_modifier=".cs")
                    else:
                        tl.store(dst + offs, values)
                else:
                    tl.store(dst + offs, values, mask=offs < length)


# --------------------------------------------------------------------------- ids by value

PARAM_SLOTS = (16, 32, 64, 128)  # the id slots a generated kernel may have (its list's most ids)

_PARAM_SOURCE = """\
def {name}(
    anchor_ptr,  # as fill_pages_kernel's
    delta_ptr,
    stride_ptr,
    length_ptr,
    num_planes,
    chunks,
    count,  # ids listed (<= {k}); the slots after them are ignored
    {ids},
    FILL: tl.constexpr,
    DTYPE: tl.constexpr,
    EPU: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    CHUNKED: tl.constexpr,
    PLANE_MAJOR: tl.constexpr,
    STREAMING: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    tasks = count * num_planes
    lane = tl.arange(0, BLOCK)
    values = tl.full([BLOCK], FILL, DTYPE)
    anchor = anchor_ptr.to(tl.pointer_type(DTYPE))
    total = tasks * chunks if CHUNKED else tasks
    for item in range(pid, total, nprog):
        if CHUNKED:
            task = item // chunks
            first = (item - task * chunks) * BLOCK
        else:
            task = item
            first = 0
        if PLANE_MAJOR:
            plane = task // count
            slot = task - plane * count
        else:
            slot = task // num_planes
            plane = task - slot * num_planes
        page = i0
{select}
        page = page.to(tl.int64)
        delta = tl.load(delta_ptr + plane) * EPU
        stride = tl.load(stride_ptr + plane) * EPU
        dst = anchor + (delta + page * stride)
        if CHUNKED:
            if STREAMING:
                tl.store(dst + first + lane, values, cache_modifier=".cs")
            else:
                tl.store(dst + first + lane, values)
        else:
            length = tl.load(length_ptr + plane).to(tl.int32) * EPU
            for start in range(0, length, BLOCK):
                offs = start + lane
                if EVEN:
                    if STREAMING:
                        tl.store(dst + offs, values, cache_modifier=".cs")
                    else:
                        tl.store(dst + offs, values)
                else:
                    tl.store(dst + offs, values, mask=offs < length)
"""


@functools.cache
def param_fill_kernel(k: int) -> Any:
    """The fill kernel with the page list in its parameters: ``count`` then ``k`` int32 id slots.

    Its arguments are ``fill_pages_kernel``'s with ``meta_ptr`` replaced by ``count, i0 ..
    i{k-1}``; the constexprs are the same (``fill_constants``). Each work item picks its
    page id from the slots with a chain of ``k - 1`` selects on the slot number (parameters
    live in the constant bank, which a kernel cannot index at run time in Triton): cheap
    next to the 16-byte stores of a page, and the reason ``k`` stays small. Generated from
    one source text per ``k`` (``PARAM_SLOTS``), registered with ``linecache`` so that
    Triton (and its interpreter) can read it like a file's. Every integer argument is
    left unspecialized: one compiled kernel serves every list.
    """
    if k not in PARAM_SLOTS:
        raise ValueError(f"k must be one of {PARAM_SLOTS}, got {k!r}")
    name = f"param_fill_kernel_{k}"
    ids = [f"i{j}" for j in range(k)]
    select = "\n".join(f"        page = tl.where(slot == {j}, i{j}, page)" for j in range(1, k))
    src = _PARAM_SOURCE.format(name=name, k=k, ids=", ".join(ids), select=select)
    filename = f"<kvledger {name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict[str, Any] = {"tl": tl, "triton": triton, "__name__": __name__}
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102  (our own template, no input in it)
    fn = namespace[name]
    fn.__module__ = __name__
    return triton.jit(do_not_specialize=["num_planes", "chunks", "count", *ids])(fn)


@triton.jit(do_not_specialize=["num_planes", "max_out"])
def verify_pages_kernel(
    anchor_ptr,  # int8 pointer: plane addresses are kept relative to it, in bytes
    lists_ptr,  # int32: [n_cleared, n_committed, cleared ids..., committed ids...]
    delta_ptr,  # int64 [num_planes]: plane base - anchor, bytes
    stride_ptr,  # int64 [num_planes]: page stride, bytes
    length_ptr,  # int64 [num_planes]: bytes per page
    num_planes,
    out_ptr,  # int32 [1 + 3 * max_out]: violations found, then (plane, page, kind) triples
    max_out,
    WIDE: tl.constexpr,  # every base, stride and length is a multiple of 8: read 8-byte words
    BLOCK: tl.constexpr,  # words (WIDE) or 8-byte groups per iteration
):
    # kind 1: a cleared page with a non-zero byte; kind 2: a committed page with an
    # 8-byte group (page offsets 8i .. 8i+7, the last group cut at the page end) all 0xFF.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_cleared = tl.load(lists_ptr)
    n_listed = n_cleared + tl.load(lists_ptr + 1)
    anchor = anchor_ptr.to(tl.pointer_type(tl.int8))
    lane = tl.arange(0, BLOCK)
    for task in range(pid, n_listed * num_planes, nprog):
        j = task // num_planes
        plane = task - j * num_planes
        page = tl.load(lists_ptr + 2 + j)
        base = anchor + (tl.load(delta_ptr + plane) + page.to(tl.int64) * tl.load(stride_ptr + plane))
        length = tl.load(length_ptr + plane).to(tl.int32)
        nonzero = tl.zeros([BLOCK], dtype=tl.int32)
        poison = tl.zeros([BLOCK], dtype=tl.int32)
        if WIDE:
            words = base.to(tl.pointer_type(tl.int64))
            for start in range(0, length // 8, BLOCK):
                offs = start + lane
                w = tl.load(words + offs, mask=offs < length // 8, other=0)
                nonzero = tl.maximum(nonzero, (w != 0).to(tl.int32))
                poison = tl.maximum(poison, (w == -1).to(tl.int32))
        else:
            byte = tl.arange(0, 8)
            for start in range(0, (length + 7) // 8, BLOCK):
                offs = (start + lane)[:, None] * 8 + byte[None, :]
                inside = offs < length
                b = tl.load(base + offs, mask=inside, other=0)
                nonzero = tl.maximum(nonzero, tl.max((b != 0).to(tl.int32), axis=1))
                ones = tl.min(tl.where(inside, (b == -1).to(tl.int32), 1), axis=1)
                starts = (start + lane) * 8 < length
                poison = tl.maximum(poison, tl.where(starts, ones, 0))
        kind = tl.where(j < n_cleared, tl.max(nonzero, axis=0), 2 * tl.max(poison, axis=0))
        if kind != 0:
            at = tl.atomic_add(out_ptr, 1)
            if at < max_out:
                tl.store(out_ptr + 1 + 3 * at, plane)
                tl.store(out_ptr + 2 + 3 * at, page)
                tl.store(out_ptr + 3 + 3 * at, kind)


# --------------------------------------------------------------------------- host description

@dataclasses.dataclass(frozen=True)
class FillConfig:
    """Knobs of :func:`fill_pages_kernel` (defaults measured on an H200, ``bench/bench_gpu_tune.py``).

    The defaults won the last of three 2026-12-01 sweeps of 18 configurations (best
    worst case over the clears of 32 MB and more) and placed in the top three of
    the other; the leaders were within about 1 % of each other: the 34-50 MB cases
    are bound by fixed launch and drain time (as is a memset of the same size),
    the large ones run at ~92 % of a 2 GiB memset.

    ``block_bytes``: bytes per store instruction group (a power of two);
    ``num_warps``; ``programs_per_sm``: size of the persistent grid; ``chunked``:
    split pages into ``block_bytes`` chunks when every plane has the same page
    length; ``plane_major``: task order; ``streaming``: evict-first stores.
    """

    block_bytes: int = 16384
    num_warps: int = 4
    programs_per_sm: int = 16
    chunked: bool = True
    plane_major: bool = False
    streaming: bool = False

    def tag(self) -> str:
        """A short name for tables: ``b8k w4 p4 task page``."""
        order = "plane" if self.plane_major else "page"
        mode = "chunk" if self.chunked else "task"
        cs = " cs" if self.streaming else ""
        return f"b{self.block_bytes // 1024}k w{self.num_warps} p{self.programs_per_sm} {mode} {order}{cs}"


class PlaneTables:
    """The fill kernel's plane tables (host lists) and compile-time choices for one set of planes."""

    __slots__ = ("unit", "dtype", "epu", "block", "even", "chunks", "deltas", "strides", "lengths")

    def __init__(self, unit: int, dtype: Any, epu: int, block: int, even: bool, chunks: int,
                 deltas: list[int], strides: list[int], lengths: list[int]) -> None:
        self.unit, self.dtype, self.epu, self.block, self.even = unit, dtype, epu, block, even
        self.chunks = chunks  # > 0: chunks per page (uniform, even pages); 0: tasks with an inner loop
        self.deltas, self.strides, self.lengths = deltas, strides, lengths


def plane_tables(anchor: int, ptrs: Sequence[int], strides: Sequence[int], lengths: Sequence[int],
                 config: FillConfig | None = None) -> PlaneTables:
    """Choose UNIT / store type / BLOCK for planes at ``ptrs`` and build the fill tables.

    ``anchor`` is the address of the kernel's ``anchor_ptr`` argument;
    ``strides[k]`` and ``lengths[k]`` are plane k's page stride and bytes per page.
    UNIT is the largest of 16, 4, 1 dividing every address, stride and length
    (16: 16-byte stores). Pure: returns host lists; the caller puts them on the device.
    """
    config = config or FillConfig()
    vals = [anchor, *ptrs, *strides, *lengths]
    if all(v % 16 == 0 for v in vals):
        unit, dtype, epu = 16, tl.int32, 4
    elif all(v % 4 == 0 for v in vals):
        unit, dtype, epu = 4, tl.int32, 1
    else:
        unit, dtype, epu = 1, tl.int8, 1
    elem_bytes = 4 if unit >= 4 else 1
    elems = [n // elem_bytes for n in lengths]
    pow2 = min(e & -e for e in elems)  # largest power of two dividing every length
    want = max(1, config.block_bytes // elem_bytes)
    if pow2 >= 256:
        block, even = min(pow2, want), True
    else:  # small or odd pages: a masked block about the size of the smallest page
        block, even = min(want, max(128, 1 << (min(elems) - 1).bit_length())), False
    uniform = even and len(set(lengths)) == 1
    chunks = elems[0] // block if (config.chunked and uniform) else 0
    return PlaneTables(unit, dtype, epu, block, even, chunks, [(p - anchor) // unit for p in ptrs],
                       [s // unit for s in strides], [n // unit for n in lengths])


def fill_constants(tables: PlaneTables, config: FillConfig, fill: int) -> dict[str, Any]:
    """The constexpr arguments of :func:`fill_pages_kernel` for these tables, knobs and fill value."""
    return {
        "FILL": fill, "DTYPE": tables.dtype, "EPU": tables.epu, "BLOCK": tables.block, "EVEN": tables.even,
        "CHUNKED": tables.chunks > 0, "PLANE_MAJOR": config.plane_major, "STREAMING": config.streaming,
    }


def fill_work(tables: PlaneTables, count: int, num_planes: int) -> int:
    """Work items of one fill of ``count`` pages (the most programs worth launching)."""
    return count * num_planes * max(1, tables.chunks)
