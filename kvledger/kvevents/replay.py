"""The replay side of a publisher: the buffer of sent batches and the answers owed to requesters.

    record(seq, payload)          a batch the PUB socket sent goes into the buffer (the last N kept)
    request(frames) ─► a job      [id, b"", seq (8 bytes)] from the ROUTER socket: owed every buffered
                                  batch from seq up to the newest one buffered now, then the end marker
    serve(send, budget)           send at most ``budget`` frames' worth of answers, round robin over
                                  the requesters (each gets an equal share of a turn, and the next
                                  turn starts with those the last one did not reach);
                                  ``send(frames)`` returns False when the requester's queue is full
                                  (the job waits for a later turn), raises PeerGone when the
                                  requester left (its jobs end)

    answer (replay_format "vllm")    [id, b"", topic, seq, payload] ...  [id, b"", b"", SEQ_END, b""]
           (replay_format "legacy")  [id, b"", seq, payload] ...         [id, b"", SEQ_END, b""]

Why jobs: one request owes up to ``buffer_steps`` batches. Answering it in one go
(what vLLM does) starves the live stream while it lasts, and a flood of requests
starves it for good; sending without blocking drops what a slow requester's queue
cannot take. Here the publisher's thread serves a bounded amount per turn, between
live batches, and a job whose requester's queue is full keeps its place and goes on
when there is room: every batch and the end marker arrive, none is dropped.

Bounds (memory and work): at most ``max_clients`` requesters with jobs and
``per_client`` jobs each; a job is an id, two seqs and a time (the payloads stay in
the buffer; the socket sends them without copying, ``publisher``); a job that made
no progress for ``stall_s`` seconds is dropped (its requester stopped reading).

Every request is answered, after any flood (issue 32). A new requester that finds
``max_clients`` requesters takes the place of the one stalled longest (its queue was
full at its last send: it stopped reading; its jobs are dropped), else of the one
owed the most batches, when that is more than the newcomer asks for (a flood asks
for whole buffers; a consumer that saw a gap asks for a few): the one cut off is
sent the end marker, so its replay ends, short, and it may ask again. When neither
applies, the request is refused *in protocol*: answered with the end marker
alone, at once, never left without an answer (refusals take at most a quarter of a
turn). A requester that already has ``per_client`` requests in hand is owed their
answers, which it gets: more requests from it are dropped, counted, not answered (a
flood from one socket costs a read each, not a send). A requester that does not read
its refusals either is let go (counted). Sans-I/O apart from ``clock``.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from itertools import islice
from operator import itemgetter

from .schema import SEQ_END, seq_bytes

__all__ = ["PeerGone", "ReplayService"]

_SEQ = itemgetter(0)


class PeerGone(Exception):
    """Raised by a ``send`` callback: the requester is no longer connected."""


class _Job:
    __slots__ = ("ident", "next_seq", "end_seq", "touched", "blocked")

    def __init__(self, ident: bytes, next_seq: int, end_seq: int, now: float) -> None:
        self.ident, self.next_seq, self.end_seq, self.touched = ident, next_seq, end_seq, now
        self.blocked = False  # its last send found the requester's queue full


_MAX_REFUSALS = 1024  # refusals (end markers alone) waiting to be sent; more are dropped, counted


class ReplayService:
    """The buffer and the jobs of one replay socket (module docstring). Owned by one thread."""

    def __init__(self, buffer_steps: int, *, topic: bytes = b"", replay_format: str = "vllm",
                 max_clients: int = 64, per_client: int = 4, stall_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic
        self._vllm = replay_format == "vllm"
        self._max_clients, self._per_client, self._stall = max_clients, per_client, stall_s
        self._clock = clock
        self._jobs: dict[bytes, deque[_Job]] = {}  # requester -> its jobs, oldest first (order: round robin)
        self._refusals: deque[bytes] = deque()  # requesters owed an end marker alone (refused in protocol)
        self.requests = 0  # requests read
        self.errors = 0  # malformed requests, requesters gone mid-answer
        self.refused = 0  # requests refused (answered with the end marker alone), stalled jobs dropped
        self.evicted = 0  # stalled requesters dropped to make room for a new one
        self.batches = 0  # batches resent
        self.answers = 0  # end markers sent (answers completed)

    @property
    def pending(self) -> int:
        """Jobs not finished (refusals not yet sent included)."""
        return sum(len(q) for q in self._jobs.values()) + len(self._refusals)

    def record(self, seq: int, payload: bytes) -> None:
        self.buffer.append((seq, payload))

    def request(self, frames: list) -> None:
        """One message read from the ROUTER socket: a job for a well-formed request; a malformed
        one with an envelope is owed just the end marker, one without is dropped (counted)."""
        self.requests += 1
        if len(frames) < 2 or frames[1] != b"":
            self.errors += 1  # no envelope to answer to
            return
        ident = frames[0]
        good = len(frames) == 3 and len(frames[2]) == 8
        if not good:
            self.errors += 1
        buf = self.buffer
        end = buf[-1][0] if buf else -1
        start = int.from_bytes(frames[2], "big") if good else end + 1  # malformed: nothing, just the marker
        start = max(start, buf[0][0] if buf else start)  # (what left the buffer is not owed)
        queue = self._jobs.get(ident)
        if queue is None:
            if len(self._jobs) >= self._max_clients and not self._make_room(end - start + 1):
                return self._refuse(ident)
            queue = self._jobs[ident] = deque()
        elif len(queue) >= self._per_client:
            self.refused += 1  # (it is owed the answers to the ones in hand: those end with the marker)
            return None
        queue.append(_Job(ident, start, end, self._clock()))

    def _refuse(self, ident: bytes) -> None:
        """Answer a request we cannot take with the end marker alone (sent by ``serve``)."""
        self.refused += 1
        if len(self._refusals) < _MAX_REFUSALS:
            self._refusals.append(ident)

    def _make_room(self, wanted: int) -> bool:
        """Cut off one requester for a newcomer that asks for ``wanted`` batches: the one stalled
        longest, else the one owed the most when that is more than ``wanted`` (it is sent the end
        marker). False when no one qualifies."""
        jobs = self._jobs
        stalled = [(q[0].touched, ident) for ident, q in jobs.items() if q and q[0].blocked]
        if stalled:
            victim = min(stalled)[1]
        else:
            owed = {ident: sum(max(0, j.end_seq - j.next_seq + 1) for j in q) for ident, q in jobs.items()}
            most = max(owed, key=owed.__getitem__, default=None)
            if most is None or owed[most] <= wanted:
                return False
            victim = most
            if len(self._refusals) < _MAX_REFUSALS:
                self._refusals.append(victim)  # its replay ends here: the end marker
        self.refused += len(jobs.pop(victim))
        self.evicted += 1
        return True

    def serve(self, send: Callable[[tuple], bool], budget: int) -> int:
        """Send at most ``budget`` answer messages: first refusals owed (a quarter of it at most), then the jobs, round
        robin (each requester at most an equal share of what is left, and the ones served move
        to the back, so the next turn starts with the others); returns how many were sent.
        ``send(frames)`` (``frames`` start with the requester id) returns False when it would
        block; raises ``PeerGone`` when the requester left."""
        sent = self._send_refusals(send, max(1, budget // 4))
        now = self._clock()
        jobs = self._jobs
        order = list(jobs)
        share = max(1, (budget - sent) // max(1, len(order)))
        for ident in order:
            if sent >= budget:
                break
            queue = jobs.pop(ident)
            try:
                sent += self._serve_one(queue, send, min(share, budget - sent), now)
            except PeerGone:
                self.errors += len(queue)
                queue.clear()
            if queue:
                jobs[ident] = queue  # (to the back)
        return sent

    def _send_refusals(self, send: Callable[[tuple], bool], budget: int) -> int:
        sent = 0
        refusals = self._refusals
        while refusals and sent < budget:
            ident = refusals.popleft()
            end = (ident, b"", b"", SEQ_END, b"") if self._vllm else (ident, b"", SEQ_END, b"")
            try:
                if send(end):
                    sent += 1
            except PeerGone:  # (gone, or not reading its refusals either: let go, counted as refused)
                pass
        return sent

    def _serve_one(self, queue: deque[_Job], send: Callable[[tuple], bool], budget: int, now: float) -> int:
        job = queue[0]
        sent = 0
        buf = self.buffer
        if job.next_seq <= job.end_seq and buf:
            pos = bisect_left(buf, job.next_seq, key=_SEQ)
            topic, ident, vllm = self._topic, job.ident, self._vllm
            for seq, payload in islice(buf, pos, None):
                if seq > job.end_seq:  # the rest of its range left the buffer meanwhile (or never was)
                    job.next_seq = job.end_seq + 1
                    break
                if sent >= budget:
                    break
                frames = (ident, b"", topic, seq_bytes(seq), payload) if vllm else (ident, b"", seq_bytes(seq), payload)
                if not send(frames):
                    return self._stalled(queue, job, sent, now)
                sent += 1
                job.next_seq = seq + 1
                job.blocked = False
                self.batches += 1
            else:
                job.next_seq = job.end_seq + 1  # the rest left the buffer meanwhile: nothing more to send
            if job.next_seq <= job.end_seq:
                job.touched = now if sent else job.touched
                return sent
        if sent >= budget:
            return sent
        end = (job.ident, b"", b"", SEQ_END, b"") if self._vllm else (job.ident, b"", SEQ_END, b"")
        if not send(end):
            return self._stalled(queue, job, sent, now)
        self.answers += 1
        queue.popleft()
        return sent + 1

    def _stalled(self, queue: deque[_Job], job: _Job, sent: int, now: float) -> int:
        job.blocked = True
        if sent:
            job.touched = now
        elif now - job.touched > self._stall:
            self.refused += len(queue)  # the requester stopped reading: its jobs are dropped
            queue.clear()
        return sent

    def drop_all(self) -> int:
        """Forget every job (stop); returns how many there were."""
        n = self.pending
        self._jobs.clear()
        self._refusals.clear()
        return n
