"""A layer's per-token ops on CPU with the native kernels (native.py, csrc/dense.cpp,
csrc/attention.cpp): ``NativeOps`` overrides model.LayerOps where a kernel
applies (dtype, strides, batch size), per call, and defers to torch elsewhere.

- ``project`` for decode-sized batches (<= 16 rows): a decode step streams every
  weight once, and the kernel reads the row-major ``[out, in]`` views in place
  at close to memory bandwidth (AMX tiles on bfloat16 at the amx level,
  bfloat16 widened to float32 in registers below it), faster than oneDNN
  through ``torch.mm``; it returns row-major ``[N, out]``.
- ``project`` for prefill-sized inputs with bfloat16 weights on a CPU that has
  no native bfloat16 arithmetic (``bf16_native`` false: AVX2, AVX-512 without
  BF16, NEON): the weight stays bfloat16 in memory, but is converted to
  float32 a block of rows at a time (a block stays in cache for its matmul)
  and multiplied by float32 ``x`` with torch's float32 GEMM; the result is
  rounded to bfloat16 once, as a bfloat16 matmul rounds. Torch's own bfloat16
  matmul there is emulated, several times slower.
- ``project`` for float32 prefill: ``F.linear`` (row-major ``[N, out]`` straight
  from MKL; ``model.project``'s ``W @ x.T`` suits oneDNN's bfloat16 kernels).
- ``rms_norm``, ``rope_write`` (q/k norm, rope and the K/V slot write) and
  ``silu_mul``: one pass each instead of 4-6 torch kernels (a decode step
  runs hundreds of such small kernels), rounding where transformers rounds.

- ``project`` of a block-quantized weight (quant.py): the level's kernel that
  dequantizes in registers for decode batches, float32 GEMMs of blocks of
  dequantized rows for prefill.
- ``project`` of an FP8 weight (fp8.py): on the CPU it is dequantized to the
  activations' dtype per call and takes the dense paths above.
- ``decode_layers``: a decode step's whole stack of layers in one native call
  (csrc/stack.cpp: the same kernels in the same order, called from C++), where
  every projection of the model runs on these kernels (``layer_stack``). A deep
  model's step at batch 1 spent ~30% of its time between ~11 kernel calls a
  layer made from Python.

Float16 stays on torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import fp8
from .fp8 import Fp8Tensor
from .model import KVViews, LayerOps, Tokens
from .native import bf16_native, native_isa, native_ops
from .quant import GGML_TYPES, QuantTensor, project_quant
from .weights import LayerWeights, ModelWeights

NATIVE_MAX_ROWS = 16  # the native projection's limit: decode batches
_ELEMENTWISE = frozenset((torch.float32, torch.bfloat16))
# weight elements converted per block: 8 MiB of float32, held in a last-level cache; one
# GEMM per projection for most models (larger blocks ran 5-15% faster than 512 KiB ones
# on an AMD EPYC: fewer, larger GEMMs and no strided writes of partial results)
_BLOCK_ELEMS = 1 << 21


def project_widened(w: torch.Tensor, x: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` in float32 arithmetic for reduced-precision ``w`` and ``x``:
    ``w`` converted a block of rows at a time (one block, one GEMM, for most
    projections), the result rounded to ``w.dtype`` once."""
    xf = x.float()
    out_features = w.shape[0]
    rows = max(16, _BLOCK_ELEMS // max(1, w.shape[1]))
    if rows >= out_features:
        return F.linear(xf, w.float(), None if bias is None else bias.float()).to(w.dtype)
    out = torch.empty(x.shape[0], out_features, dtype=w.dtype, device=w.device)
    for start in range(0, out_features, rows):
        end = min(start + rows, out_features)
        block = torch.mm(xf, w[start:end].float().t())
        if bias is not None:
            block += bias[start:end]
        out[:, start:end] = block
    return out


@dataclass(frozen=True)
class LayerStack:
    """A model's decoder layers as the arguments of ``decode_layers`` (csrc/stack.cpp):
    per layer its 2 norms, 4 projections (qkv, o, gate_up, down; ``qtypes`` 0 for a
    dense one, else its GGML type), 2 biases (qkv, o) and the q/k norms."""

    norms: list[torch.Tensor]
    projs: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    qk_norms: list[torch.Tensor | None]
    qtypes: list[int]


class NativeOps(LayerOps):
    """The native kernels where they apply, else the torch code of ``LayerOps``."""

    def __init__(self, ops: Any, isa: str, *, project: tuple[str, Any | None] | None = None,
                 widen_prefill: bool | None = None) -> None:
        """``ops``: ``torch.ops.aegaeon_<isa>`` with the kernels loaded (the elementwise
        ops and, by default, the decode projection); ``project``: the decode
        projection's level and namespace instead (``("torch", None)``: torch's
        matmul); ``widen_prefill``: bfloat16 prefill GEMMs in float32 (default: where
        bfloat16 is not native at ``isa``)."""
        self._ops = ops
        self.isa = isa
        self.project_isa, project_ops = project or (isa, ops)
        self._project_ops: Any = project_ops
        self.project_dtypes: frozenset[torch.dtype] = frozenset(
            dtype for dtype in _ELEMENTWISE
            if project_ops is not None and project_ops.linear_supported(dtype))
        self.bf16_native = bf16_native(isa)
        self.widen_prefill = not self.bf16_native if widen_prefill is None else widen_prefill

    def with_choice(self, project: tuple[str, Any | None],
                    widen_prefill: bool) -> NativeOps:
        """These elementwise kernels with another decode projection and prefill rule."""
        return NativeOps(self._ops, self.isa, project=project, widen_prefill=widen_prefill)

    def project(self, w: torch.Tensor, x: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(w, QuantTensor):  # the decode projection's level runs quantized too
            return project_quant(self._project_ops or self._ops, w, x, bias)
        if isinstance(w, Fp8Tensor):  # dequantized rows take the dense paths below
            return fp8.project(w, x, bias, self.project)
        n = x.shape[0]
        if n > NATIVE_MAX_ROWS or w.dtype not in self.project_dtypes:
            if w.dtype == torch.bfloat16 and self.widen_prefill and n > NATIVE_MAX_ROWS:
                return project_widened(w, x, bias)
            if w.dtype == torch.float32:  # MKL's sgemm, row-major out: no transposing copy
                return F.linear(x, w, bias)
            return super().project(w, x, bias)
        out = torch.empty(n, w.shape[0], dtype=w.dtype, device=w.device)
        self._project_ops.linear(out, x, w, bias)
        return out

    def layer_stack(self, w: ModelWeights) -> LayerStack | None:
        """``w``'s layers for ``decode_layers`` when every projection runs on this level's
        native kernels (dense in a supported dtype, or GGUF-quantized), else None."""
        if w.dtype not in _ELEMENTWISE or self._project_ops is None:
            return None
        stack = LayerStack([], [], [], [], [])
        for lw in w.layers:
            for proj in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
                if isinstance(proj, QuantTensor) and proj.qtype in GGML_TYPES:
                    stack.qtypes.append(GGML_TYPES[proj.qtype])
                elif type(proj) is torch.Tensor and proj.dtype == w.dtype \
                        and proj.dtype in self.project_dtypes and proj.stride(-1) == 1:
                    stack.qtypes.append(0)
                else:
                    return None
                stack.projs.append(proj)
            stack.norms.extend((lw.input_norm, lw.post_norm))
            stack.biases.extend((lw.qkv_bias, lw.o_bias))
            stack.qk_norms.extend((lw.q_norm, lw.k_norm))
        return stack

    def decode_layers(self, stack: LayerStack, h: torch.Tensor, kv: KVViews, tokens: Tokens,
                      attention: Any, block_table: torch.Tensor, context_lens: torch.Tensor,
                      num_q: int, eps: float) -> None:
        """In place on the residual stream ``h [B, hidden]`` of a decode step: every
        layer of ``stack`` (model.forward's loop), attention on the namespace
        ``attention``'s ``paged_decode``."""
        cos, sin = tokens.rope_rows()
        self._ops.decode_layers(h, stack.norms, stack.projs, stack.biases, stack.qk_norms,
                                stack.qtypes, cos[:, 0], sin[:, 0], kv.cache,
                                tokens.slot_blocks, tokens.slot_offsets, block_table,
                                context_lens, num_q, eps, kv.cache.shape[-1] ** -0.5,
                                self._project_ops.name, attention.name)

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
        cos, sin = tokens.rope_rows()
        self._ops.rope_write(qkv, lw.q_norm, lw.k_norm, cos[:, 0], sin[:, 0], kv.cache, layer,
                             tokens.slot_blocks, tokens.slot_offsets, num_q, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype not in _ELEMENTWISE or gate_up.stride(-1) != 1:
            return super().silu_mul(gate_up)
        n, size = gate_up.shape
        out = torch.empty(n, size // 2, dtype=gate_up.dtype, device=gate_up.device)
        self._ops.silu_mul(out, gate_up)
        return out


def layer_ops(device: torch.device, native: bool = True, isa: str | None = None) -> LayerOps:
    """The native kernels on CPU when they load (and ``native``), else the torch code;
    ``isa``: that level's kernels (default: ``native_isa()``)."""
    if not native or device.type != "cpu":
        return LayerOps()
    level = isa or native_isa()
    ops = native_ops(isa) if level is not None else None
    return LayerOps() if ops is None or level is None else NativeOps(ops, level)
