"""GGUF block-quantized matrices (q8_0, q4_0, q4_1) served as such.

A quantized slot of the packed layout (layout.py) is bound as a ``QuantTensor``:
the slot's bytes as uint8 ``[out, row_bytes]`` (whole 32-element blocks, GGUF's
order, ``aegaeon_common.dtypes.QUANT_BLOCKS``) that also carries its
quantization and logical ``[out, in]`` shape. Torch functions see plain bytes
(``__torch_function__`` is off: no dispatch cost on the decode path); only this
module and the native kernels (csrc/quant.cpp) read it as weights.

- ``dequantize``: the reference, in torch (float32, the formulas of GGML and the
  ``gguf`` package); the torch path and the tests use it.
- ``project_quant``: ``x @ W.T`` for the native path: decode-sized batches on the
  kernel that dequantizes in registers (``qlinear``); prefill-sized ones
  dequantize a block of rows at a time to float32 (``qdequant``) for torch's
  float32 GEMM, the result rounded to ``x``'s dtype once.
- ``embed``: the embedding rows of some token ids, dequantized.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from aegaeon_common.dtypes import QUANT_BLOCKS, quant_row_bytes

# GGML's type numbers (the kernels' ``qtype`` argument)
GGML_TYPES: dict[str, int] = {"q8_0": 8, "q4_0": 2, "q4_1": 3}
QUANT_MAX_ROWS = 16  # the native kernel's limit: decode batches
# weight elements dequantized per prefill block: 8 MiB of float32 (kernels.py's rule)
_BLOCK_ELEMS = 1 << 21


class QuantTensor(torch.Tensor):
    """The bytes of a block-quantized ``[out, in]`` matrix: uint8 ``[out, row_bytes]``."""

    qtype: str
    in_features: int
    # torch ops on it run as on its bytes (and return plain tensors)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def over(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> QuantTensor:
        """``raw`` (1-D uint8, the slot's bytes) as the quantized matrix of ``shape``."""
        rows, in_features = shape
        data = raw.view(rows, quant_row_bytes(qtype, in_features))
        out = torch.Tensor._make_subclass(QuantTensor, data)
        out.qtype, out.in_features = qtype, in_features
        return out

    @property
    def out_features(self) -> int:
        return int(self.shape[0])


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, as float32 ``[..., 1]``."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).float()


def dequantize(data: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """float32 ``[rows, in_features]`` of quantized rows ``data`` (uint8 ``[rows, row_bytes]``)."""
    if qtype not in QUANT_BLOCKS:
        raise ValueError(f"unknown quantization {qtype!r} (known: {sorted(QUANT_BLOCKS)})")
    elems, nbytes = QUANT_BLOCKS[qtype]
    rows = data.shape[0]
    blocks = data.reshape(rows, in_features // elems, nbytes)
    d = _half(blocks, 0)
    if qtype == "q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, in_features)
    start = 4 if qtype == "q4_1" else 2
    qs = blocks[..., start:start + elems // 2]
    q = torch.cat((qs & 15, qs >> 4), -1).float()
    w = d * q + _half(blocks, 2) if qtype == "q4_1" else d * (q - 8)
    return w.reshape(rows, in_features)


def quantize_x(x: torch.Tensor) -> torch.Tensor:
    """``x [N, in]`` as the decode kernel sees it (csrc/quant.cpp): per block of 32,
    ``d = max|x| / 127`` and ``round(x * (1 / d))`` (to nearest even; 0 where ``d`` is
    0), returned dequantized (``d * q``, float32); the same float32 operations."""
    n, size = x.shape
    blocks = x.float().reshape(n, size // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    return (q * d).reshape(n, size)


def dequantize_weight(w: QuantTensor) -> torch.Tensor:
    """float32 ``[out, in]`` of ``w``."""
    return dequantize(w, w.qtype, w.in_features)


def embed(token_ids: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``token_ids`` of an embedding table (quantized or float) in ``dtype``."""
    if isinstance(table, QuantTensor):
        rows = table.index_select(0, token_ids)
        return dequantize(rows, table.qtype, table.in_features).to(dtype)
    return F.embedding(token_ids, table)


def project_reference(w: QuantTensor, x: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantize(w).T (+ bias)`` in float32, rounded to ``x``'s dtype (the torch
    path: the whole matrix dequantized per call)."""
    out = F.linear(x.float(), dequantize_weight(w), None if bias is None else bias.float())
    return out.to(x.dtype)


def project_quant(ops: Any, w: QuantTensor, x: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with a level's kernels ``ops`` (see the module docstring);
    ``x [N, in]`` float32 or bfloat16 -> ``[N, out]`` in its dtype."""
    n = x.shape[0]
    qtype = GGML_TYPES[w.qtype]
    if n <= QUANT_MAX_ROWS:
        out = torch.empty(n, w.shape[0], dtype=x.dtype, device=x.device)
        ops.qlinear(out, x, w, qtype, bias)
        return out
    xf = x.float()
    out_features, in_features = w.shape[0], w.in_features
    rows = max(16, _BLOCK_ELEMS // in_features)
    scratch = torch.empty(min(rows, out_features), in_features, dtype=torch.float32)
    result = torch.empty(n, out_features, dtype=x.dtype, device=x.device)
    for start in range(0, out_features, rows):
        end = min(start + rows, out_features)
        block = scratch[:end - start]
        ops.qdequant(block, w[start:end], qtype)
        part = torch.mm(xf, block.t())
        if bias is not None:
            part += bias[start:end]
        result[:, start:end] = part
    return result
