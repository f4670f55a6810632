"""The device side of the sanitizer (SPEC "The sanitizer"): poison, then check, on the model stream.

    step plan (sanitize on), on the rank's model stream:
      input copies -> poison(poison)         every plane of those pages := 0xFF bytes
                   -> clear(clear_list)
                   -> start_verify(clear_list, committed) -> SanitizerCheck
                        one device pass:  every cleared page zero in every plane   else NOT_ZERO
                                          no committed page holds poison           else POISON
                        one small device-to-host copy of the violations found
                   -> (the executor waits for the check without blocking its loop)
                   -> the step graph, only when the check found nothing

A page **holds poison** in a plane when one of its 8-byte groups is all ``0xFF``:
the groups are the page's bytes at offsets ``8i .. 8i+7`` counted from the start
of the page, the last group cut at the page end (a page of fewer than 8 bytes is
one group). Poison is ``0xFF`` in every byte, which is NaN in fp8 e4m3fn and
e5m2, fp16, bf16 and fp32, and a KV writer never stores eight NaN bytes in a row.
Integer planes can hold an all-ones group legitimately (int8 -1 eight times): the
check can then report a false ``POISON``; it never misses one.

Backends implement ``poison(page_ids)``, ``start_verify(cleared_ids, committed_ids)``
and ``verify(...)`` (start, wait, result). This module holds what every backend
shares: :class:`Violation`, :class:`SanitizerCheck` (a pending result), and the
torch implementation (:class:`TorchVerifier`, any torch device, the CPU
included), which is also the reference the Triton kernel is tested against.
Importing it imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ..core import checks

__all__ = ["NOT_ZERO", "POISON", "SanitizerCheck", "TorchVerifier", "Violation", "holds_poison_rows"]

NOT_ZERO = "not_zero"  # a page of the clear list has a non-zero byte after the clear
POISON = "poison"  # a page committed this step still holds poison
_KINDS = {1: NOT_ZERO, 2: POISON}


class Violation(msgspec.Struct, frozen=True, kw_only=True, gc=False, order=True):
    """One failed check: ``plane`` (index into the rank's planes), ``page``, ``kind``
    (``NOT_ZERO`` or ``POISON``). Ordered by plane, then page, then kind."""

    plane: int
    page: int
    kind: str


class SanitizerCheck:
    """A check in flight: ``query()`` (done?), ``synchronize()`` (block until done), ``result()``.

    Waitable like a CUDA event (``executor.wait_cuda_event(check)``). ``result()``
    waits if needed, then decodes the one host copy into a sorted tuple of
    :class:`Violation`; ``total`` is the number of violations the device found (it
    may exceed the ones returned when the device buffer was full). Nothing is left
    behind: the buffers belong to the backend and are reused once this check is done.
    """

    __slots__ = ("_query", "_sync", "_decode", "_result", "total")

    def __init__(self, query: Callable[[], bool], synchronize: Callable[[], None],
                 decode: Callable[[], tuple[int, list[Violation]]]) -> None:
        self._query = query
        self._sync = synchronize
        self._decode = decode
        self._result: tuple[Violation, ...] | None = None
        self.total = 0

    @classmethod
    def done(cls, violations: Sequence[Violation] = ()) -> SanitizerCheck:
        """A check whose result is already known (host-synchronous backends)."""
        found = sorted(violations)
        return cls(lambda: True, lambda: None, lambda: (len(found), found))

    def query(self) -> bool:
        return self._result is not None or self._query()

    def synchronize(self) -> None:
        if self._result is None:
            self._sync()

    def result(self) -> tuple[Violation, ...]:
        if self._result is None:
            self._sync()
            total, found = self._decode()
            self.total = total
            self._result = tuple(sorted(found))
        return self._result


def decode_flags(flags: Any, cleared: Sequence[int], committed: Sequence[int], num_planes: int) -> list[Violation]:
    """Violations from a host bool tensor ``[num_planes * (len(cleared) + len(committed))]``.

    Laid out as ``[planes, cleared]`` NOT_ZERO flags, then ``[planes, committed]`` POISON flags.
    """
    nc, nk = len(cleared), len(committed)
    out: list[Violation] = []
    for k, j in flags[: num_planes * nc].view(num_planes, nc).nonzero().tolist() if nc else ():
        out.append(Violation(plane=k, page=cleared[j], kind=NOT_ZERO))
    for k, j in flags[num_planes * nc:].view(num_planes, nk).nonzero().tolist() if nk else ():
        out.append(Violation(plane=k, page=committed[j], kind=POISON))
    return out


def decode_triples(buf: Sequence[int], max_out: int) -> tuple[int, list[Violation]]:
    """``(total, violations)`` from a device result ``[count, (plane, page, kind) * max_out]``."""
    total = int(buf[0])
    n = min(total, max_out)
    vals = list(buf[1:1 + 3 * n])
    return total, [Violation(plane=vals[i], page=vals[i + 1], kind=_KINDS[vals[i + 2]]) for i in range(0, 3 * n, 3)]


def holds_poison_rows(torch: Any, rows: Any) -> Any:
    """Bool ``[n]``: does each page row hold poison (module docstring)?

    ``rows``: ``[n, page_bytes]`` uint8, or ``[n, page_bytes / 8]`` int64 (whole 8-byte groups).
    """
    if rows.dtype == torch.int64:
        return rows.eq(-1).any(1)
    n, width = rows.shape
    full = width // 8
    hit = rows[:, : full * 8].reshape(n, full, 8).eq(255).all(2).any(1) if full else \
        torch.zeros(n, dtype=torch.bool, device=rows.device)
    return hit | rows[:, full * 8:].eq(255).all(1) if width % 8 else hit


class TorchVerifier:
    """The sanitizer's check with plain torch ops, on any device (the reference for the kernel).

    ``TorchVerifier(planes, stream=None)``: ``planes`` as the torch backend takes
    them (contiguous, ``[num_pages, ...]``, one device). ``start(cleared, committed)``
    validates both lists (``kvledger.core.checks.page_ids``: raises before reading
    anything), gathers the listed pages per plane, and returns a
    :class:`SanitizerCheck`; on CUDA the flags come back in one non-blocking copy
    into pinned memory, waited for through a CUDA event. Per-plane ops, no per-page loop.
    """

    def __init__(self, planes: Sequence[Any], stream: Any = None) -> None:
        import torch

        self._torch = torch
        self.planes = tuple(planes)
        self.num_pages = int(self.planes[0].shape[0])
        self.device = self.planes[0].device
        n = self.num_pages
        u8 = [(p.reshape(n, -1) if p.numel() else p.reshape(n, 0)).view(torch.uint8) for p in self.planes]
        # whole 8-byte groups: read the rows as int64 (one gather, no byte-wise temporaries)
        self._rows = [r.view(torch.int64) if r.shape[1] % 8 == 0 and r.data_ptr() % 8 == 0 else r for r in u8]
        self.stream = stream

    def start(self, cleared_ids: Sequence[int], committed_ids: Sequence[int]) -> SanitizerCheck:
        """Enqueue the check of ``cleared_ids`` (zero) and ``committed_ids`` (no poison)."""
        cleared = checks.page_ids(cleared_ids, self.num_pages)
        committed = checks.page_ids(committed_ids, self.num_pages)
        if not cleared and not committed:
            return SanitizerCheck.done()
        torch = self._torch
        if self.device.type != "cuda":
            flags = self._flags(cleared, committed)
            return SanitizerCheck.done(decode_flags(flags, cleared, committed, len(self._rows)))
        stream = self.stream if self.stream is not None else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            flags = self._flags(cleared, committed)
            host = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        planes = len(self._rows)
        return SanitizerCheck(event.query, event.synchronize,
                              lambda: _counted(decode_flags(host, cleared, committed, planes)))

    def _flags(self, cleared: tuple[int, ...], committed: tuple[int, ...]) -> Any:
        torch = self._torch
        parts = []
        if cleared:
            idx = _index(torch, cleared, self.device)
            parts += [rows.index_select(0, idx).any(1) for rows in self._rows]
        if committed:
            idx = _index(torch, committed, self.device)
            parts += [holds_poison_rows(torch, rows.index_select(0, idx)) for rows in self._rows]
        return torch.cat(parts)


def _counted(found: list[Violation]) -> tuple[int, list[Violation]]:
    return len(found), found


def _index(torch: Any, ids: tuple[int, ...], device: Any) -> Any:
    host = torch.tensor(ids, dtype=torch.int64)
    return host if device.type != "cuda" else host.pin_memory().to(device, non_blocking=True)
