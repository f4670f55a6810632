"""What travels between the engine and a rank's executor, one plan at a time.

    StepInputs    what one rank gets for one step: input copies, and data for the graph
    RankContext   what a step graph is told about its rank: graph(ctx, step, inputs)
    StepJob       one plan for one rank: the plan, its inputs, its scope, where to answer
    StepReplies   where the ranks answer one step (one RankOutcome each, never blocking)
    RankOutcome   a rank's answer: "ok" (with its RankTiming), "failed" or "cancelled"
    RankTiming    where one rank spent one step

``executor.py`` runs them (``RankExecutor``) and exports them too.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import Protocol, cast

import anyio
import anyio.lowlevel
import msgspec

from ..core.errors import InvalidArgumentError
from ..core.events import StepPlan
from .backend import ClearBackend
from .bytes_backend import copy_bytes
from .sanitize import Violation

__all__ = ["NO_INPUTS", "RankContext", "RankOutcome", "RankTiming", "StepInputs", "StepJob", "StepReplies",
           "copy_pair"]

_BUFFERS = (bytearray, memoryview, array.array)


class _Tensor(Protocol):
    """A tensor as an input copy uses it (``torch.Tensor``)."""

    def copy_(self, src: object, non_blocking: bool = False) -> object: ...


def copy_pair(src: object, dst: object) -> None:
    """One input copy on the host path: a byte buffer ``dst`` (bytearray, memoryview, array) gets
    ``src``'s bytes (``bytes_backend.copy_bytes``: the same length, else ``ValueError``); anything
    else is a tensor: ``dst.copy_(src, non_blocking=True)``. What it raises fails the rank's job."""
    if isinstance(dst, _BUFFERS):
        copy_bytes(src, dst)
    else:
        cast(_Tensor, dst).copy_(src, non_blocking=True)


@dataclasses.dataclass(frozen=True, slots=True)
class StepInputs:
    """What one rank gets for one step.

    ``copies``: ``(src, dst)`` pairs run before the clears (``copy_pair``): tensors as
    ``dst.copy_(src, non_blocking=True)`` on the model stream (host -> device staging,
    usually; on a CUDA rank a plain pair, one dtype and shape, contiguous, is the same bytes
    copied by one driver call: ``cuda_rank.CudaRank.copy_all``), byte buffers (a bytearray,
    a memoryview, an array: a ``bytes`` rank's) byte for byte. Keep a source unchanged until the step
    is done (``run_step`` returned, or raised).
    ``data``: anything; handed to the graph untouched.

    Raises ``InvalidArgumentError`` when ``copies`` is not a sequence of pairs.
    """

    copies: Sequence[tuple[object, object]] = ()
    data: object = None

    def __post_init__(self) -> None:
        copies = self.copies
        try:
            pairs = tuple(tuple(c) for c in copies)
        except TypeError:
            raise InvalidArgumentError(f"copies must be a sequence of (src, dst) pairs, got {copies!r}") from None
        for c in pairs:
            if len(c) != 2:
                raise InvalidArgumentError(f"each copy is a (src, dst) pair, got {len(c)} items")
        object.__setattr__(self, "copies", pairs)


NO_INPUTS = StepInputs()


@dataclasses.dataclass(frozen=True, slots=True)
class RankContext:
    """What a step graph is told about its rank: ``graph(ctx, step, inputs)``.

    ``stream`` is the model stream (``None`` on the CPU); an async graph that launches
    CUDA work after an ``await`` must do so under ``torch.cuda.stream(ctx.stream)``.
    """

    rank: int
    world_size: int
    device: object
    stream: object
    planes: tuple[object, ...]
    backend: ClearBackend | None


class RankTiming(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where one rank spent one step, in seconds.

    ``copies_s``/``clear_s``/``graph_s``: the three phases (CUDA event time on the
    model stream for CUDA ranks: ``clear_s`` is the clear's device time; host time
    on the CPU, where the work is synchronous).
    ``clear_host_s``: host time spent enqueuing the clear (the backend's ``clear``
    call, id checks included), on every device.
    ``sanitize_s``: poison + check (device time on CUDA, host time on the CPU); 0
    when the sanitizer is off.
    ``total_s``: host time from the executor taking the plan to seeing it complete.
    """

    rank: int
    copies_s: float
    clear_s: float
    graph_s: float
    total_s: float
    clear_host_s: float = 0.0
    sanitize_s: float = 0.0


class RankOutcome(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A rank's answer to one job: ``status`` is ``"ok"``, ``"failed"`` or ``"cancelled"``."""

    rank: int
    step: int
    status: str
    timing: RankTiming | None = None
    error: BaseException | None = None
    violations: tuple[Violation, ...] = ()


class StepReplies:
    """Where the ranks answer one step: each rank's ``RankOutcome`` is appended to
    ``outcomes``; ``wait()`` returns once every expected rank answered, any rank did not
    complete, or ``wake()`` was called (a rank's executor task ended). ``close()`` makes
    later answers vanish (the engine gave up on the step). The event behind ``wait`` is
    made only when someone waits (inline ranks never do)."""

    __slots__ = ("outcomes", "expected", "closed", "_woken", "_event")

    def __init__(self, expected: int) -> None:
        self.outcomes: list[RankOutcome] = []
        self.expected = expected
        self.closed = False
        self._woken = False
        self._event: anyio.Event | None = None

    def send_nowait(self, outcome: RankOutcome) -> None:
        if self.closed:
            return
        outcomes = self.outcomes
        outcomes.append(outcome)
        if outcome.status != "ok" or len(outcomes) >= self.expected:
            self._woken = True  # (wake, inlined)
            if self._event is not None:
                self._event.set()

    def wake(self) -> None:
        """End the current ``wait``."""
        self._woken = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        """Until woken (see the class docstring); a checkpoint either way."""
        if self._woken:
            await anyio.lowlevel.checkpoint()
            return
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()

    def rearm(self) -> None:
        """Wait afresh for the remaining answers (after a failure woke us)."""
        self._event = None
        self._woken = len(self.outcomes) >= self.expected

    def close(self) -> None:
        self.closed = True


class StepJob:
    """One plan for one rank. ``scope`` cancels this rank's part of the step only (None: the
    job runs under its caller's scopes, as inline ranks do); ``reply`` (a ``StepReplies``)
    receives exactly one ``RankOutcome``, never blocking.

    For the sanitizer: ``poison``, the pages to fill with 0xFF before the clear, and
    ``committed``, the pages committed this step (checked for poison after it); empty
    when not given. Read only by an executor with ``sanitize=True``.
    ``checked``: the plan's clear list is a sealed ledger plan's tuple (distinct ids in
    range): the backend's ``clear_checked`` skips re-checking it. Only the engine, which
    sealed the plan, sets it (a list that is not a tuple is checked all the same).
    """

    __slots__ = ("plan", "inputs", "scope", "reply", "poison", "committed", "checked")

    def __init__(self, plan: StepPlan, inputs: StepInputs, scope: anyio.CancelScope | None, reply: StepReplies, *,
                 poison: Sequence[int] | None = None, committed: Sequence[int] | None = None,
                 checked: bool = False) -> None:
        self.plan = plan
        self.checked = checked and type(plan.clear_list) is tuple
        self.inputs = inputs
        self.scope = scope
        self.reply = reply
        self.poison: Sequence[int] = () if poison is None else poison
        self.committed: Sequence[int] = () if committed is None else committed
