"""Hugging Face checkpoints of every family the engine claims: the configs real releases
ship parse, and directories that transformers itself writes import and generate like it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.llm import LLM
from aegaeon_engine.sampling import SamplingParams
from aegaeon_engine.spec import ModelSpec
from aegaeon_market.edit import add_model
from engine_support import hf_greedy
from market_import_support import TEXT, bpe_json
from tokenizers import Tokenizer

# config.json / generation_config.json as released (sizes as published)
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 128256}
MISTRAL03 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32768}
QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936}
QWEN25_GEN = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
              "eos_token_id": [151645, 151643], "repetition_penalty": 1.1, "temperature": 0.7,
              "top_p": 0.8, "top_k": 20}
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936}


def test_released_configs_parse() -> None:
    llama = ModelSpec.from_config(LLAMA31)
    assert (llama.rope.kind, llama.rope.factor, llama.rope.original_max_position) == \
        ("llama3", 8.0, 8192)
    assert llama.eos_token_ids == (128001, 128008, 128009) and llama.bos_token_id == 128000
    assert llama.num_kv_heads == 8 and llama.head_dim == 128 and not llama.tie_word_embeddings
    mistral = ModelSpec.from_config(MISTRAL03)
    assert mistral.max_model_len == 32768 and mistral.rope.theta == 1e6 and not mistral.qkv_bias
    qwen2 = ModelSpec.from_config(QWEN25, QWEN25_GEN)
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and qwen2.rms_norm_eps == 1e-6
    assert qwen2.eos_token_ids == (151645, 151643)  # generation_config's list wins
    qwen3 = ModelSpec.from_config(QWEN3)
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.rope.kind == "default"
    assert qwen3.dtype == "bfloat16" and qwen3.max_model_len == 40960
    # transformers 5 writes rope_parameters (theta inside) and dtype
    new_style = {k: v for k, v in LLAMA31.items() if k not in ("rope_scaling", "rope_theta",
                                                              "torch_dtype")}
    new_style |= {"dtype": "float32",
                  "rope_parameters": {**LLAMA31["rope_scaling"], "rope_theta": 500000.0}}
    assert ModelSpec.from_config(new_style).rope == llama.rope
    assert ModelSpec.from_config(new_style).dtype == "float32"
    linear = ModelSpec.from_config({**MISTRAL03, "rope_scaling": {"type": "linear",
                                                                  "factor": 4.0}})
    assert (linear.rope.kind, linear.rope.factor) == ("linear", 4.0)
    no_archs = {k: v for k, v in QWEN3.items() if k != "architectures"}
    assert ModelSpec.from_config(no_archs).architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(("config", "field", "words"), [
    ({**LLAMA31, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type", "'dynamic' is not supported"),
    ({**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}},
     "rope_scaling.rope_type", "'yarn' is not supported"),
    ({**MISTRAL03, "sliding_window": 4096}, "sliding_window", "sliding window of 4096"),
    ({**QWEN25, "use_sliding_window": True, "sliding_window": 4096}, "sliding_window",
     "not supported"),
    ({**LLAMA31, "eos_token_id": "end"}, "eos_token_id", "expected a token id or a list"),
    ({**LLAMA31, "torch_dtype": "int8"}, "dtype", "is not one of"),
    ({**LLAMA31, "hidden_act": "gelu"}, "hidden_act", "'gelu' is not supported"),
    ({k: v for k, v in QWEN3.items() if k != "architectures"} | {"model_type": "phi3"},
     "model_type", "'phi3'"),
])
def test_unservable_configs_are_refused_by_field(config: dict[str, Any], field: str,
                                                 words: str) -> None:
    with pytest.raises(CheckpointError) as err:
        ModelSpec.from_config(config, source="config.json")
    assert err.value.field == field and words in str(err.value)


# tiny versions of each family, rope variants included, written by transformers itself
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "bos_token_id": 1, "eos_token_id": [2, 0], "rms_norm_eps": 1e-5}
FAMILIES = {
    "llama3-rope": ("LlamaConfig", {"rope_theta": 500000.0, "tie_word_embeddings": True,
                                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                     "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 32}}),
    "llama-linear": ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}


def _save(tmp_path: Path, family: str) -> Path:
    import transformers

    class_name, extra = FAMILIES[family]
    config = getattr(transformers, class_name)(vocab_size=400, **TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():  # random norms too, so a mix-up of weights shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    out = tmp_path / family
    model.save_pretrained(out)
    (out / "tokenizer.json").write_text(bpe_json())
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_written_directories_import_and_generate_alike(tmp_path: Path,
                                                                     family: str) -> None:
    source = _save(tmp_path, family)
    entry = add_model(tmp_path / "market", source, family, "float32", progress=False)
    assert entry.arch == json.loads((source / "config.json").read_text())["architectures"][0]
    assert (entry.path / "tokenizer_config.json").is_file()
    prompt = Tokenizer.from_file(str(entry.path / "tokenizer.json")).encode(TEXT).ids
    ours = LLM(entry.path).generate(  # the imported copy, served in its stored float32
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert ours == hf_greedy(source, [prompt], 12)[0]
