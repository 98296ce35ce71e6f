"""The density table: bytes per precision from checkpoint shapes."""

from __future__ import annotations

import pytest
from aegaeon_bench.engine.density import PRECISIONS, fits, main, model_bytes, preset_bytes


def test_bytes_per_precision_follow_the_formats() -> None:
    shapes = {
        "model.embed_tokens.weight": (100, 64),
        "model.layers.0.mlp.up_proj.weight": (128, 64),
        "model.norm.weight": (64,),
    }
    m = model_bytes("t", shapes, 100 * 64 + 128 * 64 + 64)
    assert m.bytes["bfloat16"] == 2 * m.params
    # fp8: the projection 1 byte a weight and a float32 scale a row; the rest bf16
    assert m.bytes["float8_e4m3fn"] == 2 * 6400 + (128 * 64 + 4 * 128) + 2 * 64
    # GGUF blocks of 32: the projection in the format, the embeddings Q8_0, norms f32
    assert m.bytes["q4_1"] == 200 * 34 + 256 * 20 + 4 * 64
    assert m.bytes["q8_0"] == 200 * 34 + 256 * 34 + 4 * 64
    assert m.bytes["q4_0"] == 200 * 34 + 256 * 18 + 4 * 64


def test_presets_shrink_with_the_precision_and_8b_matches_its_release() -> None:
    by_name = {m.name: m for m in preset_bytes()}
    eight = by_name["llama-3.1-8b"]
    assert eight.bytes["bfloat16"] == 2 * eight.params  # 16.06 GB, as the release
    for m in by_name.values():
        assert m.bytes["bfloat16"] > m.bytes["float8_e4m3fn"] > m.bytes["q4_1"] > m.bytes["q4_0"]
        assert m.bytes["q8_0"] > m.bytes["q4_1"]
    assert fits(64 << 30, eight.bytes["float8_e4m3fn"]) > fits(64 << 30, eight.bytes["bfloat16"])


def test_cli_refuses_a_bad_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cache", "lots"]) == 2
    assert main(["--cache", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p in PRECISIONS)
