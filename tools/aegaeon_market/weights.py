"""Seeded random values for a recipe's checkpoint tensors.

Scales are chosen for the tests that compare our engine's greedy tokens with
transformers', not for training: logits wide enough that greedy ties are rare
and greedy text does not collapse into one repeated token (what they give on
the default market: docs/results.md, "Numbers behind defaults").
"""

from __future__ import annotations

import math

import torch

from aegaeon_market.ladder import Recipe
from aegaeon_market.shapes import tensor_shapes

# Standard deviation of the final logits over the vocabulary: wide enough
# that greedy decoding is rarely near a tie.
LOGIT_STD = 6.0
# Untied output rows get log-normal norms (this sigma): the logits get a
# heavier upper tail, which widens the top-1/top-2 gap without raising the std.
LM_HEAD_ROW_SIGMA = 0.25
# Each residual branch (attention, MLP) adds about this many embedding RMS.
BRANCH_GAIN = 2.0
# With tied embeddings the current token's own logit is boosted by about
# sqrt(hidden) / (RMS(stream) / RMS(embedding)) standard deviations; branches
# are scaled up until that boost is SELF_BOOST, or greedy text repeats the
# input token forever.
SELF_BOOST = 1.0
# Attention logits get a std of about QK_GAIN^2, peaked enough that outputs
# depend on the context and not only on the last token (uniform attention
# makes random models loop). Qwen3 normalises q and k, so there it is the
# q_norm/k_norm weight.
QK_GAIN = 1.6
QKV_BIAS_STD = 0.2
# Norm weights are near 1 but not exactly 1, so an engine that skips or
# swaps a norm weight produces different tokens.
NORM_JITTER = 0.1


def branch_gain(recipe: Recipe) -> float:
    """Residual branch scale, relative to the embedding RMS."""
    if not recipe.tie_embeddings:
        return BRANCH_GAIN
    needed = (recipe.hidden_size / SELF_BOOST**2 - 1) / (2 * recipe.num_layers)
    return max(BRANCH_GAIN, math.sqrt(needed))


def _std(name: str, fan_in: int, recipe: Recipe, embed_rms: float) -> float:
    """Standard deviation of one weight; inputs to every matmul are RMS-normalised."""
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return QK_GAIN / math.sqrt(fan_in)
    if name.endswith(("v_proj.weight", "gate_proj.weight", "up_proj.weight")):
        return 1.0 / math.sqrt(fan_in)
    if name.endswith("o_proj.weight"):
        # the attention output averages value rows, so it is smaller than one row
        return 2.0 * branch_gain(recipe) * embed_rms / math.sqrt(fan_in)
    if name.endswith("down_proj.weight"):
        # silu(gate) * up has an RMS of about 0.6 for unit-RMS gate and up
        return branch_gain(recipe) * embed_rms / (0.6 * math.sqrt(fan_in))
    if name == "lm_head.weight":
        return LOGIT_STD / math.sqrt(recipe.hidden_size)
    if name.endswith("bias"):
        return QKV_BIAS_STD
    raise KeyError(name)


def embedding_rms(recipe: Recipe) -> float:
    """RMS of the embedding: with tied embeddings it doubles as the output projection, so
    it sets the logit spread; otherwise unit."""
    return LOGIT_STD / math.sqrt(recipe.hidden_size) if recipe.tie_embeddings else 1.0


def value_scale(name: str, shape: tuple[int, ...], recipe: Recipe) -> tuple[float, float]:
    """(std, mean) of a weight's values: standard normal draws are scaled, then shifted."""
    if name.endswith("norm.weight"):
        gain = QK_GAIN if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
        return NORM_JITTER * gain, gain
    if name == "model.embed_tokens.weight":
        return embedding_rms(recipe), 0.0
    return _std(name, shape[-1], recipe, embedding_rms(recipe)), 0.0


def _value(name: str, shape: tuple[int, ...], recipe: Recipe,
           gen: torch.Generator) -> torch.Tensor:
    # in place: the largest tensors are ~100 MB, temporaries double the time
    value = torch.randn(shape, generator=gen)
    std, mean = value_scale(name, shape, recipe)
    value.mul_(std)
    if mean:
        value.add_(mean)
    if name == "lm_head.weight":
        row_scale = torch.exp(torch.randn(shape[0], 1, generator=gen) * LM_HEAD_ROW_SIGMA)
        value.mul_(row_scale / row_scale.pow(2).mean().sqrt())
    return value


def init_weights(recipe: Recipe, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded random weights; the same (recipe, seed, dtype) gives the same bytes.

    Values are drawn in float32 from one generator in checkpoint order, scaled
    by `value_scale`, then cast.
    """
    gen = torch.Generator().manual_seed(seed)
    return {
        name: _value(name, shape, recipe, gen).to(dtype).contiguous()
        for name, shape in tensor_shapes(recipe).items()
    }
