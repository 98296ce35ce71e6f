"""``aegaeon sim`` through the console-script table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from aegaeon_cli.main import main


def test_cli_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, aegaeon_sim.cli;"
        "print(sorted(m for m in ('matplotlib', 'numpy', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_figure_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # two points at once, each in a process of its own (the sweep's pool); 10 s of arrivals
    # give each point its attainment (the plumbing checked here, not the figure's values)
    argv = ["sim", "--figure", "11a", "--points", "16,24", "--policies", "aegaeon,static-mux",
            "--duration", "10", "--jobs", "2", "--json", "--quiet",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["figure"] == "11a"
    assert set(summary["max_models_at_90"]) == {"aegaeon", "static-mux"}
    assert summary["points"]["aegaeon"][0][0] == 16.0
    assert Path(summary["png"]).is_file() and Path(summary["png"]).stat().st_size > 10_000


def test_multi_panel_figure_nests_by_panel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # one point per panel: in this process (a pool would start anew for each panel); 10 s
    # of arrivals give each its attainment (the nesting is checked, not the values)
    argv = ["sim", "--figure", "13", "--points", "8", "--policies", "aegaeon",
            "--duration", "10", "--jobs", "1", "--json", "--quiet",
            "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["max_models_at_90"]) == {"slo0.5", "slo0.3", "slo0.2"}


def test_theorem_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --duration bounds the served run (default 1200 s; 30 s of arrivals finish dozens of
    # requests, all the range check below reads); the cases keep their 20,000 s
    argv = ["sim", "--theorem", "--duration", "30", "--json", "--out", str(tmp_path)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["horizon_s"] == 20000.0 and len(summary["cases"]) == 5
    for case in summary["cases"]:
        assert abs(case["rel_error"]) < 0.03
    served = summary["served"]
    assert served["num_models"] == 40 and 0 < served["simulated"] <= 40
    assert Path(summary["png"]).is_file()


def test_single_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "--policy", "request-level", "--models", "8", "--rps", "0.2",
            "--duration", "30", "--json"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["report"]["attainment"] == 1.0


def _scenario(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    base = ["sim", "--policy", "aegaeon", "--models", "4", "--rps", "0.1", "--duration", "10"]
    assert main([*base, *argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    scenario: dict[str, object] = summary["scenario"]
    return scenario


def test_planner_and_baseline_switch_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from aegaeon_sched import ROUND_TTFT_FRACTION
    from aegaeon_sim import cli
    from aegaeon_sim.runner import SLLM_SWITCH_BYTES_PER_S

    assert cli.ROUND_TTFT_FRACTION == ROUND_TTFT_FRACTION
    assert cli.SLLM_SWITCH_GBPS * 1e9 == SLLM_SWITCH_BYTES_PER_S
    default = _scenario([], capsys)
    assert default["round_ttft_fraction"] == ROUND_TTFT_FRACTION
    assert default["fresh_first"] is False
    assert default["baseline_switch_bytes_per_s"] == SLLM_SWITCH_BYTES_PER_S
    paper = _scenario(["--paper", "--fresh-first", "--round-ttft-fraction", "0.3"], capsys)
    assert paper["round_ttft_fraction"] is None and paper["fresh_first"] is False
    tuned = _scenario(["--round-ttft-fraction", "0.3", "--fresh-first"], capsys)
    assert tuned["round_ttft_fraction"] == 0.3 and tuned["fresh_first"] is True
    assert _scenario(["--round-ttft-fraction", "none"], capsys)["round_ttft_fraction"] is None
    assert default["hybrid_prefill"] is False
    assert _scenario(["--hybrid-prefill"], capsys)["hybrid_prefill"] is True
    eq4 = _scenario(["--baseline-switch-gbps", "eq4"], capsys)
    assert eq4["baseline_switch_bytes_per_s"] is None


def test_the_paper_scenario_plays_every_served_policy(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:  # fmt: skip
    """``aegaeon sim --scenario paper``: the one-device scenario with ``aegaeon serve``'s
    policy names, on one grid, the same requests at each rate; the rates a live run would
    measure for each."""
    from aegaeon_common.config import POLICIES as SERVED

    argv = ["sim", "--scenario", "paper", "--paper-load-s", "20", "--paper-grace-s", "10",
            "--points", "0.01,0.04,0.2", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    policies = summary["prediction"]["policies"]
    assert set(policies) == {"aegaeon", "request-level-charged", "request-level",
                             "static-mux"} and set(policies) <= set(SERVED)  # fmt: skip
    for policy, entry in policies.items():
        points = [p["rps_per_model"] for p in entry["points"]]
        assert points == [0.01, 0.04, 0.2]
        assert all(0.0 <= p["predicted"] <= 1.0 for p in entry["points"])
        assert summary["plan"][policy]["rates"], policy
    requests = {p: [q["requests"] for q in e["points"]] for p, e in policies.items()}
    assert len({tuple(r) for r in requests.values()}) == 1  # the same requests at each rate
    # static multiplexing places two models per instance: half of the eight are refused
    assert max(p["predicted"] for p in policies["static-mux"]["points"]) < 0.6
    assert "request-level-charged" in out and "sustainable at 90%" in out


def test_the_paper_scenario_refuses_bad_values_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, word in ((["--policies", "aegaeon,nope"], "nope"),
                       (["--load-gb-s", "0"], "--load-gb-s"),
                       (["--init-s", "-1"], "--init-s")):  # fmt: skip
        with pytest.raises(SystemExit) as info:
            main(["sim", "--scenario", "paper", *argv])
        said = (str(info.value) if info.value.code != 2 else capsys.readouterr().err).strip()
        assert word in said and "\n" not in said, said
