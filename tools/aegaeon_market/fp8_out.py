"""FP8 checkpoints as the market writes them (``market add --dtype fp8``).

The layer projections (q, k, v, o, gate, up, down) are stored as e4m3 codes
(``F8_E4M3 [out, in]``) with per-output-row float32 scales beside each
(``<name>_scale``, ``[out, 1]``), as compressed-tensors' FP8 checkpoints with
channel-wise weight scales are; embeddings, norms, biases and the output layer
stay bfloat16. ``config.json`` says so in its ``quantization_config``, which the
engine reads back (``aegaeon_engine.spec``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from aegaeon_engine.fp8 import FP8_DTYPE, quantize
from aegaeon_engine.loader import scale_name

from aegaeon_market.safetensors_out import TensorPlan

FLOAT_DTYPE = "bfloat16"  # every tensor that is not a projection
PROJECTIONS = tuple(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"))
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "symmetric": True, "dynamic": True},
    }},
    "ignore": ["lm_head"],
}


def is_projection(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is stored as FP8."""
    return name.endswith(PROJECTIONS)


def fp8_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a ``config.json``) for the FP8 checkpoint."""
    return {**config, "torch_dtype": FLOAT_DTYPE, "dtype": FLOAT_DTYPE,
            "quantization_config": QUANTIZATION_CONFIG}


def fp8_plans(shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[TensorPlan]:
    """The checkpoint's tensors: each projection's codes then its scales, the rest in
    bfloat16."""
    plans = []
    for name, shape in shapes:
        if is_projection(name):
            plans += [TensorPlan(name, FP8_DTYPE, shape),
                      TensorPlan(scale_name(name), torch.float32, (shape[0], 1))]
        else:
            plans.append(TensorPlan(name, torch.bfloat16, shape))
    return plans


def fp8_tensors(tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``fp8_plans`` from float ``tensors`` (in the same order)."""
    for name, tensor in tensors:
        if is_projection(name):
            codes, scale = quantize(tensor)
            yield name, codes
            yield scale_name(name), scale[:, None]
        else:
            yield name, tensor.to(torch.bfloat16)
