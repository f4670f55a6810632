"""Issue 32, heavy profile: coverage-guided fuzzing of the layout-9 handshake with atheris.

    python tests/fuzz/fuzz_wire_auth.py [libFuzzer flags, e.g. -runs=1000000 -seed=7 CORPUS_DIR]

The job's key is drawn at random when the harness starts, so the fuzzer never knows it; every
execution makes new links with fresh nonces. The oracle (``one_input``):

* leader side: bytes fed (in chunks) to a ``LeaderLink`` may raise only the library's
  ``WireProtocolError``; the link never hands out ``PeerHello`` (nothing becomes a rank
  without proving the key over *this* link's nonce: recorded handshakes, bad MACs, reflected
  proofs all fail) and never sends its welcome HELLO; what it sends is at most a CHALLENGE
  and a REJECT;
* peer side: bytes fed to a started ``PeerLink`` may raise only ``WireProtocolError``; the
  link never joins and never sends AUTH (it proves nothing to a leader that did not prove
  the key over its own nonce first).

The first input byte steers: its low bit picks the side, the next bit prepends a real
handshake recorded under the job's key on another link (a replay to mutate from), the rest
the chunk size. ``seed_corpus`` holds recorded handshakes of both sides, with bad MACs and
reflected proofs. tests/fuzz/test_fuzz_harnesses.py runs the corpus in the quick profile.
"""

from __future__ import annotations

import os
import pathlib
import sys

_KEY = os.urandom(32)  # the job's key: unknown to the fuzzer
_RECORDED: dict[str, bytes] = {}


def _geometry():
    from kvledger.core.events import Geometry

    return Geometry(num_pages=256, page_tokens=16)


def _recorded() -> dict[str, bytes]:
    """A real handshake under the job's key, on links this harness will never use again."""
    if not _RECORDED:
        from kvledger.wire import LeaderLink, PeerLink, new_nonce

        g = _geometry()
        leader = LeaderLink(g, world_size=4, key=_KEY, nonce=new_nonce())
        peer = PeerLink(g, rank=2, world_size=4, key=_KEY, nonce=new_nonce())
        peer.start()
        hello = peer.data_to_send()
        leader.receive_data(hello)
        leader.next_event()
        challenge = leader.data_to_send()
        peer.receive_data(challenge)
        peer.next_event()
        auth = peer.data_to_send()
        leader.receive_data(auth)
        leader.next_event()
        leader.accept(0)
        _RECORDED.update(peer=hello + auth, leader=challenge + leader.data_to_send())
    return _RECORDED


def one_input(data: bytes) -> None:
    """One execution (AssertionError if the oracle breaks)."""
    from kvledger.core.errors import WireProtocolError
    from kvledger.wire import NEED_DATA, ConnectionClosed, Joined, LeaderLink, PeerHello, PeerLink, new_nonce
    from kvledger.wire.codec import FrameKind

    if not data:
        return
    steer, body = data[0], bytes(data[1:])
    leader_side = not steer & 1
    if steer & 2:
        body = _recorded()["peer" if leader_side else "leader"] + body
    chunk = 1 + (steer >> 2) % 61
    g = _geometry()
    if leader_side:
        link = LeaderLink(g, world_size=4, key=_KEY, nonce=new_nonce())
    else:
        link = PeerLink(g, rank=1, world_size=4, key=_KEY, nonce=new_nonce())
        link.start()
        link.data_to_send()
    sent = bytearray()
    try:
        for start in range(0, len(body) + 1, chunk):
            link.receive_data(body[start: start + chunk] if start < len(body) else b"")
            while (ev := link.next_event()) is not NEED_DATA:
                assert type(ev) is not PeerHello, "a link handed out a rank that never proved the key"
                assert type(ev) is not Joined, "a peer joined a leader that never proved the key"
                if type(ev) is ConnectionClosed:
                    break
            sent += link.data_to_send()
    except WireProtocolError as exc:
        assert isinstance(exc.code, int) and exc.detail, "a WireProtocolError without a code or a detail"
        sent += link.data_to_send()
    kinds = _kinds(bytes(sent))
    if leader_side:
        assert FrameKind.HELLO not in kinds, "the leader welcomed a link that never proved the key"
        assert kinds.count(FrameKind.CHALLENGE) <= 1, "the leader challenged one link twice"
    else:
        assert FrameKind.AUTH not in kinds, "a peer proved the key to a leader that never proved it"


def _kinds(data: bytes) -> list[int]:
    out, pos = [], 0
    while pos + 24 <= len(data):
        out.append(data[pos + 5])
        pos += 24 + int.from_bytes(data[pos + 8: pos + 12], "little")
    return out


def seed_corpus() -> list[bytes]:
    """Recorded handshakes of both sides: as recorded, with a flipped MAC byte (CRC fixed: the
    frame is sound, the proof is not), with the proofs swapped (reflection), and cut short."""
    from kvledger.wire.codec import Auth, Challenge, encode
    from kvledger.wire.decoder import FrameDecoder

    rec = _recorded()
    dec = FrameDecoder()
    dec.feed(rec["peer"] + rec["leader"])
    hello, auth, challenge, welcome = (dec.next_frame() for _ in range(4))
    flip = bytes([auth.proof[0] ^ 1]) + auth.proof[1:]
    bad_auth = encode(hello) + encode(Auth(step=0, rank=auth.rank, proof=flip))
    reflected = encode(hello) + encode(Auth(step=0, rank=auth.rank, proof=challenge.proof))
    flip = bytes([challenge.proof[0] ^ 1]) + challenge.proof[1:]
    bad_challenge = encode(Challenge(step=0, nonce=challenge.nonce, proof=flip)) + encode(welcome)
    out = []
    for body in (rec["peer"], bad_auth, reflected, rec["peer"][:50]):
        out += [bytes([0]) + body, bytes([2 + 4 * 7])]
    for body in (rec["leader"], bad_challenge, rec["leader"][:30]):
        out += [bytes([1]) + body, bytes([3 + 4 * 5])]
    return out


def main(argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["kvledger.wire", "kvledger.core.checks"]):
        import kvledger.wire.auth  # noqa: F401
        import kvledger.wire.leader  # noqa: F401
        import kvledger.wire.peer  # noqa: F401
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    for folder in corpus[:1]:
        path = pathlib.Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        if not any(path.iterdir()):
            for i, data in enumerate(seed_corpus()):
                (path / f"seed-{i:03d}").write_bytes(data)
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
