"""Tensor-parallel ranks in separate processes, over the layout-9 wire.

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/tp_ranks.py --steps 40
    (torchrun --standalone --nproc-per-node 4 ..., same thing; --standalone picks a free
    rendezvous port; multi-host: torchrun's usual --nnodes/--rdzv-endpoint, and --host
    set to an address of rank 0 the other hosts can reach)

Rank 0 is the leader: it owns a kvledger.Ledger under KV pressure (snapshot rows
alias pages and are released, requests take the pages back as tail pages) and
sends each sealed step's plan to the other ranks in PREPARE frames. The ranks find
each other only through torch.distributed's rendezvous store: the leader listens
on TCP and publishes its address there; peers read it and connect.

A rank counts only once it proved the job's key (kvledger.wire.auth). The key is
``$KVLEDGER_WIRE_KEY`` (hex) when set, on every rank: torchrun passes the
environment on, and on several hosts set it to the same secret on each. Without
it the leader makes a fresh key for the job and hands it over through the same
rendezvous store that carries its address. That store has no authentication of
its own (anyone who can reach MASTER_PORT can read it): on a network you do not
trust, set the variable from a secret store instead.

    rank 0 (leader)                               rank r (peer)
    ───────────────                               ─────────────
    store <- "kvledger/wire/key" = the job's key  (unless $KVLEDGER_WIRE_KEY is set)
    store <- "kvledger/wire/leader" = host:port   store.get(...) -> connect, HELLO,
                                                  prove the key (CHALLENGE / AUTH)
    ledger: alias / release / reserve / commit
    plan = ledger.seal_step(k)
    run_step(plan, payload) ── PREPARE ─────────► validate ─► READY
                            ◄── READY from all ──
                            ── LAUNCH ──────────► step k on every rank, own planes:
                                                    1. rows:  snapshot rows write
                                                       FP8 NaN bytes (0x7F) into pages
                                                    2. clear: make_backend("torch"|...).clear
                                                    3. kv:    requests write their tokens
                                                    4. check: no NaN byte in a page a
                                                       request just wrote
    wait_completed(k)       ◄── COMPLETE(k, r) ───  (run_peer sends it when step k ran)
    ledger: StepCompleted(k, r) for rank 0 and every rank whose COMPLETE said ok;
            StepAborted(k) first if one failed or stayed silent (named in the reason)
    at the end every rank puts a digest of (step, sorted clear list) for the steps it
    launched into the store; the leader compares them, and the completions its ledger
    recorded per rank, and exits non-zero on any disagreement, missing completion or
    NaN byte; every rank exits with the leader's verdict.

Each rank has its own planes (K as bfloat16, V as float8_e4m3fn; bytes per page
differ per rank, as with sharded heads). ``--device cuda`` puts them on the rank's
GPU (and uses NCCL for the process group); ``--backend triton`` picks that clear
backend. ``--skip-clear`` leaves stale bytes in place, so the NaN check fails:
the check is real.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import struct
import sys
import time
from datetime import timedelta

import anyio
import msgspec
import structlog

from kvledger import Geometry, Ledger, OutOfPagesError
from kvledger.wire import connect_tcp, key_from_env, key_from_text, key_to_text, new_key, open_leader, run_peer

NAN = 0x7F  # float8_e4m3fn NaN (so is 0xFF)
KEY = "kvledger/wire/"


class Payload(msgspec.Struct, frozen=True, array_like=True):
    """What a step carries besides its clear list: row writes and KV writes."""

    rows: tuple[int, ...] = ()  # pages written by snapshot rows (whole page, NaN bytes)
    kv: tuple[tuple[int, int, int], ...] = ()  # (page, tokens, byte) written by requests


class RankState:
    """One rank's planes, clear backend and record of what it launched."""

    def __init__(self, rank: int, geometry: Geometry, device: str, backend: str, skip_clear: bool) -> None:
        import torch

        from kvledger.executors.backend import make_backend

        self.rank = rank
        self.torch = torch
        heads = 2 * (rank + 1)  # bytes per page differ per rank
        shape = (geometry.num_pages, geometry.page_tokens, heads, 8)
        self.planes = [
            torch.zeros(shape, dtype=torch.bfloat16, device=device),
            torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
        ]
        self.bytes = [p.view(torch.uint8) for p in self.planes]  # same memory, as bytes
        self.backend = make_backend(backend, self.planes)
        self.skip_clear = skip_clear
        self.decoder = msgspec.msgpack.Decoder(Payload)
        self.digest = hashlib.blake2b(digest_size=16)
        self.launched = 0
        self.dropped = 0
        self.pages_cleared = 0
        self.nan_pages: list[tuple[int, int]] = []

    def on_launch(self, step: int, clear_pages, payload: bytes) -> None:
        torch = self.torch
        p = self.decoder.decode(payload)
        ids = sorted(clear_pages)
        for b in self.bytes:  # 1. input copies: snapshot rows land in their pages
            if p.rows:
                b[list(p.rows)] = NAN
        if not self.skip_clear:  # 2. zero the clear list in every plane
            self.backend.clear(ids)
        for page, tokens, byte in p.kv:  # 3. the step graph: requests write their tokens
            for b in self.bytes:
                b[page, :tokens] = byte
        written = sorted({page for page, _, _ in p.kv})
        if written:  # 4. no request page may hold a NaN byte it did not write
            for b in self.bytes:
                bad = (b[written] == NAN).flatten(1).any(1).nonzero().flatten().tolist()
                self.nan_pages += [(step, written[i]) for i in bad]
        self.digest.update(struct.pack("<QI", step, len(ids)) + struct.pack(f"<{len(ids)}I", *ids))
        self.launched += 1
        self.pages_cleared += len(ids)
        if self.planes[0].is_cuda:
            torch.cuda.current_stream().synchronize()

    def on_drop(self, step: int, code: int, rank: int) -> None:
        self.dropped += 1

    def report(self) -> dict:
        return {
            "rank": self.rank,
            "digest": self.digest.hexdigest(),
            "launched": self.launched,
            "dropped": self.dropped,
            "pages_cleared": self.pages_cleared,
            "nan_pages": len(self.nan_pages),
            "first_nan": self.nan_pages[:3],
            "plane_bytes_per_page": [b[0].numel() for b in self.bytes],
        }


class Workload:
    """KV pressure with snapshots, driven through a Ledger (the leader's side)."""

    def __init__(self, geometry: Geometry, seed: int) -> None:
        self.ledger = Ledger(geometry, record=False)
        self.g = geometry
        self.rng = random.Random(seed)
        self.live: dict[int, int] = {}
        self.snaps: list[int] = []
        self.next_request = self.next_snapshot = 0
        self.rows: list[int] = []  # carried until a step launches
        self.writes: dict[int, tuple[int, int]] = {}  # request -> (tokens, byte), until a step launches
        self.refused = 0
        self.recorded: dict[int, int] = {}  # rank -> StepCompleted events recorded for it

    def step(self, step: int) -> tuple:
        rng, led, T = self.rng, self.ledger, self.g.page_tokens
        for _ in range(rng.randint(1, 3)):  # hybrid-model snapshots take pages ...
            try:
                pages = led.alias_snapshot(self.next_snapshot, rng.randint(2, 6))
            except OutOfPagesError:
                self.refused += 1
                continue
            self.snaps.append(self.next_snapshot)
            self.next_snapshot += 1
            self.rows.extend(pages)
        while self.snaps and rng.random() < 0.55:  # ... and some are released: pages marked
            led.release_snapshot(self.snaps.pop(rng.randrange(len(self.snaps))))
        for _ in range(rng.randint(1, 4)):  # requests: whole pages plus a partial tail page
            tokens = rng.randint(T + 1, 8 * T)
            need = -(-tokens // T)
            r = self.next_request
            self.next_request += 1
            try:
                led.reserve(r, need, tenant=f"t{r % 3}")
            except OutOfPagesError:
                self.refused += 1
                continue
            led.commit(r, step, need)
            self.writes[r] = (tokens, 0x01 + r % 0x7E)  # never 0x7F
            self.live[r] = tokens
        for r in [r for r in self.live if rng.random() < 0.3]:
            (led.cancel if rng.random() < 0.2 else led.finish)(r)
            del self.live[r]
        plan = led.seal_step(step)
        kv = []  # requests still live write their tokens; one that finished already writes nothing
        for r, (tokens, byte) in self.writes.items():
            if r in self.live:
                for i, page in enumerate(led.kv_pages(r)):
                    kv.append((page, min(T, tokens - i * T), byte))
        payload = msgspec.msgpack.encode(Payload(rows=tuple(self.rows), kv=tuple(kv)))
        return plan, payload

    def launched(self, step: int, completion) -> None:
        """Record launched ``step`` from the peers' COMPLETEs (a ``StepCompletion``): abort it
        first if a peer failed or stayed silent, then StepCompleted for rank 0 and every peer
        that reported it ran the step."""
        self.rows.clear()
        self.writes.clear()
        if not completion.ok:
            rank, why = (completion.failed + completion.missing)[0]
            self.ledger.abort_step(step, f"rank {rank} did not complete: {why}")
        for rank in (0, *completion.completed):
            self.ledger.complete_step(step, rank)
            self.recorded[rank] = self.recorded.get(rank, 0) + 1

    def aborted(self, step: int, reason: str) -> None:
        self.ledger.abort_step(step, reason)  # the clear list is carried into the next step


def job_key(store, rank: int) -> bytes:
    """The job's wire key: $KVLEDGER_WIRE_KEY on every rank when it is set; otherwise rank 0 makes
    one and puts it in the rendezvous store, and the other ranks read it there."""
    key = key_from_env()
    if key is not None:
        return key
    if rank == 0:
        key = new_key()
        store.set(KEY + "key", key_to_text(key))
        return key
    return key_from_text(store.get(KEY + "key").decode(), "the rendezvous store's wire key")


async def lead(args, store, world: int, me: RankState, g: Geometry) -> dict:
    work = Workload(g, args.seed)
    decisions = []
    async with open_leader(g, world_size=world, key=job_key(store, 0)) as leader:
        host, port = await leader.listen_tcp(args.host, 0)
        store.set(KEY + "leader", f"{host}:{port}")
        with anyio.fail_after(args.join_timeout):
            await leader.wait_joined()
        t0 = time.perf_counter()
        for step in range(args.steps):
            plan, payload = work.step(step)
            d = await leader.run_step(plan, payload, timeout=args.timeout)
            if d.launch:
                ids = memoryview(struct.pack(f"<{len(plan.clear_list)}I", *sorted(plan.clear_list))).cast("I")
                me.on_launch(step, ids, payload)
                work.launched(step, await leader.wait_completed(step, timeout=args.timeout))
            else:
                me.on_drop(step, d.code, d.rank)
                work.aborted(step, d.detail)
            decisions.append(d.launch)
        elapsed = time.perf_counter() - t0
        stats = leader.statistics()
    return {
        "steps": args.steps,
        "launched": sum(decisions),
        "aborted": len(decisions) - sum(decisions),
        "seconds": elapsed,
        "ledger_digest": work.ledger.digest(),
        "refused": work.refused,
        "frames": sum(v for k, v in stats.items() if k.endswith("frames_in")),
        "recorded": work.recorded,
        "completes": stats.get("complete.completed", 0),
    }


async def follow(args, store, rank: int, world: int, me: RankState, g: Geometry) -> dict:
    host, port = store.get(KEY + "leader").decode().rsplit(":", 1)  # (the key is set before the address)
    key = job_key(store, rank)
    with anyio.fail_after(args.join_timeout):
        stream = await connect_tcp(host, int(port))
    return await run_peer(
        stream, g, rank=rank, world_size=world, key=key, on_launch=me.on_launch, on_drop=me.on_drop,
        hello_timeout=args.join_timeout,
    )


def _verdict(store, world: int, run: dict, join_timeout: float) -> None:
    """The leader's check of every rank's report: one clear digest, as many steps launched
    as the leader launched, each recorded completed for every rank (from its own COMPLETE),
    no NaN byte read. Prints the table and puts the verdict into the store."""
    store.wait([f"{KEY}report/{r}" for r in range(world)], timedelta(seconds=join_timeout))
    reports = [json.loads(store.get(f"{KEY}report/{r}")) for r in range(world)]
    recorded = {int(k): v for k, v in run["recorded"].items()}
    agree = len({r["digest"] for r in reports}) == 1 and len({r["launched"] for r in reports}) == 1
    nan = sum(r["nan_pages"] for r in reports)
    complete = all(recorded.get(r["rank"], 0) == r["launched"] for r in reports)
    ok = agree and complete and nan == 0 and run["launched"] == reports[0]["launched"]
    ms = 1e3 * run["seconds"] / max(1, run["steps"])
    print(
        f"tp_ranks: {world} ranks, {run['steps']} steps ({run['launched']} launched, {run['aborted']} aborted) "
        f"in {run['seconds']:.3f} s, {ms:.2f} ms/step; ledger digest {run['ledger_digest'][:16]}; "
        f"reservations refused under KV pressure: {run['refused']}; COMPLETE frames counted: {run['completes']}"
    )
    print(" rank  launched  recorded  dropped  pages cleared  NaN pages  bytes/page per plane  clear digest")
    for r in reports:
        print(
            f"{r['rank']:>5}{r['launched']:>10}{recorded.get(r['rank'], 0):>10}{r['dropped']:>9}"
            f"{r['pages_cleared']:>15}{r['nan_pages']:>11}  {str(r['plane_bytes_per_page']):<22}{r['digest']}"
        )
        if r["nan_pages"]:
            print("       first NaN pages (step, page):", r["first_nan"])
    why = "digests differ, a completion is missing or NaN bytes read"
    print("verdict:", "ranks agree, every completion recorded, no stale byte read" if ok else f"FAILED ({why})")
    store.set(f"{KEY}verdict", "ok" if ok else "failed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds the leader waits for READY from all")
    ap.add_argument("--join-timeout", type=float, default=60.0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (each rank takes cuda:LOCAL_RANK)")
    ap.add_argument("--backend", default="torch", help="clear backend: torch, triton or cuda")
    ap.add_argument("--host", default=None, help="address the leader listens on (default: MASTER_ADDR)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-clear", action="store_true", help="do not clear (the NaN check must then fail)")
    args = ap.parse_args()

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    import torch
    import torch.distributed as dist

    # Rendezvous through torch.distributed's store (torchrun's env://): no discovery of our own.
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=args.join_timeout)))
    store = dist.PrefixStore("kvledger-tp", store)
    device = args.device
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.join_timeout),
    )
    args.host = args.host or os.environ.get("MASTER_ADDR", "127.0.0.1")
    if args.host == "localhost":
        args.host = "127.0.0.1"
    g = Geometry(num_pages=args.pages, page_tokens=args.page_tokens)
    me = RankState(rank, g, device, args.backend, args.skip_clear)

    if rank == 0:
        run = anyio.run(lead, args, store, world, me, g)
    else:
        run = anyio.run(follow, args, store, rank, world, me, g)
    rep = me.report()
    store.set(f"{KEY}report/{rank}", json.dumps(rep))
    if rank == 0:
        _verdict(store, world, run, args.join_timeout)
    verdict = store.get(KEY + "verdict").decode()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
