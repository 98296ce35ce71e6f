"""``scripts/gpu-check --dry-run``: the GPU check's whole sequence on the CPU, offline.

Proves the plumbing the one GPU run depends on: every step runs and is
recorded with a status, the JSON and the log archive are written, and
nothing is left running or mapped afterwards.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
from gpu_check_support import assert_work_gone, dry_run
from market_support import market_cache

STEPS = ["install", "imports", "probe", "market", "gpu_tests", "namespaces", "tensor_parallel",
         "bench_engine", "bench_switch", "fp8_model", "fp8_switch", "serve", "leaks"]  # fmt: skip
STATUSES = {"ok", "failed", "timeout", "error", "skipped"}


@pytest.fixture(scope="session")
def small_market(pytestconfig: pytest.Config) -> Path:
    """Where the dry run keeps its small market across sessions (it builds it if missing)."""
    return market_cache(pytestconfig) / "gpu-check-small"


def test_dry_run_records_every_step_and_leaves_nothing(tmp_path: Path,
                                                       small_market: Path) -> None:
    out = tmp_path / "out"
    proc, summary = dry_run(out, "--market", str(small_market), timeout_s=450)
    console = proc.stdout + proc.stderr
    steps = summary["steps"]
    assert list(steps) == STEPS, console[-3000:]
    for step in steps.values():
        assert step["status"] in STATUSES
        assert isinstance(step["duration_s"], float | int)
    failed = {n: s["error"] for n, s in steps.items() if s["status"] not in ("ok", "skipped")}
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    assert proc.returncode == 0, console[-3000:]
    assert summary["dry_run"] and summary["device"] == "cpu" and summary["ok"]

    # each step's results are there, parsed
    assert steps["gpu_tests"]["results"]["files"]
    if steps["namespaces"]["status"] == "ok":  # (skipped where not root: no namespaces)
        counts = steps["namespaces"]["results"]["counts"]
        assert counts["device"] == "cpu" and counts["failed_frees"] == 0, counts
        assert counts["blocks_freed_now"] + counts["blocks_freed_after_event"] > 0
    assert steps["bench_engine"]["results"]["device"] == "cpu"
    assert steps["bench_switch"]["results"]["memcpy"] == "host memcpy"
    serve = steps["serve"]["results"]
    # a slower CPU's node may refuse a request past its measured admission bound (429):
    # the only failure allowed
    bench = serve["bench"]
    assert bench["requests"] > 0 and bench["completed"] > 0
    assert bench["failed"] == bench["refused"], bench
    assert serve["leaked_processes"] == [] and serve["leaked_shm"] == []
    assert summary["highlights"]["serve"]["completed"] == serve["bench"]["completed"]

    with tarfile.open(out / "gpu-check-logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/serve-run/proxy.log" in names and "logs/gpu-tests.xml" in names

    assert_work_gone(proc.stdout, str(out))
