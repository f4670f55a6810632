"""The remote half of a step (``StepRunner``'s base): the handshake with the peers before the
ranks run, and their COMPLETEs after.

    seal ─► _remote_handshake: PREPARE to every peer, READY from each, LAUNCH (or ABORT:
            the step is recorded as aborted, nothing ran anywhere, StepFailedError
            names the culprit) ─► the local ranks' parts ─► _collect_remote: every
            peer's COMPLETE (a failed, lost or silent peer is a failure of the step)
            ─► the outcome recorded with the local one (steps.py)

A sealed step the caller abandoned before its handshake still goes through the wire
(``_wire_catch_up``: PREPARE then ABORT), so the peers' step numbers stay in line with
the ledger's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from kvledger.core.errors import StepFailedError, WireProtocolError
from kvledger.core.events import StepPlan


class RemoteSteps:
    """Mixed into ``StepRunner``: uses its ``leader``, ``remote``, ``world_size``, ``metrics``,
    ``settle`` and ``_log``."""

    leader: Any
    remote: Any
    world_size: int
    metrics: Any
    _log: Any

    settle: Callable[..., Awaitable[None]]  # StepRunner.settle: the one path that records an outcome

    async def _remote_handshake(self, plan: StepPlan, payload: bytes) -> None:
        """PREPARE/READY with every peer; returns on LAUNCH. On anything else the step
        is recorded as aborted (no rank ran it) and this raises: ``StepFailedError``
        naming the culprit rank for an ABORT, or what interrupted it (cancellation)."""
        step = plan.step
        t0 = time.perf_counter()
        try:
            decision = await self.leader.run_step(plan, payload, timeout=self.remote.timeout)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._wire_catch_up(plan)
                reason = "cancelled" if isinstance(exc, anyio.get_cancelled_exc_class()) else repr(exc)
                await self.settle(step, (), f"remote handshake: {reason}")
            raise
        if self.metrics is not None:
            self.metrics.wire_decision(decision, time.perf_counter() - t0)
        if decision.launch:
            return
        from kvledger.wire.codec import NO_RANK

        base = self.world_size - 1
        rank = base + decision.rank if decision.rank != NO_RANK else self.world_size
        cause = WireProtocolError(decision.code, decision.detail or "aborted", remote=True)
        reason = f"rank {rank} aborted the step over the wire: code {int(decision.code)}: {decision.detail}"
        await self.settle(step, (), reason)
        err = StepFailedError(step, rank, [(rank, cause)], reason, plan.clear_list)
        if self.metrics is not None:
            self.metrics.step_failed(err)
        raise err from cause

    async def _wire_catch_up(self, plan: StepPlan) -> None:
        """A sealed step that never reached the wire (the caller was cancelled first):
        put it through the handshake with a deadline that is already over, so the
        peers see PREPARE then ABORT and their step numbers stay in line with the
        ledger's. Call shielded. Should a LAUNCH go out all the same, the ledger
        still records the step as aborted and its clear list is cleared again next
        step (zeroing is idempotent)."""
        leader = self.leader
        if leader is None or leader.next_step != plan.step:
            return
        try:
            await leader.run_step(plan, b"", timeout=1e-9)
        except Exception as exc:  # the peers will refuse the next step: it aborts, naming them
            self._log.error("wire_catch_up_failed", step=plan.step, error=repr(exc))

    async def _collect_remote(self, step: int) -> Any:
        """The peers' COMPLETEs for a launched step (``remote.collect_remote``), waited for
        whatever happens to the caller: the step's outcome is recorded from them."""
        from .remote import collect_remote

        with anyio.CancelScope(shield=True):
            return await collect_remote(self.leader, self.remote, step, local_ranks=self.world_size)
