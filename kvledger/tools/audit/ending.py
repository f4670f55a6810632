"""The end-of-log pass of an audit: what is still open, and the faults only a closed log shows.

    open at the end     requests holding pages, live snapshots, marked free pages; on a log
                        that was not closed (live or crashed) restores and steps in flight
    faults (--check)    restore_never_completed (a closed log), step_never_completed (a rank
                        skipped a step, or never completed one before the log was closed)
"""

from __future__ import annotations

from kvledger.core.state import LedgerState

from .model import ContentModel, is_free
from .report import MAX_FINDINGS, Faults, Finding

__all__ = ["open_at_end"]


def _step_faults(model: ContentModel, closed: bool, out: list[Finding]) -> None:
    """Steps a rank skipped (faults), or never completed: faults on a closed log, else open.
    Aborted steps (named, or in a cascade) are owed by no rank."""
    if not model.done:
        return
    steps = [s for s in model.sealed if s not in model.aborted]
    for rank in sorted(model.done):
        done, first = model.done[rank], model.first_done[rank]
        last = max(done) if done else first - 1
        missing = [s for s in steps if s >= first and s not in done]
        skipped = [s for s in missing if s < last]
        tail = [s for s in missing if s > last]
        if skipped:
            model.faults.add("step_never_completed", None, skipped[0],
                             f"rank {rank} completed step {last} but never steps {skipped[:16]}", page_ids=[])
        if tail:
            if closed:
                model.faults.add("step_never_completed", None, tail[0],
                                 f"rank {rank} never completed steps {tail[:16]} before the log was closed")
            else:
                out.append(Finding(kind="steps_in_flight", seq=None, step=tail[0],
                                   detail=f"rank {rank} has not completed steps {tail[:16]} (yet)"))


def open_at_end(st: LedgerState, model: ContentModel | None, faults: Faults, closed: bool) -> list[Finding]:
    """End-of-log pass: what is still open (returned), and (``model``) the faults of a closed log."""
    out: list[Finding] = []
    step = st.open_step
    _restores_at_end(st, model, faults, closed, out)
    if model is not None:
        _step_faults(model, closed, out)
    for r, rec in sorted(st.requests.items()):
        if rec.reserved or rec.kv:
            out.append(Finding(kind="request_open", seq=None, step=step, request=r,
                               page_ids=(rec.kv + rec.reserved)[:64],
                               detail=f"request {r} holds {len(rec.kv)} kv and {len(rec.reserved)} reserved pages"))
        if len(out) > MAX_FINDINGS:
            break
    for s, pages in sorted(st.snapshots.items()):
        out.append(Finding(kind="snapshot_live", seq=None, step=step, snapshot=s, page_ids=pages[:64],
                           detail=f"snapshot {s} aliases {len(pages)} pages"))
        if len(out) > 2 * MAX_FINDINGS:
            break
    free_marked = sorted(p for p in st.marks if is_free(st, p))
    if free_marked:
        out.append(Finding(kind="marked_free_pages", seq=None, step=step, page_ids=free_marked[:64],
                           detail=f"{len(free_marked)} free pages are marked: each is zeroed when a request "
                                  "first commits it"))
    return out


def _restores_at_end(st: LedgerState, model: ContentModel | None, faults: Faults, closed: bool,
                     out: list[Finding]) -> None:
    """Restores still writing: faults on a cleanly closed log (with ``model``), else open."""
    if not st.restore_targets:
        return
    by_target: dict = {}
    for p, tgt in sorted(st.restore_targets.items()):
        by_target.setdefault(tgt, []).append(p)
    restore_seq = model.restore_seq if model is not None else {}
    for (into, target), pages in sorted(by_target.items()):
        started = min((restore_seq.get(p, -1) for p in pages), default=-1)
        detail = f"restore into {into} {target} of pages {pages[:16]} started at seq {started} never completed"
        kw = {"request": target} if into == "request" else {"snapshot": target}
        if closed and model is not None:
            faults.add("restore_never_completed", started, st.open_step, f"{detail} before the log was closed",
                       page_ids=pages[:64], **kw)
        else:
            out.append(Finding(kind="restore_in_flight", seq=started, step=st.open_step, detail=f"{detail} (yet)",
                               page_ids=pages[:64], **kw))
