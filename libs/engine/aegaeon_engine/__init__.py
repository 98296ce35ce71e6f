"""aegaeon_engine: Llama-family model execution over caller-owned weight and KV memory.

Importing the package (or ``aegaeon_engine.spec`` / ``.layout``) does not import
torch, so a cache process can plan layouts and KV shapes cheaply; the
torch-using names below are imported on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError
from .layout import TensorSlot, WeightLayout, weight_layout
from .spec import KVShape, ModelSpec, RopeSpec

if TYPE_CHECKING:
    from .engine import DecodeSeq, Engine
    from .llm import LLM
    from .loader import fill_layout, load_weights
    from .sampling import Sampler, SamplingParams
    from .weights import LayerWeights, ModelWeights, bind_weights

_LAZY: dict[str, str] = {
    "DecodeSeq": "engine", "Engine": "engine", "LLM": "llm",
    "fill_layout": "loader", "load_weights": "loader", "Sampler": "sampling",
    "SamplingParams": "sampling",
    "LayerWeights": "weights", "ModelWeights": "weights", "bind_weights": "weights",
}

__all__ = [
    "LLM", "CheckpointError", "DecodeSeq", "Engine", "KVShape", "LayerWeights", "ModelSpec",
    "ModelWeights", "RopeSpec", "Sampler", "SamplingParams", "TensorSlot", "WeightLayout",
    "bind_weights", "fill_layout", "load_weights", "weight_layout",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aegaeon_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
