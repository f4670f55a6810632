"""The canonical form of a state: its digest and its checkpoints.

``canonical(st)`` is every field of the state in a form independent of hash seed
and insertion order (copies, not views: later folds do not change it);
``digest`` is BLAKE2b-256 of its MessagePack encoding, so equal states give
equal digests in any process on any machine; ``from_canonical`` rebuilds a state
from it (log checkpoints). The key names are part of the digest: ``owner`` and
``alias_n`` are the historical names of ``holder`` and ``alias_count``.

Versions: 2 (written now) adds each request's ``kv_steps`` and the prefix-cache
fields (``hashes``, ``sharers``, ``cached``, ``aborted_steps``) to version 1, and
replaces ``last_plan`` with ``in_flight`` (the plans an abort may still reach) and
``restored_since_seal`` with ``restored_since`` (page -> step).
``canonical(st, 1)`` still writes version 1 for a state that uses none of them
(to verify checkpoints written by version 1), and ``from_canonical`` reads both
(a version-1 request's commit steps are unknown: its pages cannot be published).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

from collections import OrderedDict

from ..errors import ConfigurationError
from ..events.events import CacheConfigured, Geometry, StepPlan
from .table import UNKNOWN_STEP, RequestRecord, sharer_set

if TYPE_CHECKING:
    from .state import LedgerState

__all__ = ["DIGEST_VERSION", "DIGEST_VERSIONS", "canonical", "canonical_bytes", "digest", "from_canonical"]

DIGEST_VERSION = 2
DIGEST_VERSIONS = (1, 2)


def canonical(st: LedgerState, version: int = DIGEST_VERSION) -> dict:
    """Every field of ``st`` in canonical form, as ``version`` lays it out.

    Raises ``ConfigurationError`` for an unknown version, or for version 1 when
    the state holds prefix-cache data that version 1 cannot express.
    """
    if version not in DIGEST_VERSIONS:
        raise ConfigurationError(f"unknown canonical state version {version!r}; one of {DIGEST_VERSIONS}")
    g = st.geometry
    lp = st.last_plan
    out: dict[str, object] = {
        "v": version,
        "geometry": None if g is None else [g.num_pages, g.page_tokens],
        "policy": st.policy,
        "seq": st.seq,
        "open_step": st.open_step,
        "owner": list(st.holder),
        "alias_n": list(st.alias_count),
        "marks": sorted(st.marks.items()),
        "residue": sorted(st.residue.items()),
        "restore_targets": [[p, t[0], t[1]] for p, t in sorted(st.restore_targets.items())],
        "pending": sorted(st.pending.items()),
        "restored_since_seal": sorted(st.restored_since),
        "free_stack": st.live_free_stack(),
        "requests": [
            [r, rec.tenant, list(rec.reserved), list(rec.kv), sorted(rec.restored or ())]
            for r, rec in sorted(st.requests.items())
        ],
        "snapshots": [[s, list(pages)] for s, pages in sorted(st.snapshots.items())],
        "clear_lists": [[s, list(pages)] for s, pages in sorted(st.clear_lists.items())],
        "last_plan": None if lp is None else [lp.step, list(lp.clear_list)],  # (v1; v2 replaces it)
        "completed": sorted(st.completed.items()),
    }
    if version == 1:
        if (st.page_hash or st.sharers or st.cached or st.aborted_steps or len(st.in_flight) > 1 or st.overwritten
                or any(s != st.open_step for s in st.restored_since.values())):
            raise ConfigurationError("this state (prefix-cache data, or steps in flight) has no version-1 form")
        return out
    del out["last_plan"], out["restored_since_seal"]
    out["in_flight"] = [[plan.step, list(plan.clear_list)] for plan in st.in_flight]
    out["restored_since"] = sorted(st.restored_since.items())
    out["kv_steps"] = [[r, list(rec.kv_steps)] for r, rec in sorted(st.requests.items())]
    out["hashes"] = [[p, h, st.hash_tenant.get(p)] for p, h in sorted(st.page_hash.items())]
    out["sharers"] = [[p, list(rs)] for p, rs in sorted(st.sharers.items())]
    out["cached"] = list(st.cached)  # least recently used first: the order is state
    out["aborted_steps"] = sorted(st.aborted_steps)
    if st.overwritten:  # (present only while in use: every other state's digest is as before)
        out["overwritten"] = sorted(st.overwritten.items())
    return out


def canonical_bytes(st: LedgerState, version: int = DIGEST_VERSION) -> bytes:
    return msgspec.msgpack.encode(canonical(st, version))


def digest(st: LedgerState, version: int = DIGEST_VERSION) -> str:
    """BLAKE2b-256 of the canonical encoding, hex."""
    return digest_of(canonical_bytes(st, version))


def digest_of(data: bytes) -> str:
    """The digest of a state whose canonical encoding is ``data`` (a checkpoint's bytes)."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def from_canonical(cls: type[LedgerState], data: dict) -> LedgerState:
    """Rebuild a state of class ``cls`` from ``canonical()`` output (a checkpoint).

    Raises ``ConfigurationError`` for another digest version; malformed data raises
    what the Python operations raise (the log's checkpoint loader turns those into
    ``CorruptLogError``).
    """
    st = cls()
    version = data.get("v")
    if version not in DIGEST_VERSIONS:
        raise ConfigurationError(f"unsupported checkpoint version {version!r}")
    if data["geometry"] is not None:
        n, t = data["geometry"]
        st.apply(CacheConfigured(geometry=Geometry(num_pages=n, page_tokens=t), policy=data["policy"]))
    st.seq = data["seq"]
    st.open_step = data["open_step"]
    st.holder = list(data["owner"])
    st.alias_count = list(data["alias_n"])
    st.marks = dict(data["marks"])
    st.residue = dict(data["residue"])
    st.restore_targets = {p: (into, t) for p, into, t in data["restore_targets"]}
    st.pending = dict(data["pending"])
    if version >= 2:
        st.restored_since = dict(data["restored_since"])
        st.in_flight = [StepPlan(step=s, clear_list=tuple(pages)) for s, pages in data["in_flight"]]
    else:
        st.restored_since = dict.fromkeys(data["restored_since_seal"], data["open_step"])
        lp = data["last_plan"]
        st.in_flight = [] if lp is None else [StepPlan(step=lp[0], clear_list=tuple(lp[1]))]
    st.free_stack, st.parked, st.parked_count = [], [], 0
    st.push_free(list(data["free_stack"]))  # (restoring pages are parked where they sit)
    steps = dict(data["kv_steps"]) if version >= 2 else {}
    for r, tenant, reserved, kv, restored in data["requests"]:
        kv_steps = list(steps[r]) if version >= 2 else [UNKNOWN_STEP] * len(kv)
        st.requests[r] = RequestRecord(r, tenant, list(reserved), list(kv), kv_steps, set(restored) or None)
    st.snapshots = {s: list(pages) for s, pages in data["snapshots"]}
    st.clear_lists = {s: list(pages) for s, pages in data["clear_lists"]}
    st.completed = {int(r): s for r, s in data["completed"]}
    if version >= 2:
        for p, h, tenant in data["hashes"]:
            st.page_hash[p] = h
            st.hash_page[h] = p
            if st.policy != "released_aliases":
                st.hash_tenant[p] = tenant
        st.sharers = {p: sharer_set(rs) for p, rs in data["sharers"]}
        st.cached = OrderedDict.fromkeys(data["cached"])
        st.aborted_steps = set(data["aborted_steps"])
        st.overwritten = dict(data.get("overwritten", ()))
    return st
