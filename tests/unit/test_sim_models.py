"""Simulated hardware, workload and Theorem 3.1."""

from __future__ import annotations

import random
import statistics

import pytest
from aegaeon_sim.hardware import (
    ARCHS,
    PUBLISHED_H800_MS,
    decode_kv_bytes,
    latency_model,
    market,
)
from aegaeon_sim.theorem import PAPER_FIG4, TheoremCase, check
from aegaeon_workload.synthetic import (
    CONTEXT_LIMIT,
    SHAREGPT_INPUT,
    SHAREGPT_OUTPUT,
    WorkloadSpec,
    generate,
)


def test_model_sizes_match_the_real_checkpoints() -> None:
    # Parameter counts of the released checkpoints (billions).
    assert ARCHS["qwen2.5-7b"].params / 1e9 == pytest.approx(7.62, abs=0.01)
    assert ARCHS["yi-1.5-9b"].params / 1e9 == pytest.approx(8.83, abs=0.01)
    assert ARCHS["llama-2-13b"].params / 1e9 == pytest.approx(13.02, abs=0.01)
    # Table 1 of the paper: Llama-13B KV is 800 KB per token.
    assert ARCHS["llama-2-13b"].kv_bytes_per_token == 800 * 1024


def test_latency_model_within_25_percent_of_published_h800_steps() -> None:
    lat = latency_model(dict(ARCHS))
    for model, points in PUBLISHED_H800_MS.items():
        for (kind, batch, tokens), ms in points.items():
            if kind == "prefill":
                got = lat.prefill_s(model, [tokens] * batch)
            else:
                got = lat.decode_step_s(model, batch, batch * tokens)
            assert 1e3 * got == pytest.approx(ms, rel=0.25), (model, kind, batch, tokens)


def test_switch_times_follow_eq4() -> None:
    lat = latency_model(dict(ARCHS))
    # 26 GB over an effective 51.2 GB/s: about half a second (section 7.3: "under one second")
    assert lat.switch_s("llama-2-13b") == pytest.approx(0.508, abs=0.01)
    assert lat.switch_s("qwen2.5-7b") == pytest.approx(0.297, abs=0.01)


def test_market_mix_and_decode_kv_room() -> None:
    models = market(20)
    kinds = [arch.name for arch in models.values()]
    assert kinds.count("qwen2.5-7b") == 12 and kinds.count("llama-2-13b") == 4
    assert decode_kv_bytes(models) == pytest.approx(72e9 - 2 * ARCHS["llama-2-13b"].weight_bytes)


def test_workload_rates_and_lengths() -> None:
    spec = WorkloadSpec(tuple(f"m{i}" for i in range(20)), 0.5, 1000.0, seed=3)
    reqs = generate(spec)
    assert len(reqs) == pytest.approx(20 * 0.5 * 1000, rel=0.05)
    assert statistics.median(r.prompt_len for r in reqs) == pytest.approx(585, rel=0.08)
    assert statistics.mean(r.oracle_output_len or 0 for r in reqs) == pytest.approx(294, rel=0.05)
    assert all(r.prompt_len + r.max_tokens <= CONTEXT_LIMIT for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    doubled = generate(WorkloadSpec(spec.models, 0.5, 1000.0, seed=3, output_scale=2.0))
    assert statistics.mean(r.max_tokens for r in doubled) == pytest.approx(2 * 294, rel=0.06)
    # Adding models leaves existing models' arrivals unchanged.
    more = generate(WorkloadSpec((*spec.models, "extra"), 0.5, 1000.0, seed=3))
    assert [r for r in more if r.model != "extra"] == reqs


def test_lognormal_fit_reproduces_median_and_mean() -> None:
    rng = random.Random(0)
    for dist in (SHAREGPT_INPUT, SHAREGPT_OUTPUT):
        xs = [dist.sample(rng) for _ in range(40000)]
        assert statistics.median(xs) == pytest.approx(dist.median, rel=0.03)
        assert statistics.mean(xs) == pytest.approx(dist.mean, rel=0.03)


@pytest.mark.parametrize(
    "case",
    [PAPER_FIG4, TheoremCase(100, 0.037, 16.79, "exponential"), TheoremCase(30, 0.2, 5.0)],
)
def test_theorem_3_1_by_simulation(case: TheoremCase) -> None:
    simulated, expected = check(case, horizon_s=20000.0, seed=1)
    assert simulated == pytest.approx(expected, rel=0.03)
