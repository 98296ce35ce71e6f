"""The simulator's scenario knobs that change costs, not policies."""

from __future__ import annotations

import pytest
from aegaeon_sim.runner import Scenario, run_scenario


def test_switch_scale_halves_every_exposed_switch_and_changes_nothing_else() -> None:
    base = Scenario("aegaeon", 4, 0.1, duration_s=60.0, drain_s=60.0)
    full = run_scenario(base)
    half = run_scenario(Scenario("aegaeon", 4, 0.1, duration_s=60.0, drain_s=60.0,
                                 switch_scale=0.5))  # fmt: skip
    assert full.num_switches == half.num_switches > 0  # the same plan on the same trace
    assert half.exposed_switch_mean_s == pytest.approx(full.exposed_switch_mean_s / 2)
    assert half.report.num_requests == full.report.num_requests
