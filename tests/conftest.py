import os

from hypothesis import HealthCheck, settings

# Quick profile in CI and by default; KVLEDGER_HYPOTHESIS=heavy selects the heavy one.
settings.register_profile("quick", max_examples=100, stateful_step_count=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("heavy", max_examples=2000, stateful_step_count=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVLEDGER_HYPOTHESIS", "quick"))
