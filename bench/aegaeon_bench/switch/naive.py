"""The naive switch paths, timed from outside: cold worker, vLLM engine start, transformers.

- cold worker (``switch_cold.py``): spawn -> first token of a fresh process
  that imports, builds our engine and loads the weights from disk;
- vLLM engine start (the engine bench's ``vllm_peer.py`` under
  ``--vllm-python``): spawn -> first token of a fresh ``vllm.LLM`` for the model
  (one model per server is how vLLM switches);
- transformers ``from_pretrained`` in this (warm) process, for reference.

The checkpoints are in the page cache by then (the cachemgr read them), so
"from disk" is the best case for the naive paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLD_TIMEOUT_S = 300.0
VLLM_TIMEOUT_S = 900.0
DEFAULT_VLLM_PYTHON = Path("/tmp/vllm-venv/bin/python")


@dataclass(frozen=True)
class Spawned:
    """Spawn -> first JSON line, seconds, and what the child printed."""

    seconds: float
    report: dict[str, Any]


def spawn_until_line(argv: list[str], stdin: str, timeout_s: float,
                     env: dict[str, str] | None = None) -> Spawned:
    """Start ``argv``, time until it prints a JSON object line, wait for it to exit.

    Other stdout lines (vLLM logs to stdout) are skipped; its stderr goes to a
    file, so a chatty child never blocks on a full pipe. RuntimeError (with
    the end of its output) if it fails or prints no JSON object.
    """
    with tempfile.TemporaryFile("w+") as errors:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=errors, text=True, env=env)
        watchdog = threading.Timer(timeout_s, proc.kill)  # a hung child ends the reads
        watchdog.start()
        report: dict[str, Any] | None = None
        seconds = 0.0
        skipped: list[str] = []
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(stdin)
            proc.stdin.close()
            for line in proc.stdout:
                report = _json_object(line)
                if report is not None:
                    seconds = time.perf_counter() - start
                    break
                skipped = [*skipped[-20:], line]
            proc.stdout.read()
            proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        errors.seek(0)
        err = errors.read()
    if proc.returncode != 0 or report is None:
        tail = (err.strip() or "".join(skipped).strip())[-1500:]
        raise RuntimeError(f"{argv[1:]} failed (exit {proc.returncode}, no JSON line): {tail}")
    return Spawned(seconds, report)


def _json_object(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def cold_worker(model_dir: Path, dtype: str) -> Spawned:
    """A fresh worker process producing the model's first token (our engine)."""
    argv = [sys.executable, "-m", "aegaeon_bench.switch.cold", str(model_dir), dtype]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return spawn_until_line(argv, "", COLD_TIMEOUT_S, env)


def vllm_python(requested: str | None, disabled: bool) -> str | None:
    """The vLLM interpreter: ``--vllm-python``, else the default venv if it exists."""
    if disabled:
        return None
    if requested:
        return requested
    return str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.exists() else None


def vllm_start(python: str, model_dir: Path, dtype: str, threads: int) -> Spawned:
    """A fresh vLLM engine for the model, until its first token."""
    script = Path(__file__).parents[1] / "engine" / "vllm_peer.py"
    work = json.dumps({"model": str(model_dir), "dtype": dtype, "threads": threads,
                       "cpus": f"0-{threads - 1}" if threads > 1 else "0"})
    return spawn_until_line([python, str(script)], work + "\n", VLLM_TIMEOUT_S)


def transformers_load(model_dir: Path, dtype: str) -> float:
    """Seconds of ``AutoModelForCausalLM.from_pretrained`` in this process (warm: call
    it once before timing, so imports and lazy initialisation are paid)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    seconds = time.perf_counter() - start
    del model
    return seconds


def transformers_available() -> bool:
    """True if transformers can be imported here."""
    import importlib.util

    return importlib.util.find_spec("transformers") is not None
