"""A model's generation_config.json sampling defaults apply to requests that leave them out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from aegaeon_common.config import ModelConfig
from aegaeon_proxy.assets import AssetError, load_assets
from aegaeon_proxy.params import FIELDS, parse_common
from aegaeon_proxy.prompts import build_request
from proxy_support import market_dir


def _model_with(tmp_path: Path, **generation: object) -> ModelConfig:
    src = market_dir() / "llama-gqa-5m"
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **generation}))
    return ModelConfig(name="m", path=dst)


def test_defaults_fill_only_what_the_request_left_out(tmp_path: Path) -> None:
    assets = load_assets(_model_with(tmp_path, temperature=0.6, top_p=0.9, top_k=50,
                                     do_sample=True))  # fmt: skip
    assert dict(assets.sampling_defaults) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50}

    bare = {"model": "m", "prompt": "x"}
    s = build_request("r", parse_common(bare, FIELDS), [1], assets, chat=False).sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.9, 50)

    explicit = {"model": "m", "prompt": "x", "temperature": 0, "top_k": 0, "top_p": None}
    s = build_request("r", parse_common(explicit, FIELDS), [1], assets, chat=False).sampling
    # an explicit 0 (greedy, top-k off) wins; null counts as left out
    assert (s.temperature, s.top_k, s.top_p) == (0.0, 0, 0.9)


def test_a_model_without_defaults_keeps_openai_defaults(tmp_path: Path) -> None:
    assets = load_assets(_model_with(tmp_path))
    assert dict(assets.sampling_defaults) == {}
    bare = {"model": "m", "prompt": "x"}
    s = build_request("r", parse_common(bare, FIELDS), [1], assets, chat=False).sampling
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 0)


def test_a_bad_default_names_the_file_and_key(tmp_path: Path) -> None:
    with pytest.raises(AssetError, match=r"generation_config\.json: top_p: .*\(0, 1\]"):
        load_assets(_model_with(tmp_path, top_p=1.5))
