"""kvledger.wire: tensor-parallel PREPARE/READY/LAUNCH over layout-7 frames.

    codec      frames <-> bytes (sans-I/O, ``struct`` layout, CRC32, golden bytes)
    protocol   per-link state machines (PeerLink, LeaderLink) and the leader's
               decision rule (Leader); pure, no I/O, no clock
    transport  in-process memory pipes and anyio TCP streams
    rank       async drivers: open_leader / WireLeader.run_step, run_peer

Importing this package pulls in anyio and msgspec, never torch, triton or CUDA.
"""

from .codec import (
    LAYOUT,
    NO_RANK,
    Abort,
    FrameKind,
    Hello,
    Launch,
    Prepare,
    Ready,
    Reject,
    RejectCode,
    encode,
    encode_prepare,
    geometry_digest,
)
from .decoder import FrameDecoder, decode, page_ids_problem
from .decision import Leader
from .leader import LeaderLink, LeaderState
from .peer import PeerLink, PeerState
from .protocol import (
    NEED_DATA,
    Answered,
    ConnectionClosed,
    Decision,
    DropStep,
    Joined,
    PeerHello,
    RunStep,
)
from .rank import WireLeader, open_leader, run_peer
from .transport import MemoryByteStream, connect_tcp, listen_tcp, listener_address, memory_pipe

__all__ = [
    "LAYOUT",
    "NO_RANK",
    "Abort",
    "FrameDecoder",
    "FrameKind",
    "Hello",
    "Launch",
    "Prepare",
    "Ready",
    "Reject",
    "RejectCode",
    "decode",
    "encode",
    "encode_prepare",
    "geometry_digest",
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
