"""The seeded serving workload of the log tests (tests/support/workload.py): every event kind, valid
commands only, deterministic, and a reopened ledger continues it exactly as the original would."""

from __future__ import annotations

import pytest
from support.workload import GEOMETRY, drive, make_events

from kvledger import CLEAR_POLICIES, Ledger, check_invariants


@pytest.mark.parametrize("policy", CLEAR_POLICIES)
def test_workload_is_valid_and_exercises_every_event(policy):
    led = Ledger(GEOMETRY, policy=policy, record=True, check=True)
    drive(led, "sanity", 120)
    check_invariants(led.state)
    kinds = {type(e).__name__ for e in led.events}
    print(f"workload {policy}: {led.seq} events, kinds {sorted(kinds)}")
    assert {"PagesReserved", "PagesCommitted", "ReservationReturned", "RequestFinished", "RequestCancelled",
            "SnapshotAliased", "SnapshotReleased", "RestoreStarted", "RestoreCompleted", "StepSealed",
            "StepCompleted", "StepAborted"} <= kinds


def test_workload_is_deterministic_and_continues_after_a_restart():
    a, la = make_events("det", 40)
    b, lb = make_events("det", 40)
    assert a == b and la.digest() == lb.digest()
    # a ledger rebuilt from the first 20 steps' events continues exactly like the original would
    led = Ledger(GEOMETRY, record=True)
    drive(led, "cont", 20)
    copy = Ledger(GEOMETRY, record=True)
    for ev in led.events[1:]:
        copy.submit(ev)
    drive(led, "cont", 20)
    drive(copy, "cont", 20)
    assert led.digest() == copy.digest()
