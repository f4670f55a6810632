"""KVEventPublisher: KV event batches on a ZMQ PUB socket, with a replay socket (vLLM's protocol).

    step thread (the ledger's)                      publisher thread (owns the sockets)
    ledger observer ─► observe ─► KVEventBatcher     ┌─► build, encode ─► PUB [topic, seq, payload]
       at StepSealed: batch ─► publish_nowait ─► bounded queue ─┤                 └─► replay buffer (last N)
                        (full: dropped, counted; the seq stays a gap)          ROUTER: [id, "", seq]
                                                                               ─► [id, "", seq, payload] ...
                                                                               ─► [id, "", SEQ_END, ""]

The step path never blocks and never does I/O: ``observe`` keeps the effect
objects, the seal stamps them (a ``PendingBatch``), ``publish_nowait`` assigns
the next seq and puts the batch on a bounded queue, or drops it when the queue
is full (``statistics().batches_dropped``); a consumer sees the gap in the seqs
and can ask for a replay, which answers what the buffer still holds. The PUB
socket drops too when a subscriber is slower than its high-water mark (ZMQ's
PUB semantics). Building the structs, encoding, sending and answering replay
requests happen in one thread, which alone touches the sockets after ``start``.

Endpoints are ZMQ strings: ``tcp://127.0.0.1:5557`` (port 0 or ``*``: an
ephemeral port, read back from ``endpoint``), ``tcp://*:5557``,
``ipc:///tmp/kv-events``, ``inproc://name``. The PUB socket binds (``bind=True``,
the default) or connects; the replay socket always binds. pyzmq is imported
when a publisher is made (``pip install kvledger[events]``), never by
``import kvledger``.

Failures: a bad endpoint or a missing pyzmq raises ``ConfigurationError`` and
leaves nothing open; a send or encode failure in the thread is counted
(``send_errors``) and the thread goes on; ``stop`` sends what is queued, then
closes the sockets (``linger`` bounds how long queued frames may take to leave).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from kvledger.core.errors import ConfigurationError, InvalidArgumentError

from .batcher import KVEventBatcher, PendingBatch
from .schema import MEDIUM_GPU, SEQ_END, KVEventBatch, KVEventBatchMap, encode_batch, seq_bytes

__all__ = ["KVEventPublisher", "PublisherStatistics", "check_endpoint", "load_zmq"]

_SCHEMES = ("tcp://", "ipc://", "inproc://")
_BATCHES = (KVEventBatch, KVEventBatchMap, PendingBatch)
_STOP = object()


def load_zmq() -> Any:
    """Import pyzmq; ``ConfigurationError`` naming ``pip install kvledger[events]`` when it is missing."""
    try:
        import zmq
    except ImportError as exc:
        raise ConfigurationError("KV event publishing needs pyzmq, which is not installed: "
                                 "pip install kvledger[events]") from exc
    return zmq


def check_endpoint(endpoint, what: str = "endpoint") -> str:
    """``endpoint`` if it looks like a ZMQ tcp / ipc / inproc endpoint; ``ConfigurationError`` otherwise."""
    ok = type(endpoint) is str and endpoint.startswith(_SCHEMES)
    if ok:
        scheme, _, address = endpoint.partition("://")
        ok = bool(address) and (scheme != "tcp" or address.rpartition(":")[2] not in ("", address))
    if not ok:
        raise ConfigurationError(f"{what} must be a ZMQ endpoint such as 'tcp://127.0.0.1:5557', 'tcp://*:5557', "
                                 f"'ipc:///tmp/kv-events' or 'inproc://kv-events'; got {endpoint!r}")
    return endpoint


class PublisherStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Counters of a ``KVEventPublisher`` (each written by one thread; read as a snapshot)."""

    batches_queued: int  # accepted onto the queue
    batches_dropped: int  # queue full, or published after stop: their seqs are gaps
    events_dropped: int
    batches_sent: int  # handed to the PUB socket
    events_sent: int
    bytes_sent: int  # payload bytes
    send_errors: int  # a batch that could not be encoded or sent (its seq is a gap)
    replay_requests: int
    replay_batches: int  # batches resent on the replay socket
    replay_errors: int  # malformed requests, or an answer the socket refused
    queue_depth: int
    last_seq: int  # the last seq assigned (-1: none)


def _positive(value, what: str) -> int:
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{what} must be a positive int, got {value!r}")
    return value


class KVEventPublisher:
    """Publishes the ledger's KV events in vLLM's format (``schema``) on a ZMQ PUB socket.

    Give ``observe`` to the ledger (``Ledger(..., observer=publisher.observe)``),
    ``start()`` before the first step, ``stop()`` at the end (or use ``with``).
    One batch per step (``batcher``); ``flush()`` closes one early. ``topic``: the
    first frame; ``buffer_steps``: batches kept for replay; ``max_queue``: batches
    waiting for the thread before new ones are dropped; ``hwm``: the PUB socket's
    send high-water mark; ``poll_interval``: how long the idle thread waits before
    looking at the replay socket again (a replay is answered within about that);
    ``layout``, ``medium``, ``data_parallel_rank``, ``clock``, ``auto_flush``: see
    ``KVEventBatcher``. Raises ``ConfigurationError`` for a bad
    endpoint or a missing pyzmq, ``InvalidArgumentError`` for other bad arguments.
    """

    def __init__(self, endpoint: str = "tcp://*:5557", *, replay_endpoint: str | None = None, topic: str = "",
                 bind: bool = True, layout: str = "array", medium: str | None = MEDIUM_GPU,
                 data_parallel_rank: int | None = 0, buffer_steps: int = 10_000, max_queue: int = 1024,
                 hwm: int = 100_000, auto_flush: bool = True, clock: Callable[[], float] = time.time,
                 poll_interval: float = 0.02) -> None:
        if type(topic) is not str:
            raise InvalidArgumentError(f"topic must be a str, got {topic!r}")
        self._endpoint = check_endpoint(endpoint)
        self._replay_endpoint = None if replay_endpoint is None else check_endpoint(replay_endpoint, "replay_endpoint")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=_positive(buffer_steps, "buffer_steps"))
        self._queue: queue.Queue = queue.Queue(maxsize=_positive(max_queue, "max_queue"))
        self._hwm = _positive(hwm, "hwm")
        if type(poll_interval) not in (int, float) or not 0 < poll_interval <= 1:
            raise InvalidArgumentError(f"poll_interval must be in (0, 1] seconds, got {poll_interval!r}")
        self._poll = float(poll_interval)
        self._batcher = KVEventBatcher(self.publish_nowait, layout=layout, medium=medium, deferred=True,
                                       data_parallel_rank=data_parallel_rank, clock=clock, auto_flush=auto_flush)
        self._zmq = load_zmq()
        self._topic = topic.encode()
        self._bind = bool(bind)
        self._lock = threading.Lock()  # seq order == queue order; state changes
        self._done = threading.Condition()
        self._state = "new"  # new -> running -> stopped
        self._next_seq = 0
        self._done_seq = -1  # the last seq the thread handled (sent or failed)
        self._last: int | None = None  # what the last publish_nowait returned (for flush)
        self._thread: threading.Thread | None = None
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._n = dict.fromkeys(("batches_queued", "batches_dropped", "events_dropped", "batches_sent",
                                 "events_sent", "bytes_sent", "send_errors", "replay_requests",
                                 "replay_batches", "replay_errors"), 0)

    # ------------------------------------------------------------------ queries

    @property
    def endpoint(self) -> str:
        """The PUB endpoint (after ``start``: as bound, with the real port of an ephemeral one)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    @property
    def topic(self) -> str:
        return self._topic.decode()

    @property
    def layout(self) -> str:
        return self._batcher.layout

    @property
    def running(self) -> bool:
        return self._state == "running"

    def statistics(self) -> PublisherStatistics:
        return PublisherStatistics(**self._n, queue_depth=self._queue.qsize(), last_seq=self._next_seq - 1)

    # ------------------------------------------------------------------ the step path

    def observe(self, seq: int, event, effects: tuple) -> None:
        """The ``Ledger`` observer: collect the KV events of one folded event (a batch at each seal)."""
        self._batcher.observe(seq, event, effects)

    def flush(self) -> int | None:
        """Close the pending events into a batch now; its seq, or None when nothing was pending
        or the batch was dropped. Never blocks."""
        self._last = None
        self._batcher.flush()
        return self._last

    def publish_nowait(self, batch) -> int | None:
        """Queue a batch (``KVEventBatch`` / ``KVEventBatchMap``, or a ``PendingBatch`` of this
        publisher's batcher, built in the thread) under the next seq; returns
        the seq, or None when the queue is full or the publisher stopped (the batch is dropped
        and counted, the seq stays a gap). Never blocks."""
        self._last = seq = self._enqueue(batch, False, None, ("new", "running"))
        return seq

    def publish(self, batch, timeout: float | None = None) -> int | None:
        """Queue a batch, waiting up to ``timeout`` seconds for room (offline export, not the step
        path). Returns the seq, or None when it was dropped (timed out, or not running)."""
        return self._enqueue(batch, True, timeout, ("running",))

    def _enqueue(self, batch, block: bool, timeout: float | None, states: tuple[str, ...]) -> int | None:
        """Number ``batch`` with the next seq and queue it (``block``: waiting up to ``timeout``);
        a batch that comes in a state not in ``states``, or finds no room, is dropped and counted."""
        if type(batch) not in _BATCHES:
            raise InvalidArgumentError(f"not a KV event batch: {type(batch).__name__}")
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if self._state in states:
                try:
                    self._queue.put((seq, batch), block, timeout)
                    self._n["batches_queued"] += 1
                    return seq
                except queue.Full:
                    pass
            self._n["batches_dropped"] += 1
            self._n["events_dropped"] += len(batch.events)
            return None

    def wait_sent(self, seq: int, timeout: float | None = None) -> bool:
        """Block until the thread has handled every batch up to ``seq`` (sent it, or counted it
        as a send error); False on timeout. A dropped seq counts as handled once a later one is."""
        with self._done:
            return self._done.wait_for(lambda: self._done_seq >= seq, timeout)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> KVEventPublisher:
        """Bind (or connect) the sockets and start the thread. Raises ``ConfigurationError`` when
        an endpoint cannot be used (in use, bad address): nothing is left open then."""
        if self._state != "new":
            raise InvalidArgumentError(f"the publisher is {self._state}; start it once")
        zmq = self._zmq
        ctx = zmq.Context()
        socks: list = []
        try:
            pub = ctx.socket(zmq.PUB)
            socks.append(pub)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            self._endpoint = _attach(zmq, pub, self._endpoint, self._bind, "endpoint")
            if self._replay_endpoint is not None:
                rep = ctx.socket(zmq.ROUTER)
                socks.append(rep)
                self._replay_endpoint = _attach(zmq, rep, self._replay_endpoint, True, "replay_endpoint")
                self._replay = rep
        except BaseException:
            for s in socks:
                s.close(linger=0)
            ctx.term()
            self._replay = None
            raise
        self._ctx, self._pub = ctx, pub
        self._thread = threading.Thread(target=self._run, name="kvledger-kv-events", daemon=True)
        self._state = "running"
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0, *, linger: float = 1.0) -> None:
        """Close the pending batch, send everything queued, close the sockets. Idempotent.

        Waits up to ``timeout`` seconds for the thread, and up to ``linger`` seconds for queued
        frames to leave the sockets. Batches published afterwards are dropped (counted)."""
        if self._state == "stopped":
            return
        self._batcher.flush()
        with self._lock:
            was, self._state = self._state, "stopped"
        if was == "new":  # never started: what was queued is dropped
            while not self._queue.empty():
                _, batch = self._queue.get_nowait()
                self._n["batches_dropped"] += 1
                self._n["events_dropped"] += len(batch.events)
            return
        assert self._thread is not None
        with contextlib.suppress(queue.Full):  # the thread is stuck; join times out below
            self._queue.put(_STOP, timeout=timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck in a send: leave the sockets to it, the daemon ends with us
            return
        ms = max(0, int(linger * 1000))
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=ms)
        self._ctx.term()

    def __enter__(self) -> KVEventPublisher:
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        q, get = self._queue, self._queue.get
        while True:
            try:
                item = get(timeout=self._poll)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    self._serve_replays()
                    return
                self._send(*item)
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    item = None
            self._serve_replays()

    def _send(self, seq: int, batch) -> None:
        n = self._n
        try:
            if type(batch) is PendingBatch:
                batch = self._batcher.build(batch.ts, batch.events)
            payload = encode_batch(batch)
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=self._zmq.NOBLOCK)
        except Exception:  # the thread outlives any one batch: counted, the seq stays a gap
            n["send_errors"] += 1
        else:
            self._buffer.append((seq, payload))
            n["batches_sent"] += 1
            n["events_sent"] += len(batch.events)
            n["bytes_sent"] += len(payload)
        with self._done:
            self._done_seq = seq
            self._done.notify_all()

    def _serve_replays(self) -> None:
        rep = self._replay
        if rep is None:
            return
        zmq, n = self._zmq, self._n
        while rep.poll(0):
            frames = rep.recv_multipart()
            n["replay_requests"] += 1
            if len(frames) < 2 or frames[1] != b"":
                n["replay_errors"] += 1  # no envelope to answer to
                continue
            start = int.from_bytes(frames[2], "big") if len(frames) == 3 and len(frames[2]) == 8 else None
            if start is None:
                n["replay_errors"] += 1
            ident = frames[0]
            try:
                if start is not None:
                    for seq, payload in self._buffer:
                        if seq >= start:
                            rep.send_multipart((ident, b"", seq_bytes(seq), payload), flags=zmq.NOBLOCK)
                            n["replay_batches"] += 1
                rep.send_multipart((ident, b"", SEQ_END, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                n["replay_errors"] += 1


def _attach(zmq: Any, sock: Any, endpoint: str, bind: bool, what: str) -> str:
    """Bind or connect ``sock``; the endpoint as bound (an ephemeral port resolved)."""
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    except zmq.ZMQError as exc:
        raise ConfigurationError(f"cannot {'bind' if bind else 'connect'} the {what} {endpoint!r}: {exc}") from None
