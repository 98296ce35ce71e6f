"""Checkpoint tensor names and shapes of a recipe, as Hugging Face names them.

Torch-free, so planning a market (names carry parameter counts) stays light.
"""

from __future__ import annotations

import hashlib
import math

from aegaeon_market.ladder import Recipe

Shapes = dict[str, tuple[int, ...]]


def tensor_shapes(recipe: Recipe) -> Shapes:
    """Every checkpoint tensor, in the order HF checkpoints list them."""
    family = recipe.family_spec
    h, d = recipe.hidden_size, recipe.head_dim
    q_dim, kv_dim = recipe.num_heads * d, recipe.num_kv_heads * d
    shapes: Shapes = {"model.embed_tokens.weight": (family.vocab.size, h)}
    for i in range(recipe.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if family.qkv_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        if family.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (recipe.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (recipe.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, recipe.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not recipe.tie_embeddings:
        shapes["lm_head.weight"] = (family.vocab.size, h)
    return shapes


def param_count(recipe: Recipe) -> int:
    """Number of parameters, counting tied embeddings once (as HF does)."""
    return sum(math.prod(shape) for shape in tensor_shapes(recipe).values())


def weight_seed(market_seed: int, index: int) -> int:
    """Generator seed of the model at ``index``: stable and distinct per pair."""
    digest = hashlib.sha256(f"aegaeon-market:{market_seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
