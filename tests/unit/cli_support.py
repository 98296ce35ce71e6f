"""Shared helpers of the command-line and config tests: small markets written by hand,
and the parsed ``aegaeon serve`` arguments."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def index_market(market: Path, names: tuple[str, ...] = ("a", "b")) -> Path:
    """A market whose ``market.json`` names ``names`` (each in a folder of its name, never
    read): enough for a config to name its models."""
    market.mkdir()
    models = [{"name": n, "path": n} for n in names]
    (market / "market.json").write_text(json.dumps({"seed": 0, "models": models}))
    return market


def config_market(market: Path, configs: dict[str, dict[str, Any]]) -> Path:
    """Real-shaped models, their config.json only (sizing and plans read no weights)."""
    entries = []
    for model, config in configs.items():
        (market / model).mkdir(parents=True)
        (market / model / "config.json").write_text(json.dumps(config))
        entries.append({"name": model, "path": model, "dtype": "bfloat16", "params": 1})
    (market / "market.json").write_text(json.dumps({"models": entries}))
    return market


def serve_args(config: Path | None, **flags: object) -> argparse.Namespace:
    """``aegaeon serve``'s parsed arguments: ``--config config`` and ``flags``."""
    base: dict[str, object] = {"config": config, "market": None, "api_key": [],
                               "api_key_file": [], "admin_key": [], "admin_key_file": [],
                               "host": None, "port": None,
                               "policy": None, "run_dir": None, "gpus": None,
                               "device_memory": None, "tp": None}  # fmt: skip
    return argparse.Namespace(**{**base, **flags})
