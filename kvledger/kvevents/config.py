"""``make_publisher``: a KVEventPublisher from what an engine's caller hands over.

    make_publisher("tcp://127.0.0.1:0")                  an endpoint: the defaults (vLLM 0.33's wire)
    make_publisher('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "allow_remote": true,
                     "replay_endpoint": "tcp://*:5558", "topic": "kv@pod-0@llama"}')
                                                         vLLM's --kv-events-config JSON
    make_publisher({"endpoint": ..., "buffer_steps": 1000, "layout": "array"})
                                                         the same as a mapping, with kvledger's options
    make_publisher(publisher)                            a KVEventPublisher (or anything with observe,
                                                         flush, start and stop) as it is

vLLM's ``KVEventsConfig`` fields (0.33) and what they become:

    enable_kv_cache_events   False, or publisher "null": no publisher (returns None)
    publisher                "zmq" (or None: "zmq" when enabled, as vLLM decides)
    endpoint                 endpoint            (default: bind tcp://127.0.0.1:5557, this host only;
                                                  vLLM's default, tcp://*:5557, needs allow_remote)
    replay_endpoint          replay_endpoint     (default None: no replay socket)
    buffer_steps             buffer_steps        (default 10,000)
    hwm                      hwm                 (default kvledger's 10,000; vLLM's is 100,000)
    max_queue_size           max_queue           (default kvledger's 1,024 batches)
    topic                    topic               (default "")

and kvledger's own: ``layout``, ``hashes``, ``replay_format``, ``medium``,
``data_parallel_rank``, ``bind``, ``poll_interval``, ``allow_remote`` (a bind
other hosts can reach) and ``omit`` (a list of ``token_ids``, ``tenant``,
``salt``) (``KVEventPublisher``). A JSON
string holding only ``endpoint`` and friends (no ``enable_kv_cache_events``) is
taken as enabled, as is a mapping. An unknown field, a field of the wrong type or
JSON that does not parse raises ``ConfigurationError`` naming it; nothing is opened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from kvledger.core.errors import ConfigurationError, InvalidArgumentError

__all__ = ["VLLM_FIELDS", "KVLEDGER_FIELDS", "make_publisher", "publisher_options"]

_PUBLISHER_CALLS = ("observe", "flush", "start", "stop")

# vLLM's KVEventsConfig field -> (KVEventPublisher option, accepted types)
VLLM_FIELDS: dict[str, tuple[str | None, tuple[type, ...]]] = {
    "enable_kv_cache_events": (None, (bool,)),
    "publisher": (None, (str, type(None))),
    "endpoint": ("endpoint", (str,)),
    "replay_endpoint": ("replay_endpoint", (str, type(None))),
    "buffer_steps": ("buffer_steps", (int,)),
    "hwm": ("hwm", (int,)),
    "max_queue_size": ("max_queue", (int,)),
    "topic": ("topic", (str,)),
}
KVLEDGER_FIELDS: dict[str, tuple[type, ...]] = {
    "layout": (str,),
    "hashes": (str,),
    "replay_format": (str,),
    "medium": (str, type(None)),
    "data_parallel_rank": (int, type(None)),
    "bind": (bool, type(None)),
    "poll_interval": (int, float),
    "max_queue": (int,),
    "allow_remote": (bool,),
    "omit": (list, tuple),
}


def publisher_options(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``KVEventPublisher`` keyword arguments of a config mapping (module docstring), or None
    when the config turns publishing off. ``ConfigurationError`` for an unknown field or a
    value of the wrong type."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if key in VLLM_FIELDS:
            name, types = VLLM_FIELDS[key]
        elif key in KVLEDGER_FIELDS:
            name, types = key, KVLEDGER_FIELDS[key]
        else:
            known = sorted({*VLLM_FIELDS, *KVLEDGER_FIELDS})
            raise ConfigurationError(f"KV events config: unknown field {key!r} (known: {', '.join(known)})")
        if type(value) not in types or (type(value) is bool and bool not in types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ConfigurationError(f"KV events config: {key} must be {want}, got {value!r}")
        if name is not None:
            out[name] = value
    enabled = config.get("enable_kv_cache_events", True)
    kind = config.get("publisher") or ("zmq" if enabled else "null")
    if kind not in ("zmq", "null"):
        raise ConfigurationError(f"KV events config: publisher must be 'zmq' or 'null', got {kind!r}")
    if not enabled or kind == "null":
        return None
    return out


def make_publisher(spec: Any) -> Any:
    """A publisher for ``spec`` (module docstring): None when ``spec`` is None or turns publishing
    off. Raises ``ConfigurationError`` for a bad config, a bad endpoint or a missing pyzmq, and
    ``InvalidArgumentError`` for something that is none of the accepted forms or a bad option.
    Nothing is opened (``start()`` binds)."""
    from .publisher import KVEventPublisher

    if spec is None:
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if not text.startswith("{"):
            return KVEventPublisher(spec)
        try:
            spec = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ConfigurationError(f"KV events config is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ConfigurationError("KV events config JSON must be an object")
    if isinstance(spec, Mapping):
        options = publisher_options(spec)
        if options is None:
            return None
        return KVEventPublisher(**options)
    if all(callable(getattr(spec, n, None)) for n in _PUBLISHER_CALLS):
        return spec
    raise InvalidArgumentError(f"kv_events must be a ZMQ endpoint, vLLM's --kv-events-config JSON, a mapping of "
                               f"its fields or a kvledger.kvevents.KVEventPublisher, got {spec!r}")
