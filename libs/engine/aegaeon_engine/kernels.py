"""A layer's per-token ops on CPU with the native kernels (native.py, csrc/dense.cpp,
csrc/attention.cpp): ``NativeOps`` overrides model.LayerOps where a kernel
applies (dtype, strides, batch size), per call, and defers to torch elsewhere.

- ``project`` for decode-sized batches (<= 16 rows): a decode step streams every
  weight once, and the kernel reads the row-major ``[out, in]`` views in place
  (AMX tiles on bfloat16) at close to memory bandwidth, ~1.3-3x faster than
  oneDNN through ``torch.mm``; it returns row-major ``[N, out]``.
- ``rms_norm``, ``rope_write`` (q/k norm, rope and the K/V slot write) and
  ``silu_mul``: one pass each instead of 4-6 torch kernels (a decode step
  runs hundreds of such small kernels), rounding where transformers rounds.

Float16, and bfloat16 projections without AVX512-BF16, stay on torch.
"""

from __future__ import annotations

from typing import Any

import torch

from .model import KVViews, LayerOps, Tokens
from .native import native_ops
from .weights import LayerWeights

NATIVE_MAX_ROWS = 16  # the native projection's limit: decode batches
_ELEMENTWISE = frozenset((torch.float32, torch.bfloat16))


class NativeOps(LayerOps):
    """The native kernels where they apply, else the torch code of ``LayerOps``."""

    def __init__(self, ops: Any) -> None:
        """``ops``: ``torch.ops.aegaeon`` with the kernels loaded."""
        self._ops = ops
        self.project_dtypes: frozenset[torch.dtype] = frozenset(
            dtype for dtype in _ELEMENTWISE if ops.linear_supported(dtype))

    def project(self, w: torch.Tensor, x: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        n = x.shape[0]
        if n > NATIVE_MAX_ROWS or w.dtype not in self.project_dtypes:
            return super().project(w, x, bias)
        out = torch.empty(n, w.shape[0], dtype=w.dtype, device=w.device)
        self._ops.linear(out, x, w, bias)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> torch.Tensor:
        if x.dtype not in _ELEMENTWISE or x.dim() != 2 or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._ops.rms_norm(out, x, weight, eps)
        return out

    def rope_write(self, qkv: torch.Tensor, lw: LayerWeights, kv: KVViews, layer: int,
                   tokens: Tokens, num_q: int, eps: float) -> None:
        if qkv.dtype not in _ELEMENTWISE or qkv.stride(-1) != 1:
            super().rope_write(qkv, lw, kv, layer, tokens, num_q, eps)
            return
        self._ops.rope_write(qkv, lw.q_norm, lw.k_norm, tokens.cos[:, 0], tokens.sin[:, 0],
                             kv.cache, layer, tokens.slot_blocks, tokens.slot_offsets, num_q,
                             eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype not in _ELEMENTWISE or gate_up.stride(-1) != 1:
            return super().silu_mul(gate_up)
        n, size = gate_up.shape
        out = torch.empty(n, size // 2, dtype=gate_up.dtype, device=gate_up.device)
        self._ops.silu_mul(out, gate_up)
        return out


def layer_ops(device: torch.device, native: bool = True) -> LayerOps:
    """The native kernels on CPU when they load (and ``native``), else the torch code."""
    ops = native_ops() if native and device.type == "cpu" else None
    return LayerOps() if ops is None else NativeOps(ops)
