"""The wire tests' job key and the handshake done by hand (layout 9: a rank proves the key).

    KEY                      the tests' job key (a real 32-byte key, not INSECURE_TEST_KEY)
    leader_link(g, W)        a LeaderLink with KEY and a fresh nonce
    peer_link(g, rank, W)    a PeerLink with KEY and a fresh nonce
    prove(link, rank)        feed a leader link a peer's HELLO and AUTH made with ``key``: the
                             event it then hands out (PeerHello when the key is the link's)
    challenge(peer)          start a peer link and answer its HELLO with a CHALLENGE made with
                             ``key``: the leader nonce used (the peer has sent AUTH if the key is right)
    joined_peer(g, rank, W, step)   a peer link past its handshake at ``step`` (scripted leader side)
    welcome(peer, nonce, step)      the leader's HELLO for a challenged peer

Everything here builds frames with the library's own codec and MACs; nothing is mocked.
"""

from __future__ import annotations

from kvledger.core.events import Geometry
from kvledger.wire import NEED_DATA, Joined, LeaderLink, PeerLink
from kvledger.wire.auth import leader_proof, new_nonce, peer_proof
from kvledger.wire.codec import Auth, Challenge, Hello, encode, geometry_digest
from kvledger.wire.decoder import decode

__all__ = ["KEY", "OTHER_KEY", "challenge", "joined_peer", "leader_link", "peer_link", "prove", "welcome"]

KEY = bytes(range(32))
OTHER_KEY = bytes(range(100, 132))


def leader_link(geometry: Geometry, world_size: int, *, key: bytes = KEY, **kwargs) -> LeaderLink:
    return LeaderLink(geometry, world_size=world_size, key=key, nonce=new_nonce(), **kwargs)


def peer_link(geometry: Geometry, rank: int, world_size: int, *, key: bytes = KEY, **kwargs) -> PeerLink:
    return PeerLink(geometry, rank=rank, world_size=world_size, key=key, nonce=new_nonce(), **kwargs)


def prove(link: LeaderLink, rank: int = 1, *, key: bytes = KEY, step: int = 0, hello: Hello | None = None):
    """A peer's HELLO (``hello``, or rank ``rank`` of the link's world and geometry) and its AUTH
    made with ``key`` for the CHALLENGE the link answers: the link's next event after that."""
    if hello is None:
        hello = Hello(step=step, rank=rank, world_size=link.world_size, geometry_digest=link.digest,
                      nonce=new_nonce())
    link.receive_data(encode(hello))
    assert link.next_event() is NEED_DATA  # challenged
    ch = decode(link.data_to_send())
    assert type(ch) is Challenge
    link.receive_data(encode(Auth(step=0, rank=hello.rank, proof=peer_proof(key, hello, ch.nonce))))
    return link.next_event()


def challenge(peer: PeerLink, *, key: bytes = KEY, step: int = 0) -> bytes:
    """Start ``peer`` and answer its HELLO with a CHALLENGE made with ``key``; returns the leader
    nonce. The peer's answer (AUTH, or REJECT BAD_AUTH) is left in its ``data_to_send``."""
    peer.start(step)
    hello = decode(peer.data_to_send())
    nonce = new_nonce()
    peer.receive_data(encode(Challenge(step=0, nonce=nonce, proof=leader_proof(key, hello, nonce))))
    return nonce


def welcome(geometry: Geometry, world_size: int, nonce: bytes, step: int = 0) -> Hello:
    """The leader's HELLO naming its first step, for a peer it challenged with ``nonce``."""
    return Hello(step=step, rank=0, world_size=world_size, geometry_digest=geometry_digest(geometry), nonce=nonce)


def joined_peer(geometry: Geometry, rank: int = 1, world_size: int = 2, step: int = 0, **kwargs) -> PeerLink:
    """A peer link that proved the key to a scripted leader and joined at ``step``."""
    peer = peer_link(geometry, rank, world_size, **kwargs)
    nonce = challenge(peer)
    assert peer.next_event() is NEED_DATA  # AUTH sent
    peer.data_to_send()
    peer.receive_data(encode(welcome(geometry, world_size, nonce, step)))
    assert type(peer.next_event()) is Joined
    return peer
