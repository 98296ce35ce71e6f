"""FP8 projections in Triton: activation quantization in one kernel, and a GEMV.

- :func:`quantize_rows`: ``x [N, K]`` to e4m3 codes with one float32 scale per row
  (``max(amax(|x[n]|) / 448, 1e-12)``), as ``fp8.project_scaled`` does in ~7 torch
  kernels (float, abs, amax, div, clamp, div, clamp, cast): one read of ``x``
  for the maximum, one to quantize.
- :func:`fp8_gemv`: ``x @ W.T * scale (+ bias)`` for a decode batch (``N <=
  GEMV_MAX_ROWS``) straight from the FP8 codes, the activations kept in their
  16-bit dtype: each program reads ``BLOCK_M`` weight rows once for every row of
  ``x``. Products of e4m3 codes (3 mantissa bits) and bf16/f16 activations are
  exact in TF32, sums in float32, then one multiply by the row scale and one
  rounding. The weight is read at one byte per element and the activations
  need no quantization pass, where ``torch._scaled_mm`` (cuBLASLt) pads a
  handful of rows to a tensor-core tile and quantizes them first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import next_pow2

FP8_MAX = 448.0
MIN_SCALE = 1e-12
GEMV_MAX_ROWS = 16
_QUANT_CHUNK = 1024
_GEMV_BLOCK_M = 16
_GEMV_BLOCK_K = 256


@triton.jit
def _quantize_rows(x_ptr, out_ptr, scale_ptr, stride_x, stride_o, size,
                   CHUNK: tl.constexpr, FP8_LIMIT: tl.constexpr, SCALE_MIN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], tl.float32)
    for first in range(0, size, CHUNK):
        ok = first + cols < size
        x = tl.load(x_ptr + row * stride_x + first + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / FP8_LIMIT, SCALE_MIN)
    tl.store(scale_ptr + row, scale)
    for first in range(0, size, CHUNK):
        ok = first + cols < size
        x = tl.load(x_ptr + row * stride_x + first + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
        tl.store(out_ptr + row * stride_o + first + cols, q.to(out_ptr.dtype.element_ty),
                 mask=ok)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [N, K] float8_e4m3fn, scale [N, 1] float32)`` of ``x [N, K]`` (unit stride
    in K), per row as ``fp8.project_scaled`` quantizes."""
    rows, size = x.shape
    if x.stride(-1) != 1:
        raise ValueError("quantize_rows: rows must have a unit stride")
    out = torch.empty(rows, size, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows[(rows,)](x, out, scale, x.stride(0), out.stride(0), size,
                                CHUNK=min(_QUANT_CHUNK, next_pow2(size)), FP8_LIMIT=FP8_MAX,
                                SCALE_MIN=MIN_SCALE)
    return out, scale


@triton.jit
def _fp8_gemv(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, rows, out_features, size,
              stride_x, stride_w, stride_o,
              ROWS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    block = tl.program_id(0)
    n = tl.arange(0, ROWS_PAD)
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < rows
    m_ok = m < out_features
    acc = tl.zeros([ROWS_PAD, BLOCK_M], tl.float32)
    for first in range(0, size, BLOCK_K):
        k_ok = first + k < size
        x = tl.load(x_ptr + n[:, None].to(tl.int64) * stride_x + first + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + m[:, None].to(tl.int64) * stride_w + first + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision="tf32")
    scale = tl.load(scale_ptr + m, mask=m_ok, other=0.0)
    y = acc * scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + m, mask=m_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + n[:, None].to(tl.int64) * stride_o + m[None, :],
             y.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def fp8_gemv(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (codes * scale[:, None]).T (+ bias)`` for ``x [N, K]`` (N <= GEMV_MAX_ROWS,
    unit stride in K), ``codes [M, K]`` float8_e4m3fn, ``scale [M]`` float32 -> ``[N, M]``
    in ``x``'s dtype."""
    rows, size = x.shape
    out_features = codes.shape[0]
    if rows > GEMV_MAX_ROWS or x.stride(-1) != 1 or codes.stride(-1) != 1:
        raise ValueError(f"fp8_gemv: at most {GEMV_MAX_ROWS} rows with unit strides, got "
                         f"{tuple(x.shape)}")
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows:
        grid = (triton.cdiv(out_features, _GEMV_BLOCK_M),)
        _fp8_gemv[grid](x, codes, scale, bias if bias is not None else scale, out, rows,
                        out_features, size, x.stride(0), codes.stride(0), out.stride(0),
                        ROWS_PAD=GEMV_MAX_ROWS, BLOCK_M=_GEMV_BLOCK_M,
                        BLOCK_K=_GEMV_BLOCK_K, HAS_BIAS=bias is not None)
    return out
