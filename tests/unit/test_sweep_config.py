"""The sweep's nodes plan for the SLO the sweep scores with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from aegaeon_bench.node.launch import slo_config
from aegaeon_common.config import ConfigError, load_config


def test_default_config_gets_the_scoring_slo(default_market: Path, tmp_path: Path) -> None:
    path = slo_config(default_market, None, 1.5, 0.01, tmp_path)
    config = load_config(path)
    assert (config.slo.ttft_s, config.slo.tbt_s) == (1.5, 0.01)
    assert config.market_dir == default_market


def test_given_config_keeps_its_deployment(default_market: Path, tmp_path: Path) -> None:
    first = slo_config(default_market, None, 10.0, 0.1, tmp_path / "a")
    raw = yaml.safe_load(first.read_text())
    raw["decode"]["instances"] = 3
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(raw))
    config = load_config(slo_config(default_market, given, 2.0, 0.025, tmp_path / "b"))
    assert config.decode.instances == 3
    assert (config.slo.ttft_s, config.slo.tbt_s) == (2.0, 0.025)
    assert yaml.safe_load(given.read_text())["slo"]["ttft_s"] == 10.0  # the user's file untouched


def test_config_that_is_not_a_mapping(default_market: Path, tmp_path: Path) -> None:
    given = tmp_path / "list.yaml"
    given.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: <top>: must be a mapping"):
        slo_config(default_market, given, 1.0, 0.01, tmp_path / "out")
