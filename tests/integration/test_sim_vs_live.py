"""The simulator against the live system (issue "measure", item 4).

`aegaeon serve` (two workers: for aegaeon a prefill instance that decodes
when idle plus a decode instance, for request-level two unified ones) on a
small market, driven by `aegaeon bench serve` with the planner's SLO equal to the
scoring SLO; then `aegaeon sim --replay` of its trace (the same requests,
the instances' start-up profiles, the costs measured from the run's own
records; see bench/aegaeon_bench/sim/replay.py) must land within 5 points of
the live attainment.

Two cases at 0.6 RPS per model, ShareGPT lengths x 0.5, TTFT 1 s / TBT 10 ms
(about 4 warm decode steps), 25 s of arrivals, both just below their knee:

- aegaeon, 8 models (live 98.9-100%, simulated 99.9-100% over five runs; at
  9 models live 90-97% and simulated 1.6-7.5 points higher; 10 models 87-90%).
  Decode rounds, learned switch estimates, the hybrid's preemptions and the
  decode-share placement all act.
- request-level, 7 models (live 97.6-99.5%, simulated 0.4-1.6 points higher
  over three runs; at 8 models live 90.6-99.6% over twelve runs, once 5.9
  points under the simulation; 9 models ~63-83%, 10 ~30%, 12 ~15%): switching
  only between requests, and the queueing behind other models' requests it
  starts to cause.

Past the knee single live runs of the same workload differ from each other by
10 points or more (request-level at 9 models: 63% and 83%; which instance a
request is bound to flips with milliseconds, and every later decision follows),
and the simulator, which is right about the run's totals (engine, prefill and
loop seconds), lands 2-7 points above the live run there: docs/results.md
("The simulator against the live system"). So the test stays below the knee:
it guards the replay end to end and the agreement there, not the optimism
past the knee, which is documented.

The simulated attainment is the mean of 5 replays (measured per-request
arrival lags, then shuffled). About 40 s a case.
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

CASES = {
    "aegaeon-8": LiveCase(
        policy="aegaeon", models=8, rps=0.6, ttft_s=1.0, tbt_s=0.01, scale=0.5,
        duration_s=25.0, seed=3, grace_s=20.0,
    ),
    "request-level-7": LiveCase(
        policy="request-level", models=7, rps=0.6, ttft_s=1.0, tbt_s=0.01, scale=0.5,
        duration_s=25.0, seed=3, grace_s=20.0,
    ),
}  # fmt: skip
NUM_MODELS = max(case.models for case in CASES.values())
TOLERANCE_POINTS = 5.0


@pytest.fixture(scope="module")
def small_market(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from aegaeon_market import ensure_market

    market = tmp_path_factory.mktemp("market")
    ensure_market(market, num_models=NUM_MODELS, profile="small", progress=False)
    return market


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CASES))
def test_replay_matches_live_attainment(name: str, small_market: Path, tmp_path: Path) -> None:
    case = CASES[name]
    out = tmp_path / "case"
    config = write_serve_config(small_market, case, out)
    run_dir = out / "run"
    served = start_serve(small_market, run_dir, "--config", str(config), "--policy", case.policy)
    trace = out / "trace.jsonl"
    try:
        run_bench(served.url, small_market, case, trace)
    finally:
        survivors = stop_serve(served)
    assert served.proc.returncode == 0, served.log_tail()
    assert not survivors, f"processes outlived aegaeon serve: {survivors}"
    assert not shm_segments(run_dir), f"shared memory left: {shm_segments(run_dir)}"

    result = replay(load_case(trace, serve_config=run_dir / "config.yaml"))
    assert result.workload.startswith("identical"), result.workload
    spec = result.case.spec
    assert (spec.policy, spec.num_prefill, spec.num_decode) == (case.policy, 1, 1)
    assert spec.planner_slo.tbt_s == case.tbt_s
    assert spec.hybrid_prefill == (case.policy == "aegaeon")
    live, sim = result.live.attainment, result.sim_attainment
    report = (f"live {100 * live:.1f}% sim {100 * sim:.1f}% "
              f"(replicas {[round(100 * r.attainment, 1) for r in result.sims]}), "
              f"costs {spec.costs.describe()}")  # fmt: skip
    print(report)
    assert result.live.num_failed == 0, report
    assert abs(result.diff_points) <= TOLERANCE_POINTS, report
