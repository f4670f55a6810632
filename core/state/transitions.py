"""The transition table: every event's rule as data, and the code that enforces and folds it.

One row per event type, as in h11's ``_state.py``. The columns are data, not prose:

    names      the event's arguments that name what it acts on (``r``, ``s``, ``pages``,
               ``step`` ...): SPEC's event cell
    touches    how the pages it touches are found: one of its fields (``page_ids``,
               ``page_id``, ``clear_list``), or, read in the state before its fold, every
               page of the request (``request``) or snapshot (``snapshot``) it names, or
               of the plans an abort takes down (``plans``); ``""``: none
    requires   the precondition: the holders each named page may have, the flags it must
               have (``not restoring`` ...), the id that must be known or live, the step's
               relation to the open step (``STEP_RULES``), and the rest in SPEC's words
    moves      the holders the pages move from and to (``""``: unchanged)
    marks      what happens to the mark: ``kept``, ``cleared``, ``set``, ``unchanged``,
               ``none``, ``policy`` (as the policy says for a page going free), ``relisted``
               (an abort's pages), ``restored`` (a mark a ``reads="none"`` commit took off
               comes back) or ``by target`` (a restore)
    effects    the effect types the applier may return (``ClearPages``, ``StepPlan``, ...)
    unbounded  the fields no validation bounds (a durable log measures an event with one)
    validate   ``(state, event) -> None``: the precondition, raising the specific error
    apply      ``(state, event) -> effects``: the applier (``fold*.py``)

What is derived from the columns, and nowhere kept by hand:

    the SPEC table's cells   ``row.precondition``, ``row.pages``, ``row.mark``, ``row.effect``,
                             ``event_cell(t)``, ``spec_rows()`` (docs/TRANSITIONS.md is generated
                             from them: ``python scripts/transitions``, ``document()``, pinned by
                             tests/core/test_transitions.py, which also holds them against
                             SPEC's own table)
    touched(state, event)    the pages an event touches (the audit, the sanitizer)
    handlers(namespace, prefix)   a dispatch of one handler per event type, built from the
                             rows: an event type without a handler fails where it is built, at
                             import (the audit's model, the sanitizer)
    STEP_RULES, unbounded    the log's bounds of a trusted fold and its size risks

``LedgerState.validate`` / ``apply`` dispatch through this table and nothing else;
an event type that is not in it is refused (``InvalidArgumentError``) naming the type.
To add an event: its struct in ``core/events/events.py``, a precondition in
``preconditions.py``, an applier in the fold module of its seam (``fold.py``,
``fold_steps.py``, ``fold_prefix.py``), its row here, and a handler wherever
``handlers`` builds a dispatch (the import says which are missing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..events.events import (
    EVENT_TYPES,
    BlocksRemoved,
    BlocksStored,
    CacheConfigured,
    ClearPages,
    PagesCommitted,
    PagesEvicted,
    PagesMarked,
    PagesPublished,
    PagesReleased,
    PagesReserved,
    PagesShared,
    PagesUnwritten,
    RequestCancelled,
    RequestFinished,
    RequestLabelled,
    ReservationReturned,
    RestoreCompleted,
    RestoreStarted,
    SanitizerViolation,
    SnapshotAliased,
    SnapshotReleased,
    StepAborted,
    StepCompleted,
    StepPlan,
    StepSealed,
)
from . import fold, fold_prefix, fold_steps
from . import preconditions as pre

if TYPE_CHECKING:
    from .state import LedgerState

__all__ = ["STEP_RULES", "TOUCHES", "TRANSITIONS", "Marks", "Moves", "Requires", "Transition", "event_cell",
           "document", "event_name", "handlers", "spec_rows", "touched"]

# A holder in SPEC's notation: its kind and the name of what it belongs to.
FREE, RESERVED, KV, KV_SHARED, ALIAS, CACHED = "free", "reserved(r)", "kv(r)", "kv(R)", "alias(S)", "cached(h)"

# The step an event names, against the open step (what a trusted fold still checks: core/log/fold.py).
STEP_RULES: dict[str, str] = {
    "not older": "step not older than the open step",  # step >= open step
    "open": "step open",  # step == open step
    "sealed": "step sealed",  # step < open step
    "in flight": "a step in flight",  # one of the plans in flight
}

# How an event's pages are found (``touched``).
TOUCHES = ("page_ids", "page_id", "clear_list", "request", "snapshot", "plans", "")


class Requires(NamedTuple):
    """The precondition. ``holders``: what each named page may be held by (any one); ``flags``:
    what each must also be; ``qualifier``: said of each page before its holders; ``known``: the
    id that must be known (``r``) or live (``s``); ``step``: a ``STEP_RULES`` key; ``first``:
    only as a log's first event; ``also``: the rest of the rule in SPEC's words; ``words``: the
    whole rule in SPEC's words, for a rule whose shape is its own."""

    holders: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    qualifier: str = ""
    known: str = ""
    step: str = ""
    first: bool = False
    also: str = ""
    words: str = ""


class Moves(NamedTuple):
    """Where the touched pages go: from ``frm`` (all of them when empty) to the holder ``to``
    (``""``: unchanged; ``None`` for an event that moves no page); ``note`` qualifies it;
    ``words``: the whole move in SPEC's words where its shape is its own."""

    to: str | None = None
    frm: tuple[str, ...] = ()
    note: str = ""
    words: str = ""


class Marks(NamedTuple):
    """What happens to the mark of the touched pages: ``change`` (the kind), ``note`` after it in
    parentheses, or ``words``: the whole rule in SPEC's words."""

    change: str
    note: str = ""
    words: str = ""


class Transition(NamedTuple):
    """One row of the table (the module docstring names the columns)."""

    names: tuple[str, ...]
    touches: str
    requires: Requires
    moves: Moves
    marks: Marks
    effects: tuple[type, ...]
    effect_words: str
    unbounded: tuple[str, ...]
    validate: Callable[[Any, Any], None]
    apply: Callable[[Any, Any], tuple]

    @property
    def precondition(self) -> str:
        """SPEC's precondition cell, from ``requires``."""
        q = self.requires
        if q.words:
            return q.words
        parts: list[str] = []
        if q.first:
            parts.append("first event of a log")
        if q.known:
            parts.append(f"{q.known} {'known' if q.known == 'r' else 'live'}")
        if q.holders or q.flags:
            each = " ".join(filter(None, (q.qualifier + ("," if q.qualifier and q.holders else ""),
                                          " or ".join(q.holders))))
            parts.append(", ".join(filter(None, (f"each page {each}".rstrip(), *q.flags))))
        if q.step:
            parts.append(STEP_RULES[q.step])
        if q.also:
            parts.append(q.also)
        return "; ".join(parts)

    @property
    def pages(self) -> str:
        """SPEC's pages cell, from ``moves``."""
        m = self.moves
        if m.words:
            return m.words
        if m.to is None:
            return "—"
        if m.to == "":
            return "unchanged" + (f" ({m.note})" if m.note else "")
        head = f"{' and '.join(m.frm)} pages → {m.to}" if m.frm else f"→ {m.to}"
        return f"{head}, {m.note}" if m.note else head

    @property
    def mark(self) -> str:
        """SPEC's mark cell, from ``marks``."""
        k = self.marks
        if k.words:
            return k.words
        return f"{k.change} ({k.note})" if k.note else k.change

    @property
    def effect(self) -> str:
        """SPEC's effect cell."""
        return self.effect_words or "—"


def _row(names: tuple[str, ...], touches: str, requires: Requires, moves: Moves, marks: Marks,
         effects: tuple[type, ...], effect_words: str, validate, apply, unbounded: tuple[str, ...] = ()) -> Transition:
    assert touches in TOUCHES and (not requires.step or requires.step in STEP_RULES)
    return Transition(names, touches, requires, moves, marks, effects, effect_words, unbounded, validate, apply)


_REQUEST_GONE = dict(
    names=("r",), touches="request", requires=Requires(known="r"),
    moves=Moves(to=FREE, frm=("reserved", "kv")), marks=Marks("kept"), effects=(PagesMarked,), effect_words="",
    validate=pre.request_known, apply=fold.request_gone)

# SPEC's tables ("Events and their rules", "Prefix-shared pages"), row by row, and the engine's step records.
TRANSITIONS: dict[type, Transition] = {
    CacheConfigured: _row(
        ("geometry",), "", Requires(first=True), Moves(words="all free"), Marks("none"), (), "",
        pre.cache_configured, fold.cache_configured, unbounded=("geometry",)),
    PagesReserved: _row(
        ("r", "pages"), "page_ids", Requires(holders=(FREE,), flags=("not restoring",)), Moves(to=RESERVED),
        Marks("kept"), (), "", pre.pages_reserved, fold.pages_reserved, unbounded=("tenant",)),
    ReservationReturned: _row(
        ("r", "pages"), "page_ids", Requires(holders=(RESERVED,)), Moves(to=FREE), Marks("kept"), (PagesMarked,), "",
        pre.reservation_returned, fold.reservation_returned),
    PagesCommitted: _row(
        ("r", "step", "pages"), "page_ids", Requires(holders=(RESERVED,), flags=("not restoring",), step="not older"),
        Moves(to=KV, note="appended in order"), Marks("cleared"), (ClearPages,),
        "the page ids that were marked, in commit order: the clear list of step",
        pre.pages_committed, fold.pages_committed),
    RequestCancelled: _row(**_REQUEST_GONE),  # type: ignore[arg-type]
    RequestFinished: _row(**_REQUEST_GONE),  # type: ignore[arg-type]
    SnapshotAliased: _row(
        ("s", "pages"), "page_ids", Requires(holders=(FREE, ALIAS), flags=("not restoring",)),
        Moves(to="alias(S ∪ {s})"), Marks("kept", note="snapshot reuse keeps the mark"), (), "",
        pre.snapshot_aliased, fold.snapshot_aliased),
    SnapshotReleased: _row(
        ("s",), "snapshot", Requires(known="s"),
        Moves(to=FREE, words="s leaves each page's S; a page whose S becomes empty → free"),
        Marks("set", words="set on every page whose last alias was released"), (PagesMarked,), "",
        pre.snapshot_released, fold.snapshot_released),
    RestoreStarted: _row(
        ("target", "pages"), "page_ids",
        Requires(holders=(RESERVED, ALIAS), words="target is r with pages reserved(r), or s with pages in alias(S∋s)"),
        Moves(to=""),
        Marks("by target", words="into a request: cleared (overwritten whole); into a snapshot: unchanged"),
        (), "restoring set", pre.restore_started, fold.restore_started),
    RestoreCompleted: _row(
        ("target", "pages"), "page_ids", Requires(words="pages restoring"),
        Moves(to="", note="a page may be free now if its snapshot was released mid-restore"), Marks("unchanged"),
        (), "restoring cleared", pre.restore_completed, fold.restore_completed),
    StepSealed: _row(
        ("step",), "clear_list", Requires(step="open"), Moves(), Marks("—"), (StepPlan,),
        "the step plan: the union of that step's clear lists, each id once",
        pre.step_sealed, fold_steps.step_sealed),
    # Not in SPEC's table: the engine's record of how a sealed step ran.
    StepCompleted: _row(
        ("step", "rank"), "", Requires(step="sealed"), Moves(), Marks("—"), (), "",
        pre.step_completed, fold_steps.step_completed),
    StepAborted: _row(
        ("step",), "plans",
        Requires(step="in flight", words="a step in flight (sealed, not aborted, not yet completed on every rank, "
                 "among the last MAX_IN_FLIGHT sealed); it is aborted with every later step in flight"),
        Moves(), Marks("relisted", words="their pages still in kv(r) listed again for the open step; the others set"),
        (PagesMarked,), "", pre.step_aborted, fold_steps.step_aborted, unbounded=("reason",)),
    SanitizerViolation: _row(
        ("step", "rank", "plane", "page"), "page_id", Requires(step="sealed", also="page in range"), Moves(),
        Marks("—"), (), "— (a record for audits; the step is aborted by its own event)",
        pre.sanitizer_violation, fold_steps.sanitizer_violation),
    # SPEC, "Prefix-shared pages".
    PagesPublished: _row(
        ("r", "pages", "hashes", "parent_hash", "token_ids"), "page_ids",
        Requires(holders=("kv(r) written by r",), flags=("full", "committed in a step that has completed"),
                 also="hash not already published"),
        Moves(words="gain their hash"), Marks("—"), (BlocksStored,), "KV event BlockStored",
        pre.pages_published, fold_prefix.pages_published, unbounded=("token_ids", "lora_name")),
    PagesShared: _row(
        ("r", "pages"), "page_ids",
        Requires(qualifier="hashed", holders=(KV_SHARED, CACHED), flags=("not stale", "not restoring"),
                 also="under cross_tenant / all_reused same tenant as r"),
        Moves(to="kv(R ∪ {r})", note="appended to r's block table in order"),
        Marks("unchanged", note="a hashed page holds the KV r wants: never listed"), (), "",
        pre.pages_shared, fold_prefix.pages_shared, unbounded=("tenant",)),
    PagesEvicted: _row(
        ("pages",), "page_ids", Requires(holders=(CACHED,)), Moves(to=FREE, note="hash dropped"),
        Marks("policy", words="as for a request's page going free under the policy"), (BlocksRemoved, PagesMarked),
        "KV event BlockRemoved", pre.pages_evicted, fold_prefix.pages_evicted),
    # Not in SPEC's table: a live request letting go of some pages (vLLM's sliding windows and
    # state blocks), and two records for engines that name their requests and drop work.
    PagesReleased: _row(
        ("r", "pages"), "page_ids", Requires(known="r", holders=(KV,)),
        Moves(to=FREE, words="each leaves r: still shared, kept by the others; hashed, → cached(h); else → free"),
        Marks("policy", words="as for a request's page going free under the policy"), (PagesMarked,), "",
        pre.pages_released, fold.pages_released),
    PagesUnwritten: _row(
        ("r", "step", "pages"), "page_ids", Requires(step="sealed", also="pages valid"), Moves(),
        Marks("restored", words="a mark a reads=none commit of the step took off comes back (in KV: listed "
              "again; else set)"), (PagesMarked,), "", pre.pages_unwritten, fold_steps.pages_unwritten,
        unbounded=("reason",)),
    RequestLabelled: _row(
        ("r", "label"), "", Requires(words="— (it may come before r's first event)"), Moves(), Marks("—"), (),
        "— (a record: the engine's name for r)", pre.request_labelled, fold.record),
}

assert set(TRANSITIONS) == set(EVENT_TYPES), "every event type has exactly one row"


# ---------------------------------------------------------------------- what is derived from the rows


def event_name(t: type) -> str:
    """The event type's snake_case name: its tag in the log (``pages_reserved``)."""
    return t.__struct_config__.tag  # type: ignore[attr-defined]


def event_cell(t: type, table: Mapping[type, Transition] = TRANSITIONS) -> str:
    """SPEC's event cell of a row: ``PagesReserved(r, pages)``."""
    return f"{t.__name__}({', '.join(table[t].names)})"


def spec_rows(table: Mapping[type, Transition] = TRANSITIONS) -> Iterator[tuple[str, str, str, str, str]]:
    """(event, precondition, pages, mark, effect) of every row, in table order: SPEC's cells."""
    for t, row in table.items():
        yield event_cell(t, table), row.precondition, row.pages, row.mark, row.effect


def touched(st: LedgerState, event) -> tuple[int, ...]:
    """The pages ``event`` touches, by its row's ``touches``: the pages it names, or those ``st``
    (the state before its fold) holds for the request, snapshot or aborted plans it names."""
    how = TRANSITIONS[type(event)].touches
    if how == "page_ids":
        return tuple(event.page_ids)
    if how == "request":
        rec = st.requests.get(event.request)
        return () if rec is None else (*rec.reserved, *rec.kv)
    if how == "snapshot":
        return tuple(st.snapshots.get(event.snapshot, ()))
    if how == "clear_list":
        return tuple(event.clear_list)
    if how == "plans":
        return tuple(p for plan in st.in_flight if plan.step >= event.step for p in plan.clear_list)
    if how == "page_id":
        return (event.page_id,)
    return ()


def handlers(namespace: Any, prefix: str, table: Mapping[type, Transition] = TRANSITIONS) -> dict[type, Callable]:
    """``{event type: handler}``, the handler of each row being ``prefix + event_name(t)`` in
    ``namespace`` (a class, a module's ``globals()``, any mapping or object). Raises
    ``TypeError`` naming every event type without one: a dispatch built at import fails there
    when an event is added to the table and not to it."""
    get = namespace.get if isinstance(namespace, Mapping) else (lambda name: getattr(namespace, name, None))
    out: dict[type, Callable] = {}
    missing = []
    for t in table:
        fn = get(prefix + event_name(t))
        if fn is None:
            missing.append(f"{prefix}{event_name(t)} ({t.__name__})")
        else:
            out[t] = fn
    if missing:
        where = getattr(namespace, "__qualname__", None) or getattr(namespace, "__name__", None) or "the namespace"
        raise TypeError(f"{where} has no handler for {', '.join(missing)}")
    return out


def document() -> str:
    """docs/TRANSITIONS.md: the table's rows, rendered."""
    head = ("| event | precondition | pages | mark | effect | touches | effect types |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = []
    for t, row in TRANSITIONS.items():
        cells = (f"`{event_cell(t)}`", row.precondition, row.pages, row.mark, row.effect,
                 f"`{row.touches}`" if row.touches else "—", ", ".join(f"`{e.__name__}`" for e in row.effects) or "—")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return (
        "# The transition table\n\n"
        "Generated from `core/state/transitions.py` by `python scripts/transitions`;\n"
        "`tests/core/test_transitions.py` fails when this file and the table differ, and holds the first five\n"
        "columns against SPEC's own table. *touches*: how the pages an event touches are found (one of its\n"
        "fields, or, in the state before its fold, the pages of the `request` or `snapshot` it names or of the\n"
        "`plans` an abort takes down). *effect types*: what the applier may return.\n\n"
        + head + "\n".join(lines) + "\n")

