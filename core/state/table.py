"""The page table's vocabulary: holder and mark codes, and one request's record.

Per page the state keeps one int, ``holder[p]``: a request id r >= 0 (the page
is ``reserved(r)`` or ``kv(r)``; which one is told by r's ``reserved`` / ``kv``
lists), ``HOLDER_FREE`` or ``HOLDER_ALIAS``. Marks are sparse: ``marks[p]`` is
``MARK_ALL`` (zero before any request reads it) or ``MARK_TENANT`` (zero unless
the reader is the tenant whose bytes these are).
"""

from __future__ import annotations

import msgspec

__all__ = [
    "ALIAS",
    "FREE",
    "HOLDER_ALIAS",
    "HOLDER_FREE",
    "HOLDER_NAMES",
    "KV",
    "MARK_ALL",
    "MARK_TENANT",
    "RESERVED",
    "RequestRecord",
]

FREE, RESERVED, KV, ALIAS = 0, 1, 2, 3  # holder kinds (``LedgerState.holder_code``)
HOLDER_NAMES = ("free", "reserved", "kv", "alias")
HOLDER_FREE, HOLDER_ALIAS = -1, -2  # ``holder[p]`` of a free / an aliased page
MARK_ALL, MARK_TENANT = 1, 2


class RequestRecord(msgspec.Struct, gc=False):
    """One request: its tenant, its reserved pages and its KV pages (block table) in order.

    ``restored``: reserved pages an inbound restore wrote (tracked for the non-default
    policies only). Built in C (a msgspec Struct): one is made per request.
    """

    request: int
    tenant: str | None
    reserved: list
    kv: list
    restored: set | None = None
