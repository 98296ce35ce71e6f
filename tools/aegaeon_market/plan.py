"""Which models a market holds: names, seeds and roles, before any file is written."""

from __future__ import annotations

from dataclasses import dataclass, replace

from aegaeon_common.market_index import MarketError

from aegaeon_market.ladder import PROFILES, Recipe
from aegaeon_market.shapes import param_count, weight_seed

ROLE_BENCH = "bench"



@dataclass(frozen=True)
class ModelPlan:
    """One model to write: its directory name, recipe, weight seed and role."""

    name: str
    recipe: Recipe
    seed: int
    params: int
    role: str = ""


def _suffix(cycle: int) -> str:
    """'' for the first pass over the ladder, then -b, -c, ..., -z, -27, -28, ..."""
    if cycle == 0:
        return ""
    return f"-{chr(ord('a') + cycle)}" if cycle < 26 else f"-{cycle + 1}"


def model_name(recipe: Recipe, cycle: int = 0) -> str:
    """``<stem>-<params in millions>m[-suffix]``, e.g. ``qwen3-28m`` or ``qwen2-19m-b``."""
    millions = max(1, round(param_count(recipe) / 1e6))
    return f"{recipe.stem}-{millions}m{_suffix(cycle)}"


def plan_market(num_models: int, seed: int, profile: str = "default") -> list[ModelPlan]:
    """The first ``num_models`` models of the profile's ladder, repeated cyclically.

    Repeats get fresh weights (their seed depends on the position) and a
    suffix. Exactly one model gets the ``bench`` role: the first copy of the
    ladder's bench rung if present, else the median-size model.
    """
    if profile not in PROFILES:
        raise MarketError(f"unknown profile {profile!r}; choose from {', '.join(PROFILES)}")
    if num_models < 1:
        raise MarketError(f"a market needs at least one model, got {num_models}")
    ladder = PROFILES[profile]
    plans = []
    for index in range(num_models):
        cycle, rung = divmod(index, len(ladder))
        recipe = ladder[rung]
        plans.append(ModelPlan(model_name(recipe, cycle), recipe, weight_seed(seed, index),
                               param_count(recipe)))
    bench = next((i for i, p in enumerate(plans) if p.recipe.bench), None)
    if bench is None:
        by_size = sorted(range(len(plans)), key=lambda i: (plans[i].params, i))
        bench = by_size[(len(by_size) - 1) // 2]
    plans[bench] = replace(plans[bench], role=ROLE_BENCH)
    return plans
