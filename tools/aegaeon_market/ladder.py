"""Model sizes of the market: the default ladder and the small profile.

Sizes follow the shape of the paper's Table 1 at toy scale: layers, KV heads
and head dim differ between models, so the KV cache holds several block
shapes at once. Decode at batch 1 on a CPU core is a few ms for the small
ones and tens of ms for the largest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from aegaeon_market.families import FAMILIES, Family, Vocab


@dataclass(frozen=True)
class Rope:
    """Rotary position settings; ``llama3_factor`` > 0 adds Llama 3.1 scaling."""

    theta: float
    max_positions: int
    llama3_factor: float = 0.0
    original_max_positions: int = 0


@dataclass(frozen=True)
class Recipe:
    """One rung of the ladder: a family plus the sizes of one model.

    ``vocab`` replaces the family's vocabulary (a real model's, `presets`).
    """

    stem: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_embeddings: bool
    rope: Rope
    # the mid-size model benchmarks use by default
    bench: bool = False
    vocab: Vocab | None = None

    @property
    def family_spec(self) -> Family:
        """The family, with this recipe's own vocabulary if it has one."""
        family = FAMILIES[self.family]
        return family if self.vocab is None else replace(family, vocab=self.vocab)


_LLAMA3_ROPE = Rope(theta=500_000.0, max_positions=8192)
_LLAMA31_ROPE = Rope(theta=500_000.0, max_positions=16_384, llama3_factor=8.0,
                     original_max_positions=2048)

# Order matters: the first four are the four variants, then sizes grow, so
# `--models N` for any N < 8 mixes families. Names (stem + rounded parameter
# count) are used by other rooms' tests: keep them stable when tuning sizes.
LADDER: tuple[Recipe, ...] = (
    Recipe("llama-gqa", "llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
           head_dim=64, intermediate_size=768, tie_embeddings=True, rope=_LLAMA3_ROPE),
    Recipe("mistral", "mistral", hidden_size=384, num_layers=5, num_heads=6, num_kv_heads=3,
           head_dim=64, intermediate_size=1024, tie_embeddings=False,
           rope=Rope(theta=10_000.0, max_positions=32_768)),
    Recipe("qwen2", "qwen2", hidden_size=448, num_layers=6, num_heads=7, num_kv_heads=1,
           head_dim=64, intermediate_size=1664, tie_embeddings=True,
           rope=Rope(theta=1_000_000.0, max_positions=32_768)),
    Recipe("qwen3", "qwen3", hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4,
           head_dim=128, intermediate_size=1664, tie_embeddings=True,
           rope=Rope(theta=1_000_000.0, max_positions=40_960), bench=True),
    Recipe("llama", "llama", hidden_size=640, num_layers=8, num_heads=10, num_kv_heads=2,
           head_dim=64, intermediate_size=1792, tie_embeddings=False, rope=_LLAMA31_ROPE),
    Recipe("mistral", "mistral", hidden_size=768, num_layers=9, num_heads=12, num_kv_heads=4,
           head_dim=64, intermediate_size=2048, tie_embeddings=False,
           rope=Rope(theta=1_000_000.0, max_positions=32_768)),
    Recipe("qwen2", "qwen2", hidden_size=768, num_layers=8, num_heads=6, num_kv_heads=2,
           head_dim=128, intermediate_size=3008, tie_embeddings=False,
           rope=Rope(theta=1_000_000.0, max_positions=32_768)),
    Recipe("qwen3", "qwen3", hidden_size=1024, num_layers=6, num_heads=16, num_kv_heads=8,
           head_dim=128, intermediate_size=3200, tie_embeddings=True,
           rope=Rope(theta=1_000_000.0, max_positions=40_960)),
)

# `--profile small`: only the three smallest rungs, for sweeps with many models.
PROFILES: dict[str, tuple[Recipe, ...]] = {
    "default": LADDER,
    "small": LADDER[:3],
}
