"""model.LayerOps on the Triton kernels: what a layer runs on a CUDA device.

Per layer of a decode step: RMSNorm with the residual add before it (norm.py,
one kernel each, twice), the fused qkv projection (cuBLAS), q/k norm + rope +
the K/V slot write (rope_write.py, one kernel), paged attention
(paged_attention.py, one kernel, plus a combine where the context is split),
o_proj, gate_up, silu-mul and down (cuBLAS and two torch kernels).

FP8 weights: a decode batch (<= ``GEMV_MAX_ROWS`` rows) multiplies the codes
in a Triton GEMV with the activations as they are; larger batches quantize the
activations in one kernel and run ``torch._scaled_mm`` where the device has FP8
tensor cores, else the dequantized weight's dense matmul (fp8.py's fallback,
logged once). Block-quantized (GGUF) weights take the torch reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .. import fp8
from ..fp8 import Fp8Tensor
from ..model import KVViews, LayerOps, Tokens
from ..quant import QuantTensor, project_reference
from ..weights import LayerWeights
from . import fp8 as triton_fp8
from .norm import rms_norm
from .rope_write import rope_write

_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


class TritonOps(LayerOps):
    """The Triton kernels where they apply (unit strides, float dtypes), else torch."""

    def project(self, w: torch.Tensor, x: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(w, QuantTensor):
            return project_reference(w, x, bias)
        if isinstance(w, Fp8Tensor):
            return project_fp8(w, x, bias)
        return F.linear(x, w, bias)  # cuBLAS; row-major [N, out] for the kernels after it

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> torch.Tensor:
        if x.dtype not in _DTYPES or x.dim() != 2 or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                     eps: float) -> torch.Tensor:
        if (h.dtype not in _DTYPES or h.dim() != 2 or h.stride(-1) != 1
                or delta.dtype != h.dtype or delta.stride(-1) != 1):
            return super().add_rms_norm(h, delta, weight, eps)
        return rms_norm(h, weight, eps, residual=delta)

    def rope_write(self, qkv: torch.Tensor, lw: LayerWeights, kv: KVViews, layer: int,
                   tokens: Tokens, num_q: int, eps: float) -> None:
        if (qkv.dtype not in _DTYPES or qkv.stride(-1) != 1 or tokens.positions is None
                or tokens.rope is None):
            super().rope_write(qkv, lw, kv, layer, tokens, num_q, eps)
            return
        rope_write(qkv, lw.q_norm, lw.k_norm, tokens.rope, tokens.positions, kv.cache, layer,
                   tokens.slot_blocks, tokens.slot_offsets, num_q, eps)


@functools.cache
def _fp8_loads(device: torch.device) -> bool:
    """Whether Triton reads e4m3 on ``device`` (CUDA capability >= 8.9; the interpreter)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= fp8.SCALED_MM_CAPABILITY


def project_fp8(w: Fp8Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` of an FP8 weight on the Triton kernels (module docstring)."""
    if (x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= triton_fp8.GEMV_MAX_ROWS
            and _fp8_loads(x.device)):
        return triton_fp8.fp8_gemv(x.contiguous(), w.as_subclass(torch.Tensor), w.scale, bias)
    if fp8.fallback_reason(w, x) is None:
        xq, x_scale = triton_fp8.quantize_rows(x.contiguous())
        out = torch._scaled_mm(xq, w.as_subclass(torch.Tensor).t(), scale_a=x_scale,
                               scale_b=w.scale[None, :], out_dtype=x.dtype)
        return out if bias is None else out.add_(bias)
    return fp8.project(w, x, bias, lambda wd, xd, b: F.linear(xd, wd, b))
