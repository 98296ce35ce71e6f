"""The ``scripts/gpu-check --dry-run`` tests' run of the script and check of what it left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]


def dry_run(out: Path, *args: str,
            timeout_s: int) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:  # fmt: skip
    """``scripts/gpu-check ARGS --dry-run --out OUT`` with this interpreter: the finished
    process and its JSON summary (``steps`` keyed by name)."""
    env = dict(os.environ, AEGAEON_PYTHON=sys.executable)
    env.pop("OUT", None)
    argv = ["bash", str(ROOT / "scripts" / "gpu-check"), *args, "--dry-run", "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s,
                          check=False)  # fmt: skip
    summary = json.loads((out / "gpu-check.json").read_text())
    summary["steps"] = {s["name"]: s for s in summary["steps"]}
    return proc, summary


def assert_work_gone(stdout: str, *also: str) -> None:
    """The run's work folder (its ``work in`` line) is gone and nothing of it, nor of
    ``also``, runs."""
    work = next(line.split(" work in ")[1].strip() for line in stdout.splitlines()
                if " work in " in line)  # fmt: skip
    assert not Path(work).exists()
    running = [p.info for p in psutil.process_iter(["pid", "cmdline"])
               if any(w in part for w in (work, *also) for part in p.info["cmdline"] or [])]
    assert running == []
