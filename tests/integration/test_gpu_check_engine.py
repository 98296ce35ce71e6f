"""``scripts/gpu-check --scenario engine --dry-run``: the engine scenario's plan on the CPU.

The same plan a GPU runs (gpu_check.engine: three big models and a small one,
batches 1/8/32, two equal-length contexts and a mixed batch, eager and on the
engine's graph path, the roofline, the kernels the profiler saw, greedy tokens
eager vs graphs, the FP8 wake, transformers beside it, the bounds) on tiny
models: every part runs and lands in the JSON's ``engine`` section, nothing is
left running. Its numbers are a CPU's: only their presence is checked.
"""

from __future__ import annotations

from pathlib import Path

from gpu_check_support import dry_run


def test_engine_dry_run_writes_its_section(tmp_path: Path) -> None:
    proc, summary = dry_run(tmp_path / "out", "--scenario", "engine", timeout_s=300)
    console = proc.stdout + proc.stderr
    steps = summary["steps"]
    assert list(steps) == ["install", "probe", "engine_bench", "fp8_switch", "leaks"], console
    assert steps["engine_bench"]["status"] == "ok", steps["engine_bench"].get("error")
    assert proc.returncode == 0 and summary["scenario"] == "engine", console[-3000:]
    engine = summary["engine"]
    assert engine["tiny"] and engine["device"] == "cpu" and engine["d2d_gb_s"] > 0
    assert set(engine["models"]) == {"llama-3.1-8b-bfloat16", "llama-3.1-8b-fp8",
                                     "llama-3.2-3b-bfloat16"}
    for name, model in engine["models"].items():
        assert len(model["decode"]) == 9, name  # batches 1/8/32 x 64, 256, mixed
        for row in model["decode"].values():
            assert row["eager_ms"] > 0 and row["graphs_ms"] > 0 and row["roofline_ms"] > 0
        assert model["greedy_equal"] is True, name
        assert model["small_after"]["ratio"] > 0 and model["prefill_tok_s"] > 0
        peer = engine["transformers"][name]
        assert {s.get("mode") for s in peer["shapes"].values()} <= {"eager-sdpa", "skipped"}
    assert engine["kernels"]["decode"] and engine["kernels"]["prefill"]
    assert engine["fp8_wake"]["wake_to_first_token_s"] > 0
    assert {t["what"].split(":")[0] for t in engine["targets"]}  # the bounds, judged
    assert summary["highlights"]["engine_bench"]["bounds"] == len(engine["targets"])
    # (new /dev/shm segments are not checked: other runs on a shared machine make theirs)
    assert steps["leaks"]["status"] == "ok" and steps["leaks"]["results"]["processes"] == []
