"""A deployment serves in the dtype its market stores (the greedy mismatch of issue 14).

A float32 checkpoint served through `aegaeon serve` ran in the config's default
bfloat16, so its greedy text drifted from transformers' float32 output after a
few tokens. Without an explicit ``dtype`` the market's dtype is served now.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aegaeon_cli.serve import default_config_dict
from aegaeon_common.config import config_from_dict, serving_dtype


def _market(tmp_path: Path, dtypes: list[str]) -> Path:
    market = tmp_path / "market"
    market.mkdir()
    models = [{"name": f"m{i}", "path": f"m{i}", "arch": "LlamaForCausalLM",
               "params": 1000 * (i + 1), "dtype": d} for i, d in enumerate(dtypes)]
    (market / "market.json").write_text(json.dumps({"seed": 0, "models": models}))
    return market


@pytest.mark.parametrize(
    ("dtypes", "served"),
    [
        (["float32"], "float32"),
        (["float32", "float32"], "float32"),
        (["bfloat16", "bfloat16"], "bfloat16"),
        (["float16"], "float16"),
        (["bfloat16", "float32"], "float32"),  # nothing served below its own precision
        (["bfloat16", "float16"], "float32"),
    ],
)
def test_market_dtype_is_served(tmp_path: Path, dtypes: list[str], served: str) -> None:
    market = _market(tmp_path, dtypes)
    assert config_from_dict({"market": str(market)}).dtype == served
    assert serving_dtype(dtypes) == served


def test_explicit_dtype_wins_and_no_record_means_bfloat16(tmp_path: Path) -> None:
    market = _market(tmp_path, ["float32"])
    assert config_from_dict({"market": str(market), "dtype": "bfloat16"}).dtype == "bfloat16"
    listed = {"models": [{"name": "a", "path": str(tmp_path / "a")}]}
    assert config_from_dict(listed).dtype == "bfloat16"
    assert serving_dtype([]) == "bfloat16"


def test_embedded_default_sizes_the_arena_in_the_served_dtype(tmp_path: Path) -> None:
    mixed = default_config_dict(_market(tmp_path, ["bfloat16", "float32"]), 8000)
    # the largest model (2000 params) in float32, twice, plus 16 MiB
    assert mixed["prefill"]["device_memory_bytes"] == 2 * 2000 * 4 + (16 << 20) + (256 << 20)


def test_an_entry_without_dtype_takes_its_checkpoints(tmp_path: Path) -> None:
    """A hand-written market.json entry: the checkpoint's config.json says float32."""
    market = tmp_path / "market"
    (market / "real").mkdir(parents=True)
    (market / "real" / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    (market / "market.json").write_text(json.dumps({"models": [{"name": "real",
                                                                "path": "real"}]}))
    assert config_from_dict({"market": str(market)}).dtype == "float32"
