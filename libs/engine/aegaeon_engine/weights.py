"""Typed views of a model's weights over a caller-owned byte buffer.

Binding allocates nothing: every tensor is a dtype/shape view of ``buffer``,
so a model switch is "copy the bytes, bind again" and the buffer's owner (the
device buffer's bump arena, a shared-memory Model Cache) stays the owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import Fp8Tensor
from .layout import TensorSlot, WeightLayout
from .quant import QuantTensor
from .spec import FP8, ModelSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. ``qkv`` rows are [q; k; v], ``gate_up`` rows are [gate; up].

    Norms and biases are 1-D.
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass(frozen=True)
class ModelWeights:
    """All weights of one model; ``lm_head`` is ``embed_tokens`` when tied. A quantized
    model's matrices are ``QuantTensor``s (GGUF blocks) or ``Fp8Tensor``s; ``dtype`` is
    its float tensors' (and the activations')."""

    spec: ModelSpec
    dtype: torch.dtype
    embed_tokens: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor


def _view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    raw = buffer[slot.offset:slot.offset + slot.nbytes]
    if slot.dtype == FP8:  # e4m3 codes and row scales (fp8.py)
        return Fp8Tensor.over(raw, slot.shape)
    if slot.dtype not in TORCH_DTYPES:  # a block quantization (quant.py)
        return QuantTensor.over(raw, slot.dtype, slot.shape)
    return raw.view(TORCH_DTYPES[slot.dtype]).view(slot.shape)


def checked_dtype(buffer: torch.Tensor, layout: WeightLayout, what: str) -> torch.dtype:
    """``layout``'s float dtype, once ``buffer`` is known to hold it: 1-D uint8 of at least
    ``layout.total_bytes``, its start aligned to the dtype (ValueError naming ``what``)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"{what} buffer must be 1-D uint8, got {buffer.dtype} "
                         f"{tuple(buffer.shape)}")
    if buffer.numel() < layout.total_bytes:
        raise ValueError(f"{what} buffer holds {buffer.numel()} bytes, layout of "
                         f"{layout.model!r} needs {layout.total_bytes}")
    dtype = TORCH_DTYPES[layout.dtype]
    if buffer.data_ptr() % dtype.itemsize:
        raise ValueError(f"{what} buffer start is not {dtype.itemsize}-byte aligned")
    return dtype


def bind_weights(spec: ModelSpec, layout: WeightLayout, buffer: torch.Tensor) -> ModelWeights:
    """Views of ``layout``'s slots over ``buffer`` (a 1-D uint8 tensor, any device).

    ``buffer`` must start where the layout's byte 0 is and hold
    ``layout.total_bytes``; its start must be aligned to the dtype's size.
    """
    dtype = checked_dtype(buffer, layout, "weights")
    slots = layout.by_name

    def get(name: str) -> torch.Tensor:
        return _view(buffer, slots[name])

    def opt(name: str) -> torch.Tensor | None:
        return _view(buffer, slots[name]) if name in slots else None

    layers = tuple(
        LayerWeights(
            input_norm=get(f"layers.{i}.input_norm"), qkv=get(f"layers.{i}.qkv_proj"),
            qkv_bias=opt(f"layers.{i}.qkv_bias"), q_norm=opt(f"layers.{i}.q_norm"),
            k_norm=opt(f"layers.{i}.k_norm"), o_proj=get(f"layers.{i}.o_proj"),
            o_bias=opt(f"layers.{i}.o_bias"), post_norm=get(f"layers.{i}.post_norm"),
            gate_up=get(f"layers.{i}.gate_up_proj"), down=get(f"layers.{i}.down_proj"),
        )
        for i in range(spec.num_layers)
    )
    embed = get("embed_tokens")
    lm_head = embed if spec.tie_word_embeddings else get("lm_head")
    return ModelWeights(spec, dtype, embed, layers, get("norm"), lm_head)
