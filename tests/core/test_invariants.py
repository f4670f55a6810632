"""``check_invariants`` is total: any state, however it was built (a forged checkpoint decodes to
whatever its bytes say), gets ``InvariantViolation`` or nothing, never a Python error from
indexing the page table with an id outside the geometry.

The heavy profile's log fuzzer found the gap (2026-12-02): a checkpoint whose request listed a page
past ``num_pages`` passed the trusted start, and the final invariant check raised IndexError."""

from __future__ import annotations

import pytest

from kvledger import InvariantViolation, LedgerState, check_invariants
from kvledger.options import LogOptions
from kvledger.durable import open_ledger
from support import QUIET
from support.simdisk import SimulatedDisk
from support.workload import GEOMETRY, drive


def _canonical() -> dict:
    led = open_ledger("t", GEOMETRY, policy="cross_tenant", logger=QUIET, log_options=LogOptions(layer=SimulatedDisk()))
    drive(led, "inv-range", 12, ranks=2, tenants=3)
    assert led.state.requests, "the workload left no live request to edit"
    return led.state.canonical()


def _add(c: dict, field: str, bad: int) -> None:
    """Name page ``bad`` in one of the state's page-id collections."""
    r0 = c["requests"][0][0]
    step = c["open_step"]
    pairs = {"marks": (bad, 1), "residue": (bad, "t1"), "restore_targets": [bad, "request", r0],
             "pending": (bad, step), "restored_since": (bad, step), "snapshots": [1 << 30, [bad]],
             "clear_lists": [step, [bad]], "in_flight": [step, [bad]], "hashes": [bad, 12345, "t0"],
             "sharers": [bad, [r0, r0 + 1]]}
    if field in pairs:
        c[field] = [*c[field], pairs[field]]
    elif field == "cached":
        c["cached"] = [*c["cached"], bad]
    else:  # a request's reserved, kv or restored pages
        slot = {"reserved": 2, "kv": 3, "restored": 4}[field]
        c["requests"][0][slot] = [*c["requests"][0][slot], bad]
        if field == "kv":
            c["kv_steps"][0][1] = [*c["kv_steps"][0][1], step - 1]


FIELDS = ["reserved", "kv", "restored", "snapshots", "clear_lists", "in_flight", "marks", "residue",
          "restore_targets", "pending", "restored_since", "hashes", "sharers", "cached"]


@pytest.mark.parametrize("bad", [GEOMETRY.num_pages, GEOMETRY.num_pages + 1000, -1])
@pytest.mark.parametrize("field", FIELDS)
def test_a_page_id_outside_the_geometry_is_an_invariant_violation(field, bad):
    c = _canonical()
    _add(c, field, bad)
    st = LedgerState.from_canonical(c)
    with pytest.raises(InvariantViolation, match="outside the geometry"):
        check_invariants(st)


def test_the_unedited_state_passes():
    check_invariants(LedgerState.from_canonical(_canonical()))
