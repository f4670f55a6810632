"""The handshake's proof of the job's shared key (layout 9), and what it protects. Pure.

A rank counts only after it proved the job's key on its own connection (SPEC,
"The wire"). The proof is an HMAC-SHA256 challenge over both ends' fresh nonces,
in both directions, inside the HELLO exchange (``protocol`` draws the whole
handshake; the links compute and check the MACs with the key and nonces their
drivers hand them: nothing here draws randomness unless asked, nothing does I/O):

    peer r                                               leader
    ──────                                               ──────
    HELLO(r, W, geometry, nonce_p)  ──────────────►      layout, W, geometry, rank range
                                    ◄──────────────      CHALLENGE(nonce_l, proof_l)
    proof_l == leader_proof(K, HELLO, nonce_l)?             proof_l = HMAC(K, "leader" | HELLO | nonce_l)
      no: REJECT BAD_AUTH, close
    AUTH(r, proof_p)                ──────────────►      proof_p == peer_proof(K, HELLO, nonce_l)?
      proof_p = HMAC(K, "peer" | HELLO | nonce_l)           no: REJECT BAD_AUTH, close: never a rank
                                    ◄──────────────      HELLO(0, W, geometry, first step, nonce_l)
    joined                                               PeerHello: rank r counts from here

``HELLO`` in a MAC is the peer's HELLO frame, every byte of it (layout, rank,
world size, geometry digest, its nonce), so a proof is bound to one rank of one
job's geometry on one connection.

What the key protects (each pinned by a test in tests/wire/test_wire_auth.py):

* **Who is a rank.** Without the key nobody gets past CHALLENGE: no vote, no
  COMPLETE, no ``StepCompleted`` recorded for it, and a rank's slot is never
  held by an impostor (slots are taken only after AUTH).
* **Replays.** Every proof covers the leader's nonce of this connection, drawn
  fresh (32 random bytes) for each link: a recorded handshake played again
  fails. The peer's own nonce makes the leader's proof fresh for the peer too.
* **Reflection.** The two directions carry different labels: a leader's proof
  is never a peer's, nor the other way round.
* **The peer's side.** A peer proves nothing before the leader proved the key,
  so a fake leader learns no proof and launches nothing on it.

What it does not protect (say so to whoever deploys it; README "Security"):

* **No encryption.** Every frame, the clear lists and payloads included, is in
  clear on the wire. The key is never sent.
* **No integrity after the handshake** beyond each frame's CRC32: someone who
  can inject into or take over an established TCP connection (on the path
  between two hosts) can forge frames on it. Between hosts, run the wire inside
  a network boundary you trust (a private network, WireGuard, IPsec, an SSH
  tunnel); loopback is not a boundary against local users, the key is.
* **The key's own secrecy.** It is as secret as the place it travels: the
  environment (``KVLEDGER_WIRE_KEY``) or torch.distributed's rendezvous store,
  which has no authentication of its own (anyone who can reach the store's port
  can read it). Where that matters, set the variable from a secret store.
* **Denial of service** is bounded, not prevented: the leader drops a link that
  has not proved the key within a deadline and holds at most a fixed number of
  such links (``WireLeader``), but a flood still costs it accepts and bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

from ..core.errors import ConfigurationError, InvalidArgumentError
from .codec import NONCE_BYTES, PROOF_BYTES, Hello, encode

__all__ = [
    "INSECURE_TEST_KEY",
    "KEY_ENV",
    "MIN_KEY_BYTES",
    "check_key",
    "check_nonce",
    "key_from_env",
    "key_from_text",
    "key_to_text",
    "leader_proof",
    "new_key",
    "new_nonce",
    "peer_proof",
    "proofs_match",
]

KEY_ENV = "KVLEDGER_WIRE_KEY"  # the job's key as hex, for ranks started elsewhere
MIN_KEY_BYTES = 16  # 128 bits; new_key() draws 32
MAX_KEY_BYTES = 1024
INSECURE_TEST_KEY = b"kvledger.wire INSECURE TEST KEY: publicly known, authenticates no one"
"""A key everyone knows: for tests and benchmarks that do not want to carry a secret around.
A link that uses it is as open as no authentication at all; the drivers log a warning
(``wire.insecure_test_key``) each time one is made with it. Never use it in a deployment."""

_LABEL = b"kvledger.wire/9 handshake proof of the job key: "


def check_key(key: object, what: str = "key") -> bytes:
    """``key`` as bytes if it can be a job's key (bytes of ``MIN_KEY_BYTES`` to 1024 bytes);
    ``InvalidArgumentError`` otherwise (the message never shows the key)."""
    if not isinstance(key, (bytes, bytearray)):
        raise InvalidArgumentError(f"the wire {what} must be bytes, got {type(key).__name__}")
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgumentError(f"the wire {what} must be {MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes, "
                                   f"got {len(key)}")
    return bytes(key)


def check_nonce(nonce: object) -> bytes:
    """``nonce`` if it is ``NONCE_BYTES`` bytes; ``InvalidArgumentError`` otherwise."""
    if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
        raise InvalidArgumentError(f"a handshake nonce must be {NONCE_BYTES} bytes, got {nonce!r}")
    return nonce


def new_key() -> bytes:
    """A fresh job key: 32 bytes from ``secrets``."""
    return secrets.token_bytes(32)


def new_nonce() -> bytes:
    """A fresh handshake nonce: ``NONCE_BYTES`` bytes from ``secrets`` (one per link, never reused)."""
    return secrets.token_bytes(NONCE_BYTES)


def key_to_text(key: bytes) -> str:
    """The key as hex (what ``KVLEDGER_WIRE_KEY`` and the rendezvous store carry)."""
    return check_key(key).hex()


def key_from_text(text: str, what: str = KEY_ENV) -> bytes:
    """A key from its hex text. ``ConfigurationError`` naming ``what`` (never the text) when it is
    not hex or not the size of a key."""
    try:
        key = bytes.fromhex(text.strip())
    except (ValueError, AttributeError):
        raise ConfigurationError(f"{what} is not a hex string") from None
    try:
        return check_key(key)
    except InvalidArgumentError as exc:
        raise ConfigurationError(f"{what}: {exc}") from None


def key_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The key in ``$KVLEDGER_WIRE_KEY`` (hex), or None when it is unset or empty.
    ``ConfigurationError`` when it is set but not a key."""
    text = (os.environ if environ is None else environ).get(KEY_ENV, "").strip()
    return key_from_text(text) if text else None


def _mac(key: bytes, role: bytes, hello: Hello, nonce: bytes) -> bytes:
    return hmac.new(key, _LABEL + role + b"\0" + encode(hello) + nonce, hashlib.sha256).digest()


def leader_proof(key: bytes, hello: Hello, nonce: bytes) -> bytes:
    """The leader's proof (CHALLENGE) for the peer's ``hello`` and the leader's ``nonce``."""
    return _mac(key, b"leader", hello, nonce)


def peer_proof(key: bytes, hello: Hello, nonce: bytes) -> bytes:
    """The peer's proof (AUTH) for its own ``hello`` and the leader's CHALLENGE ``nonce``."""
    return _mac(key, b"peer", hello, nonce)


def proofs_match(expected: bytes, got: bytes) -> bool:
    """Whether a received proof is the expected one, in constant time."""
    return len(got) == PROOF_BYTES and hmac.compare_digest(expected, got)
