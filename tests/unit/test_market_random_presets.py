"""``aegaeon market add --random PRESET``: released configs at their real sizes, checked
without writing the big weights; the same writer at toy sizes loads, generates like
transformers, and fails without touching the market."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aegaeon_cli.main import main
from aegaeon_engine.llm import LLM
from aegaeon_engine.loader import checkpoint_index
from aegaeon_engine.sampling import SamplingParams
from aegaeon_engine.spec import ModelSpec
from aegaeon_market import load_market
from aegaeon_market.edit import add_random
from aegaeon_market.presets import PRESETS, Preset, preset_config
from aegaeon_market.shapes import tensor_shapes
from aegaeon_market.tokenizer import build_tokenizer
from engine_support import hf_greedy
from market_import_support import market_tree as _tree
from tokenizers import Tokenizer

# parameters of the releases' safetensors (the hub's "model size": 0.49B, 1.54B, ...)
RELEASED_PARAMS = {
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
    "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248, "qwen3-8b": 8_190_735_360,
    "mistral-7b-v0.3": 7_248_023_552,
}
# the released config.json's values (instruct releases), key by key
_LLAMA = {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
          "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 131072, "num_key_value_heads": 8}
_LLAMA32_SCALING = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}
_QWEN = {"bos_token_id": 151643, "eos_token_id": 151645, "rope_theta": 1000000.0,
         "rms_norm_eps": 1e-6, "use_sliding_window": False, "rope_scaling": None}
_QWEN25_SMALL = {**_QWEN, "num_key_value_heads": 2, "vocab_size": 151936,
                 "tie_word_embeddings": True, "max_position_embeddings": 32768,
                 "sliding_window": 32768, "max_window_layers": 21}  # 0.5B and 1.5B
RELEASED_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {**_QWEN25_SMALL, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14},
    "qwen2.5-1.5b": {**_QWEN25_SMALL, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12},
    "qwen2.5-7b": {**_QWEN, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "tie_word_embeddings": False,
                   "max_position_embeddings": 32768, "sliding_window": 131072,
                   "max_window_layers": 28},
    "llama-3.2-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64,
                     "tie_word_embeddings": True, "rope_scaling": _LLAMA32_SCALING},
    "llama-3.2-3b": {**_LLAMA, "hidden_size": 3072, "intermediate_size": 8192,
                     "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128,
                     "tie_word_embeddings": True, "rope_scaling": _LLAMA32_SCALING},
    "llama-3.1-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32,
                     "tie_word_embeddings": False,
                     "rope_scaling": {**_LLAMA32_SCALING, "factor": 8.0}},
    "qwen3-8b": {**_QWEN, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                 "max_position_embeddings": 40960, "attention_bias": False},
    "mistral-7b-v0.3": {"hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "vocab_size": 32768, "bos_token_id": 1,
                        "eos_token_id": 2, "tie_word_embeddings": False,
                        "rope_theta": 1000000.0, "max_position_embeddings": 32768,
                        "rms_norm_eps": 1e-5, "sliding_window": None},
}
SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
         "intermediate_size": 96}
PROMPT = "Hello, how are you today? Tell me about the kettle."


def scaled_down(preset: Preset) -> Preset:
    """``preset`` at toy sizes: the released vocabulary, rope and conventions kept."""
    return replace(preset, recipe=replace(preset.recipe, **SMALL))


@pytest.fixture
def market(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A market holding a toy ``llama-3.2-1b`` written through the CLI (the preset table
    patched to toy sizes)."""
    monkeypatch.setitem(PRESETS, "llama-3.2-1b", scaled_down(PRESETS["llama-3.2-1b"]))
    root = tmp_path / "m" / "market"
    assert main(["market", "add", "--market", str(root), "--random", "llama-3.2-1b",
                 "--name", "base", "--quiet"]) == 0
    return root


@pytest.mark.parametrize("name", sorted(RELEASED_PARAMS))
def test_presets_have_the_released_config_and_parameter_count(name: str) -> None:
    preset = PRESETS[name]
    params = sum(math.prod(shape) for shape in tensor_shapes(preset.recipe).values())
    assert params == preset.params
    assert abs(params / RELEASED_PARAMS[name] - 1) < 0.005, params
    config = preset_config(preset, "bfloat16")
    assert {k: config.get(k) for k in RELEASED_CONFIGS[name]} == RELEASED_CONFIGS[name]
    spec = ModelSpec.from_config(config)  # what the engine will make of it
    assert (spec.vocab_size, spec.architecture) == (config["vocab_size"], preset.architecture)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-7b", "qwen3-8b", "mistral-7b-v0.3"])
def test_tokenizers_fit_and_keep_the_released_special_ids(name: str) -> None:
    preset = PRESETS[name]
    config = preset_config(preset, "bfloat16")
    tok = build_tokenizer(preset.recipe.family_spec)
    ids = tok.get_vocab(with_added_tokens=True).values()
    assert max(ids) < config["vocab_size"] and len(ids) == len(set(ids))
    specials = {"llama": ("<|begin_of_text|>", "<|end_of_text|>"), "qwen2": ("<|endoftext|>",
                "<|im_end|>"), "qwen3": ("<|endoftext|>", "<|im_end|>"),
                "mistral": ("<s>", "</s>")}[preset.recipe.family]
    eos = config["eos_token_id"]
    assert (tok.id_to_token(config["bos_token_id"]), tok.id_to_token(
        eos[0] if isinstance(eos, list) else eos)) in (specials, specials[::-1])
    encoded = tok.encode(PROMPT).ids
    assert tok.decode(encoded, skip_special_tokens=True).strip() == PROMPT


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-7b", "qwen3-8b", "mistral-7b-v0.3"])
def test_scaled_down_presets_load_shard_and_generate_like_transformers(tmp_path: Path,
                                                                       name: str) -> None:
    preset = scaled_down(PRESETS[name])
    entry = add_random(tmp_path / "market", preset, "toy", "float32", progress=False,
                       max_shard_bytes=8 << 20)
    assert entry.source == f"random (preset {name})" and entry.params == preset.params
    index = json.loads((entry.path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, as the big ones are
    assert {n: e.shape for n, e in checkpoint_index(entry.path).items()} == \
        tensor_shapes(preset.recipe)
    assert ModelSpec.from_dir(entry.path).vocab_size == RELEASED_CONFIGS[name]["vocab_size"]
    tok = Tokenizer.from_file(str(entry.path / "tokenizer.json"))
    prompt = tok.encode(PROMPT).ids
    ours = LLM(entry.path).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert all(tok.id_to_token(t) is not None for t in ours)  # within the tokenizer
    assert len(set(ours)) > 1
    assert ours == hf_greedy(entry.path, [prompt], 8)[0]


def test_cli_lists_it_as_random_and_dtype_sets_the_bytes(
        market: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["market", "add", "--market", str(market), "--random", "llama-3.2-1b",
                 "--name", "wide", "--dtype", "float32", "--quiet"]) == 0
    entries = {e.name: e for e in load_market(market)}
    assert (entries["base"].dtype, entries["wide"].dtype) == ("bfloat16", "float32")
    sizes = {n: (e.path / "model.safetensors").stat().st_size for n, e in entries.items()}
    assert 1.95 < sizes["wide"] / sizes["base"] < 2.0  # the header is not doubled
    assert json.loads((entries["wide"].path / "config.json").read_text())["torch_dtype"] == \
        "float32"
    capsys.readouterr()
    assert main(["market", "list", "--market", str(market)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("base ")]
    assert len(rows) == 1 and rows[0].endswith("random (preset llama-3.2-1b)"), rows


def test_unknown_preset_is_one_line_naming_the_presets(
        market: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _tree(market)
    assert main(["market", "add", "--market", str(market), "--random", "llama-4",
                 "--name", "x", "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aegaeon market add: error: "), lines
    assert "'llama-4'" in lines[0] and all(name in lines[0] for name in PRESETS)
    assert _tree(market) == before


def test_random_and_source_are_exclusive(market: Path, tmp_path: Path) -> None:
    for argv in (["--random", "llama-3.2-1b", str(tmp_path)], []):
        with pytest.raises(SystemExit) as exit_info:
            main(["market", "add", "--market", str(market), "--name", "x", *argv])
        assert exit_info.value.code == 2


@pytest.mark.parametrize("where", ["write", "commit"])
def test_a_failure_leaves_the_market_unchanged(market: Path, where: str,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from aegaeon_market import edit, safetensors_out

    def disk_full(*_args: object) -> None:
        raise OSError(28, "No space left on device", str(market / "market.json"))

    if where == "write":
        monkeypatch.setattr(safetensors_out.SafetensorsWriter, "write_bytes", disk_full)
    else:
        monkeypatch.setattr(edit, "write_manifest", disk_full)
    for argv in (["--name", "new"], ["--name", "base", "--replace"]):
        before = _tree(market)
        assert main(["market", "add", "--market", str(market), "--random", "llama-3.2-1b",
                     "--quiet", *argv]) == 2
        assert "No space left on device" in capsys.readouterr().err
        assert _tree(market) == before
