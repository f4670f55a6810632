"""``CudaRank``: what a CUDA rank keeps from one plan to the next, made once (no per-plan lookups).

    on_stream   one ``torch.cuda.StreamContext`` for the model stream, entered around each
                plan's enqueued work (copies, poison, clear, check, a sync graph); a plan
                never runs nested in another on one rank, so one context object serves them all
    done        the completion event, recorded after the graph and awaited without blocking
                the loop (``executor.wait_cuda_event``); timed only with ``timings``
    marks       with ``timings``: start, copied, poisoned, cleared, checked (the poisoned and
                checked ones recorded in sanitize mode only); ``phases()`` reads them

``import torch`` happens here, when a CUDA rank is built: ``import kvledger.executors``
never imports it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CudaRank"]


class CudaRank:
    """A CUDA rank's model stream, its stream context and its events (module docstring).
    ``stream`` None: the device's current stream now is the model stream."""

    __slots__ = ("stream", "on_stream", "done", "marks")

    def __init__(self, device: Any, stream: Any, *, sanitize: bool, timings: bool) -> None:
        import torch

        if stream is None:
            stream = torch.cuda.current_stream(device)
        self.stream = stream
        self.on_stream = torch.cuda.stream(stream)
        self.done = torch.cuda.Event(enable_timing=timings)
        self.marks: tuple[Any, ...] | None = None
        if timings:
            self.marks = tuple(torch.cuda.Event(enable_timing=True) for _ in range(5))

    def phases(self, sanitize: bool) -> tuple[float, float, float, float]:
        """``(copies_s, clear_s, graph_s, sanitize_s)`` of the plan just completed, from the marks
        (device time on the model stream); zeros without ``timings``. Call after ``done`` completed."""
        marks = self.marks
        if marks is None:
            return 0.0, 0.0, 0.0, 0.0
        start, copied, poisoned, cleared, checked = marks
        done = self.done
        copies_s = start.elapsed_time(copied) * 1e-3
        if not sanitize:
            return copies_s, copied.elapsed_time(cleared) * 1e-3, cleared.elapsed_time(done) * 1e-3, 0.0
        sanitize_s = (copied.elapsed_time(poisoned) + cleared.elapsed_time(checked)) * 1e-3
        return copies_s, poisoned.elapsed_time(cleared) * 1e-3, checked.elapsed_time(done) * 1e-3, sanitize_s
