"""Pieces of the live-node replay: measured switch costs, turn fits, decode shares, a node."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from aegaeon_sched import SLO, ClusterSpec, LatencyModel, PrefillSample, make_policy
from aegaeon_sim.hardware import QWEN25_7B, latency_model
from aegaeon_sim.node import NodeSpec, simulate_node
from aegaeon_sim.node_costs import CPU_DEFAULTS, fit_copy, prefill_scale, refit_prefill
from aegaeon_sim.node_turns import DecodeCosts, _line, decode_costs
from aegaeon_sim.shares import DecodeShareFeed
from aegaeon_sim.switching import LinearCopy, MeasuredSwitching, SwitchCosts, switch_cost
from aegaeon_workload.synthetic import WorkloadSpec, generate


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


def _profile_with_shared_only(*shared: str) -> dict[str, object]:
    """Models a, b, c, d; those in ``shared`` read the shared Eq. 5-6 coefficients."""
    profile = latency_model(dict.fromkeys("abcd", QWEN25_7B)).to_dict()
    for model in shared:
        del profile["decode_coef"][model], profile["prefill_coef"][model]
    return profile


def test_truth_scales_every_model_once() -> None:
    # A model without its own fit reads the shared coefficients: scaling them
    # first and that model after would scale it twice (the order of a set of
    # names differs from one interpreter to the next).
    profile = _profile_with_shared_only("b", "d")
    costs = dataclasses.replace(CPU_DEFAULTS, decode_scale=1.25, prefill_scale=0.8,
                                model_scale={"c": 2.0})  # fmt: skip
    spec = dataclasses.replace(_cpu_node("request-level", False), profiles={"decode-0": profile},
                               costs=costs)  # fmt: skip
    base, truth = LatencyModel.from_dict(profile), spec.truth("decode-0")
    for model, factor in {"a": 1.25, "b": 1.25, "c": 2.5, "d": 1.25}.items():
        want = base.decode_step_s(model, 4, 2000) * factor
        assert truth.decode_step_s(model, 4, 2000) == pytest.approx(want, rel=1e-9), model
        want = base.prefill_s(model, [500]) * 0.8
        assert truth.prefill_s(model, [500]) == pytest.approx(want, rel=1e-9), model


def test_refitted_prefill_spends_the_measured_seconds() -> None:
    # Right-skewed times: a fit of relative errors lands below their sum.
    profile = LatencyModel.from_dict(_profile_with_shared_only())
    rng = random.Random(7)
    samples = []
    for _ in range(200):
        n = rng.randint(50, 900)
        slow = 1.0 + rng.expovariate(4.0)
        samples.append(PrefillSample("a", (n,), 2.0 * profile.prefill_s("a", [n]) * slow))
    coef = refit_prefill(profile, samples)
    fitted = LatencyModel.from_dict(profile.to_dict())
    for model, c in coef.items():
        fitted.set_prefill_coefficients(model, c)
    measured = sum(s.seconds for s in samples)
    predicted = sum(fitted.prefill_s(s.model, s.prompt_lens) for s in samples)
    scale = prefill_scale(profile, coef, samples)
    assert scale > 1.01
    assert predicted * scale == pytest.approx(measured, rel=1e-9)


def test_decode_costs_give_each_model_its_engine_share() -> None:
    # Model b's steps take 1.5x what the profile says, a's 1x: the node's scale
    # is their mix, and each model's own factor is relative to it.
    profile = LatencyModel.from_dict(_profile_with_shared_only())
    turns, t = [], 0.0
    for i in range(60):
        model = "ab"[i % 2]
        steps, ratio = 20 + i, (1.0 if model == "a" else 1.5)
        engine = ratio * steps * profile.decode_step_s(model, 1, 1000)
        turns.append({"instance": "decode-0", "model": model, "start_s": t, "end_s": t + engine,
                      "switch_s": 0.0, "kv_wait_s": 0.0, "steps": steps, "tokens": steps,
                      "engine_s": engine})  # fmt: skip
        t += engine + 0.01
    counters = {"decode_s": sum(x["engine_s"] for x in turns),
                "steps": sum(x["steps"] for x in turns)}  # fmt: skip
    stats = {"turns": turns, "layout": {"unified": True},
             "instances": {"decode-0": {"counters": counters}}}  # fmt: skip
    trace = [{"model": m, "prompt_tokens": 900, "expected_tokens": 200} for m in "ab"]
    costs = decode_costs(stats, trace, {"decode-0": profile}, DecodeCosts(0, 0, 0, 1, 0, 0))
    a, b = costs.model_scale["a"], costs.model_scale["b"]
    assert b / a == pytest.approx(1.5, rel=1e-6)
    assert costs.decode_scale * a == pytest.approx(1.0, rel=1e-6)
