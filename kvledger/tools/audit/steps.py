"""Steps and ranks (``--steps``, and a summary line in ``--check``): which ranks completed each step,
which steps were aborted, and which were taken down with an earlier one.

    step k   sealed ─► StepCompleted(k, rank) from each rank ─► completed on every rank
                    └► StepAborted(j <= k) while k was in flight ─► aborted (j = k) or
                       aborted in a cascade (j < k: nothing of k ran anywhere either)

``StepTable.event`` sees each validated event before it is folded (an abort
takes the plans in flight at that moment); ``finish`` fills in what each step
is missing. The ranks that count are those that report completions (in the
window, or in the state it starts from): a log whose engine reports none
leaves every step ``sealed``.
"""

from __future__ import annotations

from kvledger.core.events.events import SanitizerViolation, StepAborted, StepCompleted, StepSealed
from kvledger.core.state import LedgerState

from .report import AuditReport, StepStatus

__all__ = ["StepTable", "render_steps"]


class StepTable:
    """Every step of the window (and the plans in flight when it starts), as ``StepStatus`` rows."""

    def __init__(self, st: LedgerState) -> None:
        self.rows: dict[int, StepStatus] = {}
        self.completions: dict[int, int] = {}  # rank -> completions in the window
        self.known_ranks = set(st.completed)
        self.named = self.in_cascade = 0
        for plan in st.in_flight:
            self.rows[plan.step] = StepStatus(step=plan.step, cleared=len(plan.clear_list))

    def _row(self, step: int) -> StepStatus:
        row = self.rows.get(step)
        if row is None:
            row = self.rows[step] = StepStatus(step=step)  # sealed before the window
        return row

    def event(self, seq: int, ev, t, st: LedgerState) -> None:
        """A validated event, before it is folded into ``st``."""
        if t is StepSealed:
            self.rows[ev.step] = StepStatus(step=ev.step, sealed_seq=seq, cleared=len(ev.clear_list))
        elif t is StepCompleted:
            self.known_ranks.add(ev.rank)
            self.completions[ev.rank] = self.completions.get(ev.rank, 0) + 1
            self._row(ev.step).ranks.append(ev.rank)
        elif t is StepAborted:
            taken = [plan.step for plan in st.in_flight if plan.step >= ev.step]
            self.named += 1
            self.in_cascade += len(taken) - 1
            for step in taken:
                row = self._row(step)
                row.aborted_seq, row.aborted_by, row.reason = seq, ev.step, ev.reason
        elif t is SanitizerViolation:
            self._row(ev.step).violations += 1

    def finish(self, rep: AuditReport, *, table: bool) -> None:
        """Statuses, missing ranks; the counts into ``rep`` (and every row with ``table``)."""
        ranks = sorted(self.known_ranks)
        for row in self.rows.values():
            done = set(row.ranks)
            if row.aborted_by is not None:
                row.status = "aborted" if row.aborted_by == row.step else "aborted_in_cascade"
            else:
                row.missing = [r for r in ranks if r not in done]
                row.status = "sealed" if not ranks else "in_flight" if row.missing else "completed"
        rep.ranks = {str(r): self.completions.get(r, 0) for r in ranks}
        rep.aborted = {"named": self.named, "in_cascade": self.in_cascade}
        if table:
            rep.step_table = [self.rows[s] for s in sorted(self.rows)]


def _ranks(ids: list) -> str:
    return ",".join(map(str, ids)) if ids else "-"


def render_steps(rep: AuditReport) -> list[str]:
    """The ``--steps`` table: one line per step."""
    hdr = ("step", "sealed at", "cleared", "completed by", "missing", "status")
    lines = []
    for row in rep.step_table:
        status = row.status
        if row.aborted_by is not None:
            status += f" at seq {row.aborted_seq:,}" + (f" (step {row.aborted_by} aborted)"
                                                         if row.aborted_by != row.step else "")
            if row.reason:
                status += f": {row.reason}"
        if row.violations:
            status += f"; {row.violations} sanitizer violation(s)"
        sealed = "-" if row.sealed_seq is None else f"{row.sealed_seq:,}"
        lines.append((str(row.step), sealed, str(row.cleared), _ranks(row.ranks), _ranks(row.missing), status))
    out = [summary_line(rep)]
    if not lines:
        return out + ["no step sealed, completed or aborted in this window"]
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(hdr)]
    widths[-1] = 0
    out.append("  ".join(h.ljust(w) for h, w in zip(hdr, widths, strict=True)).rstrip())
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in lines]
    return out


def summary_line(rep: AuditReport) -> str:
    """Completions per rank and aborts, in one line."""
    per_rank = ", ".join(f"rank {r} {n:,}" for r, n in rep.ranks.items()) or "no rank reports completions"
    named, cascade = rep.aborted.get("named", 0), rep.aborted.get("in_cascade", 0)
    return (f"steps: completions per rank: {per_rank}; {named} abort(s)"
            + (f", {cascade} more step(s) aborted in a cascade" if cascade else ""))
