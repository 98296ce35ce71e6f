"""``aegaeon bench engine --model`` takes a model of the market by name, or a directory."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from aegaeon_bench.engine.bench import _model_dir
from aegaeon_market import MarketError
from aegaeon_market.edit import add_model
from gguf import GGMLQuantizationType
from market_import_support import Tiny, hf_tensors, write_gguf


def test_market_name_or_directory(tmp_path: Path) -> None:
    source = tmp_path / "t.gguf"
    write_gguf(source, Tiny(), hf_tensors(Tiny()), GGMLQuantizationType.Q8_0)
    market = tmp_path / "market"
    add_model(market, source, "tiny", progress=False)

    def resolve(model: str) -> Path:
        return _model_dir(argparse.Namespace(model=model, market=market))

    assert resolve("tiny") == (market / "tiny").resolve()
    assert resolve(str(market / "tiny")) == market / "tiny"
    with pytest.raises(MarketError, match=r"no model named 'nope'.*the market has: tiny"):
        resolve("nope")
