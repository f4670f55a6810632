"""Metrics over HTTP: ``MetricsServer`` on loopback, and ``kvledger demo --metrics-port`` run as
a real process, scraped while it runs and once it is over, its counters checked against its
own JSON figures and against the observer folded over its own log; and docs/METRICS.md
holds exactly one row per metric. Budget: about 12 s (the demo subprocess).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from support import wait_for  # noqa: E402
from kvledger import ConfigurationError, Geometry, InvalidArgumentError, Ledger  # noqa: E402
from kvledger.core.events import EVENT_TYPES  # noqa: E402
from kvledger.core.state.table import HOLDER_NAMES  # noqa: E402
from kvledger.metrics import ABORT_REASONS, STEP_FAILURES, LedgerMetrics, MetricsServer  # noqa: E402
from kvledger.metrics.counts import event_tag  # noqa: E402
from kvledger.metrics.families import SCRAPE_METRICS  # noqa: E402
from kvledger.metrics.hooks import HOOK_METRICS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
G = Geometry(num_pages=32, page_tokens=2)


def parse(text: str) -> dict:
    """``{(sample name, ((label, value), ...)): value}`` from a text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def v(got: dict, name: str, **labels) -> float:
    return got[(name, tuple(sorted(labels.items())))]


def fresh() -> tuple:
    reg = prometheus_client.CollectorRegistry()
    return reg, LedgerMetrics(reg)


# ---------------------------------------------------------------------- the HTTP server


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    assert text, "an empty answer: the server stopped before writing it"
    return text


def test_server_serves_the_registry_counts_scrapes_and_releases_its_port():
    reg, m = fresh()
    led = Ledger(G, observer=m.observe)
    m.track_ledger(led)
    with MetricsServer(reg, port=0) as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics" and server.port > 0
        assert not server.wait_scrape(0, 0.05)
        led.reserve(1, 3)
        got = parse(get(server.url))
        assert v(got, "kvledger_pages", holder="reserved") == 3 and v(got, "kvledger_ledger_seq") == 2
        assert server.scrapes == m.scrapes == 1 and server.wait_scrape(0, 1)
        with pytest.raises(ConfigurationError, match="cannot serve"):
            MetricsServer(reg, port=server.port)  # taken
        seen = threading.Thread(target=lambda: get(server.url))
        seen.start()
        assert server.wait_scrape(1, 10)
        seen.join()
    with pytest.raises(OSError):
        get(server.url)
    for port in (-1, 65536, "80"):
        with pytest.raises(InvalidArgumentError):
            MetricsServer(reg, port=port)  # type: ignore[arg-type]


class _Gate:
    """A collector whose collect() blocks until released: a scrape held in flight."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.armed = True

    def collect(self):
        if self.armed:
            self.armed = False
            self.entered.set()
            self.release.wait(30)
        from prometheus_client.core import GaugeMetricFamily

        yield GaugeMetricFamily("gate", "held in flight once", value=1)


def test_a_fresh_scrape_is_one_that_began_after_the_wait_not_one_in_flight():
    """CI flake of stop 26: the demo's linger counted a scrape already in flight when the run
    was over as "one more" (its figures may predate the end) and stopped serving before the
    final scrape. ``wait_fresh_scrape`` returns only for a scrape that began after the call."""
    reg = prometheus_client.CollectorRegistry()
    gate = _Gate()
    reg.register(gate)  # type: ignore[arg-type]
    with MetricsServer(reg, port=0) as server:
        early = threading.Thread(target=lambda: get(server.url))
        early.start()
        assert gate.entered.wait(10)  # the early scrape is collecting, not yet served
        waited: list[bool] = []
        waiter = threading.Thread(target=lambda: waited.append(server.wait_fresh_scrape(30)))
        mark = server.scrapes
        waiter.start()
        time.sleep(0.2)  # the waiter has taken its mark (a scheduling delay makes the test pass, never fail)
        gate.release.set()
        early.join()
        assert server.wait_scrape(mark, 10)  # the in-flight scrape was served ...
        waiter.join(0.3)
        assert waiter.is_alive() and not waited  # ... and is not the fresh one
        get(server.url)
        waiter.join(10)
        assert waited == [True]
        assert not server.wait_fresh_scrape(0.05)  # none began after this call


class _Bulky:
    """A collector whose exposition (~24 MB) is larger than loopback's socket buffers."""

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        fam = GaugeMetricFamily("bulky", "a large answer", labels=["blob"])
        for i in range(24):
            fam.add_metric([f"{i:02d}" + "x" * (1 << 20)], i)
        yield fam


def test_a_scrape_counts_as_served_only_once_its_answer_is_written():
    """The cause of stop 26's CI failure: the scrape was counted when the registry had been
    collected, before the answer was written, so the demo stopped serving (and exited) with
    the final scrape's answer unwritten (the scraper read an empty body). A client that asks
    and does not read holds the answer in the server: it is not served until it is read."""
    reg = prometheus_client.CollectorRegistry()
    reg.register(_Bulky())  # type: ignore[arg-type]
    with MetricsServer(reg, port=0, idle_timeout=30) as server:
        client = socket.create_connection(("127.0.0.1", server.port))
        try:
            client.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            assert not server.wait_scrape(0, 1.0)  # collected, still being written: not served
            got = bytearray()
            client.settimeout(30)
            while chunk := client.recv(1 << 20):
                got += chunk
        finally:
            client.close()
        assert server.wait_scrape(0, 10) and server.scrapes == 1
        head, _, body = bytes(got).partition(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0] and len(body) > 24 << 20


def test_an_idle_client_blocks_no_scrape_and_close_returns_at_once():
    """The probe of issue #19 (cc956ad: one idle TCP client blocked every scrape and made close()
    hang): a client that connects and sends nothing, and one that sends half a request, sit on
    the server while scrapes are answered; close() returns at once; idle connections are dropped
    after idle_timeout; past max_clients a connection is closed at once."""
    reg, m = fresh()
    led = Ledger(G, observer=m.observe)
    m.track_ledger(led)
    server = MetricsServer(reg, port=0, idle_timeout=0.5, max_clients=3)
    idle = socket.create_connection(("127.0.0.1", server.port))
    half = socket.create_connection(("127.0.0.1", server.port))
    half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
    closer = threading.Thread(target=server.close)
    try:
        got = parse(get(server.url))
        assert v(got, "kvledger_kv_cache_pages") == G.num_pages and server.scrapes == 1
        late = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]  # over max_clients
        assert _closed_within(late[-1], 10)  # past max_clients: closed at once (or, at the latest, idle-dropped)
        assert _closed_within(idle, 10)  # idle_timeout: the server dropped it
        for s in late:
            s.close()
        # The server frees a closed client's slot when its thread reads the EOF: under load that
        # lands after our next connect, which is then refused at once (a scraper retries).
        assert v(parse(get_until_served(server.url, 10)), "kvledger_ledger_seq") == 1
        half2 = socket.create_connection(("127.0.0.1", server.port))
        half2.sendall(b"GET /metrics HTTP/1.1\r\n")
        t0 = time.monotonic()
        closer.start()
        closer.join(10)
        took = time.monotonic() - t0
        half2.close()
    finally:
        idle.close()
        half.close()
        if not closer.is_alive() and closer.ident is None:
            server.close()
    print(f"close() with a half-sent request open: {took * 1000:.0f} ms")
    assert not closer.is_alive() and took < 1.0


def _trickle(port: int, stop: threading.Event, every: float, log: list, again: bool = False) -> None:
    """A client sending its request one byte per ``every`` seconds (never finishing it); records
    how long the server kept each connection. ``again``: connect anew each time it is cut off."""
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 10_000
    while not stop.is_set():
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            continue
        t0 = time.monotonic()
        try:
            for b in request:
                if stop.wait(every):
                    return
                s.sendall(bytes([b]))
        except OSError:  # the server cut it off
            log.append(time.monotonic() - t0)
        finally:
            s.close()
        if not again:
            return


def test_sixteen_trickling_clients_do_not_block_a_scrape():
    """Issue 32, finding 5 (e388c64: 16 clients sending a byte a second held every slot, and
    every scrape was refused: the idle timeout was per read). With every slot held by a
    trickler (each connecting again as soon as it is cut off), a scrape takes the slot of the
    oldest one and is answered; and a trickler that keeps sending is cut off at
    ``request_timeout``, however often it sends."""
    reg, m = fresh()
    led = Ledger(G, observer=m.observe)
    m.track_ledger(led)
    stop = threading.Event()
    cut: list = []
    with MetricsServer(reg, port=0, idle_timeout=5, max_clients=16, request_timeout=60) as server:
        threads = [threading.Thread(target=_trickle, args=(server.port, stop, 0.25, cut, True), daemon=True)
                   for _ in range(16)]
        for t in threads:
            t.start()
        answered, took = 0, 0.0
        try:
            for _ in range(5):
                # every slot held by a trickler (the one cut off for the last scrape is back)
                assert wait_for(lambda: server.statistics()["reading"] == 16, 10)
                t0 = time.monotonic()
                answered += v(parse(get(server.url)), "kvledger_kv_cache_pages") == G.num_pages
                took = max(took, time.monotonic() - t0)
            evicted = server.statistics()["evicted"]
        finally:
            stop.set()
            for t in threads:
                t.join(10)
    print(f"16 trickling clients holding every slot (reconnecting when cut off): {answered}/5 scrapes answered, "
          f"the slowest in {took * 1000:.0f} ms; {evicted} trickling connections evicted for them")
    assert answered == 5 and evicted == 5
    # the total bound: one byte every 0.1 s keeps every read under idle_timeout, not the request
    stop, cut = threading.Event(), []
    with MetricsServer(reg, port=0, idle_timeout=5, request_timeout=1.0) as server:
        t = threading.Thread(target=_trickle, args=(server.port, stop, 0.1, cut), daemon=True)
        t.start()
        t.join(20)
        stop.set()
    print(f"a client sending a byte every 0.1 s (idle_timeout 5 s, request_timeout 1 s): cut off after "
          f"{cut[0]:.2f} s")
    assert len(cut) == 1 and 0.9 < cut[0] < 5.0
    for bad in (0, -1, "10"):
        with pytest.raises(InvalidArgumentError):
            MetricsServer(reg, port=0, request_timeout=bad)  # type: ignore[arg-type]


def get_until_served(url: str, deadline_s: float) -> str:
    """``get``, again every 50 ms while the server refuses the connection (all slots busy)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return get(url)
        except (http.client.RemoteDisconnected, ConnectionResetError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _closed_within(sock: socket.socket, timeout: float) -> bool:
    """True once the peer closed ``sock`` (a read returns EOF or a reset), within ``timeout``."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# ---------------------------------------------------------------------- the demo, scraped over HTTP


@pytest.mark.parametrize("argv, what", [
    (["--metrics-port", "70000"], "port"), (["--metrics-port", "0", "--metrics-linger", "-1"], "linger"),
])
def test_demo_refuses_bad_metrics_options_with_exit_2(argv, what, capsys):
    from kvledger.demo.cli import main

    assert main([*argv, "--no-progress", "--requests", "2"]) == 2
    assert what in capsys.readouterr().err


ALLOWED = {
    "type": {event_tag(c) for c in EVENT_TYPES}, "holder": set(HOLDER_NAMES), "reason": {*ABORT_REASONS,
    *STEP_FAILURES}, "status": {"completed", "failed", "cancelled"}, "outcome": {"launch", "abort"},
    "decision": {"launched", "aborted"}, "state": {"joined", "lost"}, "direction": {"in", "out"},
    "why": {"duplicate", "stale"},
}


def assert_labels_bounded(got: dict, world: int) -> None:
    """Every label value comes from a vocabulary, or is a rank < world: never a page or request id."""
    for name, labels in got:
        for key, value in labels:
            if key == "le":
                continue
            if key == "rank":
                assert value.isdigit() and int(value) < world, (name, value)
            else:
                assert value in ALLOWED[key], (name, key, value)


def poll(url: str, into: list, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        try:
            into.append(parse(get(url)))
        except OSError:  # the demo stopped serving: its one more scrape was one of ours
            return


def final_scrape(proc: subprocess.Popen, url: str, deadline_s: float = 60.0) -> dict:
    """Scrape the finished demo until it stops serving: the run is over, so every scrape is final.
    (One is enough, but a scrape that lands before the demo starts waiting for "one more" does
    not count as that one: scraping again until it exits never waits out the linger.)"""
    final: dict = {}
    deadline = time.monotonic() + deadline_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            final = parse(get(url))
        except OSError:  # it stopped serving between our checks
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
    return final


def demo_with_scrapes(tmp_path: Path, world: int) -> tuple[list[dict], dict, dict]:
    """Run the demo as a process serving metrics; scrape it while it runs and once it is
    over (it lingers until then). Returns (scrapes during the run, the final one, its JSON)."""
    js, log = tmp_path / "run.json", tmp_path / "run.kvlog"
    argv = [sys.executable, "-m", "kvledger.demo", "--requests", "24", "--prompt-tokens", "128,256",
            "--ranks", str(world), "--no-reference", "--no-progress", "--json", str(js), "--log", str(log),
            "--metrics-port", "0", "--metrics-linger", "60"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    during: list[dict] = []
    final: dict = {}
    stop = threading.Event()
    poller = threading.Thread(target=lambda: None)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            found = re.search(r"http://127\.0\.0\.1:\d+/metrics", line)
            if line.startswith("metrics: serving") and found:
                url = found.group(0)
                poller = threading.Thread(target=poll, args=(url, during, stop))
                poller.start()
            elif line.startswith("metrics: the run is over"):
                stop.set()
                poller.join()
                # The demo stops serving after the first scrape that began after the run was
                # over. If that was the poller's (it raced this line), the server is gone now
                # and the poller's last scrape is that one: the final figures.
                final = final_scrape(proc, url) or (during[-1] if during else {})
                break
        out, err = proc.communicate(timeout=120)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and final, err
    return during, final, json.loads(js.read_text())


def test_demo_serves_metrics_that_equal_its_own_figures(tmp_path):
    pytest.importorskip("torch")
    world = 1  # two ranks are checked through the engine above (the demo's ranks meet per layer: slow here)
    during, got, data = demo_with_scrapes(tmp_path, world)
    run = data["run"]
    assert run["pages_zeroed"] > 0 and run["invalid_speculation"] == 0
    assert v(got, "kvledger_steps_completed_total") == run["steps"] == v(got, "kvledger_step_seconds_count")
    assert v(got, "kvledger_step_seconds_sum") == pytest.approx(run["step_s"], rel=1e-9)
    assert v(got, "kvledger_pages_cleared_total") == run["pages_zeroed"] == run["pages_listed"]
    assert sum(v(got, "kvledger_zeroed_bytes_total", rank=str(r)) for r in range(world)) == run["bytes_zeroed"]
    for r in range(world):
        assert v(got, "kvledger_rank_clear_seconds_count", rank=str(r)) == run["steps_with_clears"]
        assert v(got, "kvledger_rank_plans_total", rank=str(r), status="completed") == run["steps"]
    assert v(got, "kvledger_ledger_seq") == v(got, "kvledger_log_events") == run["events"]
    assert v(got, "kvledger_log_durable_lag_events") == 0
    assert v(got, "kvledger_pages", holder="free") == run["page_budget"]  # the demo drained everything
    assert sum(v(got, "kvledger_steps_failed_total", reason=r) for r in ("rank_error", "wire_abort", "cancelled")) == 0
    assert_labels_bounded(got, world)
    # while it ran: counters only grew, and never past the final figures
    assert during, "no scrape landed while the demo ran"
    steps = [d.get(("kvledger_steps_completed_total", ()), 0) for d in during] + [run["steps"]]
    assert steps == sorted(steps)
    for d in during:
        assert_labels_bounded(d, world)
    # the observer over the demo's own log counts what the demo reports
    replayed = replay_through_observer(tmp_path / "run.kvlog")
    assert sum(v(replayed, "kvledger_events_total", type=event_tag(c)) for c in EVENT_TYPES) == run["events"]
    assert v(replayed, "kvledger_steps_sealed_total") == run["steps"]
    assert v(replayed, "kvledger_pages_planned_total") == run["pages_listed"]
    assert v(replayed, "kvledger_events_total", type="snapshot_released") == run["snapshots_released"]
    assert v(replayed, "kvledger_events_total", type="snapshot_aliased") == run["snapshots_made"]
    assert v(replayed, "kvledger_clear_list_pages_count") - v(
        replayed, "kvledger_clear_list_pages_bucket", le="0.0") == run["steps_with_clears"]


def replay_through_observer(log: Path) -> dict:
    from kvledger.core.events import CacheConfigured
    from kvledger.core.log import open_view

    with open_view(str(log)) as view:
        events = [ev for _, ev, _ in view.iter_events()]
    first = events[0]
    assert type(first) is CacheConfigured
    reg, m = fresh()
    led = Ledger(first.geometry, policy=first.policy, observer=m.observe)
    for ev in events[1:]:
        led.submit(ev)
    return parse(prometheus_client.generate_latest(reg).decode())


# ---------------------------------------------------------------------- the documentation


def test_every_metric_has_one_row_in_docs_metrics_md_and_every_row_is_a_metric():
    doc = (ROOT / "docs" / "METRICS.md").read_text()
    rows = re.findall(r"^\| `(kvledger_\w+)` \| (\w+) \|", doc, re.M)
    documented = collections.Counter(name for name, _ in rows)
    assert all(n == 1 for n in documented.values()), documented
    exposed = {}
    for name, (kind, *_rest) in {**SCRAPE_METRICS, **HOOK_METRICS}.items():
        exposed[f"{name}_total" if kind == "counter" else name] = kind
    assert dict(rows) == exposed
