"""`bench serve` plan: Poisson arrivals per model, lengths, prompts, model limits."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest
from aegaeon_workload.plan import (
    DEFAULT_VOCAB_SIZE,
    DEFAULT_WINDOW,
    MarketError,
    ModelLimits,
    model_limits,
    plan_requests,
)
from cli_support import config_market

LIMITS = {m: ModelLimits(1000, 4096, "test") for m in ("a", "b", "c")}


def _plan(seed: int = 0, models: tuple[str, ...] = ("a", "b"), **kw: float) -> list:  # type: ignore[type-arg]
    return plan_requests(models, LIMITS, rps_per_model=kw.pop("rps", 0.5),
                         duration_s=kw.pop("duration", 400.0), seed=seed, **kw)  # fmt: skip


def test_arrivals_are_deterministic_for_a_seed() -> None:
    first, again, other = _plan(seed=7), _plan(seed=7), _plan(seed=8)
    assert first == again
    assert [r.offset_s for r in first] != [r.offset_s for r in other]
    assert first[0].prompt_ids() == again[0].prompt_ids()


def test_poisson_per_model() -> None:
    plan = _plan(rps=0.5, duration=2000.0)
    assert [r.offset_s for r in plan] == sorted(r.offset_s for r in plan)
    for model in ("a", "b"):
        times = [r.offset_s for r in plan if r.model == model]
        assert len(times) == pytest.approx(0.5 * 2000, rel=0.1)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # exponential gaps: mean 1/rate, coefficient of variation 1
        assert statistics.mean(gaps) == pytest.approx(2.0, rel=0.1)
        assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.15)
        assert all(0 < t <= 2000.0 for t in times)
    # adding a model leaves the others' arrivals alone (each has its own stream)
    more = _plan(rps=0.5, duration=2000.0, models=("a", "b", "c"))
    assert [r for r in more if r.model != "c"] == plan


def test_lengths_scale_and_clip_to_the_window() -> None:
    base = _plan(duration=2000.0)
    half = _plan(duration=2000.0, input_scale=0.5, output_scale=0.25)
    assert statistics.median(r.prompt_len for r in base) == pytest.approx(585, rel=0.1)
    assert statistics.median(r.prompt_len for r in half) == pytest.approx(585 / 2, rel=0.1)
    assert statistics.mean(r.max_tokens for r in half) == pytest.approx(294 / 4, rel=0.1)
    tight = {m: ModelLimits(50, 300, "test") for m in ("a", "b")}
    clipped = plan_requests(("a", "b"), tight, rps_per_model=0.5, duration_s=400.0, seed=0)
    assert all(r.prompt_len + r.max_tokens <= 300 for r in clipped)
    assert all(max(r.prompt_ids()) < 50 and len(r.prompt_ids()) == r.prompt_len for r in clipped)


def test_fixed_lengths_keep_the_arrivals_and_clip_to_the_window() -> None:
    drawn = _plan(duration=400.0)
    fixed = plan_requests(("a", "b"), LIMITS, rps_per_model=0.5, duration_s=400.0, seed=0,
                          prompt_tokens=256, output_tokens=64)  # fmt: skip
    assert [r.offset_s for r in fixed] == [r.offset_s for r in drawn]
    assert {(r.prompt_len, r.max_tokens) for r in fixed} == {(256, 64)}
    assert all(len(r.prompt_ids()) == 256 for r in fixed)
    tight = {m: ModelLimits(50, 300, "test") for m in ("a", "b")}
    clipped = plan_requests(("a", "b"), tight, rps_per_model=0.5, duration_s=100.0, seed=0,
                            prompt_tokens=280, output_tokens=64)  # fmt: skip
    assert {(r.prompt_len, r.max_tokens) for r in clipped} == {(280, 20)}


def test_model_limits_from_the_market_configs(tmp_path: Path) -> None:
    market = config_market(tmp_path, {
        name: {"vocab_size": vocab, "max_position_embeddings": window}
        for name, (vocab, window) in {"big": (32000, 32768), "small": (4096, 1024)}.items()})
    limits = model_limits(["big", "small", "elsewhere"], market)
    assert (limits["big"].vocab_size, limits["big"].window) == (32000, 4096)  # capped at 4096
    assert (limits["small"].vocab_size, limits["small"].window) == (4096, 1024)
    assert limits["small"].source.endswith("small/config.json")
    assert limits["elsewhere"] == ModelLimits(DEFAULT_VOCAB_SIZE, DEFAULT_WINDOW, "default")
    override = model_limits(["big"], market, vocab_size=100, max_context=None)
    assert (override["big"].vocab_size, override["big"].window) == (100, 32768)
    assert model_limits(["x"], None)["x"].source == "default"
    with pytest.raises(MarketError):
        model_limits(["x"], tmp_path / "missing")
