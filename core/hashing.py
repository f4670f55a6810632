"""Chained block hashes of token ids: a stable, documented default for callers without their own.

A sequence's KV pages are hashed block by block, each hash covering the block's
tokens and everything before it (the parent hash), so two requests share a
block's KV exactly when they share the whole prefix up to and including it:

    h[0] = H(parent,   tokens[0 : T],    extra_keys)
    h[i] = H(h[i - 1], tokens[iT : iT+T], extra_keys)       T = page_tokens

    H(parent, block, extra) = BLAKE2b-128(person=b"kvledger.block1",
                                          msgpack([parent, block, extra]))

``parent`` is None for the first block of a sequence (or the hash of the block
before it); ``block`` the block's token ids (a list of ints); ``extra`` a list of
the extra keys that must also match (a LoRA adapter name, a cache salt, a
multimodal input's hash), each a str, an int or bytes. msgpack encodes these
types one way only, so the hash is the same in every process, on every machine,
with any PYTHONHASHSEED. Only full blocks are hashed (a partial last block is
not reusable). Engines that hash their own way pass their hashes to
``Ledger.publish`` / ``share`` / ``lookup`` unchanged (ints or bytes).

The u64 form (``to_u64``): KV event consumers index blocks by 64-bit ints
(Dynamo's indexer accepts nothing else), so KV events carry each hash folded to
an unsigned 64-bit int the way vLLM 0.33 folds its own wider block hashes
(``vllm/v1/core/kv_cache_utils.py``, ``maybe_convert_block_hash``, on by default
through ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)::

    u64(h) = int.from_bytes(h, "big") & (2**64 - 1)      # h: bytes

i.e. the hash's last 8 bytes read as a big-endian unsigned int (of a 16-byte
BLAKE2b hash here, of a 32-byte SHA-256 hash in vLLM). An int hash is reduced
the same way (``h & (2**64 - 1)``: a negative 64-bit one becomes its two's
complement). The ledger keeps the full hash; only the wire carries the fold, so
two blocks whose hashes share their last 8 bytes (odds 2**-64 a pair) would look
alike to a router, exactly as vLLM's own blocks would.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

import msgspec

from .errors import InvalidArgumentError

__all__ = ["HASH_BYTES", "U64_MASK", "block_hash", "block_hashes", "to_u64", "to_u64_all"]

HASH_BYTES = 16
U64_MASK = (1 << 64) - 1
_last8 = struct.Struct(">Q").unpack_from
_SWAP = sys.byteorder == "little"  # array("Q") reads native order; the fold reads big-endian
_PERSON = b"kvledger.block1"
_encode = msgspec.msgpack.Encoder().encode


def block_hash(parent: bytes | int | None, tokens: Sequence[int], extra_keys: Sequence = ()) -> bytes:
    """H(parent, tokens, extra_keys): one block's hash (see the module docstring).

    Raises ``InvalidArgumentError`` for a parent that is not None, an int or bytes, a
    token that is not an int, or an extra key that is not a str, an int or bytes.
    """
    _check_parent(parent)
    _check_extra_keys(extra_keys)
    block = list(tokens)
    _check_tokens(block)
    return _hash(parent, block, list(extra_keys))


def _hash(parent: bytes | int | None, block: list[int], extra: list) -> bytes:
    try:
        data = _encode([parent, block, extra])
    except (TypeError, OverflowError) as exc:
        raise InvalidArgumentError(f"cannot hash block: {exc}") from None
    return hashlib.blake2b(data, digest_size=HASH_BYTES, person=_PERSON).digest()


def _check_parent(parent: object) -> None:
    if parent is not None and type(parent) not in (int, bytes):
        raise InvalidArgumentError(f"the parent hash must be None, an int or bytes, got {parent!r}")


def _check_extra_keys(extra_keys: Sequence) -> None:
    for k in extra_keys:
        if type(k) not in (str, int, bytes):
            raise InvalidArgumentError(f"extra keys must be str, int or bytes, got {k!r}")


def _check_tokens(tokens: list) -> None:
    if any(type(t) is not int for t in tokens):
        raise InvalidArgumentError("token ids must be ints")


def block_hashes(
    token_ids: Sequence[int],
    page_tokens: int,
    *,
    parent: bytes | int | None = None,
    extra_keys: Sequence = (),
) -> list[bytes]:
    """The chained hashes of every full block of ``token_ids`` (``len(token_ids) // page_tokens``).

    Raises ``InvalidArgumentError`` for a page size that is not a positive int, a
    token that is not an int, or an extra key that is not a str, an int or bytes.
    """
    if type(page_tokens) is not int or page_tokens < 1:
        raise InvalidArgumentError(f"page_tokens must be a positive int, got {page_tokens!r}")
    _check_parent(parent)
    _check_extra_keys(extra_keys)
    tokens = list(token_ids)
    _check_tokens(tokens)
    extra = list(extra_keys)
    out = []
    h = parent
    for i in range(len(tokens) // page_tokens):
        h = _hash(h, tokens[i * page_tokens : (i + 1) * page_tokens], extra)
        out.append(h)
    return out


def to_u64(h: bytes | int) -> int:
    """A block hash in the u64 form (module docstring: vLLM 0.33's fold). Raises
    ``InvalidArgumentError`` for something that is not bytes or an int."""
    t = type(h)
    if t is bytes:
        n = len(h)  # type: ignore[arg-type]
        return _last8(h, n - 8)[0] if n >= 8 else int.from_bytes(h, "big")  # type: ignore[arg-type]
    if t is int:
        return h & U64_MASK  # type: ignore[operator]
    raise InvalidArgumentError(f"a block hash is bytes or an int, got {h!r}")


def to_u64_all(hashes: Sequence[bytes | int]) -> tuple[int, ...]:
    """``to_u64`` of each hash, in order. Many 16-byte hashes (``block_hash``'s) fold in one
    pass over their bytes; anything else hash by hash. ``InvalidArgumentError`` for a hash
    that is neither bytes nor an int."""
    n = len(hashes)
    if n > 1 and type(hashes[0]) is bytes:
        try:
            joined = b"".join(hashes)  # type: ignore[arg-type]
        except TypeError:
            joined = b""
        if len(joined) == HASH_BYTES * n and min(map(len, hashes)) == HASH_BYTES:  # type: ignore[arg-type]
            words = array("Q")
            words.frombytes(joined)
            if _SWAP:
                words.byteswap()
            return tuple(words[1::2])  # each hash's last 8 bytes, big-endian
    last8, mask = _last8, U64_MASK
    try:
        return tuple([last8(h, len(h) - 8)[0] if type(h) is bytes and len(h) >= 8 else
                      (h & mask if type(h) is int else to_u64(h)) for h in hashes])
    except TypeError:
        raise InvalidArgumentError(f"block hashes are bytes or ints, got {hashes!r}") from None
