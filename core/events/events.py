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
    "Event",
    "EVENT_TYPES",
    "StepPlan",
    "ClearPages",
    "typed",
]

ClearPolicy = Literal["released_aliases", "cross_tenant", "all_reused"]
CLEAR_POLICIES: tuple[str, ...] = ("released_aliases", "cross_tenant", "all_reused")

MAX_ID = (1 << 63) - 1  # request, snapshot, step and rank ids are in [0, MAX_ID]
MAX_PAGES = 1 << 32  # page ids travel as unsigned 32-bit integers on the wire

# The id constraint is checked whenever events are decoded (the log) or type-checked
# (``typed``); constructing an event in Python does not check it.
Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
PageIds = tuple[int, ...]  # ranges checked by the fold: PageOutOfRangeError names them


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


class PagesCommitted(_Event, frozen=True, kw_only=True, tag="pages_committed"):
    """Reserved pages join ``request``'s KV pages in order; marked ones form a clear list."""

    request: Id
    step: Id
    page_ids: PageIds


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
)

EVENT_TYPES: tuple[type, ...] = Event.__args__


class StepPlan(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What every rank runs for one step: zero ``clear_list`` in every local plane.

    ``clear_list`` holds distinct page ids in the order their marks were taken
    (commit order), each once.
    """

    step: Id
    clear_list: PageIds = ()


class ClearPages(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Effect of a commit: these pages must be zeroed before ``step``'s graph reads them."""

    step: Id
    page_ids: PageIds


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
