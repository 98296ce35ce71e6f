"""``scripts/gpu-check --scenario paper --dry-run``: the paper scenario on the CPU, offline.

Tiny versions of the real presets are written, both policies serve them on
one node each, and the JSON carries the whole ``paper`` section: every
policy's runs with attainment in [0, 1], a sustainable rate or the reason
there is none, their ratio, switches and memory, and the simulator's
prediction beside each measured run. Behaviour only: the CPU's
numbers say nothing about the GPU's (nor how fast this machine is).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["install", "paper_models", "paper_aegaeon", "paper_request-level", "paper_predict",
         "leaks"]
POLICIES = ("aegaeon", "request-level")
MAX_FILES = 8  # what the device tool brings back from one run


def test_paper_dry_run_measures_both_policies(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, AEGAEON_PYTHON=sys.executable)
    env.pop("OUT", None)
    argv = ["bash", str(ROOT / "scripts" / "gpu-check"), "--scenario", "paper", "--dry-run",
            "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=330,
                          check=False)
    console = proc.stdout + proc.stderr
    summary = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert [s for s in steps if s in STEPS] == STEPS, console[-3000:]
    failed = {n: s["error"] for n, s in steps.items() if s["status"] not in ("ok", "skipped")}
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    assert proc.returncode == 0 and summary["ok"], console[-3000:]
    assert summary["scenario"] == "paper" and summary["dry_run"]

    paper = summary["paper"]
    assert paper["slo"]["scaled"]  # the dry run says how its SLO and lengths differ
    assert paper["models_per_gpu"] == len(paper["models"]) >= 2
    assert paper["instances"]["device"] == "cpu"
    ladder = paper["ladder_rps_per_model"]
    assert ladder and all(r > 0 for r in ladder) and paper["capacity"]["probe_status"] == "ok"
    for policy in POLICIES:
        runs = paper["runs"][policy]
        assert runs, f"{policy}: no run\n{console[-3000:]}"
        assert {f"{r['rps_per_model']:.4g}" for r in runs} == set(paper["attainment"][policy])
        for run in runs:
            assert run["rps_per_model"] in ladder
            assert run["bench_status"] == "ok"
            attainment = run["slo_attainment"]
            assert (attainment is None and run["why"]) or 0.0 <= attainment <= 1.0
            assert run["requests"] >= run["completed"] >= 0
            assert run["switch"]["records"] >= 0 and run["memory"]["model_cache"]["models"]
        sustainable = paper["sustainable"][policy]
        assert sustainable["kind"] in ("interpolated", "at_least", "below", None)
        assert isinstance(sustainable["rps_per_model"], float) or sustainable["reason"]
        assert paper["switches"][policy]["switches"] >= 0
    # each policy starts where the probe puts its crossing: aegaeon above the baseline
    assert paper["runs"]["aegaeon"][0]["rps_per_model"] > \
        paper["runs"]["request-level"][0]["rps_per_model"]
    ratio = paper["ratio"]
    assert isinstance(ratio["value"], float) or ratio["reason"]

    # the simulator, calibrated on the aegaeon node, beside every measured run
    predicted = paper["predicted"]
    assert predicted["calibration"]["node"] == "aegaeon"
    for policy in POLICIES:
        points = {p["rps_per_model"]: p for p in predicted["policies"][policy]["points"]}
        assert set(ladder) <= set(points)
        assert all(0.0 <= p["predicted"] <= 1.0 for p in points.values())
        for run in paper["runs"][policy]:
            assert points[run["rps_per_model"]]["measured"] == run["slo_attainment"]
        assert "kind" in predicted["policies"][policy]["sustainable"]

    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu-check-logs.tar.gz", "gpu-check.json"] and len(files) <= MAX_FILES
    with tarfile.open(out / "gpu-check-logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/paper_aegaeon-run/proxy.log" in names
    assert any(n.startswith("logs/paper_request-level-r0-trace.jsonl") for n in names)
    assert "paper:" in proc.stdout and "sustainable at 90%" in proc.stdout
    assert "simulated:" in proc.stdout

    work = next(line.split(" work in ")[1].strip() for line in proc.stdout.splitlines()
                if " work in " in line)
    assert not Path(work).exists()
    running = [p.info for p in psutil.process_iter(["pid", "cmdline"])
               if any(work in part for part in p.info["cmdline"] or [])]
    assert running == []
