"""Projections ``x @ w.T (+ bias)``: on CPU, the native skinny kernel for decode-sized
batches (native.py, csrc/decode_linear.cpp); torch (model.project) otherwise.

A decode step streams every weight once for a handful of rows, so its
projections are bound by reading the weights: the native kernel reads them in
place (AMX tiles straight from the row-major ``[out, in]`` views) at close to
the memory's bandwidth, ~1.3-3x faster than oneDNN through ``torch.mm``, and
returns a row-major ``[N, out]`` tensor. Prefill-sized inputs, dtypes the build
cannot run (float16; bfloat16 without AVX512-BF16) and CUDA take torch.
"""

from __future__ import annotations

import torch

from .model import project
from .native import native_ops

NATIVE_MAX_ROWS = 16  # the kernel's limit: decode batches


class Linear:
    """``project(w, x, bias)`` with the device's fastest kernel for the shape."""

    def __init__(self, device: torch.device, native: bool = True) -> None:
        """``native=False`` keeps torch everywhere (as ``AEGAEON_NATIVE=0`` does)."""
        self._ops = native_ops() if native and device.type == "cpu" else None
        self.native_dtypes: frozenset[torch.dtype] = frozenset(
            dtype for dtype in (torch.bfloat16, torch.float32)
            if self._ops is not None and self._ops.linear_supported(dtype))

    def __call__(self, w: torch.Tensor, x: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        n = x.shape[0]
        if n > NATIVE_MAX_ROWS or w.dtype not in self.native_dtypes:
            return project(w, x, bias)
        out = torch.empty(n, w.shape[0], dtype=w.dtype, device=w.device)
        assert self._ops is not None  # native_dtypes is empty otherwise
        self._ops.linear(out, x, w, bias)
        return out
