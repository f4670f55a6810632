"""The page table's vocabulary: holder and mark codes, and one request's record.

Per page the state keeps one int, ``holder[p]``: a request id r >= 0 (the page
is ``reserved(r)`` or ``kv(R)`` with r first in R; which one is told by r's
``reserved`` / ``kv`` lists), ``HOLDER_FREE``, ``HOLDER_ALIAS`` or ``HOLDER_CACHED``. Marks are sparse: ``marks[p]`` is
``MARK_ALL`` (zero before any request reads it) or ``MARK_TENANT`` (zero unless
the reader is the tenant whose bytes these are).
"""

from __future__ import annotations

import msgspec

__all__ = [
    "ALIAS",
    "CACHED",
    "FREE",
    "HOLDER_ALIAS",
    "HOLDER_CACHED",
    "HOLDER_FREE",
    "HOLDER_NAMES",
    "KV",
    "MARK_ALL",
    "MARK_TENANT",
    "MAX_IN_FLIGHT",
    "RESERVED",
    "RequestRecord",
    "SHARERS_ORDERED",
    "sharer_set",
]

FREE, RESERVED, KV, ALIAS, CACHED = 0, 1, 2, 3, 4  # holder kinds (``LedgerState.holder_code``)
HOLDER_NAMES = ("free", "reserved", "kv", "alias", "cached")
HOLDER_FREE, HOLDER_ALIAS, HOLDER_CACHED = -1, -2, -3  # ``holder[p]`` of a free / aliased / cached page
UNKNOWN_STEP = -2  # a kv page's commit step, in a state rebuilt from a version-1 checkpoint
SHARED_IN = -1  # the "commit step" of a page another request wrote and this one shares
MAX_IN_FLIGHT = 16  # sealed plans kept for an abort (the engine runs at most this many steps at once)
MARK_ALL, MARK_TENANT = 1, 2


class RequestRecord(msgspec.Struct, gc=False):
    """One request: its tenant, its reserved pages and its KV pages (block table) in order.

    ``kv_steps[i]`` is the step ``kv[i]`` was committed in (``SHARED_IN`` for a page this
    request shares but did not write). ``restored``: reserved pages an inbound restore
    wrote (tracked for the non-default policies only). Built in C (a msgspec Struct):
    one is made per request.
    """

    request: int
    tenant: str | None
    reserved: list
    kv: list
    kv_steps: list
    restored: set | None = None


# The requests of a shared page, R of kv(R), in the order they joined: an insertion-ordered
# set (dict keys), so a request joins and leaves in O(1) and R[0] is ``next(iter(R))``. A plain
# dict's first key sits behind the slots of the keys deleted before it (until an insertion
# compacts it), so when the first leaves a set of SHARERS_ORDERED requests or more, the set
# becomes an OrderedDict (a linked list: its first key is O(1) whatever left before it, as
# when thousands of requests on one prefix finish oldest first); the rest stay plain dicts
# (cheaper to join and leave). Either is a dict; only the cost differs.
SHARERS_ORDERED = 64


def sharer_set(requests) -> dict[int, None]:
    """R as the state keeps it: ``requests`` (distinct, in joining order) as dict keys."""
    return dict.fromkeys(requests)
