"""Tiny checkpoints for the import tests: dense HF tensors, and GGUF files written from
them the way llama.cpp's converter writes them (gguf writer, quantized, Q/K permuted)."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
TEXT = "Hello, wörld! It costs 1234 coins.\n\tdef f(x):\n        return x  # 🙂"


def market_tree(root: Path) -> dict[str, str]:
    """Every file (hashed) and folder under the market's parent (the market, anything left
    aside): equal before and after, a failed command left nothing behind."""
    return {p.relative_to(root.parent).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.parent.rglob("*"))}


@dataclass(frozen=True)
class Tiny:
    """A tiny model's shape (GGUF metadata and HF config agree on it)."""

    arch: str = "llama"  # gguf architecture: llama, qwen2, qwen3
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    inter: int = 128
    layers: int = 2
    tied: bool = True
    theta: float = 100_000.0
    extra: dict[str, Any] = field(default_factory=dict)  # metadata overrides


@functools.cache
def bpe_json() -> str:
    """A small byte-level BPE (GPT-2 splitting, specials first) trained here, as JSON."""
    from aegaeon_market.tokenizer import corpus_text
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus_text().split("\n\n")[:300], trainer)
    return str(tok.to_str())


def bpe() -> tuple[list[str], list[str]]:
    """Tokens (specials first) and merges of `bpe_json`."""
    model = json.loads(bpe_json())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def hf_tensors(tiny: Tiny, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under their HF names."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(bpe()[0])
    q, kv = tiny.heads * tiny.head_dim, tiny.kv_heads * tiny.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.5

    out = {"model.embed_tokens.weight": rnd(vocab, tiny.hidden)}
    for i in range(tiny.layers):
        p = f"model.layers.{i}"
        out |= {f"{p}.input_layernorm.weight": 1 + rnd(tiny.hidden) * 0.1,
                f"{p}.self_attn.q_proj.weight": rnd(q, tiny.hidden),
                f"{p}.self_attn.k_proj.weight": rnd(kv, tiny.hidden),
                f"{p}.self_attn.v_proj.weight": rnd(kv, tiny.hidden),
                f"{p}.self_attn.o_proj.weight": rnd(tiny.hidden, q),
                f"{p}.post_attention_layernorm.weight": 1 + rnd(tiny.hidden) * 0.1,
                f"{p}.mlp.gate_proj.weight": rnd(tiny.inter, tiny.hidden),
                f"{p}.mlp.up_proj.weight": rnd(tiny.inter, tiny.hidden),
                f"{p}.mlp.down_proj.weight": rnd(tiny.hidden, tiny.inter)}
        if tiny.arch == "qwen2":
            out |= {f"{p}.self_attn.q_proj.bias": rnd(q), f"{p}.self_attn.k_proj.bias": rnd(kv),
                    f"{p}.self_attn.v_proj.bias": rnd(kv)}
        if tiny.arch == "qwen3":
            out |= {f"{p}.self_attn.q_norm.weight": 1 + rnd(tiny.head_dim) * 0.1,
                    f"{p}.self_attn.k_norm.weight": 1 + rnd(tiny.head_dim) * 0.1}
    out["model.norm.weight"] = 1 + rnd(tiny.hidden) * 0.1
    if not tiny.tied:
        out["lm_head.weight"] = rnd(vocab, tiny.hidden)
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``permute``: each head's rotary halves interleaved."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def gguf_values(tiny: Tiny, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array as llama.cpp's converter stores it (Q/K permuted)."""
    out = {}
    for hf, t in tensors.items():
        data = t.numpy().astype(np.float32)
        if tiny.arch == "llama" and ".q_proj." in hf:
            data = llama_cpp_permute(data, tiny.heads)
        elif tiny.arch == "llama" and ".k_proj." in hf:
            data = llama_cpp_permute(data, tiny.kv_heads)
        out[gguf_name(hf)] = data
    return out


def write_gguf(path: Path, tiny: Tiny, tensors: dict[str, torch.Tensor],
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32, *, pre: str = "gpt2",
               add_bos: bool | None = False, raw: dict[str, tuple[np.ndarray, Any]] | None = None,
               skip_keys: tuple[str, ...] = (),
               extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """Write ``tensors`` as llama.cpp would: 2-D weights in ``qtype``, 1-D ones in F32.

    ``raw`` replaces named tensors by ``(bytes array, type)`` as they are;
    ``extra_tensors`` are added as they are (e.g. ``rope_freqs.weight``).
    """
    tokens, merges = bpe()
    arch = tiny.arch
    writer = GGUFWriter(str(path), arch)
    fields: dict[str, Any] = {
        f"{arch}.block_count": tiny.layers, f"{arch}.context_length": 512,
        f"{arch}.embedding_length": tiny.hidden, f"{arch}.feed_forward_length": tiny.inter,
        f"{arch}.attention.head_count": tiny.heads,
        f"{arch}.attention.head_count_kv": tiny.kv_heads,
        f"{arch}.attention.key_length": tiny.head_dim,
        f"{arch}.rope.dimension_count": tiny.head_dim,
        f"{arch}.rope.freq_base": tiny.theta,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.vocab_size": len(tokens),
        **tiny.extra,
    }
    for key, value in fields.items():
        if key in skip_keys:
            continue
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    if "tokenizer.ggml.tokens" not in skip_keys:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_merges(merges)
        writer.add_token_types([TokenType.CONTROL if t in SPECIALS else TokenType.NORMAL
                                for t in tokens])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, data in gguf_values(tiny, tensors).items():
        if raw and name in raw:
            blob, kind = raw[name]
            writer.add_tensor(name, blob, raw_dtype=kind)
        elif data.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, data.astype(np.float16))
        else:
            blob = quantize(data, qtype)
            writer.add_tensor(name, blob, raw_dtype=qtype)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
