"""A page-lifecycle timeline as a standalone SVG: one lane per page, sequence numbers across.

    page 12 |▓▓ free ▓▓|██ alias(3) ██|▒ free ▒|▒ reserved(7) ▒|████ kv(7) ████|
            |          |              |═══ marked (red underline) ═══|▼ zeroed
            +---------------------------------------------------------------> seq

Each lane is coloured by the page's holder (free, reserved, kv, shared: kv of
several requests, alias, cached: KV kept for reuse under its block hash) over
the seqs it held it, labelled with the holder when there is room; a red band
under the lane while the page is marked (stale bytes that must be zeroed before
a request reads them); an orange band over it while a restore writes it; a
green triangle where a step plan zeroed it (hollow when that step was aborted,
by name or in a cascade, so nothing was zeroed there); a red cross at a fault;
a magenta diamond where the sanitizer caught the page. Step boundaries run
along the top. Hovering any shape shows its details (SVG <title>).

``SvgTrack`` collects what the SVG draws while the audit folds (holder segments
and markers of the chosen pages); ``render_svg`` is pure string building from
the report: no dependency, nothing read from outside it.
"""

from __future__ import annotations

from collections.abc import Callable
from xml.sax.saxutils import escape

from kvledger.core.events.events import SanitizerViolation, SnapshotReleased, StepAborted, StepSealed
from kvledger.core.state import LedgerState

from .report import Segment

__all__ = ["COLORS", "SvgTrack", "holder_kind", "render_svg"]

COLORS = {
    "free": "#e5e7eb",
    "reserved": "#f59e0b",
    "kv": "#2563eb",
    "shared": "#0891b2",
    "alias": "#7c3aed",
    "cached": "#65a30d",
    "marked": "#dc2626",
    "restoring": "#f97316",
    "zeroed": "#059669",
    "fault": "#b91c1c",
    "violation": "#db2777",
}
_TEXT_ON = {"free": "#374151", "reserved": "#111827", "kv": "#ffffff", "shared": "#ffffff", "alias": "#ffffff",
            "cached": "#ffffff"}

LEFT, RIGHT, TOP = 96, 24, 74
LANE, GAP = 22, 4
WIDTH = 1280


def _nice_ticks(lo: int, hi: int, want: int = 10) -> list[int]:
    span = max(1, hi - lo)
    raw = span / want
    mag = 10 ** max(0, len(str(int(raw))) - 1)
    for m in (1, 2, 5, 10):
        step = m * mag
        if span / step <= want:
            break
    first = -(-lo // step) * step
    return list(range(first, hi + 1, step))


def holder_kind(label: str) -> str:
    """The lane colour of a holder text: kv({1,2}) -> shared, cached(-7) -> cached, kv(1) -> kv, ..."""
    if label.startswith("kv({"):
        return "shared"
    return label.split("(")[0]


def _short(label: str) -> str:
    """kv(12) -> r12, kv({12,13}) -> r12,13, reserved(12) -> r12, alias({3,4}) -> s3,4, cached(-7) -> #-7,
    free -> ''."""
    if label.startswith("kv({"):
        return "r" + label[4:-2]
    if label.startswith(("kv(", "reserved(")):
        return "r" + label[label.index("(") + 1 : -1]
    if label.startswith("alias("):
        return "s" + label[7:-2]
    if label.startswith("cached("):
        return "#" + label[7:-1][:8]
    return ""


class SvgTrack:
    """The segments and markers of the watched pages, recorded while the audit folds."""

    def __init__(self, st: LedgerState, pages: list[int]) -> None:
        self.st = st
        self.pages = list(pages)
        self.page_set = set(self.pages)
        self.seg_state: dict[int, tuple] = {}
        self.seg_start: dict[int, int] = {}
        self.segments: list[Segment] = []
        self.markers: list[list] = []
        self._seal_markers: dict[int, list[int]] = {}  # step -> its plan's markers (an abort undoes them)

    def update(self, p: int, at: int) -> None:
        """Page ``p`` as it is from seq ``at`` on: a new segment if its holder or flags changed."""
        st = self.st
        label = st.holder_of(p)
        state = (label, p in st.marks, p in st.restore_targets)
        old = self.seg_state.get(p)
        if old == state:
            return
        if old is not None:
            start = self.seg_start[p]
            if at > start:
                self.segments.append(Segment(p, start, at, holder_kind(old[0]), old[0], old[1], old[2]))
        self.seg_state[p] = state
        self.seg_start[p] = at

    def begin(self, at: int) -> None:
        """Start every lane afresh at seq ``at`` (what came before is not drawn)."""
        for p in self.pages:
            self.seg_state.pop(p, None)
            self.update(p, at)

    def after(self, seq: int, ev, t, want, before: dict) -> None:
        """After a folded event: the touched pages' new segments, zeroed / aborted / marked / sanitizer
        markers."""
        st, page_set, markers = self.st, self.page_set, self.markers
        for p in want:
            if p in page_set:
                self.update(p, seq + 1)
        if t is StepSealed:
            live = {plan.step for plan in st.in_flight}  # plans an abort may still reach
            self._seal_markers = {s: m for s, m in self._seal_markers.items() if s in live}
            mine = self._seal_markers[ev.step] = []
            for p in ev.clear_list:
                if p in page_set:
                    mine.append(len(markers))
                    markers.append(["zeroed", p, seq])
        elif t is StepAborted:
            for s in [s for s in self._seal_markers if s >= ev.step]:  # the named step and the later ones
                for i in self._seal_markers.pop(s):  # that zeroing never ran: drawn hollow
                    markers[i][0] = "zeroed_aborted"
        elif t is SanitizerViolation:
            if ev.page_id in page_set:
                markers.append(["violation", ev.page_id, seq])
        elif t is SnapshotReleased:
            for p in want:
                if p in page_set and not before[p][1] and p in st.marks:
                    markers.append(["marked", p, seq])

    def fault(self, page_ids, seq: int | None) -> None:
        for p in page_ids:
            if p in self.page_set:
                self.markers.append(["fault", p, seq])

    def close(self, end_seq: int) -> None:
        """End every lane's open segment at ``end_seq``."""
        for p in self.pages:
            old = self.seg_state.get(p)
            start = self.seg_start.get(p, end_seq)
            if old is not None and end_seq > start:
                self.segments.append(Segment(p, start, end_seq, holder_kind(old[0]), old[0], old[1], old[2]))
            self.seg_state.pop(p, None)


def render_svg(rep) -> str:
    """The SVG text for an ``AuditReport`` built with ``svg_pages``."""
    pages = list(rep.svg_pages)
    lo = rep.start_seq
    hi = max(rep.end_seq, lo + 1)
    plot_w = WIDTH - LEFT - RIGHT
    height = TOP + len(pages) * (LANE + GAP) + 196
    lane_of = {p: i for i, p in enumerate(pages)}

    def x(seq: float) -> float:
        return LEFT + (min(max(seq, lo), hi) - lo) * plot_w / (hi - lo)

    def y(p: int) -> float:
        return TOP + lane_of[p] * (LANE + GAP)

    out: list[str] = []
    add = out.append
    add(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12">')
    add(f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>')
    _title(add, rep, len(pages), lo, hi)
    _step_ticks(add, rep.steps, lo, hi, x)
    for p in pages:
        yy = y(p)
        add(f'<text x="{LEFT - 8}" y="{yy + LANE / 2 + 4:.1f}" text-anchor="end">page {p}</text>')
        add(f'<rect x="{LEFT}" y="{yy:.1f}" width="{plot_w}" height="{LANE}" fill="#f9fafb"/>')
    for seg in rep.segments:
        if seg.page in lane_of and seg.end > lo and seg.start < hi:
            _segment(add, seg, x, y(seg.page))
    for kind, p, seq in rep.markers:
        if p in lane_of and lo <= seq < hi:
            _marker(add, kind, p, seq, x(seq + 1), y(p))
    ay = TOP + len(pages) * (LANE + GAP) + 4
    _axis(add, lo, hi, x, ay)
    _legend(add, ay + 56)
    add("</svg>")
    return "\n".join(out) + "\n"


Add = Callable[[str], None]
Scale = Callable[[float], float]


def _title(add: Add, rep, lanes: int, lo: int, hi: int) -> None:
    n_faults = sum(getattr(rep, "fault_counts", {}).values()) if getattr(rep, "fault_counts", None) else len(rep.faults)
    title = f"kvledger page lifecycles: {rep.path}"
    sub = (f"{lanes} of {rep.num_pages:,} pages, seq {lo:,} to {hi - 1:,}, policy {rep.policy}, "
           f"{'closed cleanly' if rep.closed_cleanly else 'not closed'}; "
           + (f"{n_faults} lifecycle fault(s)" if n_faults else "no lifecycle faults"))
    add(f'<text x="{LEFT}" y="22" font-size="16" font-weight="bold">{escape(title)}</text>')
    add(f'<text x="{LEFT}" y="42" fill="#374151">{escape(sub)}</text>')


def _step_ticks(add: Add, all_steps, lo: int, hi: int, x: Scale) -> None:
    """Step boundaries along the top, thinned to readable spacing."""
    steps = [(sq, st) for sq, st in all_steps if lo <= sq < hi]
    if not steps:
        return
    plot_w = WIDTH - LEFT - RIGHT
    add(f'<text x="{LEFT - 8}" y="{TOP - 8}" text-anchor="end" fill="#6b7280">step sealed</text>')
    last_label = -1e9
    stride = max(1, len(steps) // max(1, plot_w // 3))
    for i in range(0, len(steps), stride):
        sq, number = steps[i]
        sx = x(sq + 1)
        add(f'<line x1="{sx:.1f}" y1="{TOP - 14}" x2="{sx:.1f}" y2="{TOP - 4}" stroke="#9ca3af">'
            f'<title>step {number} sealed at seq {sq:,}</title></line>')
        if sx - last_label >= 46:
            add(f'<text x="{sx + 2:.1f}" y="{TOP - 16}" font-size="10" fill="#6b7280">{number}</text>')
            last_label = sx


def _segment(add: Add, seg: Segment, x: Scale, yy: float) -> None:
    """One holder segment; a mark below it, a restore above it."""
    x0, x1 = x(seg.start), x(seg.end)
    w = max(x1 - x0, 0.8)
    tip = f"page {seg.page}: {seg.label}, seq {seg.start:,}-{seg.end - 1:,}"
    if seg.marked:
        tip += ", marked"
    if seg.restoring:
        tip += ", restore writing"
    add(f'<rect x="{x0:.1f}" y="{yy + 2:.1f}" width="{w:.1f}" height="{LANE - 8}" fill="{COLORS[seg.holder]}">'
        f'<title>{escape(tip)}</title></rect>')
    label = _short(seg.label)
    if label and w > 8 * len(label) + 6:
        add(f'<text x="{x0 + w / 2:.1f}" y="{yy + LANE / 2 + 1:.1f}" text-anchor="middle" font-size="10" '
            f'fill="{_TEXT_ON[seg.holder]}">{escape(label)}</text>')
    if seg.marked:
        add(f'<rect x="{x0:.1f}" y="{yy + LANE - 5:.1f}" width="{w:.1f}" height="4" fill="{COLORS["marked"]}">'
            f'<title>{escape(tip)}</title></rect>')
    if seg.restoring:
        add(f'<rect x="{x0:.1f}" y="{yy:.1f}" width="{w:.1f}" height="3" fill="{COLORS["restoring"]}"/>')


def _marker(add: Add, kind: str, p: int, seq: int, mx: float, yy: float) -> None:
    if kind == "zeroed":
        add(f'<path d="M{mx - 5:.1f},{yy - 1:.1f} L{mx + 5:.1f},{yy - 1:.1f} L{mx:.1f},{yy + 8:.1f} Z" '
            f'fill="{COLORS["zeroed"]}" stroke="#ffffff" stroke-width="0.8">'
            f'<title>page {p} zeroed by the step plan sealed at seq {seq:,}</title></path>')
    elif kind == "zeroed_aborted":
        add(f'<path d="M{mx - 5:.1f},{yy - 1:.1f} L{mx + 5:.1f},{yy - 1:.1f} L{mx:.1f},{yy + 8:.1f} Z" '
            f'fill="#ffffff" stroke="{COLORS["zeroed"]}" stroke-width="1.2">'
            f'<title>page {p} was in the plan sealed at seq {seq:,}, but that step was aborted: '
            f'not zeroed there</title></path>')
    elif kind == "marked":
        add(f'<line x1="{mx:.1f}" y1="{yy + LANE - 9:.1f}" x2="{mx:.1f}" y2="{yy + LANE:.1f}" '
            f'stroke="{COLORS["marked"]}" stroke-width="2"><title>page {p} marked at seq {seq:,} '
            f'(its last snapshot alias was released)</title></line>')
    elif kind == "violation":
        add(f'<path d="M{mx:.1f},{yy + 1:.1f} L{mx + 6:.1f},{yy + LANE / 2:.1f} L{mx:.1f},{yy + LANE - 1:.1f} '
            f'L{mx - 6:.1f},{yy + LANE / 2:.1f} Z" fill="{COLORS["violation"]}" stroke="#ffffff" stroke-width="0.8">'
            f'<title>page {p}: a sanitizer violation recorded at seq {seq:,}</title></path>')
    elif kind == "fault":
        add(f'<g stroke="{COLORS["fault"]}" stroke-width="2.5"><title>fault on page {p} at seq {seq:,}</title>'
            f'<line x1="{mx - 6:.1f}" y1="{yy + 2:.1f}" x2="{mx + 6:.1f}" y2="{yy + LANE - 2:.1f}"/>'
            f'<line x1="{mx + 6:.1f}" y1="{yy + 2:.1f}" x2="{mx - 6:.1f}" y2="{yy + LANE - 2:.1f}"/></g>')


def _axis(add: Add, lo: int, hi: int, x: Scale, ay: float) -> None:
    plot_w = WIDTH - LEFT - RIGHT
    add(f'<line x1="{LEFT}" y1="{ay}" x2="{LEFT + plot_w}" y2="{ay}" stroke="#374151"/>')
    for t in _nice_ticks(lo, hi - 1):
        tx = x(t)
        add(f'<line x1="{tx:.1f}" y1="{ay}" x2="{tx:.1f}" y2="{ay + 5}" stroke="#374151"/>')
        add(f'<text x="{tx:.1f}" y="{ay + 18}" text-anchor="middle" font-size="11">{t:,}</text>')
    add(f'<text x="{LEFT + plot_w / 2:.0f}" y="{ay + 36}" text-anchor="middle" fill="#374151">'
        f'sequence number (one event each)</text>')


def _legend(add: Add, ly: float) -> None:
    """Two rows of holders, two of markers."""
    rows = [[("free", "free"), ("reserved", "reserved(r)"), ("kv", "kv(r): request r's KV pages"),
             ("alias", "alias(S): backs snapshot rows")],
            [("shared", "kv(R): shared by the requests R, read-only"),
             ("cached", "cached(h): no holder, KV of block h kept for reuse")]]
    for items in rows:
        lx = LEFT
        for key, text in items:
            add(f'<rect x="{lx}" y="{ly}" width="18" height="12" fill="{COLORS[key]}" stroke="#9ca3af" '
                'stroke-width="0.5"/>')
            add(f'<text x="{lx + 24}" y="{ly + 10}">{escape(text)}</text>')
            lx += 32 + 7 * len(text)
        ly += 22
    lx = LEFT
    add(f'<rect x="{lx}" y="{ly + 8}" width="18" height="4" fill="{COLORS["marked"]}"/>')
    add(f'<text x="{lx + 24}" y="{ly + 10}">marked: stale bytes, to zero before a request reads them</text>')
    lx += 420
    add(f'<rect x="{lx}" y="{ly + 1}" width="18" height="3" fill="{COLORS["restoring"]}"/>')
    add(f'<text x="{lx + 24}" y="{ly + 10}">restore writing</text>')
    lx += 140
    add(f'<g stroke="{COLORS["fault"]}" stroke-width="2.5">'
        f'<line x1="{lx + 3}" y1="{ly}" x2="{lx + 13}" y2="{ly + 12}"/>'
        f'<line x1="{lx + 13}" y1="{ly}" x2="{lx + 3}" y2="{ly + 12}"/></g>')
    add(f'<text x="{lx + 24}" y="{ly + 10}">fault</text>')
    ly += 22
    lx = LEFT
    add(f'<path d="M{lx + 4},{ly} L{lx + 14},{ly} L{lx + 9},{ly + 9} Z" fill="{COLORS["zeroed"]}"/>')
    add(f'<text x="{lx + 24}" y="{ly + 10}">zeroed by a step plan</text>')
    lx += 170
    add(f'<path d="M{lx + 4},{ly} L{lx + 14},{ly} L{lx + 9},{ly + 9} Z" fill="#ffffff" '
        f'stroke="{COLORS["zeroed"]}" stroke-width="1.2"/>')
    add(f'<text x="{lx + 24}" y="{ly + 10}">aborted step (named or in a cascade): not zeroed</text>')
    lx += 360
    add(f'<path d="M{lx + 9},{ly} L{lx + 15},{ly + 6} L{lx + 9},{ly + 12} L{lx + 3},{ly + 6} Z" '
        f'fill="{COLORS["violation"]}"/>')
    add(f'<text x="{lx + 24}" y="{ly + 10}">sanitizer violation recorded</text>')
