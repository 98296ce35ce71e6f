"""The simulator against the live system on a small case (issue "measure", item 4).

`aegaeon serve` (one hybrid prefill + one decode instance, policy aegaeon) on
a 4-model small market, driven by `aegaeon bench serve` with the planner's
SLO equal to the scoring SLO; then `aegaeon sim --replay` of its trace (the
same requests, the instances' start-up profiles, the costs measured from the
run's own records; see bench/aegaeon_bench/sim/replay.py) must land within
5 points of the live attainment.

The case: 4 models x 0.6 RPS for 25 s, ShareGPT lengths x 0.5, TTFT 1 s /
TBT 10 ms (about 3x this node's warm decode step). A lighter case is 100%
in both (trivial); a heavier one (every model active all the time) is chaotic
on two cores: which instance a model's batch lands on flips with
milliseconds and sticks, and single live runs of the same workload then
differ by 10+ points from each other. This one keeps two to four models
active, so the decode rounds, the learned switch estimates, the hybrid's
preemptions and the decode-share placement all matter, and attainment sits
well below 100% (typically 70-90%) while repeated live runs agree within a
few points (docs/sim-vs-live.md). The simulated attainment is the mean of
5 replays (measured per-request arrival lags, then shuffled).

About 60 s: ~12 s to start (the instances profile themselves), 25 s of
arrivals plus the drain, ~10 s of replays.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from aegaeon_bench.sim.replay import load_case
from aegaeon_bench.sim.replay_run import replay
from aegaeon_bench.sim_check import LiveCase, run_bench, write_serve_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from serve_harness import shm_segments, start_serve, stop_serve

NUM_MODELS = 4
CASE = LiveCase(
    policy="aegaeon", models=NUM_MODELS, rps=0.6, ttft_s=1.0, tbt_s=0.01, scale=0.5,
    duration_s=25.0, seed=3, grace_s=20.0,
)  # fmt: skip
TOLERANCE_POINTS = 5.0


@pytest.fixture(scope="module")
def small_market(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from aegaeon_market import ensure_market

    market = tmp_path_factory.mktemp("market")
    ensure_market(market, num_models=NUM_MODELS, profile="small", progress=False)
    return market


@pytest.mark.timeout(240)
def test_replay_matches_live_attainment(small_market: Path, tmp_path: Path) -> None:
    out = tmp_path / "case"
    config = write_serve_config(small_market, CASE, out)
    run_dir = out / "run"
    served = start_serve(small_market, run_dir, "--config", str(config), "--policy", CASE.policy)
    trace = out / "trace.jsonl"
    try:
        run_bench(served.url, small_market, CASE, trace)
    finally:
        survivors = stop_serve(served)
    assert served.proc.returncode == 0, served.log_tail()
    assert not survivors, f"processes outlived aegaeon serve: {survivors}"
    assert not shm_segments(run_dir), f"shared memory left: {shm_segments(run_dir)}"

    result = replay(load_case(trace, serve_config=run_dir / "config.yaml"))
    assert result.workload.startswith("identical"), result.workload
    spec = result.case.spec
    assert (spec.policy, spec.num_prefill, spec.num_decode) == ("aegaeon", 1, 1)
    assert spec.hybrid_prefill and spec.planner_slo.tbt_s == CASE.tbt_s
    live, sim = result.live.attainment, result.sim_attainment
    report = (f"live {100 * live:.1f}% sim {100 * sim:.1f}% "
              f"(replicas {[round(100 * r.attainment, 1) for r in result.sims]}), "
              f"costs {spec.costs.describe()}")  # fmt: skip
    print(report)
    assert result.live.num_failed == 0, report
    assert abs(result.diff_points) <= TOLERANCE_POINTS, report
