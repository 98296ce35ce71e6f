"""Specs and layouts: pure parsing of checkpoint JSON and the packed weight layout."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aegaeon_engine import CheckpointError, KVShape, ModelSpec, WeightLayout, weight_layout


def _llama(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
        "intermediate_size": 640, "num_hidden_layers": 3, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": 2,
    }
    config.update(overrides)
    return config


def test_llama_defaults_and_generation_config() -> None:
    spec = ModelSpec.from_config(_llama(), {"eos_token_id": [7, 9, 7], "bos_token_id": 1},
                                 name="m")
    assert (spec.head_dim, spec.q_size, spec.kv_size) == (32, 256, 64)
    assert spec.eos_token_ids == (7, 9) and spec.bos_token_id == 1
    assert spec.dtype == "bfloat16" and spec.rope.theta == 500000.0
    assert not (spec.qkv_bias or spec.o_bias or spec.qk_norm or spec.tie_word_embeddings)
    assert ModelSpec.from_config(_llama()).eos_token_ids == (2,)  # falls back to config.json


def test_family_flags() -> None:
    qwen2 = ModelSpec.from_config(_llama(architectures=["Qwen2ForCausalLM"],
                                         tie_word_embeddings=True))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings
    qwen3 = ModelSpec.from_config(_llama(architectures=["Qwen3ForCausalLM"], head_dim=128))
    assert qwen3.qk_norm and qwen3.head_dim == 128 and not qwen3.qkv_bias
    yi = ModelSpec.from_config(_llama(attention_bias=True))  # Yi/InternLM2 convert to Llama
    assert yi.qkv_bias and yi.o_bias


def test_rope_variants() -> None:
    v5 = ModelSpec.from_config(_llama(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert v5.rope.kind == "llama3" and v5.rope.theta == 10000.0 and v5.rope.factor == 8.0
    v4 = ModelSpec.from_config(_llama(rope_scaling={"type": "linear", "factor": 2.0}))
    assert v4.rope.kind == "linear" and v4.rope.theta == 500000.0
    with pytest.raises(CheckpointError, match=r"rope_scaling\.rope_type: rope type 'yarn'"):
        ModelSpec.from_config(_llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_sliding_window() -> None:
    mistral = _llama(architectures=["MistralForCausalLM"], sliding_window=4096,
                     max_position_embeddings=32768)
    with pytest.raises(CheckpointError, match="sliding_window: sliding window of 4096"):
        ModelSpec.from_config(mistral)
    assert ModelSpec.from_config(mistral, max_model_len=4096).max_model_len == 4096
    ok = _llama(architectures=["MistralForCausalLM"], sliding_window=32768,
                max_position_embeddings=32768)
    assert ModelSpec.from_config(ok).max_model_len == 32768
    qwen = _llama(architectures=["Qwen2ForCausalLM"], sliding_window=128,
                  use_sliding_window=False)
    assert ModelSpec.from_config(qwen).max_model_len == 4096
    with pytest.raises(CheckpointError, match="sliding_window"):
        ModelSpec.from_config({**qwen, "use_sliding_window": True})


@pytest.mark.parametrize(("key", "value", "match"), [
    ("hidden_size", None, "hidden_size: missing"),
    ("hidden_size", "256", "hidden_size: expected int"),
    ("num_key_value_heads", 3, "num_key_value_heads: 3 does not divide 8"),
    ("hidden_act", "gelu", "hidden_act: 'gelu' is not supported"),
    ("torch_dtype", "int8", "dtype: dtype 'int8'"),
    ("architectures", ["BertModel"], "architectures: unsupported architecture"),
])
def test_bad_config_fields(key: str, value: Any, match: str) -> None:
    config = _llama()
    if value is None:
        del config[key]
    else:
        config[key] = value
    with pytest.raises(CheckpointError, match=match):
        ModelSpec.from_config(config, source="x/config.json")


def test_bad_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        ModelSpec.from_dir(tmp_path)


def test_kv_shape() -> None:
    spec = ModelSpec.from_config(_llama())
    shape = spec.kv_shape()
    assert shape == KVShape(3, 2, 32, 16, "bfloat16")
    assert shape.block_bytes == 2 * 3 * 16 * 2 * 32 * 2
    assert spec.kv_shape("float32").block_bytes == 2 * shape.block_bytes
    assert shape.blocks_for(16) == 1 and shape.blocks_for(17) == 2


def test_layout_is_packed_aligned_and_fused() -> None:
    spec = ModelSpec.from_config(_llama(architectures=["Qwen2ForCausalLM"],
                                        tie_word_embeddings=True))
    layout = weight_layout(spec, "float32")
    slots = layout.slots
    assert all(s.offset % 64 == 0 for s in slots)
    assert all(a.offset + a.nbytes <= b.offset for a, b in itertools.pairwise(slots))
    assert layout.total_bytes >= slots[-1].offset + slots[-1].nbytes
    qkv = layout.slot("layers.2.qkv_proj")
    assert qkv.shape == (256 + 2 * 64, 256) and qkv.nbytes == 384 * 256 * 4
    assert qkv.sources == tuple(f"model.layers.2.self_attn.{p}_proj.weight" for p in "qkv")
    assert qkv.source_shapes() == [(256, 256), (64, 256), (64, 256)]
    assert layout.slot("layers.0.gate_up_proj").shape == (1280, 256)
    assert "lm_head" not in layout.by_name  # tied
    assert "layers.0.qkv_bias" in layout.by_name and "layers.0.o_bias" not in layout.by_name
    assert WeightLayout.from_json(layout.to_json()) == layout
    bf16 = weight_layout(spec)
    assert bf16.dtype == "bfloat16" and bf16.total_bytes < layout.total_bytes


def test_spec_and_layout_do_not_import_torch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_llama()))
    code = ("import sys, aegaeon_engine, aegaeon_engine.spec, aegaeon_engine.layout\n"
            f"s = aegaeon_engine.ModelSpec.from_dir({str(tmp_path)!r})\n"
            "aegaeon_engine.weight_layout(s)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
