"""Eq. 4-6 estimators: least squares recovers known coefficients, online refinement."""

from __future__ import annotations

import json
import random

import pytest
from aegaeon_sched import SHARED, DecodeSample, LatencyModel, ModelSpec, PrefillSample

QWEN = ModelSpec("qwen", 3584, 18944, 28, 15_231_233_024, 57_344)
LLAMA = ModelSpec("llama", 5120, 13824, 40, 26_031_738_880, 819_200)
TRUE_PREFILL = (2.5e-15, 1.1e-14, 0.006)
TRUE_DECODE = (3.0e-13, 2.0e-12, 4.0e-16)


def _model(per_seq: bool = True) -> LatencyModel:
    return LatencyModel([QWEN, LLAMA], pcie_bytes_per_s=32e9, decode_per_seq_term=per_seq)


def _truth(per_seq: bool = True) -> LatencyModel:
    lat = _model(per_seq)
    lat.set_prefill_coefficients(SHARED, TRUE_PREFILL)
    lat.set_decode_coefficients(SHARED, TRUE_DECODE if per_seq else TRUE_DECODE[:2])
    return lat


def _profile(
    truth: LatencyModel, rng: random.Random, noise: float
) -> tuple[list[PrefillSample], list[DecodeSample]]:
    prefill: list[PrefillSample] = []
    decode: list[DecodeSample] = []
    for model in ("qwen", "llama"):
        for n in (16, 64, 256, 1024, 2048, 4096):
            for b in (1, 2, 4):
                lens = tuple(n for _ in range(b))
                y = truth.prefill_s(model, lens) * (1 + rng.gauss(0, noise))
                prefill.append(PrefillSample(model, lens, y))
        for bs in (1, 4, 16, 64, 128):
            for ctx in (128, 1024, 4096):
                y = truth.decode_step_s(model, bs, bs * ctx) * (1 + rng.gauss(0, noise))
                decode.append(DecodeSample(model, bs, bs * ctx, y))
    return prefill, decode


@pytest.mark.parametrize("per_seq", [False, True])
def test_fit_recovers_known_coefficients(per_seq: bool) -> None:
    truth = _truth(per_seq)
    prefill, decode = _profile(truth, random.Random(0), noise=0.0)
    lat = _model(per_seq)
    lat.fit_prefill(prefill)
    lat.fit_decode(decode)
    for key in ("qwen", "llama", SHARED):
        assert lat.prefill_coefficients(key) == pytest.approx(TRUE_PREFILL, rel=1e-6)
        want = TRUE_DECODE if per_seq else TRUE_DECODE[:2]
        assert lat.decode_coefficients(key) == pytest.approx(want, rel=1e-6)


def test_fit_with_noise_predicts_within_a_few_percent() -> None:
    truth = _truth()
    prefill, decode = _profile(truth, random.Random(1), noise=0.03)
    lat = _model()
    lat.fit_prefill(prefill)
    lat.fit_decode(decode)
    for model in ("qwen", "llama"):
        for n in (100, 700, 3000):
            assert lat.prefill_one_s(model, n) == pytest.approx(
                truth.prefill_one_s(model, n), rel=0.05
            )
        for bs, ctx in ((1, 500), (8, 8000), (32, 40000)):
            got, want = lat.decode_step_s(model, bs, ctx), truth.decode_step_s(model, bs, ctx)
            assert got == pytest.approx(want, rel=0.05)


def test_model_without_profile_uses_the_shared_fit() -> None:
    truth = _truth()
    prefill, decode = _profile(truth, random.Random(0), noise=0.0)
    yi = ModelSpec("yi", 4096, 11008, 48, 17_660_000_000, 98_304)
    lat = LatencyModel([QWEN, LLAMA, yi], pcie_bytes_per_s=32e9, decode_per_seq_term=True)
    lat.fit_prefill(prefill)
    lat.fit_decode(decode)
    truth_yi = LatencyModel([yi], pcie_bytes_per_s=32e9, decode_per_seq_term=True)
    truth_yi.set_prefill_coefficients(SHARED, TRUE_PREFILL)
    truth_yi.set_decode_coefficients(SHARED, TRUE_DECODE)
    assert lat.prefill_one_s("yi", 900) == pytest.approx(truth_yi.prefill_one_s("yi", 900))
    assert lat.decode_step_s("yi", 4, 4000) == pytest.approx(truth_yi.decode_step_s("yi", 4, 4000))


def test_online_refinement_tracks_a_slower_device() -> None:
    lat = _truth()
    slower = _model()
    slower.set_prefill_coefficients(SHARED, [c * 1.3 for c in TRUE_PREFILL])
    slower.set_decode_coefficients(SHARED, [c * 1.3 for c in TRUE_DECODE])
    rng = random.Random(2)
    before = lat.decode_step_s("qwen", 8, 8000)
    for _ in range(400):
        bs = rng.choice([1, 2, 4, 8, 16, 32])
        ctx = bs * rng.randint(100, 3000)
        lat.observe_decode("qwen", bs, ctx, slower.decode_step_s("qwen", bs, ctx))
        n = rng.randint(10, 3000)
        lat.observe_prefill("qwen", [n], slower.prefill_one_s("qwen", n))
    assert before == pytest.approx(slower.decode_step_s("qwen", 8, 8000) / 1.3)
    assert lat.decode_step_s("qwen", 8, 8000) == pytest.approx(
        slower.decode_step_s("qwen", 8, 8000), rel=0.02
    )
    assert lat.prefill_one_s("qwen", 1500) == pytest.approx(
        slower.prefill_one_s("qwen", 1500), rel=0.02
    )
    # llama saw no measurements: unchanged
    assert lat.decode_coefficients("llama") == pytest.approx(TRUE_DECODE)


def test_online_refinement_survives_uninformative_samples() -> None:
    lat = _truth()
    for _ in range(100):  # always the same batch: a singular window on its own
        lat.observe_decode("qwen", 4, 4000, _truth().decode_step_s("qwen", 4, 4000))
    assert lat.decode_step_s("qwen", 16, 30000) == pytest.approx(
        _truth().decode_step_s("qwen", 16, 30000), rel=1e-3
    )


def test_switch_time_is_eq4() -> None:
    lat = _truth()
    assert lat.switch_s("llama") == pytest.approx(26_031_738_880 / 32e9 * 0.625)


def test_dict_round_trip_through_json() -> None:
    lat = _truth()
    lat.set_prefill_coefficients("llama", (3e-15, 1e-14, 0.008))
    copy = LatencyModel.from_dict(json.loads(json.dumps(lat.to_dict())))
    for model in ("qwen", "llama"):
        assert copy.prefill_one_s(model, 777) == lat.prefill_one_s(model, 777)
        assert copy.decode_step_s(model, 3, 2222) == lat.decode_step_s(model, 3, 2222)
        assert copy.switch_s(model) == lat.switch_s(model)
    with pytest.raises(ValueError):
        LatencyModel.from_dict({"version": 99})


def test_scaling_touches_every_model_once() -> None:
    # qwen has its own fit, llama reads the shared one: the shared key sorts first,
    # so scaling in place in that order would scale llama twice.
    lat = _truth()
    lat.set_decode_coefficients("qwen", [2 * c for c in TRUE_DECODE])
    before = {m: lat.decode_step_s(m, 4, 4000) for m in ("qwen", "llama")}
    lat.scale_coefficients("decode", {"qwen": 3.0}, 1.5)
    assert lat.decode_step_s("qwen", 4, 4000) == pytest.approx(3.0 * before["qwen"])
    assert lat.decode_step_s("llama", 4, 4000) == pytest.approx(1.5 * before["llama"])
    assert lat.decode_coefficients(SHARED) == pytest.approx([1.5 * c for c in TRUE_DECODE])
    prefill = lat.prefill_s("llama", [500])
    lat.scale_coefficients("prefill", {}, 0.5)
    assert lat.prefill_s("llama", [500]) == pytest.approx(0.5 * prefill)


def test_a_step_never_gets_faster_as_its_context_grows() -> None:
    # A start-up profile fitted on a busy machine can come out with a negative
    # context term (seen live: a 19M model whose steps hit zero past 2k tokens).
    lat = _model()
    lat.set_decode_coefficients("qwen", (3.0e-13, -2.0e-12, 4.0e-16))
    steps = [lat.decode_step_s("qwen", 4, ctx) for ctx in (0, 1_000, 100_000, 10_000_000)]
    assert steps == [steps[0]] * 4 and steps[0] > 0
