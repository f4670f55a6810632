"""SanitizerViolation: the record the engine writes when the sanitizer catches a page.

Pins its golden bytes (the log stores them), its precondition (a sealed step, a
page in range, a known kind) and that folding it changes nothing but ``seq``.
"""

from __future__ import annotations

import msgspec
import pytest

from kvledger import (
    Geometry,
    InvalidArgumentError,
    Ledger,
    PageOutOfRangeError,
    SanitizerViolation,
    StepOrderError,
    replay,
)

GOLDEN = (
    "86a474797065b373616e6974697a65725f76696f6c6174696f6ea47374657000a472616e6b01a5706c616e6502"
    "a7706167655f696407a46b696e64a6706f69736f6e"
)


def test_golden_bytes():
    ev = SanitizerViolation(step=0, rank=1, plane=2, page_id=7, kind="poison")
    assert msgspec.msgpack.encode(ev).hex() == GOLDEN


def test_a_violation_is_recorded_and_changes_nothing_else():
    L = Ledger(Geometry(num_pages=8, page_tokens=4), record=True, check=True)
    L.seal_step(0)
    before = L.state.canonical()
    L.record_violation(0, 1, 2, 7, "not_zero")
    after = L.state.canonical()
    assert after.pop("seq") == before.pop("seq") + 1 and after == before
    assert replay(L.events, check=True).digest() == L.digest()


@pytest.mark.parametrize(("args", "error"), [
    ((1, 0, 0, 1, "poison"), StepOrderError),  # step 1 was never sealed
    ((0, 0, 0, 8, "poison"), PageOutOfRangeError),
    ((0, 0, 0, 1, "stale"), InvalidArgumentError),
    ((0, -1, 0, 1, "poison"), InvalidArgumentError),
])
def test_bad_records_are_refused_and_change_nothing(args, error):
    L = Ledger(Geometry(num_pages=8, page_tokens=4), record=True)
    L.seal_step(0)
    digest, n = L.digest(), len(L.events)
    with pytest.raises(error):
        L.record_violation(*args)
    assert (L.digest(), len(L.events)) == (digest, n)
