"""LoRA adapters in the simulator (aegaeon_sim.adapters), as the live system serves them.

The same load as 8 streams on adapters of 2 models, on the 2 models alone (their
streams merged) and on 8 full models: the adapters' run switches like the 2
models' (a base and its adapters are one switching unit), brings each adapter
to an instance once for its own bytes, and attains what they attain; the
request-level baseline batches adapters on the instance holding their base,
where 8 full models make it switch at every request boundary.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from aegaeon_sim.adapters import adapter_bytes
from aegaeon_sim.hardware import QWEN25_7B
from aegaeon_sim.runner import Scenario, run_scenario

# 60 s of arrivals: ~190 requests, hundreds of switches and every adapter loaded (the
# bounds below hold at seeds 0-3 as at 120 s)
BASE = Scenario("aegaeon", 2, 0.4, duration_s=60.0, num_prefill=1, num_decode=1)


def test_an_adapter_is_megabytes_of_a_7b_model() -> None:
    nbytes = adapter_bytes(QWEN25_7B, 16)
    assert 10e6 < nbytes < 100e6 < QWEN25_7B.weight_bytes


@pytest.mark.parametrize("policy", ["aegaeon", "request-level"])
def test_adapters_switch_as_their_bases_alone(policy: str) -> None:
    adapters = run_scenario(replace(BASE, policy=policy, adapters_per_model=4))
    bases = run_scenario(replace(BASE, policy=policy, rps_per_model=4 * BASE.rps_per_model))
    full = run_scenario(replace(BASE, policy=policy, num_models=8))
    assert adapters.report.num_requests == full.report.num_requests  # the same 8 streams
    assert 0 < adapters.adapter_loads <= 8 * 3  # once per instance at most
    assert bases.adapter_loads == full.adapter_loads == 0
    assert adapters.num_switches <= 1.1 * bases.num_switches + 2
    assert adapters.report.attainment >= bases.report.attainment - 0.02
    if policy == "request-level":  # batched on their base, not swapped for it
        assert adapters.num_switches < full.num_switches
        assert adapters.report.attainment > full.report.attainment
