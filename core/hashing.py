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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from .errors import InvalidArgumentError

__all__ = ["HASH_BYTES", "block_hash", "block_hashes"]

HASH_BYTES = 16
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
