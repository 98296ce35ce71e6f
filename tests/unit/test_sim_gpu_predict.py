"""``aegaeon_sim.gpu_predict`` on a recorded live run: the paper scenario's prediction.

The calibration is the recorded aegaeon run of ``tests/data/replay-m6-r1.2.tgz``
(see test_sim_replay_trace.py); both policies are predicted along a rate
ladder around its 1.2 RPS per model, on the requests the live runs sent.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from aegaeon_sim.gpu_predict import predict, table

ARCHIVE = Path(__file__).resolve().parents[1] / "data" / "replay-m6-r1.2.tgz"
LADDER = [0.3, 0.6, 1.2, 2.4]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("predict")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(out, filter="data")
    return out


def _live(logs: Path, policy: str) -> tuple[str, float, int]:
    (case_dir,) = logs.glob(f"{policy}-m6-*")
    summary = json.loads((case_dir / "trace.jsonl.summary.json").read_text())
    return case_dir.name, summary["result"]["slo_attainment"], summary["result"]["requests"]


def test_both_policies_along_the_ladder(logs: Path) -> None:
    aegaeon_dir, aegaeon_live, num_requests = _live(logs, "aegaeon")
    _, baseline_live, _ = _live(logs, "request-level")
    inputs = {
        "logs": str(logs), "calibration_trace": f"{aegaeon_dir}/trace.jsonl",
        "calibration_config": f"{aegaeon_dir}/run/config.yaml",
        "plan": {"load_s": 10.0, "grace_s": 30.0}, "ladder": LADDER,
        "policies": ["aegaeon", "request-level"],
        "runs": {"aegaeon": [{"rps_per_model": 1.2, "slo_attainment": aegaeon_live}],
                 "request-level": [{"rps_per_model": 1.2, "slo_attainment": baseline_live}]},
    }  # fmt: skip
    result = predict(inputs)
    calibration = result["calibration"]
    assert calibration["node"] == "aegaeon" and calibration["costs"]["switch_gb_per_s"] > 0
    assert set(calibration["profile_copy_gb_s"]) == {"prefill-0", "decode-0"}
    for policy, live in (("aegaeon", aegaeon_live), ("request-level", baseline_live)):
        points = {p["rps_per_model"]: p for p in result["policies"][policy]["points"]}
        assert sorted(points) == LADDER
        assert all(0.0 <= p["predicted"] <= 1.0 for p in points.values())
        assert points[0.3]["predicted"] >= points[2.4]["predicted"]
        # the measured rate: the live run's own requests, its attainment beside
        at = points[1.2]
        assert at["requests"] == num_requests and at["measured"] == live
        assert at["diff_points"] == pytest.approx(100 * (at["predicted"] - live), abs=0.01)
        assert all("measured" not in p for r, p in points.items() if r != 1.2)
        assert result["policies"][policy]["sustainable"]["kind"] in (
            "interpolated", "at_least", "below")
    assert "value" in result["ratio"]
    assert predict(inputs) == result  # seeded and pure: the same answer again
    assert "request-level" in table(result)


def test_each_policy_on_its_own_node_and_every_baseline(logs: Path) -> None:
    """The baseline calibrated on its own run (its switches, steps, prefills), the charged
    baseline paying its load path, static multiplexing holding what fits its instances;
    aegaeon's ratio to each."""
    aegaeon_dir, _, _ = _live(logs, "aegaeon")
    baseline_dir, baseline_live, num_requests = _live(logs, "request-level")
    inputs = {
        "logs": str(logs), "calibration_trace": f"{aegaeon_dir}/trace.jsonl",
        "calibration_config": f"{aegaeon_dir}/run/config.yaml",
        "calibration": {"request-level": {"trace": f"{baseline_dir}/trace.jsonl",
                                          "config": f"{baseline_dir}/run/config.yaml"}},
        "plan": {"load_s": 10.0, "grace_s": 30.0, "min_requests": 0}, "grid": [0.6, 1.2],
        "policies": ["aegaeon", "request-level", "request-level-charged", "static-mux"],
        "baseline": {"load_gb_s": 0.002, "init_s": 1.0},  # a slow load path: seconds
        "runs": {"request-level": [{"rps_per_model": 1.2, "slo_attainment": baseline_live}]},
    }  # fmt: skip
    result = predict(inputs)
    policies = result["policies"]
    own = policies["request-level"]["calibrated_on"]
    assert own["node"] == "request-level" and own["trace"] == "trace.jsonl"
    assert policies["aegaeon"]["calibrated_on"] == "probe"
    at = {p: {q["rps_per_model"]: q for q in e["points"]} for p, e in policies.items()}
    assert at["request-level"][1.2]["requests"] == num_requests
    assert at["request-level"][1.2]["measured"] == baseline_live
    for rate in (0.6, 1.2):  # seconds of load per scale-up: the charged baseline is worse
        assert at["request-level-charged"][rate]["predicted"] <= \
            at["request-level"][rate]["predicted"]
    assert set(result["ratios"]) == {"request-level", "request-level-charged", "static-mux"}
    assert result["ratio"] == result["ratios"]["request-level-charged"]
