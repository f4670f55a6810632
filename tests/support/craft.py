"""Build log bytes by hand, from the documented layout (docs/LOG-FORMAT.md), checksums and chain forged to match.

An untrusted file can claim anything and still pass every checksum: whoever
writes it can compute them. These helpers write such files for the R17 tests.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import msgspec

HEADER = struct.Struct("<8sHH16sQQ16s")
PREFIX = struct.Struct("<2sBBIQIQ")
MAGIC = b"\x89KVLOG\r\n"
EVENTS, CHECKPOINT, CLOSE = 1, 2, 3


def header(num_pages: int, page_tokens: int = 16, policy: str = "released_aliases", log_id: bytes = bytes(16),
           version: int = 1, size: int = 64) -> bytes:
    body = HEADER.pack(MAGIC, version, size, log_id, num_pages, page_tokens, policy.encode())
    return body + struct.pack("<I", zlib.crc32(body))


def segment_header(num_pages: int, page_tokens: int = 16, policy: str = "released_aliases",
                   log_id: bytes = bytes(16)) -> bytes:
    """Segment 0's 96-byte version-2 header (a log directory's first file), CRC forged to match."""
    body = HEADER.pack(MAGIC, 2, 96, log_id, num_pages, page_tokens, policy.encode()) \
        + struct.pack("<QQQ8s", 0, 0, 0, bytes(8))
    return body + struct.pack("<I", zlib.crc32(body))


def record(log: bytes, kind: int, seq: int, count: int, payload: bytes, synced: int | None = None,
           length: int | None = None) -> bytes:
    """``log`` + one record whose CRC and chain are correct for ``log`` (``length`` may lie)."""
    log_id = log[12:28]
    n = len(payload) if length is None else length
    body = PREFIX.pack(b"KR", kind, 0, n, seq, count, len(log) if synced is None else synced) + payload
    chain = hashlib.blake2b(log + body, digest_size=8, key=log_id, person=b"kvledger-log-v1").digest()
    return log + body + chain + struct.pack("<I", zlib.crc32(body + chain))


def events_payload(items: list, count: int | None = None) -> bytes:
    enc = msgspec.msgpack.Encoder()
    return b"\xdd" + struct.pack(">I", len(items) if count is None else count) + b"".join(enc.encode(x) for x in items)


def configured(num_pages: int, page_tokens: int = 16, policy: str = "released_aliases") -> dict:
    return {"type": "cache_configured", "geometry": {"num_pages": num_pages, "page_tokens": page_tokens},
            "policy": policy}


def checkpoint_payload(seq: int, digest: str, state: bytes) -> bytes:
    return msgspec.msgpack.encode({"seq": seq, "digest": digest, "state": state})
