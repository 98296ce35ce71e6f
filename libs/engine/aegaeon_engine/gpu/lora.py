"""The LoRA term of a batch on CUDA: Triton kernels that read only each row's adapter.

Two kernels per targeted module (Punica's BGMV, over the stacked matrices of
lora.LoraStack, each row pointing at its adapter's columns):

- ``shrink``: ``t[n, :r] = scale_n * (x[n] @ A[c_n : c_n + r_n]^T)`` in float32, one
  program per row (a row of the base has rank 0 and gets zeros);
- ``expand``: ``out[n, span] += t[n, :r_n] @ B[:, c_n : c_n + r_n]^T``, one program
  per row and block of output columns, rounded once into ``out``'s dtype.

lora.TritonLoraStep runs them for a step.

On the CPU they run only in Triton's interpreter (``TRITON_INTERPRET=1``, set
before this module is imported): that is how the tests check them against the
torch term (lora.LoraStep). Nothing imports this module unless a step runs on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features a shrink program reads at a time
BLOCK_O = 64  # output columns of an expand program


@triton.jit
def _shrink(x_ptr, a_ptr, t_ptr, starts_ptr, ranks_ptr, scales_ptr, in_features,
            stride_xn, stride_xk, stride_a, stride_tn,
            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0)
    start = tl.load(starts_ptr + n)
    rank = tl.load(ranks_ptr + n)
    scale = tl.load(scales_ptr + n)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + n * stride_xn + k * stride_xk, mask=k < in_features, other=0.0)
        a = tl.load(a_ptr + (start + r)[:, None] * stride_a + k[None, :],
                    mask=(r[:, None] < rank) & (k[None, :] < in_features), other=0.0)
        acc += tl.sum(a.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
    tl.store(t_ptr + n * stride_tn + r, acc * scale)


@triton.jit
def _expand(t_ptr, b_ptr, out_ptr, starts_ptr, ranks_ptr, out_features,
            stride_tn, stride_b, stride_on, stride_oc,
            BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
    n = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    start = tl.load(starts_ptr + n)
    rank = tl.load(ranks_ptr + n)
    r = tl.arange(0, BLOCK_R)
    t = tl.load(t_ptr + n * stride_tn + r, mask=r < rank, other=0.0)
    b = tl.load(b_ptr + o[:, None] * stride_b + (start + r)[None, :],
                mask=(o[:, None] < out_features) & (r[None, :] < rank), other=0.0)
    delta = tl.sum(b.to(tl.float32) * t[None, :], axis=1)
    where = out_ptr + n * stride_on + o * stride_oc
    live = o < tl.where(rank > 0, out_features, 0)  # a row of the base adds nothing
    current = tl.load(where, mask=live, other=0.0)
    tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=live)


def shrink(x: torch.Tensor, a: torch.Tensor, starts: torch.Tensor, ranks: torch.Tensor,
           scales: torch.Tensor, block_r: int) -> torch.Tensor:
    """``t [N, block_r]`` float32: each row's ``scale * x A_rows^T`` (see the module)."""
    n, in_features = x.shape
    t = torch.empty(n, block_r, dtype=torch.float32, device=x.device)
    _shrink[(n,)](x, a, t, starts, ranks, scales, in_features, x.stride(0), x.stride(1),
                  a.stride(0), t.stride(0), BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    return t


def expand(t: torch.Tensor, b: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
           ranks: torch.Tensor, block_r: int) -> None:
    """``out [N, O] += t B_cols^T`` for each row's columns of ``b [O, S]`` (in place)."""
    n, out_features = out.shape
    grid = (n, triton.cdiv(out_features, BLOCK_O))
    _expand[grid](t, b, out, starts, ranks, out_features, t.stride(0), b.stride(0),
                  out.stride(0), out.stride(1), BLOCK_R=block_r, BLOCK_O=BLOCK_O)


def block_rank(max_rank: int) -> int:
    """The kernels' rank block: a power of two holding ``max_rank`` (at least 16)."""
    return max(16, int(triton.next_power_of_2(max_rank)))
