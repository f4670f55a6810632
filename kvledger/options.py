"""The openers' option groups: frozen records, one per concern, instead of a long flat signature.

    open_ledger(path, geometry, *, policy=, check=, logger=, observer=,
                log_options=LogOptions(fsync=, background=, checkpoint_every=, max_lag_bytes=,
                                       max_pages=, segment_bytes=, retain_bytes=,
                                       retain_segments=, layer=))
    open_engine(geometry, *, log=path, ranks=, policy=, backend=, remote=, check=, record=, logger=,
                log_options=LogOptions(...),
                steps=StepOptions(depth=, queue_size=, drain_timeout_s=, timings=, yield_every_s=),
                extras=ExtraOptions(sanitize=, metrics=, kv_events=, observers=))

``LogOptions`` (here) says how a durable log writes; ``StepOptions`` and ``ExtraOptions``
(``kvledger.engine.options``) how the engine runs steps and what it wires in. Each checks
its fields when made (``InvalidArgumentError`` naming the field; a log's own options are
checked where the log opens, as before) and never changes after.

The flat keywords of earlier releases (``open_ledger(path, g, fsync="per_step")``,
``open_engine(g, depth=2, sanitize=True)``, ``log_options={...}`` as a mapping) still work
for one release: ``regroup`` folds them into their group, and each call warns once
(``DeprecationWarning``, pointing at the caller's line, naming the group of each keyword). Giving a flat keyword and its
group together is an ``InvalidArgumentError`` (which should win is not guessable).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import TypeVar

from .core.errors import InvalidArgumentError
from .core.log import DEFAULT_MAX_LAG_BYTES, DEFAULT_MAX_PAGES
from .core.log.files import FileLayer

__all__ = ["LOG_FIELDS", "LogOptions", "regroup"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogOptions:
    """How a durable log writes (``open_ledger``'s and ``open_engine``'s ``log_options``).

    ``fsync``: ``"background"`` (a writer thread group-commits and fsyncs; the default),
    ``"per_step"``, ``"per_event"`` or ``"none"``; ``background``: force the writer thread on
    or off (None: the policy's default). ``checkpoint_every``: events between checkpoints
    (``"auto"``: amortized for the geometry; None: never). ``max_lag_bytes``: how far the
    writer thread may fall behind before appends block. ``max_pages``: the largest geometry
    a log may claim (what an untrusted file can make a reader allocate). ``segment_bytes``:
    a log directory of segments of about that size, with ``retain_bytes`` /
    ``retain_segments`` deleting old ones. ``layer``: the file layer (fault injection,
    timing: ``kvledger.metrics.LedgerMetrics.timed_layer``); None: the real files.
    Their values are checked where the log opens (``kvledger.durable.open_ledger``).
    """

    fsync: str = "background"
    background: bool | None = None
    checkpoint_every: int | str | None = "auto"
    max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES
    max_pages: int = DEFAULT_MAX_PAGES
    segment_bytes: int | None = None
    retain_bytes: int | None = None
    retain_segments: int | None = None
    layer: FileLayer | None = None


LOG_FIELDS = tuple(f.name for f in dataclasses.fields(LogOptions))

G = TypeVar("G")


def regroup(caller: str, param: str, group: type[G], given: G | None, flat: Mapping[str, object],
            *, stacklevel: int | None = 3) -> G | None:
    """``given``, or a ``group`` made of the deprecated flat keywords ``flat`` (then a
    ``DeprecationWarning`` at the user's frame, ``stacklevel`` counted from here; None: the
    caller warns itself, ``warn_flat``), or None when neither was given.

    Raises ``InvalidArgumentError`` (and warns about nothing) when both were given, or for a
    value the group refuses."""
    if not flat:
        return given
    names = ", ".join(f"{name}=" for name in flat)
    if given is not None:
        raise InvalidArgumentError(f"{caller}: {names} given both as flat keywords and in {param}=; "
                                   f"pass them in {param}={group.__name__}(...) only")
    try:
        made = group(**flat)
    except TypeError as exc:  # (a name the caller checked belongs here; kept as the group's error)
        raise InvalidArgumentError(f"{caller}: {exc}") from None
    if stacklevel is not None:
        warn_flat(caller, {param: (group, flat)}, stacklevel=stacklevel + 1)
    return made


def warn_flat(caller: str, grouped: Mapping[str, tuple[type, Mapping[str, object]]], *, stacklevel: int) -> None:
    """One ``DeprecationWarning`` for every flat keyword of one call, naming the group each goes
    in (``grouped``: group parameter -> (its class, the flat keywords)); ``stacklevel``: the
    user's frame as ``warnings.warn`` counts it from here."""
    uses = "; ".join(f"{param}={group.__name__}({', '.join(f'{name}=' for name in flat)}...)"
                     for param, (group, flat) in grouped.items())
    names = ", ".join(f"{name}=" for _, flat in grouped.values() for name in flat)
    warnings.warn(f"{caller}({names}...) is deprecated: pass {uses} instead; the flat keywords go in the "
                  "next release", DeprecationWarning, stacklevel=stacklevel)


def split_flat(caller: str, flat: Mapping[str, object], fields: Mapping[str, str]) -> dict[str, dict[str, object]]:
    """The deprecated flat keywords of one call, by the parameter of their group (``fields``:
    flat name -> group parameter). Raises ``TypeError`` for a name no group has, as Python does
    for an unexpected keyword argument."""
    out: dict[str, dict[str, object]] = {}
    for name, value in flat.items():
        param = fields.get(name)
        if param is None:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
        out.setdefault(param, {})[name] = value
    return out


def log_options_of(caller: str, given: LogOptions | Mapping[str, object] | None, flat: Mapping[str, object],
                   *, stacklevel: int | None = 3) -> LogOptions:
    """The ``LogOptions`` of one call: ``given``; or one made of a mapping (the earlier form of
    ``log_options=``) or of flat keywords, with a ``DeprecationWarning`` (``stacklevel``: the
    user's frame as seen from ``caller``'s call of this; None: the caller warned about flat
    keywords already); or the defaults. Raises ``InvalidArgumentError`` for a mapping naming
    what is no log option, or both forms."""
    if given is not None and not isinstance(given, LogOptions):
        if not isinstance(given, Mapping):
            raise InvalidArgumentError(f"{caller}: log_options must be a LogOptions, got {type(given).__name__}")
        unknown = sorted(set(given) - set(LOG_FIELDS))
        if unknown:
            raise InvalidArgumentError(f"{caller}: log_options names {unknown}, which are no log options "
                                       f"(those are {list(LOG_FIELDS)})")
        if flat:
            raise InvalidArgumentError(f"{caller}: log options given both as flat keywords and in log_options=")
        warnings.warn(f"{caller}(log_options={{...}}) as a mapping is deprecated: pass "
                      "log_options=LogOptions(...) instead; the mapping goes in the next release",
                      DeprecationWarning, stacklevel=stacklevel or 3)
        fields: dict[str, object] = {str(k): v for k, v in given.items()}
        return LogOptions(**fields)  # type: ignore[arg-type]
    made = regroup(caller, "log_options", LogOptions, given, flat,
                   stacklevel=None if stacklevel is None else stacklevel + 1)
    return made if made is not None else LogOptions()
