"""Cost in the user's unit: vLLM's own ``Scheduler`` step, without and with kvledger installed.

    $(python scripts/vllm-conformance --version 0.34.0 --python) bench/bench_vllm_scheduler.py [--quick] [--split]
    (any version's conformance venv; elsewhere the module reports itself skipped)

``--split`` adds a second pass per config: vLLM's pool against kvledger's pool with an
in-memory ledger (``install()``, no log), alternated the same way; its ratio (against that
pass's own vLLM baseline) is what the pool and ledger cost apart from the durable log.

vLLM's ``Scheduler`` (``AsyncScheduler`` for async scheduling) is built the way vLLM's own
``tests/v1/core`` build it: ``tests/v1/core/utils.py``'s ``create_scheduler`` for the plain
model, and its pieces (``VllmConfig`` + a two-group ``KVCacheConfig``, as
``test_scheduler.py``'s ``_create_hybrid_mamba_connector_scheduler`` does, without the
connector) for the hybrid one; that file is read from the installed version's source
distribution (``tests/support/upstream.py``), never copied here. The model config is
OPT-125m's, written from transformers' ``OPTConfig`` into a temporary folder (no hub, no
weights, no tokenizer). vLLM's KV events are on (``KVEventsConfig(enable_kv_cache_events=True,
publisher="null")``: the pool builds every event, the null publisher drops the batches) on
both sides.

Trace (fixed seed, generated before any clock runs): 240 requests (80 with --quick) arriving
about one per step; prompts are one of 6 shared system prefixes of 64-512 tokens (none for one
in five) plus 16-768 tokens of their own; 8-160 output tokens, ``ignore_eos``; 16-token
blocks, a pool of 900 blocks (``NUM_BLOCKS``: preemption under pressure, eviction of cached
blocks with caching on), at most 48 running requests, a 1,024-token step budget (long
prompts are prefilled in chunks). Per step: the step's arrivals ``add_request`` (untimed),
then ``schedule()`` and ``update_from_output()`` with a mock ``ModelRunnerOutput`` built as
vLLM's tests build it (one token per scheduled request whose prefill is complete, none for a
partial prefill chunk: "EngineCore returns no partial prefill outputs"); with async
scheduling, vLLM's one-step lag (step N+1 is scheduled before step N's output is applied).

    vllm      vLLM's own BlockPool
    kvledger  ``kvledger.integrations.vllm.install(log=<a fresh directory>, fsync="background")``:
              LedgerBlockPool writing the durable log (one file per pool; the writer thread
              syncs in the background; closing is not timed)

Both sides of a repeat are built first, then alternate: the installation is active while
the vLLM side runs too, so its ``KVCacheManager.take_new_block_ids`` goes through
kvledger's wrapper (one call and an ``isinstance`` per step, which hands vLLM's pool
straight through): a fraction of a microsecond added to vLLM's side (it flatters kvledger by that much).

Configs: plain (one full-attention group) and hybrid (full attention + Mamba; with caching on,
``mamba_cache_mode="align"``), prefix caching off and on, sync and async scheduling: 8 in all.

Timing: only ``schedule()`` + ``update_from_output()``, each step under its own
``perf_counter`` pair. The steps every side runs are cut into 12 segments; sides alternate
within each segment (the order flips every segment) with the collector off
(``_common.timed_segments``), 5 repeats (3 with --quick), each on fresh schedulers, requests
and logs; the figure is the sum over segments of each segment's best time across repeats,
divided by the steps (the first repeat warms up; its times count only where they are a
segment's best). Untimed check first: both sides schedule the same
tokens, preempt the same requests and hand out the same block ids at every step (a digest
of each ``SchedulerOutput``), else the module raises, except where kvledger's fence may
change vLLM's decisions (``fenced``: prefix caching on, and a hybrid model or async
scheduling: a block whose writing step has not completed is not a hit yet); there the step
where the two first differ and both sides' prefix-hit tokens are reported, and the sides are
timed over the steps both run (the work then differs a little: kvledger's side recomputes
what it could not take from the cache). ``added`` = kvledger / vllm - 1: what kvledger adds
to vLLM's scheduler step (issue 29's target: <= 5 %).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import random
import sys
import tempfile
from collections import deque
from dataclasses import dataclass
from typing import Any

_HERE = pathlib.Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from _common import print_table, timed_segments  # noqa: E402

TARGETS = {"worst_added_pct": ("<=", 5.0)}
NUM_BLOCKS = 900
BLOCK_SIZE = 16
MAX_RUNNING = 48
STEP_TOKENS = 1024
SEGMENTS = 12
OPT_125M = dict(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072, num_attention_heads=12,
                max_position_embeddings=2048, word_embed_proj_dim=768, architectures=["OPTForCausalLM"])


# ------------------------------------------------------------------------------------------ trace


@dataclass(frozen=True)
class TraceRequest:
    arrival: int  # the step it is added before
    prompt: tuple[int, ...]
    max_tokens: int


def make_trace(seed: int, requests: int) -> list[TraceRequest]:
    """Requests that share system prefixes, with long prompts (chunked prefill) and mixed outputs."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1000, 50000) for _ in range(rng.choice((64, 128, 256, 512))))
                for _ in range(6)]
    out, step = [], 0
    for _ in range(requests):
        step += rng.choice((0, 1, 1, 1, 2))
        prefix = () if rng.random() < 0.2 else rng.choice(prefixes)
        own = tuple(rng.randrange(1000, 50000) for _ in range(rng.randint(16, 768)))
        out.append(TraceRequest(step, prefix + own, rng.randint(8, 160)))
    return out


# ------------------------------------------------------------------------------ vLLM, set up once


class _VLLM:
    """vLLM's classes and test utilities, imported once the environment is set."""

    def __init__(self, model_dir: str) -> None:
        self.version = importlib.metadata.version("vllm")
        utils_dir = _sdist_root(self.version)
        if str(utils_dir) not in sys.path:
            sys.path.insert(0, str(utils_dir))
        # the sdist's tests/ package (kvledger's own tests/ is never on this process's path)
        from tests.v1.core import utils  # type: ignore[import-not-found]

        import torch
        from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        self.utils, self.torch, self.model_dir = utils, torch, model_dir
        self.CacheConfig, self.KVEventsConfig, self.ModelConfig = CacheConfig, KVEventsConfig, ModelConfig
        self.SchedulerConfig, self.VllmConfig, self.SamplingParams = SchedulerConfig, VllmConfig, SamplingParams
        self.Scheduler, self.AsyncScheduler = Scheduler, AsyncScheduler
        self.register_all_kvcache_specs = register_all_kvcache_specs
        self.FullAttentionSpec, self.KVCacheConfig = FullAttentionSpec, KVCacheConfig
        self.KVCacheGroupSpec, self.MambaSpec = KVCacheGroupSpec, MambaSpec
        self.ModelRunnerOutput, self.Request = ModelRunnerOutput, Request
        self.StructuredOutputManager = StructuredOutputManager
        import dataclasses

        import logging

        logging.getLogger("vllm").setLevel(logging.ERROR)  # config advice per scheduler built, not figures
        self.has_index = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        init_none_hash(sha256)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, sha256)

    def plain_scheduler(self, caching: bool, async_scheduling: bool) -> Any:
        """vLLM's ``create_scheduler`` (tests/v1/core/utils.py), KV events switched on afterwards
        the way ``VllmConfig`` would have (the scheduler reads them when it builds its manager)."""
        sched = self.utils.create_scheduler(
            model=self.model_dir, max_num_seqs=MAX_RUNNING, max_num_batched_tokens=STEP_TOKENS,
            enable_prefix_caching=caching, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
            max_model_len=2048, skip_tokenizer_init=True, async_scheduling=async_scheduling,
            scheduler_cls=_with_events(self, self.AsyncScheduler if async_scheduling else self.Scheduler))
        return sched

    def hybrid_scheduler(self, caching: bool, async_scheduling: bool) -> Any:
        """Full attention + Mamba, built from vLLM's pieces as test_scheduler.py's hybrid helper does."""
        mode = "align" if caching else "none"
        model_config = self.ModelConfig(model=self.model_dir, trust_remote_code=True, dtype="float16", seed=42,
                                        skip_tokenizer_init=True, max_model_len=2048)
        vllm_config = self.VllmConfig(
            scheduler_config=self.SchedulerConfig(
                max_num_seqs=MAX_RUNNING, max_num_batched_tokens=STEP_TOKENS, max_model_len=2048,
                enable_chunked_prefill=True, is_encoder_decoder=False, watermark=0.0,
                async_scheduling=async_scheduling),
            model_config=model_config,
            cache_config=self.CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching, mamba_cache_mode=mode),
            kv_events_config=self.KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        )
        vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        f32 = self.torch.float32
        kv_cache_config = self.KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
            self.KVCacheGroupSpec(["fa"], self.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                                                                 dtype=f32)),
            self.KVCacheGroupSpec(["mamba"], self.MambaSpec(block_size=BLOCK_SIZE, shapes=((1, 1),), dtypes=(f32,),
                                                            mamba_cache_mode=mode)),
        ])
        self.register_all_kvcache_specs(vllm_config)
        cls = self.AsyncScheduler if async_scheduling else self.Scheduler
        return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                   structured_output_manager=self.StructuredOutputManager(vllm_config), block_size=BLOCK_SIZE,
                   hash_block_size=BLOCK_SIZE, log_stats=True)

    def requests(self, trace: list[TraceRequest]) -> list[Any]:
        out = []
        for i, t in enumerate(trace):
            params = self.SamplingParams(ignore_eos=True, max_tokens=t.max_tokens)
            params.update_from_generation_config({}, self.utils.EOS_TOKEN_ID)
            out.append(self.Request(request_id=f"r{i}", prompt_token_ids=list(t.prompt), sampling_params=params,
                                    pooling_params=None, block_hasher=self.block_hasher))
        return out

    def output(self, scheduler_output: Any, running: dict[str, Any]) -> Any:
        """The mock model output vLLM's tests build: a token per scheduled request, none for a
        partial prefill chunk."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if self.has_index else {}  # 0.33
        return self.ModelRunnerOutput(
            req_ids=req_ids, **index,
            sampled_token_ids=[[] if running[r].is_prefill_chunk else [7 + i % 900] for i, r in enumerate(req_ids)],
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[])


def _with_events(v: _VLLM, cls: type) -> type:
    """``cls`` with vLLM's KV events on: ``create_scheduler`` builds a ``VllmConfig`` without a
    ``kv_events_config``; the subclass sets one before vLLM's ``__init__`` reads it."""

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        vllm_config.kv_events_config = v.KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        cls.__init__(self, vllm_config, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__})


def _sdist_root(version: str) -> pathlib.Path:
    """vLLM's unpacked source distribution (for tests/v1/core/utils.py), through
    tests/support/upstream.py loaded by path (kvledger's tests/ package must not shadow vLLM's)."""
    path = _HERE.parent / "tests" / "support" / "upstream.py"
    spec = importlib.util.spec_from_file_location("_kvledger_upstream", path)
    assert spec is not None and spec.loader is not None
    upstream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream)
    return upstream.sdist_dir(version)


# ------------------------------------------------------------------------------------------ a run


class Run:
    """One side's scheduler driven over the trace, step by step; ``segment(k)`` times k steps."""

    def __init__(self, v: _VLLM, trace: list[TraceRequest], model: str, caching: bool, async_scheduling: bool,
                 ledger_dir: str | None, digest: bool = False) -> None:
        """``ledger_dir``: None for vLLM's pool; a folder for kvledger's durable log; ``""`` for
        kvledger's pool with an in-memory ledger (no log: ``--split``)."""
        self.v, self.async_scheduling = v, async_scheduling
        self.inst = None
        if ledger_dir is not None:
            from kvledger.integrations.vllm import install

            self.inst = install(log=ledger_dir or None, fsync="background")
        try:
            make = v.plain_scheduler if model == "plain" else v.hybrid_scheduler
            self.scheduler = make(caching, async_scheduling)
        except BaseException:
            self.close()
            raise
        self.arrivals: deque[tuple[int, Any]] = deque(zip((t.arrival for t in trace), v.requests(trace), strict=True))
        self.by_id: dict[str, Any] = {}
        self.step = 0
        self.pending: deque[Any] = deque()  # async: scheduled, output not applied yet
        self.digests: list[str] | None = [] if digest else None
        self.preempted = 0
        self.hit_tokens = 0  # tokens computed before a request's first step: prefix-cache hits

    def segment(self, k: int) -> float:
        spent = 0.0
        for _ in range(k):
            spent += self.one_step()
        return spent

    def one_step(self) -> float:
        """Arrivals, then schedule() + update_from_output() (the only timed part). With async
        scheduling, vLLM's batch queue of two: a step's output is applied after the next step is
        scheduled (at once when nothing new was scheduled)."""
        from time import perf_counter

        sched = self.scheduler
        while self.arrivals and self.arrivals[0][0] <= self.step:
            req = self.arrivals.popleft()[1]
            self.by_id[req.request_id] = req
            sched.add_request(req)
        self.step += 1
        t0 = perf_counter()
        out = sched.schedule()
        spent = perf_counter() - t0
        if self.digests is not None:
            self.digests.append(_digest(out))
        self.preempted += len(out.preempted_req_ids or ())
        self.hit_tokens += sum(new.num_computed_tokens for new in out.scheduled_new_reqs)
        model_output = self.v.output(out, self.by_id)  # as of this step (is_prefill_chunk moves on)
        if not self.async_scheduling:
            t0 = perf_counter()
            sched.update_from_output(out, model_output)
            return spent + perf_counter() - t0
        if out.num_scheduled_tokens:
            self.pending.append((out, model_output))
        if self.pending and (len(self.pending) >= 2 or not out.num_scheduled_tokens):
            old, old_output = self.pending.popleft()
            t0 = perf_counter()
            sched.update_from_output(old, old_output)
            spent += perf_counter() - t0
        return spent

    def done(self) -> bool:
        return not self.arrivals and not self.pending and self.scheduler.get_num_unfinished_requests() == 0

    def close(self) -> None:
        if self.inst is not None:
            self.inst.uninstall()
            self.inst = None


def _digest(out: Any) -> str:
    """What the scheduler decided this step: tokens per request, preemptions, finished ids, and the
    block ids handed to new and resumed requests."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(sorted(out.num_scheduled_tokens.items())).encode())
    h.update(repr(sorted(out.preempted_req_ids or ())).encode())
    h.update(repr(sorted(out.finished_req_ids)).encode())
    for new in out.scheduled_new_reqs:
        h.update(repr((new.req_id, new.block_ids)).encode())
    cached = out.scheduled_cached_reqs
    h.update(repr((list(cached.req_ids), list(cached.new_block_ids))).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------- driver


def _steps_and_check(v: _VLLM, trace: list[TraceRequest], config: tuple[str, bool, bool], tmp: str) -> dict:
    """Untimed: run the whole trace on both sides; the same decisions at every step, else raise."""
    model, caching, async_scheduling = config
    stats = {}
    digests = {}
    for side in ("vllm", "kvledger"):
        log_dir = tempfile.mkdtemp(dir=tmp) if side == "kvledger" else None
        run = Run(v, trace, model, caching, async_scheduling, log_dir, digest=True)
        try:
            while not run.done():
                run.one_step()
                if run.step > 50_000:
                    raise RuntimeError(f"{config}: the trace did not finish in 50,000 steps")
            digests[side] = run.digests
            stats[side] = {"steps": run.step, "preempted": run.preempted, "hit_tokens": run.hit_tokens,
                           "events": sum(p.ledger.seq for p in run.inst.pools) if run.inst else 0}
        finally:
            run.close()
    diverged = None
    if digests["vllm"] != digests["kvledger"]:
        diverged = next((i for i, (a, b) in enumerate(zip(digests["vllm"], digests["kvledger"], strict=False))
                         if a != b), min(len(digests["vllm"]), len(digests["kvledger"])))
        if not fenced(config):
            raise AssertionError(f"{config}: kvledger's pool scheduled differently from vLLM's at step {diverged}")
    return {"steps": min(stats["vllm"]["steps"], stats["kvledger"]["steps"]), "preempted": stats["vllm"]["preempted"],
            "events": stats["kvledger"]["events"], "hit_tokens": stats["vllm"]["hit_tokens"],
            "kvledger_hit_tokens": stats["kvledger"]["hit_tokens"], "diverged": diverged}


def fenced(config: tuple[str, bool, bool]) -> bool:
    """Whether kvledger's fence may change vLLM's decisions in ``config``: with prefix caching, a
    block whose writing step has not completed is not a hit yet where the fence hides it: a state
    group's always (the hybrid model), and under async scheduling an attention block its step
    writes whole over bytes another group or request left (docs/VLLM.md, "The fence")."""
    model, caching, async_scheduling = config
    return caching and (model == "hybrid" or async_scheduling)


def _opt_model_dir(tmp: str) -> str:
    import transformers

    path = os.path.join(tmp, "opt-125m")
    transformers.OPTConfig(**OPT_125M).save_pretrained(path)
    return path


def _vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed here; run it with a conformance venv's python: "
                "$(python scripts/vllm-conformance --version 0.34.0 --python) bench/bench_vllm_scheduler.py")
    return None


def _environment() -> None:
    """vLLM's CPU platform, the hub offline; on 0.34 the Triton rule scripts/vllm-conformance
    documents (CUDA_VISIBLE_DEVICES set and empty: no GPU is visible here)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


CONFIGS = [(model, caching, async_scheduling)
           for model in ("plain", "hybrid") for caching in (False, True) for async_scheduling in (False, True)]


def run(quick: bool, split: bool = False) -> dict:
    missing = _vllm_missing()
    if missing:
        print(f"bench_vllm_scheduler: skipped: {missing}")
        return {"skipped": missing}
    _environment()
    trace = make_trace(seed=29, requests=80 if quick else 240)
    repeats = 3 if quick else 5
    out: dict = {"requests": len(trace), "blocks": NUM_BLOCKS, "repeats": repeats}
    rows = []
    worst = -1e9
    with tempfile.TemporaryDirectory(prefix="bench-vllm-sched-") as tmp:
        v = _VLLM(_opt_model_dir(tmp))
        out["vllm"] = v.version
        for config in CONFIGS:
            model, caching, async_scheduling = config
            tag = f"{model}_caching_{'on' if caching else 'off'}_{'async' if async_scheduling else 'sync'}"
            info = _steps_and_check(v, trace, config, tmp)
            k = max(1, info["steps"] // SEGMENTS)

            def side(ledger: str | None, config: tuple = config) -> Any:
                return Run(v, trace, *config, tempfile.mkdtemp(dir=tmp) if ledger == "log" else ledger)

            per_step = timed_segments({"vllm": lambda: side(None), "kvledger": lambda: side("log")},
                                      SEGMENTS, k, repeats)
            if split:  # a second pass (one installation at a time), against its own vLLM baseline
                pair = timed_segments({"vllm": lambda: side(None), "no log": lambda: side("")},
                                      SEGMENTS, k, repeats)
                per_step["no log"] = per_step["vllm"] * pair["no log"] / pair["vllm"]
            added = (per_step["kvledger"] / per_step["vllm"] - 1.0) * 100.0
            worst = max(worst, added)
            out[f"vllm_us_{tag}"] = per_step["vllm"] * 1e6
            out[f"kvledger_us_{tag}"] = per_step["kvledger"] * 1e6
            out[f"added_pct_{tag}"] = added
            out[f"steps_{tag}"] = info["steps"]
            out[f"preempted_{tag}"] = info["preempted"]
            out[f"hit_tokens_{tag}"] = info["hit_tokens"]
            out[f"kvledger_hit_tokens_{tag}"] = info["kvledger_hit_tokens"]
            out[f"diverged_at_{tag}"] = -1 if info["diverged"] is None else info["diverged"]
            hits = (str(info["hit_tokens"]) if info["diverged"] is None
                    else f"{info['hit_tokens']} / {info['kvledger_hit_tokens']} (from step {info['diverged']})")
            rows.append([model, "on" if caching else "off", "async" if async_scheduling else "sync",
                         str(info["steps"]), str(info["preempted"]), hits, str(info["events"]),
                         f"{per_step['vllm'] * 1e6:.1f}", f"{per_step['kvledger'] * 1e6:.1f}",
                         f"{(per_step['kvledger'] - per_step['vllm']) * 1e6:+.1f}", f"{added:+.1f} %"]
                        + ([f"{(per_step['no log'] / per_step['vllm'] - 1.0) * 100.0:+.1f} %"] if split else []))
            if split:
                out[f"nolog_added_pct_{tag}"] = (per_step["no log"] / per_step["vllm"] - 1.0) * 100.0
    out["worst_added_pct"] = worst
    print_table(f"vLLM {out['vllm']} Scheduler step (schedule() + update_from_output()), {len(trace)} requests, "
                f"{NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens, KV events on; kvledger: install(log=DIR, "
                f"fsync='background'); per step, sum of {SEGMENTS} segments' best of {repeats}, "
                f"sides alternated",
                ["model", "caching", "scheduling", "steps", "preempted", "hit tokens (vLLM / kvledger)",
                 "ledger events",
                 "vllm us/step", "kvledger us/step", "diff us", "kvledger adds",
                 *(["without the log"] if split else [])], rows)
    return out


if __name__ == "__main__":
    run("--quick" in sys.argv[1:], split="--split" in sys.argv[1:])
