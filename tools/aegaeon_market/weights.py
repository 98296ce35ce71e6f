"""Seeded random values for a recipe's checkpoint tensors.

Scales are chosen for the tests that compare our engine's greedy tokens with
transformers', not for training: logits wide enough that greedy ties are rare
and greedy text does not collapse into one repeated token (what they give on
the default market: docs/results.md, "Numbers behind defaults").
"""

from __future__ import annotations

import torch
from aegaeon_engine.random_weights import Sizes
from aegaeon_engine.random_weights import value_scale as _value_scale

from aegaeon_market.ladder import Recipe
from aegaeon_market.shapes import tensor_shapes

# Untied output rows get log-normal norms (this sigma): the logits get a
# heavier upper tail, which widens the top-1/top-2 gap without raising the std.
LM_HEAD_ROW_SIGMA = 0.25


def value_scale(name: str, shape: tuple[int, ...], recipe: Recipe) -> tuple[float, float]:
    """(std, mean) of a weight's values: standard normal draws are scaled, then shifted
    (``aegaeon_engine.random_weights``, shared with the weights the Model Cache generates
    at load)."""
    sizes = Sizes(recipe.hidden_size, recipe.num_layers, recipe.tie_embeddings)
    return _value_scale(name, shape, sizes)


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
