"""Pieces of the live-node replay: measured switch costs, turn fits, decode shares, a node."""

from __future__ import annotations

import math

import pytest
from aegaeon_bench.sim.hardware import QWEN25_7B, latency_model
from aegaeon_bench.sim.node import NodeSpec, simulate_node
from aegaeon_bench.sim.node_costs import CPU_DEFAULTS, fit_copy
from aegaeon_bench.sim.node_turns import _line
from aegaeon_bench.sim.shares import DecodeShareFeed
from aegaeon_bench.sim.switching import LinearCopy, MeasuredSwitching, SwitchCosts, switch_cost
from aegaeon_bench.sim.workload import WorkloadSpec, generate
from aegaeon_sched import SLO, ClusterSpec, make_policy


def test_fit_copy_recovers_fixed_cost_and_rate() -> None:
    truth = LinearCopy(0.5e-3, 6e9)
    points = [(n, truth.seconds(n) * f) for n in (10_000_000, 20_000_000, 40_000_000)
              for f in (0.97, 1.0, 1.03)]  # fmt: skip
    fitted = fit_copy(points, CPU_DEFAULTS.switch.load)
    assert fitted.fixed_s == pytest.approx(truth.fixed_s, abs=0.1e-3)
    assert fitted.bytes_per_s == pytest.approx(truth.bytes_per_s, rel=0.05)
    assert fit_copy(points[:2], CPU_DEFAULTS.switch.load) == CPU_DEFAULTS.switch.load


def test_measured_switching_exposes_what_is_left_of_a_prefetch() -> None:
    costs = SwitchCosts(LinearCopy(1e-3, 1e9), LinearCopy(0.0, 0.5e9), 0.1e-3)
    sw = MeasuredSwitching(costs, {"m": 10_000_000})
    assert sw.full_s("m") == pytest.approx(11e-3)
    assert switch_cost(sw, "m", ("m", 0.0), 5e-3) == pytest.approx(15e-3 + 0.1e-3)
    assert switch_cost(sw, "m", ("m", 0.0), 1.0) == pytest.approx(0.1e-3)
    assert switch_cost(sw, "m", ("other", 0.0), 1.0) == pytest.approx(11e-3)


def test_line_fit_ignores_outliers() -> None:
    points = [(float(n), 3e-3 + 1e-3 * n) for n in range(1, 9) for _ in range(10)]
    points += [(1.0, 0.5), (2.0, 0.4)]  # two turns hit by a stall
    slope, icept = _line(points)
    assert slope == pytest.approx(1e-3, rel=1e-6)
    assert icept == pytest.approx(3e-3, rel=1e-6)


def test_decode_share_feed_follows_the_proxy_rule() -> None:
    lat = latency_model({"a": QWEN25_7B})
    policy = make_policy("aegaeon", ClusterSpec(("prefill-0",), ("decode-0", "prefill-0")), lat)
    feed = DecodeShareFeed(policy, [])
    assert feed.observe("p", 0.0, 0.0) == 1.0  # first heartbeat: nothing to compare yet
    assert feed.observe("p", 0.25, 0.5) == pytest.approx(0.5)  # first busy value as is
    assert feed.observe("p", 0.25, 1.0) == pytest.approx(1 - 0.5 * 0.9)  # smoothed by 0.1


def _cpu_node(policy: str, hybrid: bool) -> NodeSpec:
    lat = latency_model({"a": QWEN25_7B, "b": QWEN25_7B})
    profile = lat.to_dict()
    unified = policy != "aegaeon"
    names = ["decode-0", "decode-1"] if unified else ["prefill-0", "decode-0"]
    return NodeSpec(
        policy=policy, num_prefill=1, num_decode=1, unified=unified, hybrid_prefill=hybrid,
        profiles=dict.fromkeys(names, profile), planner_slo=SLO(2.0, 0.05), costs=CPU_DEFAULTS,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "hybrid"), [("aegaeon", True), ("aegaeon", False), ("request-level", False)]
)
def test_a_light_cpu_node_serves_every_token(policy: str, hybrid: bool) -> None:
    requests = generate(WorkloadSpec(("a", "b"), 0.2, 30.0, seed=1))
    run = simulate_node(_cpu_node(policy, hybrid), requests, 120.0)
    assert len(run.traces) == len(requests)
    for r, trace in zip(requests, run.traces, strict=True):
        assert len(trace.token_times_s) == r.oracle_output_len
        assert trace.token_times_s[0] > r.arrival_s
        assert all(math.isfinite(t) for t in trace.token_times_s)
    assert run.num_switches > 0
    if hybrid:
        assert 0.0 < run.decode_shares["prefill-0"] <= 1.0
