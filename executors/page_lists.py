"""Page lists on their way to the device: pinned host rows and device rows, reused without host waits.

    ListRing (one per backend and use)        slot i:
      acquire() ──► the next slot whose       host row   pinned int32 [words]  (the host packs ids here)
                    last use has finished     device row int32 [words]         (a kernel reads it)
                    (event query, never a     done       CUevent: recorded after the last work
                    wait); when it is still              that read either row
                    busy a new slot is made   copied     CUevent: recorded after the H2D copy
                    in its place

A slot is reused only once its ``done`` event has completed, checked with a
non-blocking query; a busy slot is never waited for: the ring grows by one slot
instead (the engine's bounded queue bounds how far the host runs ahead, so the
ring stays small). Nothing here synchronizes the host with the device.

Packing: ``pack(slot, head, ids)`` writes ``[*head, *ids]`` as int32 with one
``struct.pack_into`` (no per-id Python work beyond the C-level conversion).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from . import cuda_driver

__all__ = ["ListRing", "ListSlot", "packer"]

_PACKERS: dict[int, struct.Struct] = {}


def packer(words: int) -> struct.Struct:
    """A cached ``struct.Struct`` packing ``words`` native int32 values."""
    p = _PACKERS.get(words)
    if p is None:
        if len(_PACKERS) > 256:
            _PACKERS.clear()
        p = _PACKERS[words] = struct.Struct(f"={words}i")
    return p


class ListSlot:
    """One host row + device row + their events (see :class:`ListRing`). ``host_dptr``: the
    address at which a kernel reads the host row itself (pinned memory is mapped; None where
    the driver says it is not)."""

    __slots__ = ("host", "host_np", "host_ptr", "host_dptr", "device", "dptr", "done", "copied", "used", "graphs")

    def __init__(self, torch: Any, words: int, device: Any) -> None:
        self.host = torch.zeros(words, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.host_ptr = int(self.host.data_ptr())
        self.host_dptr = cuda_driver.host_device_pointer(self.host_ptr)  # where a kernel reads the host row
        self.device = torch.zeros(words, dtype=torch.int32, device=device)
        self.dptr = int(self.device.data_ptr())
        self.done = cuda_driver.event_create()
        self.copied = cuda_driver.event_create()
        self.used = False
        self.graphs: dict[int, Any] = {}  # a user's graphs that read this row (TritonClearBackend.graph_clear)


class ListRing:
    """Slots of ``words`` int32 for lists in flight (module docstring); grows, never waits."""

    def __init__(self, torch: Any, words: int, device: Any, slots: int = 4) -> None:
        self._torch = torch
        self.words = words
        self.device = device
        self._slots = [ListSlot(torch, words, device) for _ in range(slots)]
        self._next = 0
        self.grown = 0

    def __len__(self) -> int:
        return len(self._slots)

    def slots(self) -> tuple[ListSlot, ...]:
        """Every slot, for set-up work on the rows (nothing is taken)."""
        return tuple(self._slots)

    def try_acquire(self) -> ListSlot | None:
        """The next slot if it is free for reuse, else None (the ring never grows here)."""
        i = self._next
        slot = self._slots[i]
        if slot.used and not cuda_driver.event_query(slot.done):
            return None
        self._next = (i + 1) % len(self._slots)
        slot.used = True
        return slot

    def acquire(self) -> ListSlot:
        """The next slot free for reuse (its ``done`` event completed); a new one if it is busy."""
        i = self._next
        slot = self._slots[i]
        if slot.used and not cuda_driver.event_query(slot.done):
            slot = ListSlot(self._torch, self.words, self.device)
            self._slots.insert(i, slot)
            self.grown += 1
        self._next = (i + 1) % len(self._slots)
        slot.used = True
        return slot

    @staticmethod
    def pack(slot: ListSlot, head: Sequence[int], ids: Sequence[int]) -> int:
        """Write ``[*head, *ids]`` into the slot's host row; returns the bytes written."""
        words = len(head) + len(ids)
        packer(words).pack_into(slot.host_np, 0, *head, *ids)
        return 4 * words

    @staticmethod
    def pack2(slot: ListSlot, first: Sequence[int], second: Sequence[int]) -> int:
        """Write ``[len(first), len(second), *first, *second]``; returns the bytes written."""
        words = 2 + len(first) + len(second)
        packer(words).pack_into(slot.host_np, 0, len(first), len(second), *first, *second)
        return 4 * words
