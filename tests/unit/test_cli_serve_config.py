"""`aegaeon serve --config FILE`: what the flags add to the file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from aegaeon_cli.serve import _effective_config
from aegaeon_common.config import ConfigError


def _args(config: Path, **flags: object) -> argparse.Namespace:
    base: dict[str, object] = {"config": config, "market": None, "api_key": [],
                               "api_key_file": [], "admin_key": [], "admin_key_file": [],
                               "host": None, "port": None,
                               "policy": None, "run_dir": None, "gpus": None}  # fmt: skip
    return argparse.Namespace(**{**base, **flags})


def test_market_flag_completes_a_config_without_models(tmp_path: Path) -> None:
    market = tmp_path / "market"
    market.mkdir()
    models = [{"name": "a", "path": "a"}, {"name": "b", "path": "b"}]
    (market / "market.json").write_text(json.dumps({"seed": 0, "models": models}))
    path = tmp_path / "c.yaml"
    path.write_text("proxy: {admission_max_wait: 60}\n")
    config, raw, plan = _effective_config(_args(path, market=market, run_dir=tmp_path / "run"))
    assert config.model_names == ("a", "b") and plan is None
    assert config.proxy.admission_max_wait_s == 60.0 and raw["market"] == str(market.resolve())
    # without --market the file alone must name its models, and the error says where
    with pytest.raises(ConfigError, match=r"c\.yaml.*models"):
        _effective_config(_args(path))
