"""``aegaeon serve --gpus all`` on a machine without a CUDA GPU: one clear line, exit 2,
nothing started (the parse and plan stage only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def test_serve_with_gpus_on_a_cpu_machine_says_so(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: --gpus all would serve")
    from aegaeon_market.presets import preset_config, preset_named

    (tmp_path / "m").mkdir()
    config = preset_config(preset_named("llama-3.2-1b"), "bfloat16")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    deployment = tmp_path / "deployment.yaml"
    deployment.write_text(yaml.safe_dump({"models": [{"name": "m", "path": "m"}]}))
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "aegaeon_cli.main", "serve", "--config", str(deployment),
         "--run-dir", str(run_dir), "--gpus", "all"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("aegaeon serve: --gpus: no CUDA GPU visible to torch")
    assert "run without --gpus to serve on the CPU" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == "" and not run_dir.exists()
