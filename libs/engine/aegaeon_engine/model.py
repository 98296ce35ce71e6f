"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Yi) as plain functions.

No modules, no parameters: ``forward`` reads weight views and the paged KV
cache, and writes the new tokens' K/V into their slots. The families differ
only in optional tensors (q/k/v and o biases, q/k norms) and tied embeddings,
all resolved when the weights were bound.

Activations are ``[N, features]`` tensors whose memory layout depends on N.
For decoding (few tokens) a projection runs as ``(W @ x.T).T`` with the
checkpoint's ``[out, in]`` weight as the left operand: oneDNN's bf16 kernels
are ~30% faster for a skinny right operand than ``x @ W.T``, and a single
token takes the matrix-vector kernel, ~1.5x faster again; the outputs are then
column-major views, which costs little on a handful of rows. From
``ROW_MAJOR_TOKENS`` tokens each output is transposed once to row-major, so
the elementwise work on long rows stays contiguous (still faster than ``x @
W.T`` on short prompts). From ``LINEAR_TOKENS`` tokens (prefill) the
projection is plain ``x @ W.T``: that transposing copy grows with the rows and
cost more than the matmul itself (bf16, 1 thread, a 19M Qwen2's shapes: 1.3-2x
the time of ``F.linear`` at 700 tokens, 1.4-4.8x at 1500; even at 256).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import fp8
from .fp8 import Fp8Tensor
from .quant import QuantTensor, embed, project_reference
from .spec import ModelSpec
from .weights import LayerWeights, ModelWeights

# attend(layer, qkv [N, Hq + 2 * Hkv, D] after rope) -> [N, Hq * D]
AttendFn = Callable[[int, torch.Tensor], torch.Tensor]
# reduce(partial [N, hidden]) -> the sum over a tensor-parallel group's ranks (tp.py)
ReduceFn = Callable[[torch.Tensor], torch.Tensor]
ROW_MAJOR_TOKENS = 16
LINEAR_TOKENS = 192
_FUSED_NORM_MAX = 16384  # elements


@dataclass(frozen=True)
class KVViews:
    """Views of a KV region of blocks laid out ``[layers, 2, block_size, kv_heads, head_dim]``.

    ``cache`` is the region typed, ``[num_blocks, layers, 2, block_size, heads,
    dim]`` (what the native decode kernel reads in place); ``kv[layer]`` is
    ``[num_blocks, block_size, 2, heads, dim]`` striding over whole blocks, so
    one index_put writes a token's K and V of that layer; ``rows`` views the
    region as ``[num_blocks * layers * 2, block_size * heads * dim]`` so one
    index_select gathers a layer's K and V of many blocks as contiguous token rows.
    """

    cache: torch.Tensor
    kv: tuple[torch.Tensor, ...]
    blocks: torch.Tensor  # the region as [num_blocks, block_bytes] uint8
    rows: torch.Tensor
    row_offsets: torch.Tensor  # [layers, 2, 1]: rows of layer l's K and V within a block

    @classmethod
    def over(cls, region: torch.Tensor, spec: ModelSpec, block_size: int,
             dtype: torch.dtype) -> KVViews:
        if region.dtype != torch.uint8 or region.dim() != 1:
            raise ValueError("KV region must be a 1-D uint8 tensor")
        if region.data_ptr() % dtype.itemsize:
            raise ValueError(f"KV region start is not {dtype.itemsize}-byte aligned")
        layers = spec.num_layers
        block_bytes = dtype.itemsize * 2 * layers * block_size * spec.kv_size
        num_blocks = region.numel() // block_bytes
        if num_blocks == 0:
            raise ValueError(f"KV region of {region.numel()} bytes holds no block of "
                             f"{block_bytes} bytes")
        blocks = region[:num_blocks * block_bytes].view(num_blocks, block_bytes)
        typed = blocks.view(dtype).view(num_blocks, layers, 2, block_size,
                                        spec.num_kv_heads, spec.head_dim)
        offsets = torch.arange(layers * 2, device=region.device).view(layers, 2, 1)
        return cls(typed, tuple(typed[:, i].transpose(1, 2) for i in range(layers)), blocks,
                   typed.view(num_blocks * layers * 2, -1), offsets)

    def gather_rows(self, block_table: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per layer, the row indices of K (first n) then V of blocks ``block_table [n]``."""
        layers = len(self.kv)
        return (block_table * (2 * layers) + self.row_offsets).view(layers, -1).unbind(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, rounding as transformers does: float32 statistics,
    one rounding to the serving dtype, then the weight multiply in that dtype.

    For a few rows in a reduced-precision dtype, ``layer_norm`` of ``[x, -x]``
    (whose mean is zero) does the float32 part in one fused kernel; fewer
    kernels matter more than bytes there, since each small op right after a big
    matmul runs with cold caches. Its float32 arithmetic differs in order, so
    about 1e-5 of the outputs differ from transformers' by one bf16 ulp. Float32
    and many rows (prefill) take the plain formula, which is exact.
    """
    size = x.shape[-1]
    if x.dtype != torch.float32 and x.numel() <= _FUSED_NORM_MAX:
        both = torch.cat((x, x.neg()), -1)
        normed = F.layer_norm(both, (2 * size,), None, None, eps)[..., :size]
    else:
        xf = x.float()
        scale = torch.mean(xf * xf, -1, keepdim=True).add_(eps).rsqrt_()
        normed = (xf * scale).to(x.dtype)  # not in place: xf is x itself in float32
    return normed if weight is None else normed.mul_(weight)


def project(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x [N, in]`` (any strides) -> ``[N, out]`` (see above)."""
    n = x.shape[0]
    if n == 1:
        vec = torch.mv(w, x[0]) if bias is None else torch.addmv(bias, w, x[0])
        return vec[None]
    if n >= LINEAR_TOKENS:
        return F.linear(x, w, bias)
    out = torch.mm(w, x.t()) if bias is None else torch.addmm(bias[:, None], w, x.t())
    return out.t() if n < ROW_MAJOR_TOKENS else out.t().contiguous()


@dataclass(frozen=True)
class Tokens:
    """The ``N`` tokens of one forward pass and where their K/V go.

    ``cos``/``sin`` are ``[N, 1, D]`` rope rows of the tokens' positions (``sin``
    with its first half negated, see rope.py); token ``n``'s K/V go to block
    ``slot_blocks[n]``, row ``slot_offsets[n]``. Kernels that index the rope
    table themselves (the Triton ones) read ``positions [N]`` and ``rope [2, P,
    D]`` instead; then ``cos``/``sin`` may be None (``rope_rows`` gathers them).
    """

    token_ids: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    positions: torch.Tensor | None = None
    rope: torch.Tensor | None = None

    def rope_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)``, each ``[N, 1, D]``."""
        if self.cos is not None and self.sin is not None:
            return self.cos, self.sin
        if self.positions is None or self.rope is None:
            raise ValueError("Tokens carry neither rope rows nor positions and a rope table")
        rows = self.rope.index_select(1, self.positions)[:, :, None]
        return rows[0], rows[1]


class LayerOps:
    """A layer's per-token work around attention, in torch (any device); kernels.py
    overrides it with native kernels on CPU."""

    def project(self, w: torch.Tensor, x: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ w.T (+ bias)`` for ``x [N, in]`` -> ``[N, out]``."""
        if isinstance(w, QuantTensor):
            return project_reference(w, x, bias)
        if isinstance(w, Fp8Tensor):  # scaled-mm, or this projection of the dequantized rows
            return fp8.project(w, x, bias, self.project)
        return project(w, x, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None,
                 eps: float) -> torch.Tensor:
        """RMSNorm of the rows of ``x`` (see ``rms_norm``)."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                     eps: float) -> torch.Tensor:
        """``h += delta`` in place (the residual stream), then ``rms_norm(h)``."""
        h.add_(delta)
        return self.rms_norm(h, weight, eps)

    def rope_write(self, qkv: torch.Tensor, lw: LayerWeights, kv: KVViews, layer: int,
                   tokens: Tokens, num_q: int, eps: float) -> None:
        """In place on ``qkv [N, Hq + 2 Hkv, D]``: q/k norm (if the model has it) and
        rope of the q and k heads; then K and V of every token into its KV slot."""
        n, heads, dim = qkv.shape
        num_kv = (heads - num_q) // 2
        qk = qkv[:, :num_q + num_kv]
        src = qk
        if lw.q_norm is not None and lw.k_norm is not None:
            src = rms_norm(qk, None, eps)
            src[:, :num_q].mul_(lw.q_norm)
            src[:, num_q:].mul_(lw.k_norm)
        # rope, written back into qkv so K and V stay adjacent for one slot write
        cos, sin = tokens.rope_rows()
        torch.add(src * cos, src.roll(dim // 2, -1).mul_(sin), out=qk)
        kv.kv[layer].index_put_((tokens.slot_blocks, tokens.slot_offsets),
                                qkv[:, num_q:].view(n, 2, num_kv, dim))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up [N, 2F] = [gate | up]`` -> ``[N, F]``."""
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate, inplace=True).mul_(up)


TORCH_OPS = LayerOps()


def forward(w: ModelWeights, kv: KVViews, tokens: Tokens, attend: AttendFn,
            ops: LayerOps = TORCH_OPS, reduce: ReduceFn | None = None) -> torch.Tensor:
    """Hidden states ``[N, hidden]`` (before the final norm) of ``tokens``.

    ``w`` may be one tensor-parallel shard (tp_layout.py): then o_proj and
    down_proj give partial sums, which ``reduce`` adds up over the group."""
    spec = w.spec
    n, eps = tokens.token_ids.shape[0], spec.rms_norm_eps
    heads = spec.num_heads + 2 * spec.num_kv_heads
    h = embed(tokens.token_ids, w.embed_tokens, w.dtype)  # the residual stream, [N, hidden]
    # each residual add is left to the next norm (ops.add_rms_norm: one kernel on Triton)
    pending: torch.Tensor | None = None
    for i, lw in enumerate(w.layers):
        x = (ops.rms_norm(h, lw.input_norm, eps) if pending is None
             else ops.add_rms_norm(h, pending, lw.input_norm, eps))
        qkv = ops.project(lw.qkv, x, lw.qkv_bias).view(n, heads, spec.head_dim)
        ops.rope_write(qkv, lw, kv, i, tokens, spec.num_heads, eps)
        attn_out = ops.project(lw.o_proj, attend(i, qkv), lw.o_bias)
        x = ops.add_rms_norm(h, attn_out if reduce is None else reduce(attn_out), lw.post_norm,
                             eps)
        gate_up = ops.project(lw.gate_up, x, None)
        mlp_out = ops.project(lw.down, ops.silu_mul(gate_up), None)
        pending = mlp_out if reduce is None else reduce(mlp_out)
    if pending is not None:
        h.add_(pending)
    return h


def logits(w: ModelWeights, hidden: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
    """float32 logits ``[N, vocab]`` of hidden states ``[N, hidden]``."""
    out = ops.project(w.lm_head, ops.rms_norm(hidden, w.norm, w.spec.rms_norm_eps), None)
    return torch.empty(out.shape, dtype=torch.float32, device=out.device).copy_(out)
