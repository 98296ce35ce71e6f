"""Convert a GGUF file (llama.cpp's format) into a model directory in the HF layout.

The conversion runs once, at ``aegaeon market add``. Matrices in Q8_0, Q4_0 or
Q4_1 are kept as they are (``kept_quantization``: every layer projection in one
of those types; the embeddings and output layer in theirs, else float): their
blocks go into the safetensors file as U8 ``[rows, row_bytes]`` and
``config.json`` names them in ``quantization_config`` (the engine serves them
quantized, aegaeon_engine.quant). Every other tensor, and all of them when a
float dtype is asked for, is dequantized by the ``gguf`` package, cast to the
serving dtype; all are renamed to the Hugging Face names, and the Q and K
projections of a ``llama`` file get llama.cpp's row permutation undone (its
converter interleaves each head's two rotary halves; HF Llama rotates the halves
apart; rows of blocks permute as rows of values). The metadata becomes ``config.json`` and
``generation_config.json``, the vocabulary ``tokenizer.json``
(`aegaeon_market.gguf_vocab`), the chat template and special tokens
``tokenizer_config.json``. Everything is checked against the config before any
tensor is written, so a defect is a `CheckpointError` naming the key or tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aegaeon_common.dtypes import quant_row_bytes
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.spec import ModelSpec, QuantSpec
from aegaeon_engine.weights import TORCH_DTYPES
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from aegaeon_market.fp8_out import PROJECTIONS
from aegaeon_market.gguf_file import GGUFFile
from aegaeon_market.gguf_vocab import Vocab, read_vocab
from aegaeon_market.model_files import expected_tensors, kept_blocks, write_model_files
from aegaeon_market.safetensors_out import TensorPlan

Q = GGMLQuantizationType
# block quantizations the engine serves as such (aegaeon_common.dtypes.QUANT_BLOCKS)
KEPT_TYPES: dict[GGMLQuantizationType, str] = {Q.Q8_0: "q8_0", Q.Q4_0: "q4_0", Q.Q4_1: "q4_1"}
# Types the gguf package dequantizes that these checkpoints use; others are refused.
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                   Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture maps onto a served HF one."""

    model_type: str
    architecture: str
    permute_qk: bool  # llama.cpp's converter permuted the Q/K rows (llama only)
    qkv_bias: bool | None  # None: present when the file has the bias tensors


ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", permute_qk=True, qkv_bias=None),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", permute_qk=False, qkv_bias=True),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", permute_qk=False, qkv_bias=None),
}

# GGUF tensor name -> HF name ({i} = layer)
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope factors, folded into config.json


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None when it has none here."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of a Q or K projection (rows = heads x head_dim).

    llama.cpp stores each head's rows as (pair, half) where HF stores
    (half, pair); the inverse swaps those two axes back.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def _rope(gguf: GGUFFile, head_dim: int, theta: float) -> dict[str, Any] | None:
    """``rope_scaling`` of the config (None: plain rope); refuses what cannot be served."""
    kind = gguf.arch_get("rope.scaling.type", str, "none")
    if _ROPE_FREQS in gguf.tensors:
        if kind not in ("none", "llama3"):
            raise CheckpointError(gguf.path, f"{gguf.arch}.rope.scaling.type",
                                  f"{kind!r} together with {_ROPE_FREQS}")
        return _llama3_rope(gguf, head_dim, theta)
    if kind == "none":
        return None
    if kind == "linear":
        factor = gguf.arch_get("rope.scaling.factor", float)
        return {"rope_type": "linear", "factor": factor}
    raise CheckpointError(gguf.path, f"{gguf.arch}.rope.scaling.type",
                          f"rope scaling {kind!r} is not supported (none, linear, llama3)")


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                   original: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3 rope scaling (what llama.cpp stores in rope_freqs)."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _llama3_rope(gguf: GGUFFile, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover llama3 rope parameters from the factors llama.cpp stored.

    The file keeps only the factors; the parameters Meta released (low 1, high
    4, original context 8192, factor = the largest factor) are accepted when
    they reproduce every stored factor.
    """
    tensor = gguf.tensor(_ROPE_FREQS)
    stored = _dequantized(gguf, tensor).reshape(-1).astype(np.float64)
    if stored.size != head_dim // 2:
        raise CheckpointError(gguf.path, _ROPE_FREQS,
                              f"{stored.size} factors, expected head_dim / 2 = {head_dim // 2}")
    original = gguf.arch_get("rope.scaling.original_context_length", int, 8192)
    params = {"factor": float(stored.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": original}
    rebuilt = llama3_factors(head_dim, theta, params["factor"], 1.0, 4.0, original)
    if not np.allclose(rebuilt, stored, rtol=1e-4, atol=1e-6):
        raise CheckpointError(gguf.path, _ROPE_FREQS,
                              "rope factors that are not llama3 scaling with low 1, high 4 and "
                              f"original context {original}; not supported")
    return {"rope_type": "llama3", **params}


def _hf_shape(gguf: GGUFFile, tensor: ReaderTensor) -> tuple[int, ...]:
    """The tensor's shape as HF gives it (outermost first); `CheckpointError` for a type
    that is not supported."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise CheckpointError(gguf.path, tensor.name, f"tensor type {tensor.tensor_type.name} "
                              f"is not supported (supported: {names})")
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantized(gguf: GGUFFile, tensor: ReaderTensor) -> np.ndarray:
    """The tensor as float32 in HF (row-major, outermost first) shape."""
    shape = _hf_shape(gguf, tensor)
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except (ValueError, NotImplementedError) as exc:
        raise CheckpointError(gguf.path, tensor.name, f"cannot dequantize ({exc})") from None
    # a copy: F32 data comes back as a read-only view of the mapped file
    return np.array(values, dtype=np.float32).reshape(shape)


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF file read and checked: its config, vocabulary and tensor plan."""

    gguf: GGUFFile
    config: dict[str, Any]
    generation: dict[str, Any]
    spec: ModelSpec
    vocab: Vocab
    sources: dict[str, str]  # HF name -> GGUF name

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in expected_tensors(self.spec).values())


def read_gguf(path: Path) -> GGUFModel:
    """Read and check ``path``: metadata, vocabulary, tensor names, types and shapes."""
    gguf = GGUFFile(path)
    arch = ARCHS.get(gguf.arch)
    if arch is None:
        raise CheckpointError(path, "general.architecture",
                              f"unsupported architecture {gguf.arch!r} "
                              f"(supported: {', '.join(sorted(ARCHS))})")
    vocab = read_vocab(gguf)
    hidden = gguf.arch_get("embedding_length", int)
    num_heads = gguf.arch_get("attention.head_count", int)
    num_kv_heads = gguf.arch_get("attention.head_count_kv", int, num_heads)
    head_dim = gguf.arch_get("attention.key_length", int, hidden // max(num_heads, 1))
    rope_dim = gguf.arch_get("rope.dimension_count", int, head_dim)
    if rope_dim != head_dim:
        raise CheckpointError(path, f"{gguf.arch}.rope.dimension_count",
                              f"{rope_dim} (partial rotary) differs from head_dim {head_dim}")
    theta = gguf.arch_get("rope.freq_base", float, 10000.0)
    embed = gguf.tensor("token_embd.weight")
    vocab_size = gguf.arch_get("vocab_size", int, int(embed.shape[-1]))
    if len(vocab.tokens) > vocab_size:
        raise CheckpointError(path, "tokenizer.ggml.tokens",
                              f"{len(vocab.tokens)} tokens, more than the model's vocabulary "
                              f"of {vocab_size}")
    tied = "output.weight" not in gguf.tensors
    rope_scaling = _rope(gguf, head_dim, theta)
    qkv_bias = arch.qkv_bias if arch.qkv_bias is not None else "blk.0.attn_q.bias" in gguf.tensors
    config: dict[str, Any] = {
        "architectures": [arch.architecture], "model_type": arch.model_type,
        "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": gguf.arch_get("feed_forward_length", int),
        "num_hidden_layers": gguf.arch_get("block_count", int),
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": gguf.arch_get("context_length", int),
        "rms_norm_eps": gguf.arch_get("attention.layer_norm_rms_epsilon", float),
        "rope_theta": theta, "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta},
        "tie_word_embeddings": tied, "bos_token_id": vocab.bos_id,
        "eos_token_id": vocab.eos_ids[0] if len(vocab.eos_ids) == 1 else list(vocab.eos_ids),
    }
    if arch.model_type != "qwen2":  # Qwen2 always has the bias and no key for it
        config["attention_bias"] = qkv_bias
    generation = {k: v for k, v in (("bos_token_id", vocab.bos_id),
                                    ("eos_token_id", config["eos_token_id"]),
                                    ("pad_token_id", vocab.pad_id)) if v is not None}
    spec = ModelSpec.from_config(config, generation, name=path.stem, source=path)
    sources = _check_tensors(gguf, spec)
    return GGUFModel(gguf, config, generation, spec, vocab, sources)


def _check_tensors(gguf: GGUFFile, spec: ModelSpec) -> dict[str, str]:
    """HF name -> GGUF name for every tensor the model needs, types and shapes checked."""
    by_hf: dict[str, str] = {}
    for name in gguf.tensors:
        hf = hf_name(name)
        if hf is None and name != _ROPE_FREQS:
            raise CheckpointError(gguf.path, name, "unexpected tensor for this architecture "
                                  f"({gguf.arch}); not supported")
        if hf is not None:
            by_hf[hf] = name
    expected = expected_tensors(spec)
    for hf, shape in expected.items():
        if hf not in by_hf:
            raise CheckpointError(gguf.path, _gguf_name(hf), "missing tensor")
        name = by_hf[hf]
        found = _hf_shape(gguf, gguf.tensors[name])
        if found != shape:
            raise CheckpointError(gguf.path, name, f"shape {list(found)} disagrees with the "
                                  f"metadata (expected {list(shape)})")
    extra = sorted(set(by_hf) - set(expected))
    if extra:
        raise CheckpointError(gguf.path, by_hf[extra[0]],
                              "tensor the metadata does not account for (layer count, tied "
                              "embeddings or biases disagree)")
    return {hf: by_hf[hf] for hf in expected}


def _gguf_name(hf: str) -> str:
    for gguf_name, name in _GLOBAL.items():
        if name == hf:
            return gguf_name
    _, _, layer, rest = hf.split(".", 3)
    short = next(k for k, v in _LAYER.items() if v == rest)
    return f"blk.{layer}.{short}"


def kept_quantization(model: GGUFModel) -> QuantSpec | None:
    """What ``convert_gguf`` keeps quantized: the layer projections' type when they
    all share one of ``KEPT_TYPES`` (else None: everything is dequantized), the
    embeddings' and the output layer's own types when kept (else float)."""
    types = {hf: model.gguf.tensors[name].tensor_type for hf, name in model.sources.items()}
    linear = {t for hf, t in types.items() if hf.endswith(PROJECTIONS)}
    if len(linear) != 1 or next(iter(linear)) not in KEPT_TYPES:
        return None

    def kept(hf: str) -> str | None:
        return KEPT_TYPES.get(types[hf]) if hf in types else None

    return QuantSpec(KEPT_TYPES[next(iter(linear))], kept("model.embed_tokens.weight"),
                     kept("lm_head.weight"))


def convert_gguf(model: GGUFModel, out: Path, dtype: str,
                 progress: Callable[[int], None] | None = None,
                 quant: QuantSpec | None = None) -> None:
    """Write ``model`` into ``out`` (an empty directory) in the HF layout: the matrices
    ``quant`` names (``kept_quantization``) as their blocks, everything else in ``dtype``."""
    target = TORCH_DTYPES[dtype]
    spec, gguf = model.spec, model.gguf
    arch = ARCHS[gguf.arch]
    # HF name -> the quantization whose blocks it keeps (what the engine will read)
    kept = kept_blocks(replace(spec, quant=quant, dtype=dtype))

    def tensors() -> Any:
        for hf, name in model.sources.items():
            tensor = gguf.tensors[name]
            if hf in kept:  # rows of blocks, as uint8 [rows, row_bytes]
                values = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
            else:
                values = torch.from_numpy(_dequantized(gguf, tensor)).to(target)
            if arch.permute_qk and hf.endswith(("q_proj.weight", "q_proj.bias")):
                values = unpermute_rows(values, spec.num_heads)
            elif arch.permute_qk and hf.endswith(("k_proj.weight", "k_proj.bias")):
                values = unpermute_rows(values, spec.num_kv_heads)
            yield hf, values
            if progress is not None:
                progress(1)

    plans = []
    for hf, shape in expected_tensors(spec).items():
        qtype = kept.get(hf)
        plans.append(TensorPlan(hf, target, shape) if qtype is None else
                     TensorPlan(hf, torch.uint8, (shape[0], quant_row_bytes(qtype, shape[1]))))
    vocab = model.vocab
    special = {"bos_token": vocab.text(vocab.bos_id), "eos_token": vocab.text(vocab.eos_ids[0])
               if vocab.eos_ids else None, "unk_token": vocab.text(vocab.unk_id),
               "pad_token": vocab.text(vocab.pad_id)}
    tokenizer_config: dict[str, Any] = {
        **{k: v for k, v in special.items() if v is not None},
        "add_bos_token": vocab.add_bos, "add_eos_token": vocab.add_eos,
        "model_max_length": spec.max_model_len, "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if vocab.chat_template is not None:
        tokenizer_config["chat_template"] = vocab.chat_template
    config = {**model.config, "torch_dtype": dtype, "dtype": dtype}
    if quant is not None:
        config["quantization_config"] = {"quant_method": "gguf", "linear": quant.linear,
                                         "embed_tokens": quant.embed_tokens,
                                         "lm_head": quant.lm_head}
    write_model_files(out, config=config, generation=model.generation,
                      tokenizer_json=vocab.tokenizer.to_str(pretty=True),
                      tokenizer_config=tokenizer_config, plans=plans, tensors=tensors())
