"""FP8 (e4m3) matrices with per-output-row scales, served as such.

An FP8 slot of the packed layout (layout.py, ``aegaeon_common.dtypes.FP8``) is
bound as an ``Fp8Tensor``: the codes as ``float8_e4m3fn [out, in]`` over the
slot's first bytes, carrying ``scale``, the float32 ``[out]`` row scales stored
after them (``w[r] = scale[r] * code[r]``, ``scale = amax(|w[r]|) / 448``). The
Model Cache and a switch move these bytes as they are: one byte per weight plus
four per row.

- ``quantize`` / ``dequantize``: float ``[out, in]`` to codes and scales and back
  (the market writes FP8 checkpoints with ``quantize``).
- ``project``: ``x @ W.T (+ bias)``. On a CUDA device of compute capability
  >= 8.9 (Ada, Hopper) ``torch._scaled_mm`` multiplies the codes directly, the
  activations quantized to e4m3 per token (``project_scaled``); anywhere else
  the weight is dequantized to the activations' dtype (one rounding of
  ``code * scale``) and multiplied by the caller's own dense projection, with one
  log line per process saying why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import cache

import torch
from aegaeon_common.dtypes import FP8_MAX, fp8_scales_offset

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
SCALED_MM_CAPABILITY = (8, 9)  # the first CUDA devices with FP8 tensor cores
_SCALED_MM_ALIGN = 16  # cuBLASLt's FP8 GEMM: both matrix dims multiples of 16
_SCALED_MM_OUT = frozenset((torch.bfloat16, torch.float16))
_MIN_SCALE = 1e-12  # an all-zero activation row: any positive scale gives zero codes
DenseProject = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
_fallback_logged = threading.Event()  # set once the fallback's line is logged


class Fp8Tensor(torch.Tensor):
    """The e4m3 codes of an ``[out, in]`` matrix, with its float32 row ``scale [out]``."""

    scale: torch.Tensor
    # torch ops on it run as on its codes (and return plain tensors)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def over(raw: torch.Tensor, shape: tuple[int, ...]) -> Fp8Tensor:
        """``raw`` (1-D uint8, an FP8 slot's bytes) as the matrix of ``shape``."""
        rows, in_features = shape
        codes = raw[:rows * in_features].view(FP8_DTYPE).view(rows, in_features)
        start = fp8_scales_offset(rows, in_features)
        out = torch.Tensor._make_subclass(Fp8Tensor, codes)
        out.scale = raw[start:start + 4 * rows].view(torch.float32)
        return out

    @property
    def out_features(self) -> int:
        return int(self.shape[0])


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of float ``w [out, in]``: e4m3 codes and float32 ``[out]`` scales,
    each row scaled so its largest magnitude is 448 (an all-zero row gets scale 1)."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"FP8 quantizes a float matrix, got {w.dtype} {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("FP8 quantization of a matrix with inf or nan values")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale[r] * codes[r]`` in float32, rounded once to ``dtype``."""
    return (codes.float() * scale.float()[:, None]).to(dtype)


def dequantize_weight(w: Fp8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``w`` as a dense ``dtype`` matrix."""
    return dequantize(w, w.scale, dtype)


@cache
def _device_reason(device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` is not used on ``device`` (None: it is)."""
    if device.type != "cuda":
        return f"device {device.type} has no FP8 matmul"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < SCALED_MM_CAPABILITY:
        need = ".".join(map(str, SCALED_MM_CAPABILITY))
        return f"{device} has compute capability {major}.{minor} < {need}"
    return None


def fallback_reason(w: Fp8Tensor, x: torch.Tensor) -> str | None:
    """Why ``x @ w.T`` cannot run on ``torch._scaled_mm`` (None: it can)."""
    reason = _device_reason(x.device)
    if reason is not None:
        return reason
    if x.dtype not in _SCALED_MM_OUT:
        return f"activations are {x.dtype} (scaled-mm writes bfloat16 or float16)"
    if w.shape[0] % _SCALED_MM_ALIGN or w.shape[1] % _SCALED_MM_ALIGN:
        return f"a {tuple(w.shape)} matrix is not in multiples of {_SCALED_MM_ALIGN}"
    return None


def _log_fallback(reason: str) -> None:
    if not _fallback_logged.is_set():
        _fallback_logged.set()
        log.warning("FP8 matmuls fall back to dequantized weights and a dense matmul: %s",
                    reason)


def project_scaled(w: Fp8Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` on ``torch._scaled_mm``: ``x [N, in]`` quantized per token (row
    scale ``amax / 448``), the output in ``x``'s dtype."""
    xf = x.float()
    x_scale = xf.abs().amax(1, keepdim=True).div_(FP8_MAX).clamp_(min=_MIN_SCALE)
    xq = (xf / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    codes = w.as_subclass(torch.Tensor)
    out = torch._scaled_mm(xq, codes.t(), scale_a=x_scale, scale_b=w.scale[None, :],
                           out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def project(w: Fp8Tensor, x: torch.Tensor, bias: torch.Tensor | None,
            dense: DenseProject) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [N, in]``: ``project_scaled`` where the device and
    shapes allow, else ``dense`` (the caller's projection) of the dequantized weight."""
    reason = fallback_reason(w, x)
    if reason is None:
        return project_scaled(w, x, bias)
    _log_fallback(reason)
    return dense(dequantize_weight(w, x.dtype), x, bias)
