"""Argument checks: the one implementation of every check on ids, page lists and geometry.

The ledger's commands, the fold, the wire and the executors all check page ids
the same way, here. Two forms:

* raising (``page_ids``, ``geometry``, ``ident``, ``count``, ``tenant``,
  ``block_hash_list``): the library's own error naming what was wrong; for API
  arguments (``plain_block_hashes`` and ``all_ints`` answer True / False).
* reporting (``page_ids_problem``, ``u32_page_ids_problem``): ``None`` or a
  ``Problem`` (what kind, which ids), for callers that answer with something
  else than an exception (a wire peer answers REJECT with a code).

All pure; nothing here allocates per id on the common path (distinct ids in
range), and ``u32_page_ids_problem`` checks a strictly ascending list of raw
little-endian u32 ids without building a Python int per id.
"""

from __future__ import annotations

import array
import operator
import sys
from collections.abc import Iterable, Sequence
from typing import Literal, NamedTuple

import msgspec

from .errors import (
    ConfigurationError,
    DuplicatePageError,
    InvalidArgumentError,
    PageOutOfRangeError,
)
from .events.events import COMMIT_READS, MAX_ID, MAX_PAGES, BlockHash, Geometry

__all__ = [
    "MAX_ID",
    "MAX_PAGES",
    "MAX_TENANT_CHARS",
    "OUT_OF_RANGE",
    "DUPLICATE",
    "Problem",
    "all_ints",
    "publish_args",
    "block_hash_list",
    "commit_reads",
    "count",
    "duplicates",
    "geometry",
    "ident",
    "label",
    "out_of_range",
    "page_ids",
    "page_ids_problem",
    "plain_block_hashes",
    "raise_problem",
    "tenant",
    "u32_ids",
    "u32_page_ids_problem",
]

OUT_OF_RANGE, DUPLICATE = "out_of_range", "duplicate"
MAX_TENANT_CHARS = 1 << 16  # a tenant name this long or shorter (every event that names one stays small)
_INT_ONLY = {int}
_BYTES_ONLY = {bytes}


class _Ints(msgspec.Struct, array_like=True, gc=False):
    """``tuple[int, ...]`` in a Struct: ``msgspec.convert`` caches a Struct's type once, a bare
    generic alias is parsed again on every call (``all_ints``: about half the time)."""

    values: tuple[int, ...]


_HASH_MIN, _HASH_MAX = -(1 << 63), (1 << 63) - 1  # an int block hash is a signed 64-bit value


class _Published(msgspec.Struct, array_like=True, gc=False):
    """A publish's hashes, parent hash and tokens, checked in one ``msgspec.convert`` (``publish_args``)."""

    hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


class Problem(NamedTuple):
    """What is wrong with a page list: ``kind`` (``OUT_OF_RANGE`` or ``DUPLICATE``) and
    the offending ids, sorted, each once."""

    kind: str
    page_ids: tuple[int, ...]


# ---------------------------------------------------------------------- scalars


def ident(value, what: str) -> int:
    """A request, snapshot, step or rank id: an int in ``[0, 2**63)``."""
    if type(value) is not int or not 0 <= value <= MAX_ID:
        raise InvalidArgumentError(f"{what} id must be an int in [0, 2**63), got {value!r}")
    return value


def count(value, what: str) -> int:
    """A positive int (a number of pages)."""
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{what} must be a positive int, got {value!r}")
    return value


def tenant(value) -> str | None:
    """A tenant: None, or a str of at most ``MAX_TENANT_CHARS`` characters."""
    if value is not None and (type(value) is not str or len(value) > MAX_TENANT_CHARS):
        shown = repr(value) if type(value) is not str else f"a str of {len(value)} characters"
        raise InvalidArgumentError(f"tenant must be a str of at most {MAX_TENANT_CHARS} characters or None, "
                                   f"got {shown}")
    return value


def commit_reads(value) -> str:
    """How a committing step first reads its pages: one of ``COMMIT_READS``."""
    if value not in COMMIT_READS or type(value) is not str:
        raise InvalidArgumentError(f"reads must be one of {COMMIT_READS}, got {value!r}")
    return value


def label(value) -> str:
    """A request's label: a str of at most 1,024 characters."""
    if type(value) is not str or len(value) > 1024:
        raise InvalidArgumentError(f"a label must be a str of at most 1024 characters, got {value!r:.80}")
    return value


def geometry(value) -> Geometry:
    """A ``Geometry`` whose fields have their types and ranges (Python does not check
    a Struct's annotations at construction). Raises ``ConfigurationError``."""
    if not isinstance(value, Geometry):
        raise ConfigurationError(f"geometry must be a Geometry, got {value!r}")
    n, t = value.num_pages, value.page_tokens
    if type(n) is not int or not 1 <= n <= MAX_PAGES:
        raise ConfigurationError(f"num_pages must be an int in [1, {MAX_PAGES}], got {n!r}")
    if type(t) is not int or t < 1:
        raise ConfigurationError(f"page_tokens must be a positive int, got {t!r}")
    return value


# ---------------------------------------------------------------------- page lists


def duplicates(ids: Iterable[int]) -> list[int]:
    """The ids that occur more than once, sorted, each once."""
    seen: set[int] = set()
    twice: set[int] = set()
    for p in ids:
        if p in seen:
            twice.add(p)
        else:
            seen.add(p)
    return sorted(twice)


def out_of_range(ids: Iterable[int], num_pages: int) -> list[int]:
    """The ids outside ``[0, num_pages)``, sorted, each once."""
    return sorted({p for p in ids if not 0 <= p < num_pages})


def page_ids_problem(ids: Sequence[int], num_pages: int) -> Problem | None:
    """``None`` if the ints in ``ids`` are all in ``[0, num_pages)`` and distinct."""
    if not ids:
        return None
    if min(ids) < 0 or max(ids) >= num_pages:
        return Problem(OUT_OF_RANGE, tuple(out_of_range(ids, num_pages)))
    if len(set(ids)) != len(ids):
        return Problem(DUPLICATE, tuple(duplicates(ids)))
    return None


def raise_problem(problem: Problem, num_pages: int) -> None:
    """Raise the library's error for a ``Problem``."""
    if problem.kind == OUT_OF_RANGE:
        raise PageOutOfRangeError(problem.page_ids, num_pages)
    raise DuplicatePageError(problem.page_ids)


def page_ids(ids: Iterable[int], num_pages: int, *, allow_empty: bool = True) -> tuple[int, ...]:
    """Check a page list and return it as a tuple of ints.

    Accepts any iterable of integers (numpy / torch integer scalars are converted
    with ``operator.index``; ``bool`` is refused). Raises ``InvalidArgumentError``
    (not integers, or empty when ``allow_empty`` is false), ``PageOutOfRangeError``
    naming every id outside ``[0, num_pages)``, ``DuplicatePageError`` naming every
    repeated id.
    """
    if type(ids) is tuple:
        out = ids
    else:
        try:
            out = tuple(ids)
        except TypeError:
            raise InvalidArgumentError(f"page ids must be an iterable of ints, got {ids!r}") from None
    if not out:
        if allow_empty:
            return out
        raise InvalidArgumentError("at least one page id is needed")
    if set(map(type, out)) != _INT_ONLY:
        out = _coerce_ints(out)
    problem = page_ids_problem(out, num_pages)
    if problem is not None:
        raise_problem(problem, num_pages)
    return out


def _coerce_ints(ids: tuple) -> tuple[int, ...]:
    out = []
    for p in ids:
        if type(p) is bool:
            raise InvalidArgumentError(f"page ids must be ints, got {p!r}")
        try:
            out.append(operator.index(p))
        except TypeError:
            raise InvalidArgumentError(f"page ids must be ints, got {p!r}") from None
    return tuple(out)


# ---------------------------------------------------------------------- block hashes


def plain_block_hashes(hashes: tuple) -> bool:
    """Every hash a plain int in the signed 64-bit range (the common case), or 1-64 bytes."""
    kinds = set(map(type, hashes))
    if kinds == {int}:
        return min(hashes) >= -(1 << 63) and max(hashes) < (1 << 63)
    if kinds == {bytes}:
        sizes = list(map(len, hashes))
        return min(sizes) > 0 and max(sizes) <= 64
    return not hashes


def block_hash_list(hashes, what: str) -> tuple:
    """``hashes`` as a tuple of block hashes (ints in the signed 64-bit range or 1-64 bytes).

    Raises ``InvalidArgumentError`` naming the first bad one; a single bytes or str value
    is refused (it would read as a sequence of hashes).
    """
    if type(hashes) is tuple:
        out = hashes
    elif isinstance(hashes, (bytes, str)):
        raise InvalidArgumentError(f"{what}: give a sequence of block hashes, not one {type(hashes).__name__}")
    else:
        try:
            out = tuple(hashes)
        except TypeError:
            raise InvalidArgumentError(f"{what}: block hashes must be a sequence, got {hashes!r}") from None
    kinds = set(map(type, out))
    if kinds == _BYTES_ONLY:
        sizes = set(map(len, out))  # (one pass: hashes of one size give one entry)
        if min(sizes) > 0 and max(sizes) <= 64:
            return out  # the common cases, plain_block_hashes' branches without its call
    elif kinds == _INT_ONLY:
        if min(out) >= _HASH_MIN and max(out) <= _HASH_MAX:
            return out
    elif not kinds:
        return out
    if not plain_block_hashes(out):
        for h in out:
            ok = (type(h) is int and -(1 << 63) <= h < (1 << 63)) or (type(h) is bytes and 0 < len(h) <= 64)
            if not ok:
                raise InvalidArgumentError(f"{what}: a block hash is a signed 64-bit int or 1-64 bytes, got {h!r}")
    return out


def publish_args(hashes: tuple, parent_hash, token_ids: tuple) -> bool:
    """A publish's arguments have their types: block hashes (signed 64-bit ints, 1-64 bytes), an
    optional parent hash, int tokens (not bools, floats or numpy scalars). One C pass over them
    all; False for anything else (the caller's slow path names it)."""
    try:
        msgspec.convert((hashes, parent_hash, token_ids), _Published)
    except msgspec.ValidationError:
        return False
    return True


def all_ints(values: tuple) -> bool:
    """Every value an ``int`` (not a bool, not a float, not a numpy scalar): one C pass."""
    try:
        msgspec.convert((values,), _Ints)
    except msgspec.ValidationError:
        return False
    return True


# ---------------------------------------------------------------------- raw u32 page lists

_LITTLE = sys.byteorder == "little"
_U32: Literal["I", "L"] = "I" if array.array("I").itemsize == 4 else "L"
_SWAR_MIN = 48  # below this many ids, min/max + set() is cheaper than the lane trick
_lane_cache: dict[int, tuple[int, int, int]] = {}


def u32_ids(raw) -> Sequence[int]:
    """A read-only sequence of ints over little-endian u32 bytes (zero-copy on LE hosts)."""
    if type(raw) is memoryview and raw.format == _U32 and _LITTLE:
        return raw
    if _LITTLE:
        return memoryview(raw).cast("B").cast(_U32)
    arr = array.array(_U32, bytes(raw))
    arr.byteswap()
    return memoryview(arr.tobytes()).cast(_U32)


def u32_page_ids_problem(raw, num_pages: int) -> Problem | None:
    """``page_ids_problem`` for page ids as raw little-endian u32 bytes (a wire frame).

    ``raw`` is any bytes-like, or a ``memoryview`` of format ``'I'`` over them. A
    strictly ascending list (what a leader sends) is checked with whole-list
    integer arithmetic: no Python int per id. u32 ids are never negative, so only
    the upper bound and distinctness are checked.
    """
    if type(raw) is memoryview and raw.format != "B":
        if raw.format == _U32 and _LITTLE:
            n = len(raw)
            if n == 0:
                return None
            as_bytes = raw.cast("B")
            if n >= _SWAR_MIN and _strictly_ascending(as_bytes, n) and raw[-1] < num_pages:
                return None
            return _u32_problem(raw.tolist(), num_pages)
        raw = raw.cast("B")
    n = len(raw) >> 2
    if n == 0:
        return None
    if n >= _SWAR_MIN and _strictly_ascending(raw, n) and int.from_bytes(raw[-4:], "little") < num_pages:
        return None  # ascending (so distinct) and the largest is in range
    return _u32_problem(list(u32_ids(raw)), num_pages)


def _u32_problem(ids: list[int], num_pages: int) -> Problem | None:
    if max(ids) >= num_pages:
        return Problem(OUT_OF_RANGE, tuple(out_of_range(ids, num_pages)))
    if len(set(ids)) != len(ids):
        return Problem(DUPLICATE, tuple(duplicates(ids)))
    return None


def _lanes(n: int) -> tuple[int, int, int]:
    c = _lane_cache.get(n)
    if c is None:
        if len(_lane_cache) >= 256:
            _lane_cache.clear()
        high = int.from_bytes(b"\x00\x00\x00\x80" * n, "little")
        c = _lane_cache[n] = (high, high >> 31, 1 << (32 * n - 1))
    return c


def _strictly_ascending(raw, n: int) -> bool:
    """True iff the n little-endian u32 in ``raw`` are strictly ascending.

    X holds id i in bits [32i, 32i+32); B = X >> 32 puts id i+1 in lane i. Per
    lane, with a = id i and b = id i+1 split into top bit (ah, bh) and low 31
    bits (al, bl): (b | 2**31) - al - 1 stays inside its lane and has its top bit
    set iff bl > al. Then a < b iff (ah != bh and bh) or (ah == bh and bl > al).
    The last lane compares id n-1 with 0 and is forced true.
    """
    x = int.from_bytes(raw, "little")
    high, one, top = _lanes(n)
    b = x >> 32
    ah = x & high
    bh = b & high
    gt = ((b | high) - (x ^ ah) - one) & high
    lt = ((bh ^ gt) & (ah ^ bh)) ^ gt
    return (lt | top) == high
