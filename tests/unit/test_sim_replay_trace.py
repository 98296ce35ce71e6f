"""A recorded live run replayed through the simulator gives exactly the recorded numbers.

``tests/data/replay-m6-r1.2.tgz`` holds the files of two live runs made with
``python -m aegaeon_sim.live_check --duration 10 --seed 3
aegaeon:6:1.2:1:0.01:0.5 request-level:6:1.2:1:0.01:0.5`` (6 models of the small
market at 1.2 RPS each, past both knees, so queueing, switches and the hybrid's
preemptions all act). The replay is deterministic (pure Python, seeded), so its
result is pinned: a change to the policies, the latency fit or the simulator
that moves it shows here and must update the numbers on purpose. Whether the
simulator agrees with a live run on *this* machine is a benchmark
(`python -m aegaeon_sim.live_check`, docs/results.md), not a test: live
attainment depends on the machine's speed and load.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from aegaeon_sim.replay import load_case
from aegaeon_sim.replay_run import replay

ARCHIVE = Path(__file__).resolve().parents[1] / "data" / "replay-m6-r1.2.tgz"
# live attainment as recorded; the simulator's mean over its 5 replicas (since the
# simulator runs the instances' own loops: aegaeon 0.956 -> 0.974, within its replicas'
# spread; request-level 0.765 -> 0.725, the live loop's turns and command reads,
# docs/results.md; aegaeon 0.97414 -> 0.97416 once a prefill message carried its
# group's place in the queue)
EXPECTED = {
    "aegaeon": (0.854578923147722, 0.9741555453290381),
    "request-level": (0.6781408191440405, 0.7245283018867925),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("replay")
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(out, filter="data")
    return out


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_recorded_run_replays_to_pinned_numbers(runs: Path, policy: str) -> None:
    (case_dir,) = runs.glob(f"{policy}-m6-*")
    result = replay(load_case(case_dir / "trace.jsonl"))
    assert result.workload.startswith("identical"), result.workload
    spec = result.case.spec
    assert (spec.policy, spec.num_prefill, spec.num_decode) == (policy, 1, 1)
    assert spec.hybrid_prefill == (policy == "aegaeon")
    live, sim = EXPECTED[policy]
    assert result.live.attainment == pytest.approx(live, abs=1e-12)
    assert result.sim_attainment == pytest.approx(sim, abs=1e-9)
    assert len(result.sims) == 5
