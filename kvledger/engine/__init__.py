"""The embedded async engine: one object a serving loop holds (anyio).

    async with kvledger.open(geometry, log=path, ranks=[RankSpec(planes=...), ...]) as engine:
        pages = await engine.reserve(r, 3)
        await engine.commit(r, step, 3)              # marked pages join the step's clear list
        result = await engine.run_step(step, inputs) # seal -> every rank: copies, clears, graph

    command ──► one serialized path to the ledger (access.py), which knows the engine's state:
                on the loop, without yielding: in memory, or a log that writes in the background
                in the engine's one worker thread: a log that fsyncs inline; flush; close
    run_step ─► seal_step ─► StepPlan ─┬─► rank 0 ─┐  CPU ranks with plain-function graphs: inline,
                                       ├─► rank 1 ─┤  in run_step's task, rank by rank; others: one
                                       └─► ...     ┘  executor task per rank, over bounded streams
               ◄── one RankOutcome per rank ──┘
               ├─ all ok:   StepCompleted(step, rank) for every rank  ─► StepResult
               └─ any not:  StepAborted(step, reason), then StepCompleted for
                            the ranks that did finish                 ─► StepFailedError

Steps run one at a time (``run_step`` waits for the previous one); commands may
interleave with a running step (a commit into the next step, say). With a log
that fsyncs inline, each awaited command is one worker-thread round trip (about
90 us measured); a serving loop issues a step's commands in one ``await
engine.call(fn)`` instead (one round trip; bench/bench_engine.py). With a log
that writes in the background (``log.background``), commands run on the loop as
in memory; ``flush`` and the close wait for the disk in the worker thread. What
a failure leaves behind:

* a command error (``OutOfPagesError``, ``PageNotHeldError``, ...) changes nothing;
* a rank that raises (a copy, the clear or the graph) fails the step: the other
  ranks' parts are cancelled (inline ranks after it never start), the ranks that
  had already finished are recorded as completed, nothing is recorded as
  completed for the failed or cancelled ranks, and the ledger records
  ``StepAborted`` so the step's clear list is carried into the next step
  (nothing of it is assumed zeroed). ``StepFailedError`` names the step and the rank;
* a caller that cancels ``run_step`` (``fail_after``, a cancelled scope):
  before the step is sealed (while ``run_step`` waits for the previous step or
  for the ledger's worker thread; a deadline already over when it is called)
  nothing is recorded: the step stays open, its clear list intact, and
  ``run_step(step)`` may be called again. Once sealed, the step is settled as
  for a failing rank (completions of the ranks that finished,
  ``StepAborted(step, "cancelled")``), under a shielded scope, then the
  cancellation is re-raised. Inline ranks never yield, so a cancellation that
  comes while they run lands after ``run_step`` returned, the step completed.
  Either way the ledger (and its log) stays consistent: its digest equals a
  replay of its events;
* leaving the engine's ``async with`` (R16): commands and steps not yet sealed
  raise ``EngineClosedError`` (nothing recorded); the step in flight runs to its
  end when the body returned, or, when the body raised or was cancelled, is
  cancelled and recorded as ``StepAborted(step, "engine closed")`` (its caller
  gets ``EngineClosedError``); then the executors stop and the log is closed,
  the last call on the ledger's path. Every later call raises
  ``EngineClosedError`` and nothing is written after the close;
* if recording a step's outcome itself fails (a log write error), the engine is
  broken: every later call raises ``EngineClosedError`` chained to that error.

Remote ranks (``open_engine(..., remote=RemoteRanks(...))``, see ``remote.py``):
after sealing, ``run_step`` runs the wire's PREPARE/READY/LAUNCH handshake with
every peer (the engine is the wire leader) under ``RemoteRanks.timeout``; only
on LAUNCH do the local ranks run. A REJECT, an expired deadline or a lost or
missing peer aborts the step: ``StepFailedError`` names the rank (engine
numbering), nothing is cleared or run anywhere, and the ledger records
``StepAborted`` exactly as for a failing local rank.

The rooms:

    engine.py    Engine: the ledger's commands, awaited, run_step's entry, closing; RankSpec
    access.py    LedgerAccess: the one path to the ledger (loop or worker thread; open/closing/closed)
    steps.py     StepRunner: one step across the ranks (seal, handshake, inline or dispatch, record); StepResult
    opening.py   open_engine: the ledger, the executors' task group, the wire leader
    remote.py    RemoteRanks (the leader side's options) and serve_remote_rank (a peer)

``import kvledger.engine`` does not import torch; a rank's planes bring it in.
"""

from kvledger.executors.executor import RankContext, RankTiming, StepInputs

from .engine import Engine, RankSpec
from .opening import open_engine
from .remote import RemoteRanks, serve_remote_rank
from .steps import StepResult

__all__ = [
    "Engine",
    "RankContext",
    "RankSpec",
    "RankTiming",
    "RemoteRanks",
    "StepInputs",
    "StepResult",
    "open_engine",
    "serve_remote_rank",
]
