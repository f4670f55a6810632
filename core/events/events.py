"""Page events: immutable, tagged values. Folding them is the only way state changes.

Every event is a ``msgspec.Struct(frozen=True, tag=...)``. The tag is the event's
snake_case name and is what the log stores; schemas evolve only by appending
fields with defaults (a golden-bytes test pins the encoding).

Page lifecycle (holders), with the mark (``*``) and where it is set and cleared:

               reserve                commit (clears *, lists it)
      free ───────────────► reserved(r) ───────────────────────► kv(r)
       ▲  ◄─────────────── │ return / cancel          cancel/finish │
       │                   └──────────────────────────────────────┘ ─► free
       │ alias                        release of the last alias
       └──────────► alias(S) ───────────────────────────────────────► free*

Prefix-shared pages (a page of kv(r) published under a block hash h):

      kv(r) ──publish──► kv(r), hashed ──share into r2──► kv({r, r2})
                              │ the last holder finishes / cancels
                              ▼
                          cached(h) ──share──► kv({r3})      cached(h) ──evict──► free
                                                             (least recently used first,
                                                              when reserve / alias run short)
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from ..errors import InvalidArgumentError

__all__ = [
    "MAX_ID",
    "MAX_PAGES",
    "Geometry",
    "ClearPolicy",
    "CLEAR_POLICIES",
    "CacheConfigured",
    "PagesReserved",
    "ReservationReturned",
    "PagesCommitted",
    "RequestCancelled",
    "RequestFinished",
    "SnapshotAliased",
    "SnapshotReleased",
    "RestoreStarted",
    "RestoreCompleted",
    "StepSealed",
    "StepCompleted",
    "StepAborted",
    "SanitizerViolation",
    "PagesPublished",
    "PagesShared",
    "PagesEvicted",
    "PagesReleased",
    "PagesUnwritten",
    "RequestLabelled",
    "COMMIT_READS",
    "CommitReads",
    "BlockHash",
    "Event",
    "EVENT_TYPES",
    "StepPlan",
    "ClearPages",
    "BlocksStored",
    "BlocksRemoved",
    "PagesMarked",
    "typed",
]

ClearPolicy = Literal["released_aliases", "cross_tenant", "all_reused"]
CLEAR_POLICIES: tuple[str, ...] = ("released_aliases", "cross_tenant", "all_reused")
# How the step a page is committed for first reads it (``PagesCommitted.reads``).
CommitReads = Literal["tail", "whole", "none"]
COMMIT_READS: tuple[str, ...] = ("tail", "whole", "none")

MAX_ID = (1 << 63) - 1  # request, snapshot, step and rank ids are in [0, MAX_ID]
MAX_PAGES = 1 << 32  # page ids travel as unsigned 32-bit integers on the wire

# The id constraint is checked whenever events are decoded (the log) or type-checked
# (``typed``); constructing an event in Python does not check it.
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
PageIds = tuple[int, ...]  # ranges checked by the fold: PageOutOfRangeError names them

# A block hash is the caller's: a signed 64-bit int or 1-64 bytes (vLLM's ExternalBlockHash is
# either). ``kvledger.core.hashing`` computes chained hashes of token blocks for callers
# without their own (16 bytes).
HashInt = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
HashBytes = Annotated[bytes, msgspec.Meta(min_length=1, max_length=64)]
BlockHash = HashInt | HashBytes


class Geometry(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The page space shared by every rank: ``num_pages`` pages of ``page_tokens`` tokens."""

    num_pages: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGES)]
    page_tokens: Annotated[int, msgspec.Meta(ge=1)]


class _Event(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type"):
    pass


class CacheConfigured(_Event, frozen=True, kw_only=True, tag="cache_configured"):
    """First event of every log: the geometry and the clear policy the fold uses."""

    geometry: Geometry
    policy: str = "released_aliases"


class PagesReserved(_Event, frozen=True, kw_only=True, tag="pages_reserved"):
    """Pages (chosen by the ledger's allocator) become ``reserved(request)``."""

    request: Id
    page_ids: PageIds
    tenant: str | None = None


class ReservationReturned(_Event, frozen=True, kw_only=True, tag="reservation_returned"):
    request: Id
    page_ids: PageIds


class PagesCommitted(_Event, frozen=True, kw_only=True, omit_defaults=True, tag="pages_committed"):
    """Reserved pages join ``request``'s KV pages in order; marked ones form a clear list.

    ``reads``: how the step first reads them. ``"tail"`` (KV): the request reads
    what it writes, and bytes past its last token only under a mask, so a mark of
    its own tenant's bytes is taken off without a clear. ``"whole"`` (a recurrent
    state, read before the step writes it): every mark is listed, whatever tenant
    left it. ``"none"`` (the step writes every byte it reads before reading any: a
    chunk that fills the page, a state copied in): marks come off unlisted, as a
    restore into a request takes them off; if the step does not run for the page
    (aborted, left before its seal, or the request's share dropped:
    ``PagesUnwritten``) the mark comes back. Encoded only when not the default (the
    bytes of every other commit are as before).
    """

    request: Id
    step: Id
    page_ids: PageIds
    reads: CommitReads = "tail"


class RequestCancelled(_Event, frozen=True, kw_only=True, tag="request_cancelled"):
    request: Id


class RequestFinished(_Event, frozen=True, kw_only=True, tag="request_finished"):
    request: Id


class SnapshotAliased(_Event, frozen=True, kw_only=True, tag="snapshot_aliased"):
    snapshot: Id
    page_ids: PageIds


class SnapshotReleased(_Event, frozen=True, kw_only=True, tag="snapshot_released"):
    snapshot: Id


class RestoreStarted(_Event, frozen=True, kw_only=True, tag="restore_started"):
    """An inbound host restore starts writing ``page_ids`` of a request or a snapshot."""

    into: Literal["request", "snapshot"]
    target: Id
    page_ids: PageIds


class RestoreCompleted(_Event, frozen=True, kw_only=True, tag="restore_completed"):
    into: Literal["request", "snapshot"]
    target: Id
    page_ids: PageIds


class StepSealed(_Event, frozen=True, kw_only=True, tag="step_sealed"):
    """Closes ``step``. The fold derives its plan; ``clear_list`` records what the live run derived."""

    step: Id
    clear_list: PageIds = ()


class StepCompleted(_Event, frozen=True, kw_only=True, tag="step_completed"):
    """Rank ``rank`` ran the step's input copies, clears and graph."""

    step: Id
    rank: Id


class StepAborted(_Event, frozen=True, kw_only=True, tag="step_aborted"):
    """The step did not complete on every rank (a rank failed, rejected or timed out)."""

    step: Id
    reason: str = ""


class SanitizerViolation(_Event, frozen=True, kw_only=True, tag="sanitizer_violation"):
    """Sanitize mode found a page that is not what the ledger says it must be, on ``rank``'s
    ``plane``, before step ``step``'s graph: ``kind`` is "not_zero" (a listed page was not
    zeroed) or "poison" (a page committed for the step still holds the poison of a mark).
    A record for audits: the fold changes nothing (the step is aborted separately)."""

    step: Id
    rank: Id
    plane: Id
    page_id: Annotated[int, msgspec.Meta(ge=0, le=MAX_PAGES - 1)]
    kind: Literal["not_zero", "poison"]


class PagesPublished(_Event, frozen=True, kw_only=True, tag="pages_published"):
    """Full KV pages of ``request`` (it wrote them, in a step that completed) gain block hashes.

    ``hashes[i]`` names ``page_ids[i]``; ``parent_hash`` is the hash of the block before the
    first one (None at the start of a sequence); ``token_ids`` are the pages' tokens
    (``len(page_ids) * page_tokens`` of them); ``lora_id`` / ``lora_name`` the adapter, if any.
    Everything a KV-event consumer needs travels in the event, so a log can be exported.
    """

    request: Id
    page_ids: PageIds
    hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    lora_id: int | None = None
    lora_name: str | None = None


class PagesShared(_Event, frozen=True, kw_only=True, tag="pages_shared"):
    """Hashed pages (held by other requests, or cached) join ``request``'s block table, in order.

    A new request is created with ``tenant``; a known one keeps its own.
    """

    request: Id
    page_ids: PageIds
    tenant: str | None = None


class PagesEvicted(_Event, frozen=True, kw_only=True, tag="pages_evicted"):
    """Cached pages go free and lose their hashes (least recently used first)."""

    page_ids: PageIds


class PagesReleased(_Event, frozen=True, kw_only=True, tag="pages_released"):
    """A live request lets go of some of its KV pages (a sliding window that moved on, a
    state block it no longer needs): each leaves its block table as ``RequestFinished``
    would take it (still shared: held by the others; hashed: cached; else free, marked as
    the policy says); the request keeps the rest."""

    request: Id
    page_ids: PageIds


class PagesUnwritten(_Event, frozen=True, kw_only=True, tag="pages_unwritten"):
    """``request``'s pages committed for ``step`` were not written, because the step ran without
    the request (an abort dropped its share of the step); whoever hashed them (an engine's
    prefix cache) withdrew the hashes. A page a ``reads="none"`` commit took a mark off gets
    it back (free: marked for everyone; still in a request's KV: listed for the open step)."""

    request: Id
    step: Id
    page_ids: PageIds
    reason: str = ""


class RequestLabelled(_Event, frozen=True, kw_only=True, tag="request_labelled"):
    """A record: ledger request ``request`` is the engine's ``label`` (a vLLM request id and
    KV cache group, say), for audits that follow the engine's names. It may come before the
    request's first event (so an audit following the label sees all of them); a later label
    names the next incarnation of the id. The fold changes nothing."""

    request: Id
    label: Annotated[str, msgspec.Meta(max_length=1024)]


Event = (
    CacheConfigured
    | PagesReserved
    | ReservationReturned
    | PagesCommitted
    | RequestCancelled
    | RequestFinished
    | SnapshotAliased
    | SnapshotReleased
    | RestoreStarted
    | RestoreCompleted
    | StepSealed
    | StepCompleted
    | StepAborted
    | SanitizerViolation
    | PagesPublished
    | PagesShared
    | PagesEvicted
    | PagesReleased
    | PagesUnwritten
    | RequestLabelled
)

EVENT_TYPES: tuple[type, ...] = Event.__args__


class StepPlan(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What every rank runs for one step: zero ``clear_list`` in every local plane.

    ``clear_list`` holds distinct page ids: the pages an aborted step carried in
    first, then the pages this step's commits listed, in the order they were
    listed (a page whose request let go of it before the seal is not in it; if
    it was committed and listed again, it sits where it was listed last).
    """

    step: Id
    clear_list: PageIds = ()


class ClearPages(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Effect of a commit: these pages must be zeroed before ``step``'s graph reads them."""

    step: Id
    page_ids: PageIds


class PagesMarked(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Effect of any event that set marks: these pages now hold bytes no request may read
    before a clear (the sanitizer fills them with poison before the next plan's clear)."""

    page_ids: PageIds


class BlocksStored(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Effect of a publish: a KV event for consumers (routers, KV-aware load balancers)."""

    hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    page_tokens: int
    lora_id: int | None = None
    lora_name: str | None = None


class BlocksRemoved(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Effect of an eviction: these block hashes are gone from the cache."""

    hashes: tuple[BlockHash, ...]


_type_encoder = msgspec.msgpack.Encoder()
_type_decoder = msgspec.msgpack.Decoder(Event)


def typed(event):
    """Return ``event`` if every field has its schema's type and range (a msgpack round
    trip through the schema); raise ``InvalidArgumentError`` naming the problem otherwise.

    For events built outside the ledger's commands (tools, ``Ledger.submit``): Python
    does not check the annotations when a Struct is constructed.
    """
    if not isinstance(event, EVENT_TYPES):
        raise InvalidArgumentError(f"not a kvledger event: {type(event).__name__}")
    try:
        return _type_decoder.decode(_type_encoder.encode(event))
    except (msgspec.ValidationError, msgspec.DecodeError, TypeError, OverflowError) as exc:
        shown = repr(event)
        if len(shown) > 240:
            shown = shown[:240] + "..."
        raise InvalidArgumentError(f"ill-typed event {shown}: {exc}") from None
