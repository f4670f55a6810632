"""What an audit reports: findings, timeline rows, SVG segments, and the report that holds them.

Plain msgspec values (``--json`` prints them), plus ``Faults``, the collector
every part of the audit reports a fault to.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["FAULT_KINDS", "MAX_FINDINGS", "AuditReport", "Faults", "Finding", "Row", "Segment", "StepStatus",
           "event_tag"]

FAULT_KINDS = (
    "unzeroed_read", "needless_clear", "redundant_clear", "plan_mismatch", "leak", "double_release", "double_finish",
    "unknown_snapshot", "unknown_request", "rejected_event", "restore_never_completed", "step_never_completed",
    "marked_cached_page", "shared_page_listed", "sanitizer_violation",
)
MAX_FINDINGS = 1000  # per kind; the count keeps going


def event_tag(ev) -> str:
    """The event's snake_case tag (``pages_committed``), as the log and the timelines name it."""
    return type(ev).__struct_config__.tag


class Finding(msgspec.Struct, kw_only=True, gc=False):
    kind: str
    seq: int | None
    step: int | None
    detail: str
    page_ids: list = []
    request: int | None = None
    snapshot: int | None = None


class Row(msgspec.Struct, kw_only=True, gc=False):
    """One line of a timeline. Page rows fill the holder/mark/restoring fields."""

    seq: int
    step: int  # the open step when the event was folded (the event's own step for commits)
    event: str
    page_ids: list = []
    holder_before: str = ""
    holder_after: str = ""
    marked_before: bool = False
    marked_after: bool = False
    restoring_before: bool = False
    restoring_after: bool = False
    note: str = ""


class Segment(msgspec.Struct, frozen=True, gc=False):
    """A stretch of seqs [start, end) over which a page kept one holder and flags (for SVG)."""

    page: int
    start: int
    end: int
    holder: str  # free | reserved | kv | shared (kv of several requests) | alias | cached
    label: str  # holder_of text, e.g. kv(12), kv({12,13}), cached(-7)
    marked: bool
    restoring: bool


class StepStatus(msgspec.Struct, kw_only=True, gc=False):
    """One step of ``--steps``: its plan, the ranks that completed it, and its abort if any."""

    step: int
    sealed_seq: int | None = None  # None: sealed before the window
    cleared: int = 0  # pages in its plan
    ranks: list = []  # ranks that completed it, in the order they reported
    missing: list = []  # ranks that report completions and have not completed it
    aborted_seq: int | None = None
    aborted_by: int | None = None  # the step the StepAborted named: itself, or an earlier step in flight
    reason: str = ""
    violations: int = 0  # sanitizer violations recorded for it
    status: str = ""  # completed | in_flight | aborted | aborted_in_cascade


class AuditReport(msgspec.Struct, kw_only=True, gc=False):
    path: str
    num_pages: int
    page_tokens: int
    policy: str
    start_seq: int
    end_seq: int  # seq after the last event audited
    events: int
    closed_cleanly: bool
    torn_at: int | None = None
    torn_bytes: int = 0
    subject: str = ""  # "page 3" / "request 7" / "snapshot 2" / "steps" / "check"
    mode: str = "checked"  # checked: every event validated; trusted: the fold of one page (--page)
    window: str = ""  # what the report covers, in words
    checkpoint_seq: int | None = None  # the checkpoint the fold started from (None: seq 0)
    first_file: str = ""  # the file the view starts with (a segment of a log directory)
    rows: list = []
    faults: list = []
    open: list = []  # what is still open at the end (the checked engine; the fold of one page leaves it empty)
    fault_counts: dict = {}
    step_table: list = []  # --steps: StepStatus of every step in the window
    ranks: dict = {}  # rank (a string, as JSON keys are) -> steps it completed in the window (--steps, --check)
    aborted: dict = {}  # {"named": StepAborted events, "in_cascade": later steps in flight aborted with them}
    segments: list = []  # SVG data: Segment
    markers: list = []  # SVG data: [kind, page, seq], kind zeroed | zeroed_aborted | marked | fault
    svg_pages: list = []
    marked_pages: list = []  # the first pages a snapshot release marked (the default SVG pages)
    steps: list = []  # SVG data: (seq, step) of every StepSealed (for the axis)
    error: dict | None = None  # corruption / decode problem that ended the audit
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.faults and self.error is None


class Faults:
    """Faults as they are found: every one counted, the first ``MAX_FINDINGS`` of each kind kept.

    ``svg`` (an ``svg.SvgTrack`` or None) gets a fault marker on each watched page.
    """

    def __init__(self, svg: Any = None) -> None:
        self.found: list[Finding] = []
        self.counts: dict[str, int] = {}
        self.svg = svg

    def add(self, kind: str, seq: int | None, step: int | None, detail: str, **kw: Any) -> None:
        c = self.counts.get(kind, 0)
        self.counts[kind] = c + 1
        if c < MAX_FINDINGS:
            self.found.append(Finding(kind=kind, seq=seq, step=step, detail=detail, **kw))
            if self.svg is not None:
                self.svg.fault(kw.get("page_ids", ()), seq)
