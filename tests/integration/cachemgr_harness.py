"""Helpers for the cachemgr integration tests: tiny checkpoints, configs, the process.

Checkpoints are made once per test process with transformers (LlamaConfig +
save_pretrained) in a private temporary directory removed at exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from aegaeon_common.config import Config, load_config
from aegaeon_common.process import is_ready

START_TIMEOUT_S = 60.0


@cache
def _checkpoint_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="aegaeon-test-ckpt-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@cache
def checkpoint(
    seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = 256, intermediate: int = 128
) -> Path:
    """A tiny random Llama checkpoint in bfloat16 (read-only: copy it to break it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = _checkpoint_root() / f"llama-{seed}-{hidden}-{layers}-{vocab}-{intermediate}"
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).bfloat16().save_pretrained(path)
    return path


def write_config(tmp: Path, models: dict[str, Path], dtype: str = "bfloat16",
                 market: Path | None = None, **cache: Any) -> Path:  # fmt: skip
    """A deployment YAML with a run dir under ``tmp``; ``cache`` goes to ``cachemgr:``;
    ``market``: the market whose ``market.json`` records the models' files."""
    section = {
        "model_cache": "64MiB",
        "kv_cache": "8MiB",
        "slab": "1MiB",
        "prewarm": [],
        "event_slots": 64,
        **cache,
    }
    raw = {
        "models": [{"name": n, "path": str(p)} for n, p in models.items()],
        "dtype": dtype,
        "run_dir": str(tmp / "run"),
        "cachemgr": section,
        **({"market": str(market)} if market is not None else {}),
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def shm_segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


class CacheMgrProcess:
    """``aegaeon cachemgr --config FILE`` as a child process."""

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.config: Config = load_config(config_path)
        self.log_path = config_path.parent / "cachemgr.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def prefix(self) -> str:
        return f"{self.config.shm_prefix}-"

    def start(self) -> CacheMgrProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "aegaeon_cli.main",
                    "cachemgr",
                    "--config",
                    str(self.config_path),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not is_ready(self.config.run_dir, "cachemgr", self.proc.pid):
            if self.proc.poll() is not None:
                raise RuntimeError(f"cachemgr exited {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cachemgr not ready: {self.log()}")
            time.sleep(0.02)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def __enter__(self) -> CacheMgrProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
