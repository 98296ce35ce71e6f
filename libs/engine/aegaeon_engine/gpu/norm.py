"""RMSNorm in Triton, one program per row, rounding where transformers rounds.

``y = round(x * rsqrt(mean(x^2) + eps)) * w``: float32 statistics, one rounding
to the serving dtype, then the weight multiply in that dtype (one more rounding),
as model.rms_norm's exact formula. With ``residual`` the row is first
``x += residual`` in place (rounded to the dtype, as torch's ``add_``), which
saves the residual add's kernel before each norm of a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import next_pow2


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
              SIZE: tl.constexpr, SIZE_PAD: tl.constexpr, HAS_RES: tl.constexpr,
              HAS_WEIGHT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, SIZE_PAD)
    ok = cols < SIZE
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=ok)
    xf = x.to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / SIZE + eps)
    y = (xf * scale).to(out_ptr.dtype.element_ty)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x [N, size]`` (unit stride in ``size``); with ``residual``
    ``x += residual`` first, in place."""
    rows, size = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm: rows must have a unit stride")
    out = torch.empty(rows, size, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm[(rows,)](x, res, weight if weight is not None else x, out, x.stride(0),
                       res.stride(0), out.stride(0), eps, SIZE=size,
                       SIZE_PAD=next_pow2(size), HAS_RES=residual is not None,
                       HAS_WEIGHT=weight is not None)
    return out
