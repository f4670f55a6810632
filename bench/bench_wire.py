"""The layout-9 wire: PREPARE codec costs, and a step's round trips over TCP.

Part 1, codec (one process, no I/O), for clear lists of 16, 1,024 and 16,384 ids:

    encode     encode_prepare(step, ids) with the ids sorted (what the leader sends)
    decode     FrameDecoder.feed + next_frame (checksum included)
    validate   page_ids_problem(frame.clear_pages, num_pages): every id < num_pages,
               no duplicates (the peer's check before READY)
    baseline   the plain check on the same ids as a list: max(ids) < n and
               len(set(ids)) == len(ids)    ratio = baseline / validate

Part 2, round trips over loopback TCP with 2, 4 and 8 ranks. The leader is this
process; each other rank is a separate OS process running ``run_peer`` (started
as ``python bench/bench_wire.py --peer``), whose step does nothing but answer.
Per step, timed from the leader:

    handshake  ``run_step``: PREPARE of 1,024 sorted ids to every peer, READY
               from all, LAUNCH queued (one round trip)
    complete   then ``wait_completed``: the LAUNCH goes out, every peer runs its
               (empty) step and answers COMPLETE (layout 8's second round trip)
    step       the two together: what a step of a remote group costs on the wire

The baseline, in the same run and alternated with it in batches, is a bare TCP
echo of the same bytes: the leader writes the same PREPARE frame to as many
plain echo processes, each reads it whole and writes it back whole, and the
leader reads every echo back. An untimed 2 ms pause follows every step and
every echo. p50 and p99 of the per-step wall time.

    ratio      = handshake p50 / echo p50        (target <= 1.5 at 8 ranks)
    step ratio = step p50 / (2 x echo p50)       (two round trips against two echoes)

On a 2-core machine 7 peer processes share 2 cores with the leader: both sides
pay for that equally, which is why they are alternated.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import fmt_rate, interleaved, print_table, time_call  # noqa: E402

TARGETS = {
    "validate_1024_us": ("<=", 20.0),
    "rtt_ratio_8": ("<=", 1.5),
}

SIZES = (16, 1024, 16384)
NUM_PAGES = 1 << 20
RTT_IDS = 1024
SETTLE = 0.002  # untimed pause after every round trip, on both sides
SEED = 11


# ---------------------------------------------------------------------------- part 1: codec


def _batch(fn, n: int):
    def case() -> float:
        def work():
            for _ in range(n):
                fn()

        elapsed, _ = time_call(work)
        return elapsed / n

    return case


def _codec(quick: bool) -> tuple[dict, list]:
    from kvledger.wire import FrameDecoder, decode, encode_prepare, page_ids_problem

    rng = random.Random(SEED)
    figures, rows = {}, []
    for n in SIZES:
        ids = tuple(sorted(rng.sample(range(NUM_PAGES), n)))
        as_list = list(ids)
        data = encode_prepare(7, ids)
        frame = decode(data)
        assert page_ids_problem(frame.clear_pages, NUM_PAGES) is None

        def enc(ids=ids):
            encode_prepare(7, ids)

        def dec(data=data):
            d = FrameDecoder()
            d.feed(data)
            d.next_frame()

        pages = frame.clear_pages

        def val(pages=pages):
            if page_ids_problem(pages, NUM_PAGES) is not None:
                raise AssertionError("valid ids refused")

        def base(as_list=as_list):
            if not (max(as_list) < NUM_PAGES and len(set(as_list)) == len(as_list)):
                raise AssertionError("valid ids refused")

        shuffled = list(ids)
        rng.shuffle(shuffled)
        unsorted = decode(encode_prepare(7, shuffled)).clear_pages

        def val_unsorted(unsorted=unsorted):
            page_ids_problem(unsorted, NUM_PAGES)

        reps = max(10, (200_000 if not quick else 40_000) // n)
        t = interleaved(
            {"encode": _batch(enc, reps), "decode": _batch(dec, reps), "validate": _batch(val, reps),
             "baseline": _batch(base, reps), "unsorted": _batch(val_unsorted, reps)},
            repeats=3 if quick else 7,
        )
        e, d_, v, b, u = (t[k].best for k in ("encode", "decode", "validate", "baseline", "unsorted"))
        figures.update({
            f"encode_{n}_us": e * 1e6,
            f"decode_{n}_us": d_ * 1e6,
            f"validate_{n}_us": v * 1e6,
            f"validate_unsorted_{n}_us": u * 1e6,
            f"baseline_{n}_us": b * 1e6,
            f"validate_{n}_ratio": b / v,
            f"validate_{n}_ids_per_s": n / v,
            f"codec_{n}_ids_per_s": n / (e + d_ + v),
        })
        rows.append([
            n, f"{e * 1e6:.2f}", f"{d_ * 1e6:.2f}", f"{v * 1e6:.2f}", f"{u * 1e6:.2f}", f"{b * 1e6:.2f}",
            f"{b / v:.2f}x", fmt_rate(n / v, " ids/s"), fmt_rate(n / (e + d_ + v), " ids/s"),
            f"{100 * t['validate'].spread:.0f}%",
        ])
    return figures, rows


# ---------------------------------------------------------------------------- part 2: round trip

_GEOMETRY = (NUM_PAGES, 16)


async def _peer(port: int, rank: int, world: int, echo: bool, size: int) -> None:
    import anyio

    from kvledger import Geometry
    from kvledger.wire import connect_tcp, run_peer

    stream = await connect_tcp("127.0.0.1", port)
    if not echo:
        await run_peer(stream, Geometry(num_pages=_GEOMETRY[0], page_tokens=_GEOMETRY[1]), rank=rank, world_size=world,
                       on_launch=lambda step, ids, payload: None)
        return
    buf = bytearray()
    try:
        while True:
            while len(buf) < size:
                chunk = await stream.receive()
                buf += chunk
            await stream.send(bytes(buf[:size]))
            del buf[:size]
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass


def _spawn(port: int, world: int, echo: bool, size: int, key: bytes = b"") -> list:
    """Peer processes; the job's wire key goes to them in $KVLEDGER_WIRE_KEY, as torchrun would pass it."""
    from kvledger.wire import KEY_ENV, key_to_text

    args = [sys.executable, os.path.abspath(__file__), "--peer", "--port", str(port), "--world", str(world),
            "--size", str(size)] + (["--echo"] if echo else [])
    env = {**os.environ, KEY_ENV: key_to_text(key)} if key else None
    return [subprocess.Popen(args + ["--rank", str(r)], stdout=subprocess.DEVNULL, env=env) for r in range(1, world)]


async def _round_trips(world: int, rounds: int, batch: int) -> dict:
    import anyio

    from kvledger import Geometry, StepPlan
    from kvledger.wire import encode_prepare, listen_tcp, listener_address, open_leader

    g = Geometry(num_pages=_GEOMETRY[0], page_tokens=_GEOMETRY[1])
    rng = random.Random(SEED + world)
    ids = tuple(sorted(rng.sample(range(NUM_PAGES), RTT_IDS)))
    frame = encode_prepare(0, ids)
    size = len(frame)
    hs, full, echo = [], [], []
    procs = []
    async with open_leader(g, world_size=world) as leader:
        host, port = await leader.listen_tcp()
        listener = await listen_tcp()
        _, eport = listener_address(listener)
        procs += _spawn(port, world, False, size, leader.key)
        procs += _spawn(eport, world, True, size)
        echo_streams = []
        async with listener:
            with anyio.fail_after(60):
                for _ in range(world - 1):
                    echo_streams.append(await listener.listeners[0].accept())
                await leader.wait_joined()
        step = 0

        async def one_echo():
            t0 = time.perf_counter()
            for s in echo_streams:
                await s.send(frame)
            for s in echo_streams:
                got = 0
                while got < size:
                    got += len(await s.receive())
            return time.perf_counter() - t0

        for _ in range(3):  # warm-up, both sides
            await leader.run_step(StepPlan(step=step, clear_list=ids), timeout=10)
            await leader.wait_completed(step, timeout=10)
            step += 1
            await one_echo()
        while len(hs) < rounds:
            for _ in range(batch):
                h, f = await _timed_step(leader, StepPlan(step=step, clear_list=ids))
                hs.append(h)
                full.append(f)
                step += 1
                await anyio.sleep(SETTLE)  # untimed
            for _ in range(batch):
                echo.append(await one_echo())
                await anyio.sleep(SETTLE)
        for s in echo_streams:
            await s.aclose()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    return {"handshake": hs, "step": full, "echo": echo, "bytes": size}


async def _timed_step(leader, plan) -> tuple[float, float]:
    """One step through the group: (handshake seconds, seconds until every COMPLETE is in)."""
    t0 = time.perf_counter()
    d = await leader.run_step(plan, timeout=10)
    t1 = time.perf_counter()
    if not d.launch:
        raise RuntimeError(f"bench step aborted: {d.detail}")
    c = await leader.wait_completed(plan.step, timeout=10)
    t2 = time.perf_counter()
    if not c.ok:
        raise RuntimeError(f"bench step not completed everywhere: {c}")
    return t1 - t0, t2 - t0


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(quick: bool) -> dict:
    import structlog
    import logging

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    figures, rows = _codec(quick)
    print_table(
        "PREPARE codec (ids sorted as the leader sends them; times per call, best of the repeats)",
        ["ids", "encode us", "decode us", "validate us", "unsorted us", "baseline us", "vs baseline",
         "validate rate", "enc+dec+val rate", "spread"],
        rows,
    )
    figures.update(_round_trip_figures(300 if quick else 2000))
    return figures


def _round_trip_figures(rounds: int) -> dict:
    """Part 2 at 2, 4 and 8 ranks: prints its table, returns its figures."""
    import anyio

    figures: dict = {}
    rrows = []
    for w in (2, 4, 8):
        r = anyio.run(_round_trips, w, rounds, 50)
        h50, h99 = _pct(r["handshake"], 0.5), _pct(r["handshake"], 0.99)
        s50, s99 = _pct(r["step"], 0.5), _pct(r["step"], 0.99)
        e50, e99 = _pct(r["echo"], 0.5), _pct(r["echo"], 0.99)
        c50 = _pct([b - a for a, b in zip(r["handshake"], r["step"], strict=True)], 0.5)
        figures.update({
            f"rtt_handshake_p50_us_{w}": h50 * 1e6, f"rtt_handshake_p99_us_{w}": h99 * 1e6,
            f"rtt_step_p50_us_{w}": s50 * 1e6, f"rtt_step_p99_us_{w}": s99 * 1e6,
            f"rtt_complete_p50_us_{w}": c50 * 1e6,
            f"rtt_echo_p50_us_{w}": e50 * 1e6, f"rtt_echo_p99_us_{w}": e99 * 1e6,
            f"rtt_ratio_{w}": h50 / e50, f"rtt_ratio_p99_{w}": h99 / e99,
            f"rtt_step_ratio_{w}": s50 / (2 * e50),
        })
        rrows.append([w, r["bytes"], len(r["handshake"]), f"{h50 * 1e6:.0f}", f"{h99 * 1e6:.0f}",
                      f"{s50 * 1e6:.0f}", f"{s99 * 1e6:.0f}", f"{e50 * 1e6:.0f}", f"{e99 * 1e6:.0f}",
                      f"{h50 / e50:.2f}x", f"{h99 / e99:.2f}x", f"{s50 / (2 * e50):.2f}x"])
    figures["rtt_ids"] = RTT_IDS
    figures["rtt_ranks"] = "processes (leader in the bench process, one OS process per peer), loopback TCP"
    print_table(
        f"A step over loopback TCP, layout 9 ({RTT_IDS} ids; peers are OS processes): handshake = PREPARE -> "
        "READY from all -> LAUNCH queued; step = handshake, then COMPLETE from all",
        ["ranks", "frame B", "steps", "handshake p50 us", "p99 us", "step p50 us", "p99 us", "echo p50 us",
         "p99 us", "hs/echo p50", "p99", "step/2 echo p50"],
        rrows,
    )
    return figures


def _main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--echo", action="store_true")
    ap.add_argument("--port", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--size", type=int)
    a = ap.parse_args()
    if a.peer:
        import anyio
        import logging

        import structlog

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
        anyio.run(_peer, a.port, a.rank, a.world, a.echo, a.size)
        return
    figs = run(a.quick)
    for k, (op, v) in TARGETS.items():
        print(k, op, v, "measured", f"{figs[k]:.3f}")


if __name__ == "__main__":
    _main()
