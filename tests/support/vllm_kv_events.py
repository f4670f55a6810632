"""vLLM's own KV event structs (``vllm/distributed/kv_events.py``), loaded unchanged from a
supported version's sdist (``support.upstream.source_file``) without installing vLLM.

Only the vllm modules the file imports are stood in for, in ``sys.modules``, while it
loads: its logger, its network helpers; ``KVEventsConfig`` (``vllm/config/kv_events.py``)
and ``ExternalBlockHash`` (evaluated from ``vllm/v1/core/kv_cache_utils.py``, whose
module needs torch) are the sdist's own. The module comes back with two attributes
added: ``KVEventsConfigClass`` and ``decoder`` (``msgspec.msgpack.Decoder`` of its
``KVEventBatch``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import logging
import sys
import types

import msgspec
import pytest

from support.upstream import source_file

__all__ = ["load_kv_events"]


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _external_block_hash(utils_path) -> object:
    """``ExternalBlockHash`` as vLLM's ``kv_cache_utils.py`` defines it (its one assignment,
    evaluated alone)."""
    tree = ast.parse(utils_path.read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ExternalBlockHash":
            return eval(compile(ast.Expression(node.value), str(utils_path), "eval"), {})  # noqa: S307
    raise AssertionError(f"ExternalBlockHash not found in {utils_path}")


def _load(path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def load_kv_events(version: str) -> types.ModuleType:
    """vLLM ``version``'s ``vllm.distributed.kv_events``; ``UpstreamUnavailable`` when its sdist
    cannot be had."""
    events_py = source_file("vllm/distributed/kv_events.py", version)
    config_py = source_file("vllm/config/kv_events.py", version)
    utils_py = source_file("vllm/v1/core/kv_cache_utils.py", version)
    stubs = {
        "vllm": _module("vllm"),
        "vllm.config": _module("vllm.config"),
        "vllm.config.utils": _module("vllm.config.utils", config=dataclasses.dataclass),
        "vllm.logger": _module("vllm.logger", init_logger=logging.getLogger),
        "vllm.utils": _module("vllm.utils"),
        "vllm.utils.network_utils": _module(
            "vllm.utils.network_utils", get_ip=lambda: "127.0.0.1", get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
            is_valid_ipv6_address=lambda ip: ":" in ip, split_zmq_path=lambda p: ("tcp", *p[6:].rsplit(":", 1))),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.core": _module("vllm.v1.core"),
        "vllm.v1.core.kv_cache_utils": _module("vllm.v1.core.kv_cache_utils",
                                               ExternalBlockHash=_external_block_hash(utils_py)),
        "vllm.distributed": _module("vllm.distributed"),
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, mod in stubs.items():
            mp.setitem(sys.modules, name, mod)
        mp.delitem(sys.modules, "vllm.config.kv_events", raising=False)
        mp.delitem(sys.modules, "vllm.distributed.kv_events", raising=False)
        config = _load(config_py, "vllm.config.kv_events")
        events = _load(events_py, "vllm.distributed.kv_events")
        mp.delitem(sys.modules, "vllm.config.kv_events")
        mp.delitem(sys.modules, "vllm.distributed.kv_events")
    events.KVEventsConfigClass = config.KVEventsConfig
    events.decoder = msgspec.msgpack.Decoder(type=events.KVEventBatch)
    return events
