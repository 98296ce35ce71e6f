"""GGUF export (the engine bench's llama.cpp peer): a market checkpoint written back as GGUF
holds the same tensors in the same precision under llama.cpp's names and rows, with the
metadata and vocabulary llama.cpp needs; the importer reads it back as the same model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.spec import ModelSpec
from aegaeon_market.edit import add_model
from aegaeon_market.gguf_export import permute_rows, pre_tokenizer_name, write_gguf
from aegaeon_market.gguf_import import read_gguf, unpermute_rows
from aegaeon_market.gguf_vocab import PRE_TOKENIZERS
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from market_import_support import Tiny, bpe, gguf_values, hf_tensors
from market_import_support import write_gguf as write_source_gguf
from tokenizers import Tokenizer, models

Q = GGMLQuantizationType
TYPES = {"bfloat16": Q.BF16, "float16": Q.F16, "float32": Q.F32}


def _market_model(tmp_path: Path, tiny: Tiny, dtype: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A market entry in ``dtype`` (imported from a GGUF file as llama.cpp writes one)."""
    tensors = hf_tensors(tiny)
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / f"source-{tiny.arch}.gguf"
    write_source_gguf(source, tiny, tensors)
    entry = add_model(tmp_path / "market", source, "tiny", dtype, progress=False)
    return entry.path, tensors


def _values(tensor: object) -> np.ndarray:
    """A reader tensor as float32 in numpy (outermost first) order."""
    data, kind = tensor.data, tensor.tensor_type  # type: ignore[attr-defined]
    if kind == Q.BF16:
        data = (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # type: ignore[attr-defined]
    return np.asarray(data, dtype=np.float32).reshape(shape)


def test_permute_is_the_importers_inverse() -> None:
    w = torch.randn(6 * 8, 5)
    for heads in (6, 3):
        assert not torch.equal(permute_rows(w, heads), w)
        assert torch.equal(unpermute_rows(permute_rows(w, heads), heads), w)


@pytest.mark.parametrize(("tiny", "dtype"), [
    (Tiny(arch="llama"), "bfloat16"),
    (Tiny(arch="qwen2", tied=False), "bfloat16"),
    (Tiny(arch="qwen3"), "float16"),
    (Tiny(arch="llama", tied=False), "float32"),
])
def test_tensors_names_types_and_rows(tmp_path: Path, tiny: Tiny, dtype: str) -> None:
    model_dir, tensors = _market_model(tmp_path, tiny, dtype)
    out = write_gguf(model_dir, tmp_path / "out.gguf")  # the checkpoint's dtype
    reader = GGUFReader(out)
    got = {t.name: t for t in reader.tensors}
    # what llama.cpp's converter writes for these weights: its names, Q/K rows permuted
    want = gguf_values(tiny, tensors)
    assert set(got) == set(want)
    for name, values in want.items():
        tensor = got[name]
        assert tensor.tensor_type == (TYPES[dtype] if values.ndim == 2 else Q.F32), name
        # the market's copy in `dtype`, bit for bit (1-D tensors widened to float32)
        served = torch.from_numpy(values).to(getattr(torch, dtype)).float().numpy()
        np.testing.assert_array_equal(_values(tensor), served, err_msg=name)


def test_metadata_and_vocabulary(tmp_path: Path) -> None:
    tiny = Tiny(arch="qwen3", heads=4, kv_heads=2, head_dim=32)  # head_dim != hidden / heads
    model_dir, _ = _market_model(tmp_path, tiny, "bfloat16")
    spec = ModelSpec.from_dir(model_dir)
    reader = GGUFReader(write_gguf(model_dir, tmp_path / "out.gguf"))

    def field(key: str) -> object:
        return reader.fields[key].contents()

    assert field("general.architecture") == "qwen3"
    assert field("general.file_type") == 32  # MOSTLY_BF16
    assert (field("qwen3.block_count"), field("qwen3.embedding_length"),
            field("qwen3.feed_forward_length")) == (tiny.layers, tiny.hidden, tiny.inter)
    assert (field("qwen3.attention.head_count"), field("qwen3.attention.head_count_kv"),
            field("qwen3.attention.key_length"), field("qwen3.attention.value_length"),
            field("qwen3.rope.dimension_count")) == (4, 2, 32, 32, 32)
    assert field("qwen3.rope.freq_base") == tiny.theta
    assert field("qwen3.attention.layer_norm_rms_epsilon") == pytest.approx(spec.rms_norm_eps)
    assert field("qwen3.context_length") == spec.max_model_len
    tokens, merges = bpe()
    assert field("qwen3.vocab_size") == len(tokens) == spec.vocab_size
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    assert field("tokenizer.ggml.tokens") == tokens
    assert field("tokenizer.ggml.merges") == merges
    types = field("tokenizer.ggml.token_type")
    assert isinstance(types, list)
    assert types[:3] == [TokenType.CONTROL] * 3 and set(types[3:]) == {TokenType.NORMAL}
    assert field("tokenizer.ggml.bos_token_id") == spec.bos_token_id
    assert field("tokenizer.ggml.eos_token_id") == spec.eos_token_ids[0]


def test_importer_reads_back_the_same_model(tmp_path: Path) -> None:
    for tiny in (Tiny(arch="llama", tied=False), Tiny(arch="qwen2"), Tiny(arch="qwen3")):
        model_dir, _ = _market_model(tmp_path / tiny.arch, tiny, "bfloat16")
        back = read_gguf(write_gguf(model_dir, tmp_path / f"{tiny.arch}.gguf"))
        spec = ModelSpec.from_dir(model_dir)
        for key in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "rope", "tie_word_embeddings", "qkv_bias",
                    "qk_norm", "max_model_len"):
            assert getattr(back.spec, key) == getattr(spec, key), (tiny.arch, key)
        assert back.spec.rms_norm_eps == pytest.approx(spec.rms_norm_eps)


def test_embedding_padding_beyond_the_tokenizer(tmp_path: Path) -> None:
    """Qwen pads its embedding past the tokenizer: unused tokens fill the ids."""
    model_dir, _ = _market_model(tmp_path, Tiny(arch="qwen2"), "bfloat16")
    config = json.loads((model_dir / "config.json").read_text())
    tokens, _ = bpe()
    config["vocab_size"] = len(tokens) + 5
    (model_dir / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = torch.cat([embed, embed[:5]])
    save_file(weights, str(model_dir / "model.safetensors"))
    reader = GGUFReader(write_gguf(model_dir, tmp_path / "out.gguf"))
    got = reader.fields["tokenizer.ggml.tokens"].contents()
    assert got[:len(tokens)] == tokens and len(got) == len(tokens) + 5
    assert reader.fields["tokenizer.ggml.token_type"].contents()[-1] == TokenType.UNUSED


def test_refuses_what_llama_cpp_is_not_given(tmp_path: Path) -> None:
    model_dir, _ = _market_model(tmp_path, Tiny(), "bfloat16")
    with pytest.raises(CheckpointError, match="int8"):
        write_gguf(model_dir, tmp_path / "out.gguf", "int8")


@pytest.mark.parametrize(("name", "expected"), [
    ("qwen2", "qwen2"), ("llama3", "llama-bpe"), ("llama-bpe", "llama-bpe"),
    ("smollm", "smollm"), ("gpt2", "gpt-2"), ("gpt-2", "gpt-2"),
])
def test_pre_tokenizer_names_invert_the_importers(name: str, expected: str) -> None:
    """The splitting rules the importer builds for a name are recognised as that name."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = PRE_TOKENIZERS[name].build()
    assert pre_tokenizer_name(json.loads(tok.to_str())) == expected


def test_pre_tokenizer_of_the_market_families() -> None:
    from aegaeon_market.families import FAMILIES
    from aegaeon_market.tokenizer import build_tokenizer

    names = {f.key: pre_tokenizer_name(json.loads(build_tokenizer(f).to_str()))
             for f in FAMILIES.values()}
    assert "default" not in names.values(), names
