"""Paged decode attention in Triton: one query per row over its context, read in place.

The KV region is the engine's per-layer layout (model.KVViews.cache):
``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``. Row ``b`` of a
step has ``context_lens[b]`` positions, position ``t`` in block
``block_table[b, t // block_size]`` at row ``t % block_size``; both tables are
read from device memory, so a CUDA graph captured once replays for any mix of
lengths. Nothing is padded or gathered: a program reads exactly its row's
blocks.

One program per (row, KV head, split). It loads the KV head's K and V once
for all ``group = q_heads / kv_heads`` query heads of that KV head (grouped-query
attention without repeating K/V; the group is padded to 16 rows for
``tl.dot``), runs an online softmax over tiles of ``TILE`` positions, and either
writes the normalised output (one split) or its partial maximum, sum and
accumulator for :func:`_combine` (flash-decoding: a small batch still fills
the GPU). A row of context 0 (a padding row of a captured batch) writes zeros.

The scores and the accumulator are float32; the probabilities meet V in
TF32 for 16-bit caches (bf16/f16 inputs are exact in it) and in IEEE float32
for float32 caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
MIN_ROWS = 16  # tl.dot's smallest tile side


def next_pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(0, n - 1).bit_length())


@triton.jit(do_not_specialize=["layer"])
def _paged_decode(q_ptr, cache_ptr, table_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr,
                  layer, scale_log2,
                  stride_qb, stride_qh,
                  stride_cb, stride_cl, stride_ckv, stride_ct, stride_ch,
                  stride_tb, stride_ob, stride_oh,
                  NUM_Q: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  TILE: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + row).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    # this split's positions: [start, end), whole tiles except the last
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    base = cache_ptr + layer * stride_cl + kv_head * stride_ch
    table = table_ptr + row.to(tl.int64) * stride_tb
    for first in range(start, end, TILE):
        t = first + tl.arange(0, TILE)
        t_ok = t < end
        block = tl.load(table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        offsets = block * stride_cb + (t % BLOCK_SIZE).to(tl.int64) * stride_ct
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(base + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        scores = tl.where(t_ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(base + stride_ckv + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        m = m_new
    if NUM_SPLITS == 1:
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(out_ptr + row.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                 + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        # partials [rows, NUM_Q, NUM_SPLITS, (DIM_PAD | 2)]: accumulator, (max, sum)
        part = (row.to(tl.int64) * NUM_Q + heads) * NUM_SPLITS + split
        tl.store(acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=g_ok[:, None])
        tl.store(ml_ptr + part * 2, m, mask=g_ok)
        tl.store(ml_ptr + part * 2 + 1, total, mask=g_ok)


@triton.jit
def _combine(out_ptr, acc_ptr, ml_ptr, stride_ob, stride_oh,
             NUM_Q: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
             NUM_SPLITS: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, DIM_PAD)
    part = (row.to(tl.int64) * NUM_Q + head) * NUM_SPLITS + s
    m = tl.load(ml_ptr + part * 2)
    total = tl.load(ml_ptr + part * 2 + 1)
    m_all = tl.max(m, 0)
    # an empty split has max -inf and sum 0; a row of context 0 has only empty splits
    weight = tl.where(total > 0, tl.exp2(m - tl.where(m_all > float("-inf"), m_all, 0.0)), 0.0)
    acc = tl.load(acc_ptr + part[:, None] * DIM_PAD + d[None, :])
    num = tl.sum(acc * weight[:, None], 0)
    den = tl.sum(total * weight, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_ob + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def num_splits_for(rows: int, kv_heads: int, target_programs: int = 256,
                   max_splits: int = 16) -> int:
    """Splits of each row's context so that ``rows x kv_heads x splits`` programs fill a
    GPU (a power of two; fixed per batch size, so a captured graph keeps it)."""
    want = -(-target_programs // max(1, rows * kv_heads))
    return min(max_splits, next_pow2(want))


def paged_decode(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, layer: int,
                 block_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 num_splits: int = 1, tile: int | None = None) -> torch.Tensor:
    """``out [R, Hq, D]`` = attention of ``q [R, Hq, D]`` (unit stride in D) over row
    ``r``'s ``context_lens[r]`` positions in blocks ``block_table[r]`` of layer
    ``layer`` of ``cache [num_blocks, layers, 2, block_size, Hkv, D]``.

    ``block_table [R, W]`` may have row stride 0 (one sequence's table for every
    row, as a prefill chunk's tokens have); ``num_splits`` a power of two."""
    rows, num_q, dim = q.shape
    _, _, _, block_size, num_kv, cache_dim = cache.shape
    if cache_dim != dim or num_q % num_kv or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} and cache {tuple(cache.shape)} "
                         "disagree (or a head dim is strided)")
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    group = num_q // num_kv
    dim_pad = next_pow2(dim, MIN_ROWS)
    tile = tile or (64 if dim_pad <= 128 else 32)
    if num_splits > 1:
        acc = torch.empty(rows * num_q * num_splits * dim_pad, dtype=torch.float32,
                          device=q.device)
        ml = torch.empty(rows * num_q * num_splits * 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # unused
    precision = "ieee" if cache.dtype == torch.float32 else "tf32"
    _paged_decode[(rows, num_kv, num_splits)](
        q, cache, block_table, context_lens, out, acc, ml, layer, scale * LOG2_E,
        q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), cache.stride(4),
        block_table.stride(0), out.stride(0), out.stride(1),
        NUM_Q=num_q, GROUP=group, GROUP_PAD=next_pow2(group, MIN_ROWS), HEAD_DIM=dim,
        DIM_PAD=dim_pad, BLOCK_SIZE=block_size, TILE=tile, NUM_SPLITS=num_splits,
        PRECISION=precision)
    if num_splits > 1:
        _combine[(rows, num_q)](out, acc, ml, out.stride(0), out.stride(1), NUM_Q=num_q,
                                HEAD_DIM=dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits)
    return out
