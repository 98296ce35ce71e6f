"""Write a served checkpoint (HF layout) as a GGUF file llama.cpp loads, in the same precision.

The reverse of `aegaeon_market.gguf_import`, for benchmarking llama.cpp on the
very weights our engine serves (``aegaeon bench engine``): matrices keep the
serving dtype (bfloat16 -> ``BF16``, float16 -> ``F16``, float32 -> ``F32``,
bit for bit), 1-D tensors (norms, biases) are written as ``F32`` as llama.cpp's
own converter does (exact: every bf16/f16 value is a float32). Names come from
the ``gguf`` package's `TensorNameMap`; a ``llama`` file (Llama, Mistral) gets
the Q/K row permutation llama.cpp's rope expects (each head's rotary halves
interleaved), Qwen2/Qwen3 rotate halves apart in llama.cpp too (NEOX rope) and
are written as they are. The vocabulary is the checkpoint's byte-level BPE
(``tokenizer.ggml.model`` = ``gpt2``: tokens, types, merges, the pre-tokenizer
by name), padded to the model's vocabulary size with unused tokens.

A GGUF import's kept blocks (Q8_0, Q4_0, Q4_1) go back as they are, bit for bit
(rows of blocks permute as rows of values), the file typed by its projections'
quantization: llama.cpp then runs the very weights the engine serves. ``q8_0``
(like llama.cpp's ``convert_hf_to_gguf.py --outtype q8_0``) quantizes a float
checkpoint's matrices with the ``gguf`` package's Q8_0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from aegaeon_engine.errors import CheckpointError
from aegaeon_engine.loader import checkpoint_index, read_tensor
from aegaeon_engine.spec import ModelSpec
from gguf.quants import quantize

from aegaeon_market.families import LLAMA3_SPLIT, QWEN_SPLIT
from aegaeon_market.gguf_import import llama3_factors
from aegaeon_market.model_files import expected_tensors, kept_blocks

# serving dtype -> (GGML type of the matrices, the file type in general.file_type)
GGML_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "bfloat16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "float16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "float32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
# a GGUF import's kept blocks: their GGML type, and the file's type when the projections
# hold them
BLOCK_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (gguf.GGMLQuantizationType.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
}


# served architecture -> llama.cpp's (whose ``llama`` rotates interleaved pairs: Q/K permuted)
ARCHS: dict[str, gguf.MODEL_ARCH] = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2, "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
}


def permute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's ``permute`` of a Q or K projection: each head's rows from (half, pair)
    to (pair, half); `aegaeon_market.gguf_import.unpermute_rows` undoes it."""
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def write_gguf(model_dir: Path, out: Path, dtype: str | None = None) -> Path:
    """Write ``model_dir``'s checkpoint to ``out`` in ``dtype`` (default: the checkpoint's;
    kept GGUF blocks stay as they are, the other matrices in ``dtype``).

    Raises `CheckpointError` for an architecture, dtype or rope llama.cpp is not given here.
    """
    spec = ModelSpec.from_dir(model_dir)
    dtype = dtype or spec.dtype
    blocks = kept_blocks(spec)
    if spec.quant is not None and not blocks:
        raise CheckpointError(model_dir / "config.json", "quantization_config",
                              f"{spec.quant.linear} weights have no GGUF export (GGUF blocks "
                              "and float weights do)")
    if spec.architecture not in ARCHS:
        raise CheckpointError(model_dir / "config.json", "architectures",
                              f"{spec.architecture} has no GGUF export "
                              f"(supported: {', '.join(sorted(ARCHS))})")
    if dtype not in GGML_TYPES:
        raise CheckpointError(model_dir / "config.json", "dtype",
                              f"{dtype} has no GGUF export (supported: {', '.join(GGML_TYPES)})")
    arch = ARCHS[spec.architecture]
    permute_qk = arch == gguf.MODEL_ARCH.LLAMA
    ggml_type, file_type = GGML_TYPES[dtype]
    if blocks and spec.quant is not None:
        file_type = BLOCK_TYPES[spec.quant.linear][1]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(model_dir.name)
    writer.add_file_type(file_type)
    _add_hparams(writer, spec)
    _add_vocab(writer, model_dir, spec)
    names = gguf.get_tensor_name_map(arch, spec.num_layers)
    index = checkpoint_index(model_dir)
    for hf in expected_tensors(spec):
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None or hf not in index:
            raise CheckpointError(model_dir, hf, "missing tensor" if name else "no GGUF name")
        values = read_tensor(index[hf], hf, blocks=hf in blocks)
        if permute_qk and hf.endswith(("q_proj.weight", "q_proj.bias")):
            values = permute_rows(values, spec.num_heads)
        elif permute_qk and hf.endswith(("k_proj.weight", "k_proj.bias")):
            values = permute_rows(values, spec.num_kv_heads)
        if hf in blocks:  # uint8 [rows, row_bytes]: the writer derives the logical shape
            writer.add_tensor(name, values.numpy(), raw_dtype=BLOCK_TYPES[blocks[hf]][0])
        else:
            try:
                _add_tensor(writer, name, values, ggml_type if values.dim() > 1 else None)
            except ValueError as exc:  # rows that are not whole Q8_0 blocks
                raise CheckpointError(index[hf].file, hf, f"no {dtype} export ({exc})") from None
    if spec.rope.kind == "llama3":  # the per-frequency divisors, as llama.cpp's converter
        factors = llama3_factors(spec.head_dim, spec.rope.theta, spec.rope.factor,
                                 spec.rope.low_freq_factor, spec.rope.high_freq_factor,
                                 spec.rope.original_max_position)
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_hparams(writer: gguf.GGUFWriter, spec: ModelSpec) -> None:
    writer.add_context_length(spec.max_model_len)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)  # head_dim may differ from hidden / heads (Qwen3)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope.theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_vocab_size(spec.vocab_size)
    if spec.rope.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope.factor)
    elif spec.rope.kind == "llama3":
        writer.add_rope_scaling_orig_ctx_len(spec.rope.original_max_position)


def _add_tensor(writer: gguf.GGUFWriter, name: str, values: torch.Tensor,
                ggml_type: gguf.GGMLQuantizationType | None) -> None:
    """``values`` as ``ggml_type`` (None: F32), its bits unchanged when the dtypes agree."""
    if ggml_type in (None, gguf.GGMLQuantizationType.F32):
        writer.add_tensor(name, values.float().numpy())
    elif ggml_type == gguf.GGMLQuantizationType.Q8_0:
        codes = quantize(values.float().numpy(), ggml_type)
        writer.add_tensor(name, codes, raw_dtype=ggml_type)
    elif ggml_type == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, values.to(torch.float16).numpy())
    else:  # numpy has no bfloat16: the raw 16-bit patterns, typed BF16
        bits = values.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(name, bits, raw_shape=bits.shape, raw_dtype=ggml_type)


def pre_tokenizer_name(tokenizer: dict[str, Any]) -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for a ``tokenizer.json``'s splitting rules.

    ``default`` when none of the served families' rules match: llama.cpp then
    splits text its own way (token ids fed directly, as the bench does, are unaffected).
    """
    pre = tokenizer.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre])
    patterns = {s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"}
    kinds = [s.get("type") for s in steps]
    if QWEN_SPLIT in patterns:
        return "qwen2"
    if LLAMA3_SPLIT in patterns:
        return "llama-bpe"
    if kinds == ["Digits", "ByteLevel"]:
        return "smollm"
    if kinds == ["ByteLevel"]:
        return "gpt-2"  # llama.cpp's spelling (it refuses "gpt2")
    return "default"


def _add_vocab(writer: gguf.GGUFWriter, model_dir: Path, spec: ModelSpec) -> None:
    """The byte-level BPE of ``tokenizer.json``, one token per id of the embedding."""
    path = model_dir / "tokenizer.json"
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, None, f"unreadable ({exc})") from None
    model = tokenizer.get("model", {})
    if model.get("type") != "BPE":
        raise CheckpointError(path, "model.type", f"{model.get('type')!r}: only byte-level BPE "
                              "vocabularies are exported")
    kind = gguf.TokenType
    tokens: list[str | None] = [None] * spec.vocab_size
    types = [kind.NORMAL] * spec.vocab_size
    for text, token_id in model.get("vocab", {}).items():
        if token_id < spec.vocab_size:
            tokens[token_id] = text
    for added in tokenizer.get("added_tokens", []):
        if added["id"] < spec.vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = kind.CONTROL if added.get("special") else kind.USER_DEFINED
    for i, text in enumerate(tokens):  # ids the tokenizer leaves unused (embedding padding)
        if text is None:
            tokens[i], types[i] = f"[PAD{i}]", kind.UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    writer.add_token_list([t for t in tokens if t is not None])
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)
    if spec.bos_token_id is not None:
        writer.add_bos_token_id(spec.bos_token_id)
    if spec.eos_token_ids:
        writer.add_eos_token_id(spec.eos_token_ids[0])
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    writer.add_add_bos_token(bool(config.get("add_bos_token", False)))
    if isinstance(config.get("chat_template"), str):
        writer.add_chat_template(config["chat_template"])

