"""KV events name tenants: who can read them (issue 32, finding 3), with real sockets.

* By default the publisher binds loopback (``tcp://127.0.0.1:5557``), not every interface
  (vLLM's and e388c64's ``tcp://*:5557``): a subscriber that dials this host's routable
  address gets nothing, one on loopback gets every batch. A wildcard or routable bind of the
  PUB or the replay socket is refused unless ``allow_remote=True`` asks for it (the control:
  then the routable subscriber does get the batches, so the check above is a real one); the
  same holds for vLLM's ``--kv-events-config`` JSON, the engine's ``kv_events=`` and
  ``kvledger events --zmq``.
* ``omit=`` leaves token ids, tenants and cache salts out of every event, live and exported.

Figures are printed (``-s``): batches each subscriber got.
"""

from __future__ import annotations

import io
import time

import pytest

zmq = pytest.importorskip("zmq")

from kvledger import ConfigurationError, Geometry, InvalidArgumentError, Ledger  # noqa: E402
from kvledger.kvevents import (  # noqa: E402
    DEFAULT_ENDPOINT,
    BlockRemovedMap,
    BlockStoredMap,
    KVEventBatcher,
    KVEventBatchMap,
    KVEventPublisher,
    check_exposure,
    decode_batch,
    local_bind,
    make_publisher,
)
from kvledger.kvevents.endpoints import node_ip  # noqa: E402

G = Geometry(num_pages=16, page_tokens=2)


def batch(first: int = 0) -> KVEventBatchMap:
    return KVEventBatchMap(1.0, (BlockRemovedMap((first,), "GPU"),), 0)


def _received(ctx, endpoint: str, pub: KVEventPublisher, seconds: float, enough: int = 1 << 30) -> int:
    """Batches a SUB socket dialling ``endpoint`` gets while ``pub`` publishes for ``seconds`` (or
    until it got ``enough``)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    got = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and got < enough:
            pub.publish_nowait(batch())
            while sub.poll(20):
                sub.recv_multipart()
                got += 1
    finally:
        sub.close(linger=0)
    return got


@pytest.fixture
def routable() -> str:
    ip = node_ip()
    if ip.startswith("127.") or ip == "::1":
        pytest.skip("this host has no routable address to dial (its default route is loopback)")
    return ip


def test_a_remote_subscriber_cannot_connect_by_default(ctx, routable):
    assert DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
    default = KVEventPublisher()
    assert default.endpoint == DEFAULT_ENDPOINT and default.binds  # (not started: port 5557 may be in use here)
    # the default's bind, on a free port: a subscriber through this host's routable address gets nothing
    with KVEventPublisher("tcp://127.0.0.1:0", bind=True) as pub:
        port = pub.endpoint.rpartition(":")[2]
        remote = _received(ctx, f"tcp://{routable}:{port}", pub, 1.5)
        local = _received(ctx, pub.endpoint, pub, 5, enough=10)
    # a wildcard bind is refused unless asked for; asked for, the same remote subscriber gets batches
    with pytest.raises(ConfigurationError, match="allow_remote"):
        KVEventPublisher("tcp://*:0")
    with KVEventPublisher("tcp://*:0", allow_remote=True) as open_pub:
        port = open_pub.endpoint.rpartition(":")[2]
        remote_when_allowed = _received(ctx, f"tcp://{routable}:{port}", open_pub, 5, enough=10)
    print(f"KV events bound by default: a subscriber dialling {routable} got {remote} batches, one on loopback "
          f"{local}; with a wildcard bind and allow_remote=True the {routable} subscriber got {remote_when_allowed}")
    assert remote == 0 and local > 0 and remote_when_allowed > 0


@pytest.mark.parametrize("endpoint,local", [
    ("tcp://127.0.0.1:5557", True), ("tcp://127.9.9.9:1", True), ("tcp://[::1]:5557", True),
    ("tcp://localhost:0", True), ("ipc:///tmp/kv", True), ("inproc://kv", True),
    ("tcp://*:5557", False), ("tcp://0.0.0.0:5557", False), ("tcp://[::]:5557", False),
    ("tcp://10.0.0.1:5557", False), ("tcp://eth0:5557", False), ("tcp://indexer.svc:5557", False),
])
def test_what_counts_as_a_local_bind(endpoint, local):
    assert local_bind(endpoint) is local
    if not local:
        with pytest.raises(ConfigurationError):
            check_exposure(endpoint, True, False)
        check_exposure(endpoint, True, True)  # asked for
        check_exposure(endpoint, False, False)  # a connect is named by its caller: nothing to refuse


def test_every_way_to_make_a_publisher_refuses_a_remote_bind_unless_asked(tmp_path):
    with pytest.raises(ConfigurationError, match="replay_endpoint"):
        KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://*:0")
    assert KVEventPublisher("tcp://10.0.0.1:5557").binds is False  # vLLM's rule: this one connects out
    with pytest.raises(ConfigurationError):
        KVEventPublisher("tcp://10.0.0.1:5557", bind=True)
    # vLLM's --kv-events-config: its own default endpoint is no longer ours; a wildcard needs the flag
    assert make_publisher('{"enable_kv_cache_events": true}').endpoint == DEFAULT_ENDPOINT
    with pytest.raises(ConfigurationError, match="allow_remote"):
        make_publisher('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
    assert make_publisher({"endpoint": "tcp://*:5557", "allow_remote": True}).binds
    with pytest.raises(ConfigurationError):
        make_publisher({"endpoint": "tcp://*:5557", "allow_remote": "yes"})
    # the engine's kv_events= and the CLI go through the same rule
    from kvledger.engine import open_engine

    with pytest.raises(ConfigurationError, match="allow_remote"):
        import anyio

        async def opened():
            async with open_engine(G, kv_events="tcp://*:0"):
                pass

        anyio.run(opened)
    from kvledger.durable import open_ledger
    from kvledger.kvevents.cli import EXIT_USAGE, main

    log = tmp_path / "e.kvlog"
    open_ledger(log, G).close()
    assert main([str(log), "--zmq", "tcp://*:0", "--wait", "0"]) == EXIT_USAGE
    assert main([str(log), "--zmq", "tcp://*:0", "--wait", "0", "--allow-remote"]) == 0


def _tenants_and_salts(b: KVEventBatcher) -> list:
    led = Ledger(G, observer=b.observe)
    for r, tenant in ((1, "acme"), (2, "globex")):
        led.reserve(r, 2, tenant=tenant)
        led.commit(r, 0, 2)
    b.set_cache_salt(2, "s3cret")
    led.seal_step(0)
    led.complete_step(0, 0)
    for r in (1, 2):
        led.publish(r, [10 * r, 10 * r + 1], [1, 2, 3, 4])
    return led


def test_omit_leaves_token_ids_tenants_and_salts_out_of_every_event(tmp_path):
    want = {(): ((1, 2, 3, 4), [(("acme",),) * 2, (("globex", "s3cret"),) * 2]),
            ("token_ids",): ((), [(("acme",),) * 2, (("globex", "s3cret"),) * 2]),
            ("tenant",): ((1, 2, 3, 4), [None, (("s3cret",),) * 2]),
            ("salt",): ((1, 2, 3, 4), [(("acme",),) * 2, (("globex",),) * 2]),
            ("token_ids", "tenant", "salt"): ((), [None, None])}
    for omit, (tokens, keys) in want.items():
        out: list = []
        b = KVEventBatcher(out.append, clock=lambda: 0.0, omit=omit)
        _tenants_and_salts(b)
        b.flush()
        stored = [e for e in out[-1].events if type(e) is BlockStoredMap]
        assert [e.token_ids for e in stored] == [tokens, tokens], omit
        assert [e.extra_keys for e in stored] == keys, omit
        assert [e.block_hashes for e in stored] == [(10, 11), (20, 21)]  # what a router matches on stays
    with pytest.raises(InvalidArgumentError):
        KVEventBatcher(list.append, omit=("prompt",))
    # the live publisher's bytes, decoded
    with KVEventPublisher("tcp://127.0.0.1:0", omit=("token_ids", "tenant", "salt")) as pub:
        assert pub.omit == {"token_ids", "tenant", "salt"}
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        try:
            led = Ledger(G, observer=pub.observe)
            deadline = time.monotonic() + 10
            while not sub.poll(50):  # the subscription is up once a probe batch arrives
                assert time.monotonic() < deadline
                pub.publish_nowait(batch())
            while sub.poll(100):
                sub.recv_multipart()
            for r, tenant in ((1, "acme"),):
                led.reserve(r, 2, tenant=tenant)
                led.commit(r, 0, 2)
            pub.set_cache_salt(1, "s3cret")
            led.seal_step(0)
            led.complete_step(0, 0)
            led.publish(1, [10, 11], [1, 2, 3, 4])
            pub.flush()
            payloads = []
            while sub.poll(2000):
                payloads.append(sub.recv_multipart()[2])
        finally:
            sub.close(linger=0)
    events = [e for p in payloads for e in decode_batch(p).events if type(e) is BlockStoredMap]
    assert events and all(e.token_ids == () and e.extra_keys is None for e in events)
    assert b"s3cret" not in b"".join(payloads) and b"acme" not in b"".join(payloads)
    # and an export of a log (it records tenants) leaves them out too
    from kvledger.durable import open_ledger
    from kvledger.kvevents import JsonLinesSink, export_log

    path = tmp_path / "t.kvlog"
    with open_ledger(path, G) as led:
        led.reserve(1, 2, tenant="acme")
        led.commit(1, 0, 2)
        led.seal_step(0)
        led.complete_step(0, 0)
        led.publish(1, [10, 11], [1, 2, 3, 4])
        led.seal_step(1)
    buf = io.BytesIO()
    export_log(path, JsonLinesSink(buf), omit=("tenant", "token_ids"))
    text = buf.getvalue().decode()
    assert "BlockStored" in text and "acme" not in text and '"token_ids":[]' in text.replace(" ", "")
