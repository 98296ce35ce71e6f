"""Shared helpers of the engine tests: tiny transformers-made checkpoints and references."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from aegaeon_engine import Engine, ModelSpec, load_weights, weight_layout

VOCAB = 256
# The four variants, each small enough that transformers' reference runs in ~1 s.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", {
        "num_key_value_heads": 2,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    }),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2, "sliding_window": 4096}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"num_key_value_heads": 2, "head_dim": 32,
                              "tie_word_embeddings": True}),
}


def make_checkpoint(out: Path, variant: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides: Any) -> Path:
    """Write a random ``variant`` checkpoint with transformers' ``save_pretrained``."""
    import transformers

    class_name, extra = VARIANTS[variant]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
        "initializer_range": 0.08, "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-6,
    }
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    return out


def hf_greedy(model_dir: Path, prompts: Sequence[Sequence[int]],
              num_tokens: int) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)`` for each prompt alone, in float32, no EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def hf_last_logits(model_dir: Path, prompt: Sequence[int]) -> torch.Tensor:
    """transformers' float32 logits of the last prompt position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([list(prompt)])).logits[0, -1].float()


class Bound:
    """An engine bound to one checkpoint in float32, with a block allocator for tests."""

    def __init__(self, model_dir: Path, num_blocks: int = 64, engine: Engine | None = None,
                 dtype: str = "float32") -> None:
        self.spec = ModelSpec.from_dir(model_dir)
        self.layout = weight_layout(self.spec, dtype)
        self.weights = torch.empty(self.layout.total_bytes, dtype=torch.uint8)
        load_weights(model_dir, self.spec, self.layout, self.weights)
        self.kv = torch.zeros(num_blocks * self.spec.kv_shape(dtype).block_bytes,
                              dtype=torch.uint8)
        self.engine = engine or Engine()
        self.dtype = dtype
        self.bind()

    def bind(self) -> None:
        self.engine.bind(self.spec, self.weights, self.kv, self.dtype)

    def greedy(self, prompts: Sequence[Sequence[int]], num_tokens: int,
               blocks: Sequence[Sequence[int]]) -> list[list[int]]:
        return greedy(self.engine, prompts, num_tokens, blocks)


def greedy(engine: Engine, prompts: Sequence[Sequence[int]], num_tokens: int,
           blocks: Sequence[Sequence[int]]) -> list[list[int]]:
    """Prefill each prompt, then decode all of them together greedily."""
    outs = [[int(engine.prefill(p, b).argmax())] for p, b in zip(prompts, blocks, strict=True)]
    for _ in range(num_tokens - 1):
        outs = decode_step(engine, prompts, outs, blocks)
    return outs


def decode_step(engine: Engine, prompts: Sequence[Sequence[int]], outs: list[list[int]],
                blocks: Sequence[Sequence[int]]) -> list[list[int]]:
    """One batched greedy decode step of every sequence."""
    from aegaeon_engine import DecodeSeq

    seqs = [DecodeSeq(o[-1], len(p) + len(o) - 1, b)
            for p, o, b in zip(prompts, outs, blocks, strict=True)]
    tokens = engine.decode(seqs).argmax(-1).tolist()
    return [[*o, t] for o, t in zip(outs, tokens, strict=True)]


def block_lists(num_seqs: int, per_seq: int, shuffle_seed: int = 0) -> list[list[int]]:
    """Disjoint, shuffled block ids (so sequences do not occupy consecutive blocks)."""
    ids = torch.randperm(num_seqs * per_seq, generator=torch.Generator().manual_seed(shuffle_seed))
    return [ids[i * per_seq:(i + 1) * per_seq].tolist() for i in range(num_seqs)]


def prompts_of(lengths: Sequence[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def add_tokenizer(model_dir: Path) -> Path:
    """A word-level tokenizer (``w3 w17 ...``) and a chat template for the CLI tests."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model_dir / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}w10 {{ m['content'] }} w11 {% endfor %}"
                "{% if add_generation_prompt %}w12{% endif %}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "w1 ", "eos_token": "w2", "chat_template": template}))
    return model_dir
