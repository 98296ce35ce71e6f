"""``scripts/gpu-check --scenario paper --dry-run``: the paper scenario on the CPU, offline.

Tiny versions of the real presets are added as in-memory entries, one probe
runs, the simulator calibrated on it picks each policy's rate, every policy
(aegaeon, request-level-charged, request-level, static-mux) serves them on
nodes capped with ``--device-memory``, the runs interleaved rate by rate, and
the JSON carries the whole ``paper`` section: every policy's runs with
attainment in [0, 1], a sustainable rate or the reason there is none,
aegaeon's ratio to each, what a switch cost each (the charged baseline's
charge recorded), and the simulator calibrated on each policy's own node
beside each measured run. Behaviour only: the CPU's numbers say nothing about
the GPU's (nor how fast this machine is).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from gpu_check_support import assert_work_gone, dry_run

POLICIES = ("aegaeon", "request-level-charged", "request-level", "static-mux")
MAX_FILES = 8  # what the device tool brings back from one run


def test_paper_dry_run_measures_every_policy(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # one second of arrivals per rate (the dry run's default is 4): what is checked is that
    # every policy runs and is recorded, which the plan's least requests per run give
    proc, summary = dry_run(out, "--scenario", "paper", "--paper-load-s", "1", timeout_s=900)
    console = proc.stdout + proc.stderr
    steps = summary["steps"]
    names = list(steps)
    assert names[:3] == ["install", "paper_models", "paper_plan"], names
    assert names[-2:] == ["paper_predict", "leaks"], names
    nodes = [n for n in names if n not in ("install", "paper_models", "paper_plan",
                                           "paper_predict", "leaks")]  # fmt: skip
    assert nodes[0] == "paper_aegaeon"  # the probe's node
    started = {n.rsplit("-", 1)[0] if n.rsplit("-", 1)[-1].isdigit() else n for n in nodes}
    assert started == {f"paper_{p}" for p in POLICIES}, names
    failed = {n: s["error"] for n, s in steps.items() if s["status"] not in ("ok", "skipped")}
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    assert proc.returncode == 0 and summary["ok"], console[-3000:]
    assert summary["scenario"] == "paper" and summary["dry_run"]

    paper = summary["paper"]
    assert paper["slo"]["scaled"]  # the dry run says how its SLO and lengths differ
    assert paper["policies"] == list(POLICIES)
    assert paper["models_per_gpu"] == len(paper["models"]) >= 2
    seeds = [m["seed"] for m in paper["models"]]
    assert len(set(seeds)) == len(seeds)  # in-memory entries, a seed of their own each
    assert paper["instances"]["device"] == "cpu"
    assert paper["device_memory_cap_bytes"] > 2 * max(m["bytes"] for m in paper["models"])
    grid = paper["grid_rps_per_model"]
    assert grid and all(r > 0 for r in grid) and paper["capacity"]["probe_status"] == "ok"
    plan = paper["rate_plan"]
    assert set(plan["predicted"]) == set(POLICIES) and not plan["left_out"]
    order = [tuple(o) for o in plan["order"]]
    assert [r for _, r in order] == sorted(r for _, r in order)  # interleaved rate by rate
    for policy in POLICIES:
        runs = paper["runs"][policy]
        assert runs, f"{policy}: no run\n{console[-3000:]}"
        assert {f"{r['rps_per_model']:.4g}" for r in runs} == set(paper["attainment"][policy])
        for run in runs:
            assert run["rps_per_model"] in grid
            assert run["bench_status"] == "ok"
            attainment = run["slo_attainment"]
            assert (attainment is None and run["why"]) or 0.0 <= attainment <= 1.0
            assert run["requests"] >= run["completed"] >= 0
            assert run["switch"]["records"] >= 0 and run["memory"]["model_cache"]["models"]
            assert run["node"].startswith(f"paper_{policy}")
        sustainable = paper["sustainable"][policy]
        assert sustainable["kind"] in ("interpolated", "at_least", "below", None)
        assert isinstance(sustainable["rps_per_model"], float) or sustainable["reason"]
    switches = paper["switches"]
    assert switches["request-level-charged"]["charged_s"] > 0  # its load path, recorded
    assert switches["request-level"]["charged_s"] == switches["aegaeon"]["charged_s"] == 0
    assert set(paper["ratios"]) == set(POLICIES) - {"aegaeon"}
    ratio = paper["ratio"]
    assert isinstance(ratio["value"], float) or ratio["reason"]

    # the simulator, calibrated on each policy's own node, beside every measured run
    predicted = paper["predicted"]
    for policy in POLICIES:
        entry = predicted["policies"][policy]
        assert entry["calibrated_on"]["node"] == policy
        points = {p["rps_per_model"]: p for p in entry["points"]}
        assert all(0.0 <= p["predicted"] <= 1.0 for p in points.values())
        for run in paper["runs"][policy]:
            assert points[run["rps_per_model"]]["measured"] == run["slo_attainment"]
        assert "kind" in entry["sustainable"]

    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu-check-logs.tar.gz", "gpu-check.json"] and len(files) <= MAX_FILES
    with tarfile.open(out / "gpu-check-logs.tar.gz") as tar:
        members = tar.getnames()
    assert "logs/paper_aegaeon-run/proxy.log" in members
    assert any(n.startswith("logs/paper_request-level-charged-r0-trace.jsonl") for n in members)
    assert "paper:" in proc.stdout and "sustainable at 90%" in proc.stdout
    assert "simulated:" in proc.stdout
    assert_work_gone(proc.stdout)
