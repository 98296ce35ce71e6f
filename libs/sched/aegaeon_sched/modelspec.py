"""Model sizes and profile samples the latency estimators consume."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """The sizes the estimators need (from the model's config.json)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    weight_bytes: int
    kv_bytes_per_token: int

    @property
    def layer_width(self) -> float:
        """``4 h^2 + 2 h m``: the per-layer weight term of Eq. 5-6."""
        h, m = self.hidden_size, self.intermediate_size
        return 4.0 * h * h + 2.0 * h * m


@dataclass(frozen=True)
class PrefillSample:
    model: str
    prompt_lens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    model: str
    batch_size: int
    context_tokens: int
    seconds: float
