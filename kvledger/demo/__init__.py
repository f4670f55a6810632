"""``kvledger demo``: the seed's KV-pressure failure, reproduced and fixed on torch's
real ``scaled_dot_product_attention``.

A tiny hybrid decoder (attention + a gated linear recurrence) serves the seed's
trace (143 requests, alternating short and long prompts) through the embedded
async engine, with FP8 paged KV managed by kvledger. Its recurrent-state snapshots
are written through rows that alias KV pages; under a tight page budget released
snapshot pages come back as partially filled tail pages. With clears off their
float32 row bytes decode as FP8 NaN in the masked slots and the request fails
(INVALID_SPECULATION, device error 6); with clears on every request's logits are
bit-identical to a reference run that never reuses a page.

    workload.py   DemoConfig, the request trace          (no torch)
    model.py      the decoder, paged FP8 attention, snapshot rows
    ranks.py      each rank's planes and model shard, the step graph, SkipClearBackend
    run.py        the serving simulation through kvledger.engine, run_demo
    snapshots.py  the live snapshots: which to release next, releasing them, page reuse
    prefix.py     --prefix-cache: system prompts shared through the ledger's prefix cache
    bare.py       the engine's per-step overhead against the same graph run bare
    results.py    RunResult, the logits oracle, DemoReport
    table.py      progress bars and the final table      (rich)
    cli.py        add_arguments(parser), main(args)      (no torch at import)

``--prefix-cache`` gives every prompt its tenant's system prompt and shares its pages
between the tenant's requests (cached, shared, evicted under pressure through the
ledger); the logits still equal a reference that shares nothing, and with clears off
the seed's failure is back. Every run also reports the clear phase's host and device
time per step and the engine's per-step overhead against a bare loop running the same
graph (``bare.py``).

Importing ``kvledger.demo`` does not import torch.
"""

from .workload import INVALID_SPECULATION, DemoConfig, RequestSpec

__all__ = ["INVALID_SPECULATION", "DemoConfig", "RequestSpec"]
