"""The embedded async engine: one object a serving loop holds (anyio).

    async with kvledger.open_engine(geometry, log=path, ranks=[RankSpec(planes=...), ...]) as engine:
        pages = await engine.reserve(r, 3)
        await engine.commit(r, step, 3)              # marked pages join the step's clear list
        result = await engine.run_step(step, inputs) # seal -> every rank: copies, clears, graph

    command ──► a cancellation point, then one serialized path to the ledger (access.py):
                on the loop, without yielding again: in memory, or a log that writes in the
                background; in the engine's one worker thread: a log that fsyncs inline;
                flush; close
    run_step ─► seal_step ─► StepPlan ─► hooks' sealed() ─► the ranks' strategy, chosen once
                by open_engine (ranks.py, remote_steps.py):
                  InlineRanks      in run_step's own task, rank after rank: CPU ranks whose
                                   graph is a plain function, or a lone rank of any kind
                  DispatchedRanks  one executor task per rank, over bounded streams
                  WireRanks        PREPARE / READY / LAUNCH with remote peers around either,
                                   their COMPLETEs after
               ◄── one RankOutcome per rank ──┘
               ├─ all ok:   StepCompleted(step, rank) for every rank  ─► StepResult
               └─ any not:  StepAborted(step, reason), then StepCompleted for
                            the ranks that did finish                 ─► StepFailedError
               then every hook's settled() (on the ledger's path); a failed step's
               failed() may raise another error instead (the sanitizer's SanitizerError)

Steps run one at a time (``run_step`` waits for the previous one); commands may
interleave with a running step (a commit into the next step, say). With a log
that fsyncs inline, each awaited command is one worker-thread round trip (about
90 us measured); a serving loop issues a step's commands in one ``await
engine.call(fn)`` instead (one round trip; bench/bench_engine.py). With a log
that writes in the background (``log.background``), commands run on the loop as
in memory, except while the log says an append may wait for the disk
(``EventLog.may_block``: back-pressure near ``max_lag_bytes``, a segment
rotation due): then they run in the worker thread and the loop keeps running.

Waiting for the disk is opt-in, never on the step path:

    await engine.flush()           write and fsync everything so far (in the worker thread);
                                   afterwards engine.ledger.durable_seq == engine.seq - 1
    await engine.wait_durable(seq) wait, writing nothing, until event seq is durable: the
                                   writer thread gets there shortly after the seal of its
                                   step (a log that fsyncs inline: only a seal or a flush does)

Optional parts, ``open_engine(..., extras=ExtraOptions(...))`` (``opening.py`` lists every
option, and its groups: log_options=LogOptions, steps=StepOptions, extras=ExtraOptions):

    sanitize=True      debug mode: poison -> clear -> check on every local rank; a violation
                       is recorded and raises SanitizerError with the page's lifecycle
    metrics=...        a kvledger.metrics.LedgerMetrics, fed by the engine
    kv_events=...      a KVEventPublisher (or an endpoint, or vLLM's --kv-events-config JSON):
                       one batch per step, as steps complete
    observers=(...)    the caller's Ledger observers, composed with the engine's into one

What a failure leaves behind:

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
  cancellation is re-raised. Inline CPU ranks never yield while they run (run_step
  yields once, at its entry), so a cancellation that comes while they run lands
  after ``run_step`` returned, the step completed.
  Either way the ledger (and its log) stays consistent: its digest equals a
  replay of its events;
* leaving the engine's ``async with`` (R16): commands and steps not yet sealed
  raise ``EngineClosedError`` (nothing recorded); the step in flight runs to its
  end when the body returned, or, when the body raised or was cancelled, is
  cancelled and recorded as ``StepAborted(step, "engine closed")`` (its caller
  gets ``EngineClosedError``), unless its ranks run inline and none of their graphs
  awaits (CPU ranks; a lone CUDA rank waits only for its own device work): it then
  runs to its end; then the executors stop and the log is closed,
  the last call on the ledger's path. Every later call raises
  ``EngineClosedError`` and nothing is written after the close;
* if recording a step's outcome itself fails (a log write error), the engine is
  broken: every later call raises ``EngineClosedError`` chained to that error;
* in sanitize mode, a rank whose check found violations fails the step like a
  raising rank, except that each violation is recorded first
  (``SanitizerViolation``), then ``StepAborted``, then the completions of the
  ranks that ran; ``run_step`` raises ``SanitizerError`` (its ``__cause__`` the
  ``StepFailedError``), and the step's clear list is carried into the next step;
* with steps in flight together (``steps=StepOptions(depth=2)`` or more: a
  scheduler task seals step k+1 while step k has not run or still runs; the
  ranks run the steps one after the other, in step order), a failure of step k
  aborts k and every later sealed step with one ``StepAborted(k)``, recorded
  before k's completions; each later step runs nothing and its ``run_step``
  raises ``StepFailedError`` (``failures`` empty, the message naming step k);
  every clear list of them is listed again for the next step, the oldest plan's
  pages first. A later step cancelled before it ran is recorded as aborted (and
  the steps sealed after it with it); the earlier one runs on. A page freed in
  step k and committed in step k+1 is safe: each rank runs k's graph before
  k+1's clear (on a CUDA rank, both on its model stream).

Remote ranks (``open_engine(..., remote=RemoteOptions(...))``, see ``remote.py``):
after sealing, ``run_step`` runs the wire's PREPARE/READY/LAUNCH handshake with
every peer (the engine is the wire leader) under ``RemoteOptions.timeout``; only
on LAUNCH do the local ranks run. A REJECT, an expired deadline or a lost or
missing peer aborts the step: ``StepFailedError`` names the rank (engine
numbering), nothing is cleared or run anywhere, and the ledger records
``StepAborted`` exactly as for a failing local rank. After the local ranks ran,
the engine waits (``RemoteOptions.complete_timeout``) for every peer's COMPLETE
(``remote.collect_remote``) and records ``StepCompleted`` for each peer that ran
the step; a peer that reports a failure, loses its link or stays silent fails
the step like a local rank: ``StepAborted`` first, then the completions of the
ranks that ran.

The rooms:

    engine.py    Engine: the ledger's commands, awaited, run_step's entry, the lifecycle seams; RankSpec
    opening.py   open_engine: the ledger, the strategies, the hooks, the wire leader; the options
    options.py   StepOptions, ExtraOptions: open_engine's option groups (LogOptions: kvledger.options)
    access.py    LedgerAccess: the one path to the ledger (loop or worker thread; open/closing/closed)
    steps.py     StepRunner (seal, run a sealed step, record); OneStep / InFlight: the order of steps
    ranks.py     RankStrategy: InlineRanks, DispatchedRanks (how a step reaches the local ranks)
    remote_steps.py  WireRanks: the remote peers around the local ranks' strategy
    recorder.py  StepRecorder: the one path that records an outcome, and the hooks' settled()
    records.py   SealedStep, StepResult, StepSettled; jobs_for, the one StepJob builder
    plugins.py   the typed seams: MetricsHooks, EventPublisher, StepHook and its two adapters
    extras.py    Extras: metrics, KV events, the sanitizer's tracker and the caller's observers, wired in
    sanitizer.py SanitizerTracker: each plan's poison and committed lists, page histories, SanitizerError
    remote.py    RemoteOptions (the leader side's options), collect_remote, serve_remote_rank (a peer)

``import kvledger.engine`` does not import torch; a rank's planes bring it in.
"""

from kvledger.executors.executor import RankContext, RankTiming, StepInputs
from kvledger.options import LogOptions

from .engine import Engine, RankSpec
from .opening import open_engine
from .options import ExtraOptions, StepOptions
from .remote import RemoteOptions, serve_remote_rank
from .steps import StepResult

__all__ = [
    "Engine",
    "ExtraOptions",
    "LogOptions",
    "RankContext",
    "RankSpec",
    "RankTiming",
    "RemoteOptions",
    "StepInputs",
    "StepOptions",
    "StepResult",
    "open_engine",
    "serve_remote_rank",
]


def __getattr__(name: str) -> object:
    """Deprecated names, for one more release (each access warns): ``RemoteRanks``
    (``RemoteOptions``)."""
    if name == "RemoteRanks":
        from .remote import remote_ranks_alias

        return remote_ranks_alias()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
