"""The library's exceptions: one base, specific subclasses that name the ids.

Every command is validated before any event is written, so an error raised by a
command leaves state, log and effects exactly as they were.

    KVLedgerError
     ├── InvalidArgumentError       an argument of the wrong type or range
     ├── ConfigurationError         bad geometry, policy or plane layout
     │    └── BackendUnavailableError   a clear backend cannot load here
     ├── UnknownRequestError        request id not known to the ledger
     ├── UnknownSnapshotError       snapshot id not live
     ├── UnknownBlockHashError      a block hash that no page holds
     ├── TenantMismatchError        a request's tenant cannot change
     ├── CrossTenantShareError      sharing a page across tenants under an isolating policy
     ├── PageError                  (a page-level precondition failed)
     │    ├── PageOutOfRangeError   id >= num_pages or negative
     │    ├── DuplicatePageError    one id twice in one command
     │    ├── PageNotHeldError      page not held as the command requires
     │    └── RestoringPageError    an inbound restore is writing the page
     ├── OutOfPagesError            not enough reservable pages (KV pressure)
     ├── StepOrderError             step older than the open step, or not open
     ├── LogError                   (the durable log)
     │    ├── CorruptLogError       a bad record that is not a torn tail
     │    ├── TornLogError          a partial last record
     │    ├── LogVersionError       a log format this version cannot read
     │    ├── LogExistsError        create on a path that exists
     │    ├── LogLockedError        another writer holds the log
     │    ├── LogIOError            a write, fsync or truncate failed
     │    ├── LogClosedError        an append after close or after a failure
     │    └── RecordTooLargeError   an event or checkpoint over the size limit
     ├── ReplayMismatchError        replay re-derived different effects/digest
     ├── InvariantViolation         check mode found a broken invariant (a bug)
     ├── SanitizerError             the sanitizer caught stale or poisoned bytes a request would read
     ├── WireProtocolError          a bad or unexpected frame, with a code
     │    ├── LocalProtocolError    this side broke the protocol
     │    └── RemoteProtocolError   the peer broke it
     │         ├── FrameError       bytes that are not a well-formed frame
     │         └── HandshakeRefused the peer refused our HELLO
     ├── StepFailedError            a step did not complete on every rank
     ├── EngineClosedError          the engine is closed or broken
     └── CudaDriverError            a CUDA driver call failed
          └── CudaUnavailableError  cuda-python is missing or too old
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "KVLedgerError",
    "InvalidArgumentError",
    "ConfigurationError",
    "UnknownRequestError",
    "UnknownSnapshotError",
    "UnknownBlockHashError",
    "TenantMismatchError",
    "CrossTenantShareError",
    "PageError",
    "PageOutOfRangeError",
    "DuplicatePageError",
    "PageNotHeldError",
    "RestoringPageError",
    "OutOfPagesError",
    "StepOrderError",
    "LogError",
    "CorruptLogError",
    "TornLogError",
    "ReplayMismatchError",
    "InvariantViolation",
    "SanitizerError",
    "WireProtocolError",
    "LogVersionError",
    "LogExistsError",
    "LogLockedError",
    "LogIOError",
    "LogClosedError",
    "RecordTooLargeError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "FrameError",
    "HandshakeRefused",
    "StepFailedError",
    "EngineClosedError",
    "BackendUnavailableError",
    "CudaDriverError",
    "CudaUnavailableError",
]


def _ids(ids, limit: int = 16) -> str:
    ids = list(ids)
    head = ", ".join(str(i) for i in ids[:limit])
    return "[" + head + (", ..." if len(ids) > limit else "") + "]"


class KVLedgerError(Exception):
    """Base of every error kvledger raises on purpose."""


class InvalidArgumentError(KVLedgerError, ValueError):
    """An argument has the wrong type or is out of its allowed range."""


class ConfigurationError(KVLedgerError, ValueError):
    """Geometry, clear policy or plane layout is invalid."""


class UnknownRequestError(KVLedgerError, LookupError):
    def __init__(self, request: int, detail: str = "") -> None:
        self.request = request
        super().__init__(f"unknown request {request}" + (f": {detail}" if detail else ""))


class UnknownSnapshotError(KVLedgerError, LookupError):
    def __init__(self, snapshot: int, detail: str = "") -> None:
        self.snapshot = snapshot
        super().__init__(f"snapshot {snapshot} is not live" + (f": {detail}" if detail else ""))


class UnknownBlockHashError(KVLedgerError, LookupError):
    """A block hash that no page holds (never published, or evicted)."""

    def __init__(self, block_hash, detail: str = "") -> None:
        self.block_hash = block_hash
        super().__init__(f"no page holds block hash {block_hash!r}" + (f": {detail}" if detail else ""))


class TenantMismatchError(KVLedgerError):
    def __init__(self, request: int, tenant, given) -> None:
        self.request = request
        super().__init__(f"request {request} belongs to tenant {tenant!r}, not {given!r}")


class CrossTenantShareError(KVLedgerError):
    """Under ``cross_tenant`` / ``all_reused`` a request may share only pages its own
    tenant wrote (sharing would hand one tenant's KV to another)."""

    def __init__(self, request: int, tenant, page_id: int, writer_tenant, policy: str) -> None:
        self.request = request
        self.page_id = page_id
        super().__init__(f"request {request} (tenant {tenant!r}) cannot share page {page_id} written by "
                         f"tenant {writer_tenant!r} under policy {policy!r}")


class PageError(KVLedgerError):
    """A page-level precondition failed; ``page_ids`` lists the offending pages."""

    page_ids: tuple[int, ...] = ()


class PageOutOfRangeError(PageError, IndexError):
    def __init__(self, page_ids, num_pages: int) -> None:
        self.page_ids = tuple(page_ids)
        self.num_pages = num_pages
        super().__init__(f"page ids {_ids(self.page_ids)} out of range [0, {num_pages})")


class DuplicatePageError(PageError):
    def __init__(self, page_ids) -> None:
        self.page_ids = tuple(page_ids)
        super().__init__(f"page ids {_ids(self.page_ids)} appear more than once")


class PageNotHeldError(PageError):
    """A page is not held the way the command requires (e.g. not reserved by r)."""

    def __init__(self, page_id: int, expected: str, actual: str) -> None:
        self.page_id = page_id
        self.page_ids = (page_id,)
        self.expected = expected
        self.actual = actual
        super().__init__(f"page {page_id} is {actual}, expected {expected}")


class RestoringPageError(PageError):
    def __init__(self, page_ids, detail: str = "") -> None:
        self.page_ids = tuple(page_ids)
        super().__init__(
            f"pages {_ids(self.page_ids)} have an inbound restore in flight"
            + (f": {detail}" if detail else "")
        )


class OutOfPagesError(KVLedgerError):
    """Not enough reservable pages. A normal outcome under KV pressure; nothing changed."""

    def __init__(self, requested: int, available: int, who: str = "") -> None:
        self.requested = requested
        self.available = available
        super().__init__(
            f"out of pages{(' for ' + who) if who else ''}: "
            f"requested {requested}, {available} reservable"
        )


class StepOrderError(KVLedgerError):
    def __init__(self, step: int, open_step: int, detail: str = "") -> None:
        self.step = step
        self.open_step = open_step
        super().__init__(
            f"step {step} is not allowed while step {open_step} is open"
            + (f": {detail}" if detail else "")
        )


class LogError(KVLedgerError):
    """A problem with the durable event log."""


class CorruptLogError(LogError):
    """A record that fails its checks and is not a torn tail. Never skipped."""

    def __init__(self, path, offset: int, seq: int | None, detail: str) -> None:
        self.path = str(path)
        self.offset = offset
        self.seq = seq
        where = f"offset {offset}" + (f", seq {seq}" if seq is not None else "")
        super().__init__(f"corrupt log {self.path} at {where}: {detail}")


class TornLogError(LogError):
    """A partial last record (a crash mid-append)."""

    def __init__(self, path, offset: int, nbytes: int) -> None:
        self.path = str(path)
        self.offset = offset
        self.nbytes = nbytes
        super().__init__(f"torn tail in {self.path}: {nbytes} bytes from offset {offset}")


class ReplayMismatchError(KVLedgerError):
    def __init__(self, seq: int, detail: str) -> None:
        self.seq = seq
        super().__init__(f"replay mismatch at seq {seq}: {detail}")


class InvariantViolation(KVLedgerError, AssertionError):
    """Check mode found a broken SPEC invariant. Always a bug in kvledger or its caller's log."""

    def __init__(self, invariant: int, detail: str) -> None:
        self.invariant = invariant
        super().__init__(f"invariant {invariant} violated: {detail}")


class SanitizerError(KVLedgerError):
    """Sanitize mode found a page that is not what the ledger says it must be.

    ``rank``, ``plane`` (index), ``page_id``, ``step``; ``kind``: ``"not_zero"`` (a
    listed page still holds non-zero bytes after the clear) or ``"poison"`` (a page
    committed this step still holds the 0xFF poison of a mark: its clear was
    skipped); ``request``: the request the page was committed to (or None);
    ``lifecycle``: the page's history from the ledger, one line per event (who
    held it, when and why it was marked, which step should have zeroed it).
    ``violations``: every violation the check found, as (rank, plane, page, kind).
    """

    def __init__(self, *, rank: int, plane: int, page_id: int, step: int, kind: str, request: int | None = None,
                 lifecycle: Sequence[str] = (), violations: Sequence[tuple] = (), policy: str = "") -> None:
        self.rank = rank
        self.plane = plane
        self.page_id = page_id
        self.step = step
        self.kind = kind
        self.request = request
        self.lifecycle = tuple(lifecycle)
        self.violations = tuple(violations)
        self.policy = policy
        what = ("still holds non-zero bytes after its clear" if kind == "not_zero"
                else "still holds the sanitizer's poison: its clear never ran")
        head = (f"step {step}, rank {rank}, plane {plane}: page {page_id}"
                + (f" (request {request})" if request is not None else "") + f" {what}"
                + (f"; policy {policy}" if policy else ""))
        more = f" (+{len(self.violations) - 1} more)" if len(self.violations) > 1 else ""
        body = "".join(f"\n    {line}" for line in self.lifecycle)
        super().__init__(head + more + (f"\n  lifecycle of page {page_id}:" + body if body else ""))


class WireProtocolError(KVLedgerError):
    """A frame broke the wire protocol. ``code`` is the REJECT code it maps to."""

    def __init__(self, code: int, detail: str, *, remote: bool = False) -> None:
        self.code = code
        self.detail = detail
        self.remote = remote
        super().__init__(f"wire protocol error {code}: {detail}")


# ---------------------------------------------------------------------- the durable log


class LogVersionError(LogError):
    """The file is a kvledger log of a format this version cannot read."""


class LogExistsError(LogError):
    """``EventLog.create`` on a path that already exists. Nothing was written."""


class LogLockedError(LogError):
    """Another writer (this process or another) has the log open."""


class LogIOError(LogError):
    """A write, fsync or truncate failed. The log refuses every later append until reopened.

    ``op`` is the operation, ``errno`` the OS error number (or None).
    """

    def __init__(self, path, op: str, exc: BaseException | None, detail: str = "") -> None:
        self.path = str(path)
        self.op = op
        self.errno = getattr(exc, "errno", None)
        super().__init__(f"{op} failed on {self.path}: {exc}" + (f" ({detail})" if detail else ""))


class LogClosedError(LogError):
    """An append after ``close()``, or after a failure that closed the log to appends."""


class RecordTooLargeError(LogError):
    """An event or checkpoint exceeds the record size limit. Nothing was written."""


# ---------------------------------------------------------------------- the wire


class LocalProtocolError(WireProtocolError):
    """This side broke the protocol (a send the state does not allow): ``remote=False``."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail, remote=False)


class RemoteProtocolError(WireProtocolError):
    """The other side broke the protocol (a frame it should not have sent): ``remote=True``."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail, remote=True)


class FrameError(RemoteProtocolError):
    """Bytes that are not a well-formed frame (always ``remote=True``).

    ``step`` and ``kind`` are what the header said, when the header was readable
    (``None`` otherwise); a REJECT can then name the step the sender meant.
    """

    def __init__(self, code: int, detail: str, *, step: int | None = None, kind: int | None = None) -> None:
        super().__init__(code, detail)
        self.step = step
        self.kind = kind


class HandshakeRefused(RemoteProtocolError):
    """The other side answered our HELLO with REJECT (layout, geometry, world size, rank)."""


# ---------------------------------------------------------------------- the engine


class StepFailedError(KVLedgerError):
    """A step did not complete on every rank; the ledger recorded ``StepAborted``.

    ``step``; ``rank``: the rank whose failure was reported first; ``failures``:
    ``((rank, error), ...)`` for every rank that raised, in order of report;
    ``clear_list``: the aborted step's clear list, carried into the next step
    (run the next step to zero it everywhere). The first rank's exception is the
    ``__cause__``.
    """

    def __init__(
        self,
        step: int,
        rank: int,
        failures: Sequence[tuple[int, BaseException]],
        detail: str = "",
        clear_list: Sequence[int] = (),
    ) -> None:
        self.step = step
        self.rank = rank
        self.failures = tuple(failures)
        self.clear_list = tuple(clear_list)
        first = self.failures[0][1] if self.failures else None
        what = detail or (f"{type(first).__name__}: {first}" if first is not None else "cancelled")
        super().__init__(f"step {step} failed on rank {rank}: {what}")


class EngineClosedError(KVLedgerError):
    """The engine is closed, or broken because a step's outcome could not be recorded."""


# ---------------------------------------------------------------------- executors


class BackendUnavailableError(ConfigurationError):
    """A registered clear backend could not be loaded here (its module or a dependency
    is missing, e.g. no cuda-python or triton on this machine)."""

    def __init__(self, name: str, target: str, cause: BaseException) -> None:
        self.name = name
        self.target = target
        super().__init__(f"clear backend {name!r} ({target}) is not available here: {cause!r}")


class CudaDriverError(KVLedgerError):
    """A CUDA driver call failed.

    ``call`` is the driver function (``"cuMemCreate"``), ``code`` the integer
    ``CUresult`` (None when the driver could not be reached at all), ``name`` the
    result's symbolic name (``"CUDA_ERROR_INVALID_VALUE"``) and ``detail`` the
    arguments that matter.
    """

    def __init__(self, call: str, code: int | None, name: str, detail: str = "") -> None:
        self.call = call
        self.code = code
        self.name = name
        self.detail = detail
        what = name if code is None else f"{name} ({code})"
        super().__init__(f"{call} failed: {what}" + (f": {detail}" if detail else ""))


class CudaUnavailableError(CudaDriverError):
    """cuda-python (``cuda.bindings``) is not installed, or is too old to use."""
