"""The serving loop's live snapshots (least recently used first) and the pages they leave behind.

    victim      the snapshot to release next (never one whose rows this step writes or reads)
    evict       check its rows still hold the state written into them, then release it: its
                pages go free and marked, holding row bytes until a request commits them
    drop_unwritten  release the snapshots of a step that never ran (--sanitize stopped it)
    note_reuse  count pages taken again, and those that were released rows (future tails)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from .model import RankModel

__all__ = ["Snap", "SnapshotCache"]


@dataclasses.dataclass
class Snap:
    pages: tuple
    saved: list  # per rank: the state written through the rows (None until the step that writes them ran)


class SnapshotCache:
    """The live snapshots of one run and the page reuse they cause. ``res``: the run's
    ``RunResult``; ``prefix``: its ``PrefixCache`` (or None), whose prefix states and
    pinned snapshots ``victim`` respects."""

    def __init__(self, ranks: Sequence[Any], res: Any, prefix: Any) -> None:
        self.ranks, self.res, self.prefix = ranks, res, prefix
        self.live: collections.OrderedDict[int, Snap] = collections.OrderedDict()
        self.seen_pages: set[int] = set()
        self.released_rows: set[int] = set()  # pages freed by a snapshot release, not taken since
        self.next_id = 0

    def victim(self, engine: Any, need: int | None = None) -> int | None:
        """The snapshot to release next, or None: the least recently used one, unless it was
        made this step (its rows are written by this step's graph: it cannot be released
        before then, nor can any made after it). With a prefix cache, a prefix hit's snapshot
        stays until the step is over, and a tenant's prefix state goes only once free and
        cached pages together fall short of ``need`` (``None``: it may go now): until then
        the ledger evicts cached pages instead, since a prefix hit needs both."""
        prefix = self.prefix
        for sid, snap in self.live.items():
            if snap.saved[0] is None:
                return None
            if prefix is None:
                return sid
            kept = (sid in prefix.state_key and need is not None
                    and engine.free_count + engine.ledger.cached_count >= need)
            if sid in prefix.pinned or kept:
                continue
            return sid
        return None

    async def evict(self, engine: Any, sid: int) -> None:
        """Release snapshot ``sid``, after checking its rows still hold the state written into them."""
        snap = self.live.pop(sid)
        intact = all(RankModel.snapshot_matches(snap.saved[r], RankModel.snapshot_rows(rk.planes, snap.pages))
                     for r, rk in enumerate(self.ranks))
        self.res.snapshot_rows_intact += intact
        await engine.release_snapshot(sid)
        if self.prefix is not None:
            self.prefix.forget_snapshot(sid)
        self.released_rows.update(snap.pages)
        self.res.snapshots_released += 1

    async def drop_unwritten(self, engine: Any) -> None:
        """Release every snapshot whose rows no step wrote (made for a step the sanitizer
        stopped before its graph): nothing to check them against, no prefix state to keep."""
        for sid in [sid for sid, snap in self.live.items() if snap.saved[0] is None]:
            snap = self.live.pop(sid)
            await engine.release_snapshot(sid)
            if self.prefix is not None:
                self.prefix.forget_snapshot(sid)
            self.released_rows.update(snap.pages)
            self.res.snapshots_dropped += 1

    def note_reuse(self, pages: Sequence[int]) -> int:
        """Count pages taken again; return how many of them were released snapshot pages
        still holding row bytes (never rewritten since their release)."""
        rows = 0
        for p in pages:
            if p in self.seen_pages:
                self.res.page_reuses += 1
                if p in self.released_rows:
                    self.released_rows.discard(p)
                    rows += 1
            else:
                self.seen_pages.add(p)
        return rows
