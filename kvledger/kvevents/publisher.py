"""KVEventPublisher: KV event batches on a ZMQ PUB socket, with a replay socket (vLLM 0.33's protocol).
One piece: the publisher's thread owns the sockets, the queue and the counters it reports.

    step thread (the ledger's)                      publisher thread (owns the sockets), each turn:
    ledger observer ─► observe ─► KVEventBatcher     1. up to 256 queued batches: build, encode,
       at StepSealed: batch ─► publish_nowait ─┐        PUB [topic, seq, payload], into the buffer
       (full queue: dropped, counted;          │     2. up to 64 replay requests read (ROUTER)
        the seq stays a gap)                   └─►   3. up to 256 replay answers sent (replay.py)
                               bounded queue         idle: wait up to poll_interval for a batch

The step path never blocks and never does I/O: ``observe`` keeps the effect
objects, the seal stamps them (a ``PendingBatch``), ``publish_nowait`` assigns
the next seq and puts the batch on a bounded queue, or drops it when the queue
is full (``statistics().batches_dropped``); a consumer sees the gap in the seqs
and asks for a replay. The thread's turns are bounded, so a flood of replay
requests delays live batches by one turn at most, never starves them.

vLLM's behaviour, by default (``endpoints.py`` has the endpoint rules):

* wire: map-layout events, u64 hashes, replay answers ``[topic, seq, payload]``
  ending with ``[b"", -1, b""]`` (``schema``); ``layout="array"``,
  ``hashes="raw"`` and ``replay_format="legacy"`` for older consumers;
* bind or connect by vLLM's rule (``bind=None``; True / False override); the
  replay socket always binds; a wildcard bind reports a dialable endpoint
  (``endpoint``, ``replay_endpoint``);
* data-parallel rank ``r`` moves tcp ports by ``r`` (inproc / ipc names get ``_dp{r}``);
* the replay (ROUTER) socket's send high-water mark is ``2 x (buffer_steps + 1)``
  (vLLM's: a full replay and its marker always fit), ``ROUTER_MANDATORY`` makes a
  full queue a "try later" instead of a silent drop, and ``ZMQ_MAXMSGSIZE`` (256 B)
  disconnects a requester that sends a bigger frame before it is buffered.

Memory, per subscriber (the documented bound; tests/integration/test_kvevents_probes.py measures
it): ZMQ queues at most ``hwm`` batches for a SUB connection that stops reading
(default 10,000; vLLM's 100,000 when its config says so), each three message
headers, about 200 bytes: ~2 MiB per such subscriber (measured 1.7 MiB; 4.5 MiB at
hwm 100,000 after 30,000 batches, ~19 MiB once 100,000 are queued). The payloads
are not copied per subscriber: libzmq counts references to one copy, so all of them
together hold at most ``hwm`` payloads. A replay requester's queue holds at most
one answer in flight, ``2 x (buffer_steps + 1)`` messages whose payloads are the
buffer's own bytes (sent without copying); at most 64 requesters with 4 requests
each are served (``replay.py``). The replay buffer itself keeps ``buffer_steps``
payloads.

Endpoints are ZMQ strings: ``tcp://*:5557``, ``tcp://127.0.0.1:5557`` (connects,
by vLLM's rule), ``tcp://127.0.0.1:0`` (binds an ephemeral port), ``ipc:///tmp/kv``,
``inproc://name``. pyzmq is imported when a publisher is made
(``pip install kvledger[events]``), never by ``import kvledger``.

Who can read the events (they name tenants, their prompts' token ids and cache
salts; ZMQ's PUB and ROUTER sockets authenticate nobody): with no endpoint the
publisher *binds* ``tcp://127.0.0.1:5557`` (``endpoints.DEFAULT_ENDPOINT``), this
host only; vLLM's default, ``tcp://*:5557``, binds every interface. A bind other
hosts can reach (a wildcard, a routable address, a host or interface name, for
the PUB or the replay socket) is refused unless ``allow_remote=True`` says so.
``omit=("token_ids", "tenant", "salt")`` leaves any of those out of every event
(``batcher``). docs/SECURITY.md says how to bring remote consumers in (a boundary
you trust: an SSH tunnel, a proxy on the consumer's side, a private network).

Failures: a bad endpoint or a missing pyzmq raises ``ConfigurationError`` and
leaves nothing open; a send or encode failure in the thread is counted
(``send_errors``) and the thread goes on; ``stop()`` returns within its
``timeout`` (1 s by default) with the thread gone: it sends what is queued until
half the timeout has passed (the rest is dropped, counted), then closes the
sockets, letting queued frames leave for what remains of the timeout.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from kvledger.core.errors import ConfigurationError, InvalidArgumentError

from .batcher import KVEventBatcher, PendingBatch
from .endpoints import DEFAULT_ENDPOINT, binds, check_endpoint, check_exposure, dialable, offset_endpoint
from .replay import PeerGone, ReplayService
from .schema import MEDIUM_GPU, REPLAY_FORMATS, KVEventBatch, KVEventBatchMap, check_choice, encode_batch, seq_bytes

__all__ = ["MAX_REQUEST_BYTES", "KVEventPublisher", "PublisherStatistics", "check_endpoint", "load_zmq"]

_BATCHES = (KVEventBatch, KVEventBatchMap, PendingBatch)
_WAKE = object()
LIVE_PER_TURN = 256  # queued batches sent per turn of the thread
REQUESTS_PER_TURN = 64  # replay requests read per turn
REPLAY_PER_TURN = 256  # replay answer messages sent per turn
MAX_REQUEST_BYTES = 256  # ZMQ_MAXMSGSIZE of the replay socket: a request is 8 bytes
_BLOCKED_WAIT_S = 0.002  # a turn's wait while replay answers wait for room in a requester's queue


def load_zmq() -> Any:
    """Import pyzmq; ``ConfigurationError`` naming ``pip install kvledger[events]`` when it is missing."""
    try:
        import zmq
    except ImportError as exc:
        raise ConfigurationError("KV event publishing needs pyzmq, which is not installed: "
                                 "pip install kvledger[events]") from exc
    return zmq


class PublisherStatistics(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Counters of a ``KVEventPublisher`` (each written by one thread; read as a snapshot)."""

    batches_queued: int  # accepted onto the queue
    batches_dropped: int  # queue full, published after stop, or still queued when stop ran out of time
    events_dropped: int
    batches_sent: int  # handed to the PUB socket
    events_sent: int
    bytes_sent: int  # payload bytes
    send_errors: int  # a batch that could not be encoded or sent (its seq is a gap)
    replay_requests: int
    replay_batches: int  # batches resent on the replay socket
    replay_answers: int  # replay answers completed (end marker sent)
    replay_errors: int  # malformed requests, requesters that left mid-answer
    replay_refused: int  # requests over the bounds, answers dropped because the requester stopped reading
    replay_pending: int  # replay answers in progress
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
    first frame; ``bind``: None for vLLM's rule, True / False to force;
    ``buffer_steps``: batches kept for replay; ``max_queue``: batches waiting for
    the thread before new ones are dropped; ``hwm``: the PUB socket's send
    high-water mark, per subscriber (module docstring); ``replay_format``:
    ``"vllm"`` or ``"legacy"``; ``poll_interval``: how long the idle thread waits
    for a batch before looking at the replay socket again (a replay is answered
    within about that); ``layout``, ``hashes``, ``medium``, ``data_parallel_rank``
    (also the endpoints' offset), ``clock``, ``auto_flush``, ``omit``: see
    ``KVEventBatcher``. ``endpoint`` None binds ``tcp://127.0.0.1:5557``;
    ``allow_remote``: allow a bind other hosts can reach (module docstring).
    Raises ``ConfigurationError`` for a bad endpoint, a bind other hosts can reach
    without ``allow_remote``, or a missing pyzmq, ``InvalidArgumentError`` for
    other bad arguments.
    """

    def __init__(self, endpoint: str | None = None, *, replay_endpoint: str | None = None, topic: str = "",
                 bind: bool | None = None, layout: str = "map", hashes: str = "u64", replay_format: str = "vllm",
                 medium: str | None = MEDIUM_GPU, data_parallel_rank: int | None = 0, buffer_steps: int = 10_000,
                 max_queue: int = 1024, hwm: int = 10_000, auto_flush: bool = True,
                 clock: Callable[[], float] = time.time, poll_interval: float = 0.02,
                 allow_remote: bool = False, omit: Iterable[str] = ()) -> None:
        if type(topic) is not str:
            raise InvalidArgumentError(f"topic must be a str, got {topic!r}")
        if bind is not None and type(bind) is not bool:
            raise InvalidArgumentError(f"bind must be None, True or False, got {bind!r}")
        if type(allow_remote) is not bool:
            raise InvalidArgumentError(f"allow_remote must be a bool, got {allow_remote!r}")
        self._batcher = KVEventBatcher(self.publish_nowait, layout=layout, medium=medium, deferred=True,
                                       data_parallel_rank=data_parallel_rank, clock=clock, auto_flush=auto_flush,
                                       hashes=hashes, omit=omit)
        rank = data_parallel_rank or 0
        if endpoint is None:
            endpoint, bind = DEFAULT_ENDPOINT, True if bind is None else bind
        self._endpoint = offset_endpoint(check_endpoint(endpoint), rank)
        self._replay_endpoint = (None if replay_endpoint is None else
                                 offset_endpoint(check_endpoint(replay_endpoint, "replay_endpoint"), rank))
        self._bind = binds(self._endpoint) if bind is None else bind
        check_exposure(self._endpoint, self._bind, allow_remote)
        if self._replay_endpoint is not None:
            check_exposure(self._replay_endpoint, True, allow_remote, "replay_endpoint")
        self._buffer_steps = _positive(buffer_steps, "buffer_steps")
        self._queue: queue.Queue = queue.Queue(maxsize=_positive(max_queue, "max_queue"))
        self._hwm = _positive(hwm, "hwm")
        self._replay_format = check_choice(replay_format, REPLAY_FORMATS, "replay_format")
        if type(poll_interval) not in (int, float) or not 0 < poll_interval <= 1:
            raise InvalidArgumentError(f"poll_interval must be in (0, 1] seconds, got {poll_interval!r}")
        self._poll = float(poll_interval)
        self._zmq = load_zmq()
        self._topic = topic.encode()
        self._replays = ReplayService(self._buffer_steps, topic=self._topic, replay_format=self._replay_format)
        self._lock = threading.Lock()  # seq order == queue order; state changes
        self._done = threading.Condition()
        self._state = "new"  # new -> running -> stopped
        self._stopping = threading.Event()
        self._drain_until = 0.0  # monotonic deadline for sending what is queued at stop
        self._linger_ms = 0
        self._next_seq = 0
        self._done_seq = -1  # the last seq the thread handled (sent, failed or dropped at stop)
        self._last: int | None = None  # what the last publish_nowait returned (for flush)
        self._thread: threading.Thread | None = None
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._n = dict.fromkeys(("batches_queued", "batches_dropped", "events_dropped", "batches_sent",
                                 "events_sent", "bytes_sent", "send_errors"), 0)

    # ------------------------------------------------------------------ queries

    @property
    def endpoint(self) -> str:
        """The PUB endpoint (after ``start``: as a subscriber dials it; an ephemeral port resolved)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    @property
    def binds(self) -> bool:
        """Whether the PUB socket binds (True) or connects (False)."""
        return self._bind

    @property
    def topic(self) -> str:
        return self._topic.decode()

    @property
    def layout(self) -> str:
        return self._batcher.layout

    @property
    def hashes(self) -> str:
        return self._batcher.hashes

    @property
    def replay_format(self) -> str:
        return self._replay_format

    @property
    def omit(self) -> frozenset[str]:
        """The fields left out of every event (``batcher.OMITTABLE``)."""
        return self._batcher.omit

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def thread(self) -> threading.Thread | None:
        """The publisher's thread (None before ``start``)."""
        return self._thread

    def statistics(self) -> PublisherStatistics:
        r = self._replays
        return PublisherStatistics(**self._n, replay_requests=r.requests, replay_batches=r.batches,
                                   replay_answers=r.answers, replay_errors=r.errors, replay_refused=r.refused,
                                   replay_pending=r.pending, queue_depth=self._queue.qsize(),
                                   last_seq=self._next_seq - 1)

    # ------------------------------------------------------------------ the step path

    def observe(self, seq: int, event, effects: tuple) -> None:
        """The ``Ledger`` observer: collect the KV events of one folded event (a batch at each seal)."""
        self._batcher.observe(seq, event, effects)

    def set_cache_salt(self, request: int, salt: str | None) -> None:
        """Publish ``salt`` in the ``extra_keys`` of the blocks ``request`` publishes (``batcher``)."""
        self._batcher.set_cache_salt(request, salt)

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
            self._count_dropped(batch)
            return None

    def _count_dropped(self, batch) -> None:
        self._n["batches_dropped"] += 1
        self._n["events_dropped"] += len(batch.events)

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
            pub.setsockopt(zmq.LINGER, 0)
            self._endpoint = _attach(zmq, pub, self._endpoint, self._bind, "endpoint")
            if self._replay_endpoint is not None:
                rep = ctx.socket(zmq.ROUTER)
                socks.append(rep)
                rep.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))  # a full replay and its marker fit
                rep.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue says EAGAIN instead of dropping
                rep.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # a bigger frame: the peer is disconnected
                rep.setsockopt(zmq.LINGER, 0)
                rep.copy_threshold = 0  # payloads leave without being copied (the buffer's own bytes)
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

    def stop(self, timeout: float = 1.0, *, linger: float = 0.5) -> None:
        """Close the pending batch, send what is queued, close the sockets; returns within
        ``timeout`` seconds (plus a few milliseconds) with the thread gone. Idempotent.

        Queued batches are sent until half of ``timeout`` has passed (what is left is
        dropped and counted); then the sockets close, and frames still queued in them get
        up to ``linger`` seconds (within ``timeout``) to leave. Unanswered replay requests
        are dropped. Batches published afterwards are dropped (counted)."""
        if self._state == "stopped":
            return
        t0 = time.monotonic()
        self._batcher.flush()
        with self._lock:
            was, self._state = self._state, "stopped"
        if was == "new":  # never started: what was queued is dropped
            while not self._queue.empty():
                _, batch = self._queue.get_nowait()
                self._count_dropped(batch)
            return
        timeout = max(0.0, float(timeout))
        self._drain_until = t0 + timeout / 2
        self._linger_ms = int(max(0.0, min(float(linger), timeout / 2 - 0.05)) * 1000)
        self._stopping.set()
        with contextlib.suppress(queue.Full):  # full: the thread is busy and sees the flag after its turn
            self._queue.put_nowait(_WAKE)  # wake an idle thread at once
        assert self._thread is not None
        self._thread.join(max(0.0, t0 + timeout - time.monotonic()))
        if not self._thread.is_alive():
            self._ctx.term()  # the thread closed the sockets; this waits out what is left of their linger

    def __enter__(self) -> KVEventPublisher:
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        q, stopping, replays = self._queue, self._stopping, self._replays
        rep = self._replay
        try:
            while not stopping.is_set():
                sent = self._send_live(LIVE_PER_TURN)
                busy = sent == LIVE_PER_TURN
                if rep is not None:
                    busy |= self._read_requests(rep) == REQUESTS_PER_TURN
                    answered = replays.serve(self._send_replay, REPLAY_PER_TURN) if replays.pending else 0
                    busy |= answered == REPLAY_PER_TURN
                    blocked = replays.pending and answered < REPLAY_PER_TURN
                else:
                    blocked = False
                if busy:
                    continue
                try:  # idle: wait for a batch (a little while only when answers wait for room)
                    item = q.get(timeout=_BLOCKED_WAIT_S if blocked else self._poll)
                except queue.Empty:
                    continue
                if item is not _WAKE:
                    self._send(*item)
            self._drain()
        finally:
            for s in (self._pub, rep):
                if s is not None:
                    s.close(linger=self._linger_ms)

    def _send_live(self, budget: int) -> int:
        get = self._queue.get_nowait
        n = 0
        while n < budget:
            try:
                item = get()
            except queue.Empty:
                break
            if item is not _WAKE:
                self._send(*item)
                n += 1
        return n

    def _drain(self) -> None:
        """At stop: send what is queued until the drain deadline, drop (and count) the rest."""
        self._replays.drop_all()
        get, until = self._queue.get_nowait, self._drain_until
        while True:
            try:
                item = get()
            except queue.Empty:
                return
            if item is _WAKE:
                continue
            seq, batch = item
            if time.monotonic() < until:
                self._send(seq, batch)
            else:
                self._count_dropped(batch)
                self._mark_done(seq)

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
            self._replays.record(seq, payload)
            n["batches_sent"] += 1
            n["events_sent"] += len(batch.events)
            n["bytes_sent"] += len(payload)
        self._mark_done(seq)

    def _mark_done(self, seq: int) -> None:
        with self._done:
            self._done_seq = seq
            self._done.notify_all()

    def _read_requests(self, rep: Any) -> int:
        zmq, replays = self._zmq, self._replays
        n = 0
        while n < REQUESTS_PER_TURN:
            try:
                frames = rep.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            replays.request(frames)
        return n

    def _send_replay(self, frames: tuple) -> bool:
        """Send one answer message: False when the requester's queue is full (nothing sent);
        ``PeerGone`` when it left or the socket refused the message."""
        zmq, rep = self._zmq, self._replay
        more = zmq.SNDMORE | zmq.NOBLOCK
        try:
            rep.send(frames[0], more)  # the one part that can say EAGAIN: the rest follow it
        except zmq.Again:
            return False
        except zmq.ZMQError:
            raise PeerGone from None
        try:
            last = len(frames) - 1
            for i in range(1, last):
                rep.send(frames[i], more)
            rep.send(frames[last], zmq.NOBLOCK, copy=False)  # the payload (or b""): the buffer's own bytes
        except zmq.ZMQError:
            raise PeerGone from None
        return True


def _attach(zmq: Any, sock: Any, endpoint: str, bind: bool, what: str) -> str:
    """Bind or connect ``sock``; the endpoint as a peer dials it (an ephemeral port resolved, a
    wildcard host replaced by this node's address)."""
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return dialable(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    except zmq.ZMQError as exc:
        raise ConfigurationError(f"cannot {'bind' if bind else 'connect'} the {what} {endpoint!r}: {exc}") from None
