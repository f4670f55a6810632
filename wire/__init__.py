"""kvledger.wire: tensor-parallel PREPARE/READY/LAUNCH/COMPLETE over layout-9 frames.

    frames       the frame values and codes (small frozen msgspec Structs)
    codec        their byte layout and the encoders (``struct``, CRC32, golden bytes)
    auth         the handshake's proof of the job's key (HMAC-SHA256), what it protects and what not
    decoder      bytes -> frames (incremental, checked) and the PREPARE page-id check
    protocol     the handshake's overview, the events links hand out, the link base
    peer         PeerLink: a peer's end of its link (pure state machine)
    leader       LeaderLink: the leader's end of one link (pure state machine)
    decision     Leader: the leader's decision rule over all links (pure)
    completion   Completions: which peers completed which launched step (pure)
    transport    in-process memory pipes and anyio TCP streams       (loaded on first use)
    rank         the leader's driver: open_leader / WireLeader.run_step, wait_completed  (same)
    admission    the leader's door: deadlines and a cap on unproven links, pins, accept errors (same)
    peer_driver  the peer's driver: run_peer                                          (same)

Importing this package loads only the sans-I/O half (msgspec, no anyio, no
clock): the transports and the drivers, which need anyio and structlog, load
when one of their names is first used. Never torch, triton or CUDA.
"""

from typing import TYPE_CHECKING

from .auth import INSECURE_TEST_KEY, KEY_ENV, key_from_env, key_from_text, key_to_text, new_key, new_nonce
from .codec import (
    FLAG_SANITIZE,
    LAYOUT,
    NO_RANK,
    Abort,
    Auth,
    Challenge,
    Complete,
    FrameKind,
    Hello,
    Launch,
    Prepare,
    Ready,
    Reject,
    RejectCode,
    Sanitize,
    encode,
    encode_prepare,
    geometry_digest,
)
from .completion import Completions, StepCompletion
from .decision import Leader
from .decoder import FrameDecoder, decode, page_ids_problem
from .leader import LeaderLink, LeaderState
from .peer import PeerLink, PeerState
from .protocol import (
    NEED_DATA,
    Answered,
    Completed,
    ConnectionClosed,
    Decision,
    DropStep,
    Joined,
    PeerHello,
    RunStep,
)

if TYPE_CHECKING:
    from .peer_driver import run_peer
    from .rank import WireLeader, open_leader
    from .transport import MemoryByteStream, connect_tcp, listen_tcp, listener_address, memory_pipe

# Loaded on first use (they import anyio): name -> submodule.
_LAZY = {
    "WireLeader": "rank",
    "open_leader": "rank",
    "run_peer": "peer_driver",
    "MemoryByteStream": "transport",
    "connect_tcp": "transport",
    "listen_tcp": "transport",
    "listener_address": "transport",
    "memory_pipe": "transport",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "FLAG_SANITIZE",
    "INSECURE_TEST_KEY",
    "KEY_ENV",
    "LAYOUT",
    "NO_RANK",
    "Abort",
    "Auth",
    "Challenge",
    "Complete",
    "Completed",
    "Completions",
    "FrameDecoder",
    "FrameKind",
    "Hello",
    "Launch",
    "Prepare",
    "Ready",
    "Reject",
    "RejectCode",
    "Sanitize",
    "StepCompletion",
    "decode",
    "encode",
    "encode_prepare",
    "geometry_digest",
    "key_from_env",
    "key_from_text",
    "key_to_text",
    "new_key",
    "new_nonce",
    "page_ids_problem",
    "NEED_DATA",
    "Answered",
    "ConnectionClosed",
    "Decision",
    "DropStep",
    "Joined",
    "Leader",
    "LeaderLink",
    "LeaderState",
    "PeerHello",
    "PeerLink",
    "PeerState",
    "RunStep",
    "WireLeader",
    "open_leader",
    "run_peer",
    "MemoryByteStream",
    "connect_tcp",
    "listen_tcp",
    "listener_address",
    "memory_pipe",
]
