"""Every policy answers the whole contract (``PolicyBase``): a driver tells any policy of
pauses, the models an instance serves, decode shares and roles, and never asks what
it supports; the baselines ignore what they do not use."""

from __future__ import annotations

import pytest
from aegaeon_sched import (
    AegaeonPolicy,
    ClusterSpec,
    EnqueuePrefill,
    PolicyOptions,
    Request,
    RequestLevelPolicy,
    make_policy,
)
from fake_worker import latency_model

BASELINES = ("request-level", "request-level-global", "static-mux")


@pytest.mark.parametrize("name", BASELINES)
def test_a_baseline_ignores_pauses_and_shares_and_has_no_roles(name: str) -> None:
    cluster = ClusterSpec(prefill_instances=(), decode_instances=("decode-0", "decode-1"))
    policy = make_policy(name, cluster, latency_model(["a"]), PolicyOptions())
    assert policy.pause("decode-0") == [] and policy.resume("decode-0", 1.0) == []
    assert policy.held_counts() == (0, 0)
    policy.set_decode_share("decode-0", 0.5)
    assert policy.role_load() is None
    with pytest.raises(ValueError, match="roles do not move"):
        policy.set_role("decode-0", "prefill", 1.0)


def test_a_request_level_policy_fits_requests_to_the_smallest_kv_room() -> None:
    policy = RequestLevelPolicy(["decode-0", "decode-1"], capacity_tokens={"a": 900})
    policy.learn("decode-0", {"a": 1000, "b": 400}, None)
    policy.learn("decode-1", {"b": 300}, None)
    assert policy.capacity_tokens == {"a": 900, "b": 300}


def test_aegaeon_learns_decode_room_and_new_models_and_reports_its_role_load() -> None:
    policy = AegaeonPolicy(["prefill-0"], ["decode-0"], latency_model(["a"]))
    policy.learn("decode-0", {"a": 640}, latency_model(["a", "b"]))
    policy.learn("prefill-0", {"a": 10}, None)  # prefills only: no decode room to learn
    assert policy.decode.capacity_tokens("decode-0", "a") == 640
    assert policy.decode.capacity_tokens("prefill-0", "a") is None
    assert set(policy.latency.specs) == {"a", "b"}  # the added model's spec, for Alg. 1
    policy.pause("prefill-0")  # draining: arrivals wait in the policy
    assert policy.on_arrival(Request("r0", "b", 0.0, 300, 8), 0.0) == []
    assert policy.held_counts() == (1, 0)
    load = policy.role_load()
    assert load is not None and load.backlog_tokens == 300
    assert dict(load.decode_demand) == {"decode-0": 0.0}
    (sent,) = policy.resume("prefill-0", 1.0)
    assert isinstance(sent, EnqueuePrefill) and sent.instance == "prefill-0"
    assert policy.held_counts() == (0, 0)
