"""``config.json`` and ``generation_config.json`` of a model, as HF writes them.

Keys are written in both spellings where transformers changed them: the hub
form most checkpoints carry (``torch_dtype``, ``rope_theta``,
``rope_scaling``) and the transformers 5 form (``dtype``,
``rope_parameters``). Both describe the same values, so readers of either
generation parse them.
"""

from __future__ import annotations

from typing import Any

from aegaeon_market.families import Family
from aegaeon_market.ladder import Recipe

JsonDict = dict[str, Any]


def _rope(recipe: Recipe) -> tuple[JsonDict | None, JsonDict]:
    """(rope_scaling in the hub form, rope_parameters in the transformers 5 form)."""
    rope = recipe.rope
    if rope.llama3_factor <= 0:
        return None, {"rope_type": "default", "rope_theta": rope.theta}
    scaling: JsonDict = {
        "factor": rope.llama3_factor,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": rope.original_max_positions,
        "rope_type": "llama3",
    }
    return scaling, {**scaling, "rope_theta": rope.theta}


def _token_ids(family: Family) -> tuple[int, int | list[int], int | None]:
    """(bos, eos, pad) ids as the family's real configs give them."""
    ids = family.vocab.special_ids
    bos = ids[family.config_bos_token]
    stops = [ids[t] for t in family.stop_tokens]
    eos: int | list[int] = stops[0] if len(stops) == 1 else stops
    pad = ids[family.pad_token] if family.pad_token else None
    return bos, eos, pad


def config_json(recipe: Recipe, dtype: str) -> JsonDict:
    """The model's ``config.json``."""
    family = recipe.family_spec
    rope_scaling, rope_parameters = _rope(recipe)
    bos, eos, _ = _token_ids(family)
    config: JsonDict = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": family.vocab.size,
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.num_heads,
        "num_key_value_heads": recipe.num_kv_heads,
        "head_dim": recipe.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": recipe.rope.max_positions,
        "rms_norm_eps": family.rms_norm_eps,
        "rope_theta": recipe.rope.theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": recipe.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if family.model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif family.model_type == "mistral":
        # Mistral v0.2+ dropped the sliding window; null keeps attention global.
        config["sliding_window"] = None
    else:
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=recipe.num_layers)
        if family.model_type == "qwen3":
            # Qwen2 always has a qkv bias and its config has no key for it
            config["attention_bias"] = family.qkv_bias
    return config


def generation_config_json(recipe: Recipe) -> JsonDict:
    """The model's ``generation_config.json``: special ids only, greedy by default."""
    bos, eos, pad = _token_ids(recipe.family_spec)
    config: JsonDict = {"bos_token_id": bos, "eos_token_id": eos}
    if pad is not None:
        config["pad_token_id"] = pad
    return config
