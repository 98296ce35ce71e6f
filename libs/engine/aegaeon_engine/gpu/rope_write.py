"""A layer's q/k norm, rope and K/V slot write in one Triton kernel.

In place on ``qkv [N, Hq + 2 Hkv, D]`` (after the fused projection): each q and
k head is RMS-normed with its weight where the model has q/k norms (Qwen3),
rotated by the rope rows of its token's position, and written back; each k
and v head is then written into the token's KV slot (block ``slot_blocks[n]``,
row ``slot_offsets[n]`` of layer ``layer``; a negative block writes nothing: the
warm-up of a graph capture). The positions and slots are read
from device memory and the rope table ``[2, positions, D]`` (cos, and sin with
its first half negated: rope.py) is indexed in the kernel, so a captured graph
replays for any positions. Rounding as model.LayerOps.rope_write and the CPU
kernel: the normed head rounded to the dtype, times the weight rounded, each
rope product rounded, their sum rounded.

One program per (token, head): heads ``[0, Hq)`` are q, ``[Hq, Hq + Hkv)`` k,
the rest v (copied to the slot as they are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_attention import next_pow2


@triton.jit(do_not_specialize=["layer"])
def _rope_write(qkv_ptr, q_norm_ptr, k_norm_ptr, rope_ptr, pos_ptr, blocks_ptr, offsets_ptr,
                cache_ptr, layer, eps,
                stride_n, stride_h, rope_positions,
                stride_cb, stride_cl, stride_ckv, stride_ct, stride_ch,
                NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, DIM: tl.constexpr,
                DIM_PAD: tl.constexpr, HAS_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, DIM_PAD)
    ok = d < DIM
    half: tl.constexpr = DIM // 2
    rolled = (d + half) % DIM  # roll(x, D/2)[d] = x[(d + D/2) % D]
    row = qkv_ptr + token * stride_n + head * stride_h
    dtype = qkv_ptr.dtype.element_ty
    block = tl.load(blocks_ptr + token).to(tl.int64)
    slot = (cache_ptr + layer * stride_cl + block * stride_cb
            + tl.load(offsets_ptr + token).to(tl.int64) * stride_ct)
    if head < NUM_Q + NUM_KV:
        x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
        xr = tl.load(row + rolled, mask=ok, other=0.0).to(tl.float32)
        if HAS_NORM:
            scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / DIM + eps)
            if head < NUM_Q:
                w = tl.load(q_norm_ptr + d, mask=ok, other=0.0).to(tl.float32)
                wr = tl.load(q_norm_ptr + rolled, mask=ok, other=0.0).to(tl.float32)
            else:
                w = tl.load(k_norm_ptr + d, mask=ok, other=0.0).to(tl.float32)
                wr = tl.load(k_norm_ptr + rolled, mask=ok, other=0.0).to(tl.float32)
            x = ((x * scale).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
            xr = ((xr * scale).to(dtype).to(tl.float32) * wr).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cos = tl.load(rope_ptr + pos * DIM + d, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(rope_ptr + (rope_positions + pos) * DIM + d, mask=ok,
                      other=0.0).to(tl.float32)
        y = ((x * cos).to(dtype).to(tl.float32) + (xr * sin).to(dtype).to(tl.float32))
        y = y.to(dtype)
        tl.store(row + d, y, mask=ok)
        if head >= NUM_Q and block >= 0:
            tl.store(slot + (head - NUM_Q) * stride_ch + d, y, mask=ok)
    elif block >= 0:
        v = tl.load(row + d, mask=ok, other=0.0)
        tl.store(slot + stride_ckv + (head - NUM_Q - NUM_KV) * stride_ch + d, v, mask=ok)


def rope_write(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               rope: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, layer: int,
               slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, num_q: int,
               eps: float) -> None:
    """See the module docstring. ``qkv [N, Hq + 2 Hkv, D]`` with a unit stride in D;
    ``rope [2, P, D]`` contiguous, covering every position; ``cache`` the KV region
    ``[num_blocks, layers, 2, block_size, Hkv, D]``."""
    n, heads, dim = qkv.shape
    num_kv = (heads - num_q) // 2
    if qkv.stride(-1) != 1 or not rope.is_contiguous() or rope.shape[-1] != dim:
        raise ValueError(f"rope_write: qkv {tuple(qkv.shape)} (unit stride in D) and a "
                         f"contiguous rope table of head dim {dim} expected")
    if n == 0:
        return
    has_norm = q_norm is not None and k_norm is not None
    _rope_write[(n, heads)](
        qkv, q_norm if has_norm else qkv, k_norm if has_norm else qkv, rope, positions,
        slot_blocks, slot_offsets, cache, layer, eps, qkv.stride(0), qkv.stride(1),
        rope.shape[1], cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        cache.stride(4), NUM_Q=num_q, NUM_KV=num_kv, DIM=dim, DIM_PAD=next_pow2(dim),
        HAS_NORM=has_norm)
