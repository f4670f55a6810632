"""The ledger's snapshot-row and restore commands: alias, release, restore start and completion.

A mixin of ``Ledger`` (as ``ledger_prefix.PrefixCommands``): each command checks
its arguments, decides one event (``alias_snapshot(n=...)`` takes the allocator's
pages, evicting cached ones when free pages run short) and hands it to
``self._submit``, the table's path; nothing changes when one raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from . import checks
from .errors import InvalidArgumentError
from .events.events import RestoreCompleted, RestoreStarted, SnapshotAliased, SnapshotReleased

if TYPE_CHECKING:
    from .state.state import LedgerState

__all__ = ["SnapshotCommands"]


def _one_of(n, pages, what: str):
    if (n is None) == (pages is None):
        raise InvalidArgumentError(f"{what}: give exactly one of n= or pages=")


class SnapshotCommands:
    """Back snapshot rows with pages and let them go; start and complete inbound restores.
    Mixed into ``Ledger``, which supplies ``state``, ``_submit`` and ``_evict_for``."""

    state: LedgerState
    _submit: Callable[[Any], tuple]
    _evict_for: Callable[[int, str], tuple[int, ...]]

    def alias_snapshot(
        self, snapshot: int, n: int | None = None, *, pages: Iterable[int] | None = None
    ) -> tuple[int, ...]:
        """Back snapshot rows with pages: ``n`` free pages from the allocator, or named
        free/aliased pages (snapshot reuse). Returns the page ids."""
        checks.ident(snapshot, "snapshot")
        _one_of(n, pages, "alias_snapshot")
        if pages is None:
            k = checks.count(n, "n")
            got = self.state.pick_free(k)
            if got is None:
                got = self._evict_for(k, f"snapshot {snapshot}")
            ids = tuple(got)
        else:
            ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(SnapshotAliased(snapshot=snapshot, page_ids=ids))
        return ids

    def release_snapshot(self, snapshot: int) -> None:
        """The snapshot is gone; pages it was the last alias of become free and marked."""
        self._submit(SnapshotReleased(snapshot=checks.ident(snapshot, "snapshot")))

    def _restore_target(self, request, snapshot) -> tuple[Literal["request", "snapshot"], int]:
        if (request is None) == (snapshot is None):
            raise InvalidArgumentError("restore: give exactly one of request= or snapshot=")
        if request is not None:
            return "request", checks.ident(request, "request")
        return "snapshot", checks.ident(snapshot, "snapshot")

    def start_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        """An inbound host restore starts writing ``pages`` of a request or a snapshot."""
        into, target = self._restore_target(request, snapshot)
        ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(RestoreStarted(into=into, target=target, page_ids=ids))

    def complete_restore(
        self, pages: Iterable[int], *, request: int | None = None, snapshot: int | None = None
    ) -> None:
        """The restore into ``pages`` finished writing; they may be reserved and committed again."""
        into, target = self._restore_target(request, snapshot)
        ids = checks.page_ids(pages, self.state.num_pages, allow_empty=False)
        self._submit(RestoreCompleted(into=into, target=target, page_ids=ids))
