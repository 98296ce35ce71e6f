"""GGUF import: tiny files written with the gguf writer (as llama.cpp's converter writes
them) come back as the dense HF tensors, tokenizer, template and special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from aegaeon_engine.llm import LLM
from aegaeon_engine.sampling import SamplingParams
from aegaeon_engine.spec import ModelSpec
from aegaeon_market.edit import add_model
from aegaeon_market.gguf_import import llama3_factors, unpermute_rows
from engine_support import hf_greedy
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from market_import_support import (
    CHAT_TEMPLATE,
    TEXT,
    Tiny,
    bpe_json,
    gguf_name,
    gguf_values,
    hf_tensors,
    llama_cpp_permute,
    write_gguf,
)
from safetensors.torch import load_file
from tokenizers import Tokenizer

Q = GGMLQuantizationType
DENSE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _expected(tiny: Tiny, tensors: dict[str, torch.Tensor], qtype: Q) -> dict[str, torch.Tensor]:
    """What an import must hold: each tensor through qtype and back, HF names and rows."""
    out = {}
    for hf, dense in tensors.items():
        data = gguf_values(tiny, {hf: dense})[gguf_name(hf)]
        if data.ndim == 2 and qtype != Q.F32:
            if qtype in DENSE:
                data = torch.from_numpy(data).to(DENSE[qtype]).float().numpy()
            else:
                data = dequantize(quantize(data, qtype), qtype)
        back = torch.from_numpy(np.array(data, dtype=np.float32))
        if tiny.arch == "llama" and ".q_proj." in hf:
            back = unpermute_rows(back, tiny.heads)
        elif tiny.arch == "llama" and ".k_proj." in hf:
            back = unpermute_rows(back, tiny.kv_heads)
        out[hf] = back
    return out


def _import(tmp_path: Path, tiny: Tiny, qtype: Q, dtype: str = "float32",
            **kwargs: object) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = hf_tensors(tiny)
    source = tmp_path / f"tiny-{tiny.arch}-{qtype.name}.gguf"
    write_gguf(source, tiny, tensors, qtype, **kwargs)  # type: ignore[arg-type]
    entry = add_model(tmp_path / "market", source, "tiny", dtype, progress=False)
    return entry.path, tensors


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(6 * 8, 5)
    for heads in (6, 3):
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rows(permuted, heads), w)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                                   Q.Q8_0])
def test_round_trip_against_dense(tmp_path: Path, qtype: Q) -> None:
    tiny = Tiny()
    model_dir, tensors = _import(tmp_path, tiny, qtype)
    got = load_file(str(model_dir / "model.safetensors"))
    want = _expected(tiny, tensors, qtype)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name
        if qtype == Q.F32:  # exact, rows included: the permutation is undone
            assert torch.equal(got[name], tensors[name]), name


def test_k_quant_decodes_as_the_gguf_package_does(tmp_path: Path) -> None:
    tiny = Tiny(hidden=256, heads=4, kv_heads=2, head_dim=64, inter=256, layers=1)
    tensors = hf_tensors(tiny)
    block, size = GGML_QUANT_SIZES[Q.Q4_K]
    rng = np.random.default_rng(0)
    blob = rng.integers(0, 256, (tiny.inter, tiny.hidden // block * size), dtype=np.uint8)
    blob[:, :4] = [0, 20, 0, 20]  # finite fp16 scale and min (0x1400: ~1e-3)
    source = tmp_path / "k.gguf"
    write_gguf(source, tiny, tensors, Q.Q8_0, raw={"blk.0.ffn_up.weight": (blob, Q.Q4_K)})
    entry = add_model(tmp_path / "market", source, "k", "float32", progress=False)
    got = load_file(str(entry.path / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(got, torch.from_numpy(dequantize(blob, Q.Q4_K)))


def test_transformers_reads_the_same_tensors(tmp_path: Path) -> None:
    """An independent reader (transformers' GGUF loader) agrees with the import."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model_dir, _ = _import(tmp_path, Tiny(tied=False), Q.Q8_0)
    source = next(tmp_path.glob("*.gguf"))
    with torch.device("meta"):
        ref_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    ref = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=ref_model)
    got = load_file(str(model_dir / "model.safetensors"))
    assert set(got) == set(ref["tensors"])
    for name, tensor in ref["tensors"].items():
        assert torch.equal(got[name], tensor.float()), name


@pytest.mark.parametrize(("tiny", "dtype"), [
    (Tiny(arch="qwen2"), "float32"),
    (Tiny(arch="qwen3", tied=False), "float32"),
    (Tiny(arch="llama", tied=False), "bfloat16"),
])
def test_families_and_dtypes(tmp_path: Path, tiny: Tiny, dtype: str) -> None:
    model_dir, tensors = _import(tmp_path, tiny, Q.F32, dtype)
    spec = ModelSpec.from_dir(model_dir)
    assert spec.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}[tiny.arch]
    assert spec.qkv_bias == (tiny.arch == "qwen2") and spec.qk_norm == (tiny.arch == "qwen3")
    assert spec.tie_word_embeddings == tiny.tied and spec.dtype == dtype
    assert spec.rope.theta == tiny.theta and spec.num_kv_heads == tiny.kv_heads
    got = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor.to(getattr(torch, dtype))), name


def test_tokenizer_template_and_special_tokens(tmp_path: Path) -> None:
    model_dir, _ = _import(tmp_path, Tiny(), Q.Q8_0, add_bos=True)
    ours = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = ours.encode(TEXT, add_special_tokens=False).ids
    assert ids == Tokenizer.from_str(bpe_json()).encode(TEXT).ids  # the source BPE's ids
    assert len(ids) < len(TEXT.encode()) and ours.decode(ids) == TEXT
    assert ours.encode(TEXT).ids == [1, *ids]  # add_bos_token: BOS first
    assert ours.encode("<|im_start|>user").ids[:2] == [1, 1]  # BOS, then the special itself
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert config["add_bos_token"] is True
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    assert hf(TEXT).input_ids == [1, *ids]
    chat = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                  add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_smollm_pre_tokenizer_splits_digits(tmp_path: Path) -> None:
    model_dir, _ = _import(tmp_path, Tiny(), Q.Q8_0, pre="smollm", add_bos=None)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode("year 2024").ids  # no BOS: the file does not ask for one
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces[-4:] == ["2", "0", "2", "4"]
    assert tok.decode(ids) == "year 2024"


def test_llama3_rope_is_recovered_from_rope_freqs(tmp_path: Path) -> None:
    tiny = Tiny(theta=500_000.0, head_dim=64, heads=2, kv_heads=1, hidden=128, inter=128,
                extra={"llama.rope.scaling.original_context_length": 64})
    factors = llama3_factors(64, 500_000.0, 8.0, 1.0, 4.0, 64).astype(np.float32)
    source = tmp_path / "l3.gguf"
    write_gguf(source, tiny, hf_tensors(tiny), Q.F32,
               extra_tensors={"rope_freqs.weight": factors})
    entry = add_model(tmp_path / "market", source, "l3", "float32", progress=False)
    spec = ModelSpec.from_dir(entry.path)
    assert spec.rope.kind == "llama3" and spec.rope.factor == 8.0
    assert spec.rope.original_max_position == 64
    config = json.loads((entry.path / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"


def test_imported_model_generates_like_transformers(tmp_path: Path) -> None:
    """The converted directory serves: the engine's greedy tokens equal transformers'."""
    model_dir, _ = _import(tmp_path, Tiny(layers=2), Q.Q4_1)
    prompt = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(TEXT).ids
    ours = LLM(model_dir, dtype="float32").generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    assert ours == hf_greedy(model_dir, [prompt], 16)[0]
