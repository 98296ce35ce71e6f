"""``aegaeon bench switch`` on two tiny checkpoints: structure and sanity, not speed.

One run of the whole command (a real cachemgr process, a worker built from a
Config, cold-worker processes) with minimal repetitions; the speed targets
live in the benchmark, not here.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from aegaeon_bench.switch import rig as switch_rig
from aegaeon_cli.main import main
from aegaeon_common.config import Config, ModelConfig
from aegaeon_engine import ModelSpec, weight_layout
from aegaeon_gpumem import list_segments
from cachemgr_harness import checkpoint

SUMMARY_KEYS = {
    "load_over_memcpy", "naive_over_ours", "vllm_over_ours", "switch_ms", "switch_ms_prefetch",
    "prefetch_hidden_fraction", "kv_fragmentation", "kv_fragmentation_max", "check", "models",
    "targets", "targets_met",
}  # fmt: skip
ROW_KEYS = {
    "nbytes", "scale_up_ms", "copy_ms", "memcpy_ms", "load_over_memcpy", "first_scale_up_ms",
    "bind_ms", "engine_bind_ms", "switch_off", "switch_on", "cold_worker_s", "naive_over_ours",
    "prefetch_hidden_fraction",
}  # fmt: skip


def _market(root: Path) -> dict[str, Path]:
    """A two-model market of tiny checkpoints of different KV shapes."""
    models = {"tiny-a": checkpoint(0), "tiny-b": checkpoint(1, hidden=128, layers=3)}
    root.mkdir()
    entries = [{"name": n, "path": str(p), "arch": "LlamaForCausalLM", "params": 0,
                "dtype": "bfloat16"} for n, p in models.items()]  # fmt: skip
    (root / "market.json").write_text(json.dumps({"seed": 0, "models": entries}))
    return models


def test_switch_bench_json_and_sanity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    models = _market(tmp_path / "market")
    run_root = tmp_path / "rig"
    run_root.mkdir()
    # A known run directory, so the test can name the run's shared memory.
    monkeypatch.setattr(switch_rig, "make_run_root", lambda: run_root)
    config = Config(models=(ModelConfig("x", Path(".")),), run_dir=run_root / "run")
    prefix = f"{config.shm_prefix}-"
    # Other tests of this worker may hold session-wide children (a redis-server).
    before = set(psutil.Process().children(recursive=True))

    code = main([
        "bench", "switch", "--market", str(tmp_path / "market"), "--repeats", "2",
        "--switch-repeats", "1", "--slice-ms", "20", "--kv-ops", "60", "--cold-repeats", "1",
        "--context", "64", "--no-vllm", "--no-transformers", "--json",
    ])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert set(summary) >= SUMMARY_KEYS
    assert set(summary["models"]) == set(models) == set(summary["switch_ms"])
    for name, row in summary["models"].items():
        assert set(row) >= ROW_KEYS
        # a scale-up copies exactly the packed layout (the Model Cache region)
        assert row["nbytes"] == weight_layout(ModelSpec.from_dir(models[name]),
                                              "bfloat16").total_bytes
        assert row["scale_up_ms"] > 0 and row["memcpy_ms"] > 0 and row["load_over_memcpy"] > 0
        assert row["cold_worker_s"] > 0 and row["naive_over_ours"] > 0
        assert row["switch_off"]["prefetched_share"] == 0.0
        assert row["switch_on"]["prefetched_share"] == 1.0
        assert row["switch_off"]["total_ms"] >= row["switch_off"]["scale_up_ms"] > 0
    # A -> B -> A: the arena holds the Model Cache's bytes, the tokens a fresh engine's
    assert summary["check"]["bytes_equal"] and summary["check"]["tokens_equal"]
    assert 0.0 <= summary["kv_fragmentation"] <= summary["kv_fragmentation_max"] <= 1.0
    assert summary["vllm_over_ours"] is None
    assert summary["prefetch_hidden_fraction"] <= 1.0  # tiny models: may be < 0 (noise)
    # nothing left behind: no shared memory of the run, no child process
    assert list_segments(prefix) == []
    assert set(psutil.Process().children(recursive=True)) - before == set()
