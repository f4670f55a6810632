"""R13 with real processes over loopback TCP: a peer killed (SIGKILL), paused (SIGSTOP)
or partitioned (no bytes in or out) at each phase of the handshake, or after it ran a
step and before its COMPLETE left.

The leader runs in the test process (``open_leader`` + ``listen_tcp``); each peer
is this file run as a script (``python tests/wire/test_wire_faults.py peer ...``): the
real ``run_peer`` over a real socket, wrapped so the fault strikes at an exact
protocol point, and writing what it answered, ran and dropped to a log. Oracle:
survivors reach ABORT within the deadline, no rank (the healed one included)
runs an aborted step, every rank runs exactly the launched steps it lived for,
and the leader records a rank's completion of a step only if that rank ran it
(the survivor: every launched step; the faulted one: never the step whose
COMPLETE it had not sent).
The bulk of R13 (>= 1,000 schedules) is in test_wire_protocol.py. Quick profile: SIGKILL at every
phase, SIGSTOP or a partition at each phase once (10 schedules); ``KVLEDGER_HYPOTHESIS=heavy``: all 15.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio

from kvledger import Geometry, StepPlan
from kvledger.wire.codec import HEADER_SIZE, FrameKind

G = Geometry(num_pages=256, page_tokens=16)
DEADLINE = 0.5
HERE = Path(__file__).resolve()


class _Scanner:
    """(kind, step) of every whole frame going by, across chunk boundaries."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        self.buf += data
        out = []
        while len(self.buf) >= HEADER_SIZE:
            n = HEADER_SIZE + int.from_bytes(self.buf[8:12], "little")
            if len(self.buf) < n:
                break
            out.append((self.buf[5], int.from_bytes(self.buf[12:20], "little")))
            del self.buf[:n]
        return out


class FaultyStream:
    """A byte stream that strikes ``fault`` at ``phase`` of ``step`` (peer side)."""

    def __init__(self, inner, fault: str, phase: str, step: int, heal: str, log) -> None:
        self.inner, self.fault, self.phase, self.step = inner, fault, phase, step
        self.heal, self.log = heal, log
        self.rx, self.tx = _Scanner(), _Scanner()
        self.done = fault == "none"

    async def strike(self) -> None:
        self.done = True
        self.log({"ev": "fault", "fault": self.fault, "phase": self.phase})
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "pause":
            os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT later
        elif self.fault == "partition":
            while not os.path.exists(self.heal):  # no byte in or out until healed
                await anyio.sleep(0.02)
        self.log({"ev": "resumed"})

    async def receive(self, max_bytes: int = 65536) -> bytes:
        data = await self.inner.receive(max_bytes)
        if not self.done:
            seen = self.rx.feed(data)
            prepared = (FrameKind.PREPARE, self.step) in seen
            decided = any(k in (FrameKind.LAUNCH, FrameKind.ABORT) and s == self.step for k, s in seen)
            if (self.phase == "before_prepare" and prepared) or (self.phase == "after_decision" and decided):
                await self.strike()
        return data

    async def send(self, data: bytes) -> None:
        if not self.done:
            seen = self.tx.feed(data)
            answer = any(k in (FrameKind.READY, FrameKind.REJECT) and s == self.step for k, s in seen)
            if self.phase == "after_run" and (FrameKind.COMPLETE, self.step) in seen:
                await self.strike()  # it ran the step; its COMPLETE has not left
            elif answer and self.phase == "after_prepare":
                await self.strike()  # validated, but the answer has not left
            elif answer and self.phase == "after_ready":
                await self.inner.send(data)
                await self.strike()
                return
        await self.inner.send(data)

    async def aclose(self) -> None:
        await self.inner.aclose()


def peer_main(argv) -> int:
    from kvledger.wire import connect_tcp, run_peer

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--fault", default="none")
    ap.add_argument("--phase", default="none")
    ap.add_argument("--step", type=int, default=-1)
    ap.add_argument("--log")
    ap.add_argument("--heal")
    a = ap.parse_args(argv)

    def log(rec):
        rec["t"] = time.monotonic()
        out.write(json.dumps(rec) + "\n")

    async def main():
        stream = FaultyStream(await connect_tcp("127.0.0.1", a.port), a.fault, a.phase, a.step, a.heal, log)
        await run_peer(
            stream,
            G,
            rank=a.rank,
            world_size=a.world,
            on_launch=lambda step, ids, payload: log({"ev": "run", "step": step, "ids": list(ids)}),
            on_drop=lambda step, code, rank: log({"ev": "drop", "step": step, "code": int(code)}),
            on_answer=lambda ev: log({"ev": "answer", "step": ev.step, "ready": ev.ready}),
            hello_timeout=30,
        )
        log({"ev": "closed"})

    with open(a.log, "a", buffering=1) as out:
        anyio.run(main)
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "peer":
    sys.exit(peer_main(sys.argv[2:]))  # (before the test side's imports: a peer starts without pytest)


# ---------------------------------------------------------------------------- the test side

import pytest  # noqa: E402  (the peer script above does not need it)
from support import HEAVY  # noqa: E402

from kvledger.wire import KEY_ENV, key_to_text, open_leader  # noqa: E402

PHASES = ["before_prepare", "after_prepare", "after_ready", "after_decision", "after_run"]
# Quick profile: a kill at every phase, a pause or a partition at each phase once (two peer
# processes per schedule); KVLEDGER_HYPOTHESIS=heavy: every fault at every phase.
QUICK_PHASES = {"kill": PHASES, "pause": PHASES[1::2], "partition": PHASES[0::2]}


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _schedule(tmp: Path, fault: str, phase: str, *, world=3, steps=3, fstep=1):
    faulty = world - 1
    heal = tmp / "heal"
    logs = {r: tmp / f"rank{r}.jsonl" for r in range(1, world)}
    procs = {}
    decisions = []
    completions = {}
    try:
        async with open_leader(G, world_size=world, close_grace=0.2) as leader:
            host, port = await leader.listen_tcp()
            for r in range(1, world):
                args = [sys.executable, str(HERE), "peer", "--rank", str(r), "--world", str(world), "--port", str(port),
                        "--log", str(logs[r]), "--heal", str(heal)]
                if r == faulty:
                    args += ["--fault", fault, "--phase", phase, "--step", str(fstep)]
                env = {**os.environ, KEY_ENV: key_to_text(leader.key)}  # the job's key, as torchrun would pass it
                procs[r] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
            with anyio.fail_after(30):
                await leader.wait_joined()
            for s in range(steps):
                ids = tuple(range(s * 8, s * 8 + 5))
                t0 = time.monotonic()
                d = await leader.run_step(StepPlan(step=s, clear_list=ids), timeout=DEADLINE)
                decisions.append((d, t0, ids))
                if d.launch:
                    completions[s] = await leader.wait_completed(s, timeout=DEADLINE)
            # heal the faulted peer: it must catch up without running anything aborted
            if fault == "pause":
                os.kill(procs[faulty].pid, signal.SIGCONT)
            heal.touch()
            await anyio.sleep(0.4)
            after_heal = {s: leader.completion(s) for s in completions}
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=15)
    finally:
        for p in procs.values():  # never leave a stopped or stray peer behind
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    assert after_heal == completions  # a late COMPLETE changes no answer
    return decisions, completions, {r: _read(logs[r]) for r in logs}, {r: p.returncode for r, p in procs.items()}, procs


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", ["kill", "pause", "partition"])
async def test_r13_real_processes_fault_at_each_phase(tmp_path, fault):
    checked = violations = 0
    worst = 0.0
    summary = []
    phases = PHASES if HEAVY else QUICK_PHASES[fault]
    for phase in phases:
        tmp = tmp_path / phase
        tmp.mkdir()
        decisions, completions, logs, codes, procs = await _schedule(tmp, fault, phase)
        launched = [d.step for d, _, _ in decisions if d.launch]
        aborted = {d.step: t0 for d, t0, _ in decisions if not d.launch}
        plans = {d.step: list(ids) for d, _, ids in decisions}
        survivor, faulty = logs[1], logs[2]
        # the faulted step aborts unless the faulty peer's READY reached the leader first
        if phase in ("before_prepare", "after_prepare"):
            assert 1 in aborted, (fault, phase, decisions)
        # survivors reach ABORT within the deadline
        drops = {e["step"]: e["t"] for e in survivor if e["ev"] == "drop"}
        assert set(drops) == set(aborted), (phase, drops, aborted)
        for s, t0 in aborted.items():
            worst = max(worst, drops[s] - t0)
            assert drops[s] - t0 <= DEADLINE + 1.5, (phase, s, drops[s] - t0)
        # no rank runs an aborted step; the survivor runs every launched one, in order, as planned
        for log in (survivor, faulty):
            for e in log:
                if e["ev"] == "run":
                    checked += 1
                    if e["step"] in aborted or e["ids"] != plans[e["step"]]:
                        violations += 1
        assert [e["step"] for e in survivor if e["ev"] == "run"] == launched
        ran_f = [e["step"] for e in faulty if e["ev"] == "run"]
        ran_by = {1: set(launched), 2: set(ran_f)}
        assert ran_f == sorted(ran_f) and set(ran_f) <= set(launched)
        # completions: only from ranks that ran the step; the survivor completed every launched one
        assert set(completions) == set(launched)
        for s, c in completions.items():
            assert 1 in c.completed and all(s in ran_by[r] for r in c.completed)
        if phase == "after_run":
            assert 1 not in aborted and 2 in dict(completions[1].missing), completions
        if fault == "kill":
            assert codes[2] == -signal.SIGKILL
        else:  # healed: caught up on everything, then closed with the leader
            assert any(e["ev"] == "resumed" for e in faulty) and faulty[-1]["ev"] == "closed", faulty[-3:]
            assert ran_f == launched
        assert codes[1] == 0, procs[1].stderr.read().decode()[-2000:]
        missing = {s: [r for r, _ in c.missing] for s, c in completions.items() if c.missing}
        summary.append((phase, [(d.step, d.launch, int(d.code)) for d, _, _ in decisions], "missing", missing))
    print("R13 real processes", fault, "schedules", len(phases), "runs checked", checked, "safety violations",
          violations, "slowest ABORT after PREPARE", format(worst, ".3f"), "s (deadline", DEADLINE, "s)")
    for row in summary:
        print("   ", *row)
    assert violations == 0
