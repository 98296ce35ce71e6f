"""Attention kernels: torch SDPA everywhere, flash-attn for prefill on CUDA if installed.

Decode attention treats a GQA group as the query-length axis: the ``G`` query
heads sharing one KV head become ``G`` queries of that head, so SDPA runs
without repeating K/V and without a causal mask (a decode query sees its whole
context; only padding of shorter sequences is masked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _flash_attn_func() -> Callable[..., Any] | None:
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return flash_attn_func  # type: ignore[no-any-return,unused-ignore]


class Attention:
    """Device-specific attention entry points (chosen once per engine)."""

    def __init__(self, device: torch.device) -> None:
        self.flash = _flash_attn_func() if device.type == "cuda" else None

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of one sequence: feature-major ``[H, D, T]`` inputs ->
        ``[Hq * D, T]``."""
        num_q, dim, num_tokens = q.shape
        if self.flash is not None:
            q_, k_, v_ = (x.permute(2, 0, 1).contiguous()[None] for x in (q, k, v))
            out = self.flash(q_, k_, v_, causal=True)[0]  # [T, Hq, D]
            return out.permute(1, 2, 0).reshape(num_q * dim, num_tokens)  # type: ignore[no-any-return]
        q_, k_, v_ = (x.transpose(1, 2).contiguous()[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True,
                                             enable_gqa=num_q != k.shape[0])
        return out[0].transpose(1, 2).reshape(num_q * dim, num_tokens)

    def masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """New tokens ``q [Hq, D, T]`` of one sequence over its context ``k/v [Hkv, S, D]``.

        ``mask [T, S]`` is True where a query may attend (causal with an offset).
        """
        num_q, dim, num_tokens = q.shape
        out = F.scaled_dot_product_attention(q.transpose(1, 2)[None], k[None], v[None],
                                             attn_mask=mask, enable_gqa=num_q != k.shape[0])
        return out[0].transpose(1, 2).reshape(num_q * dim, num_tokens)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """One query per sequence: ``q [Hq, D, B]``, ``k/v [B, Hkv, T, D]`` -> ``[Hq * D, B]``.

        ``mask [B, 1, 1, T]`` (True = attend) hides the padding of shorter
        sequences; ``None`` when all sequences have length ``T``.
        """
        num_q, dim, batch = q.shape
        num_kv = k.shape[1]
        group = num_q // num_kv
        # [B, Hkv, G, D]; SDPA's fused CPU kernel needs unit stride in head_dim
        # (else it takes the slow math path), hence the copy
        grouped = q.as_strided((batch, num_kv, group, dim),
                               (1, group * dim * batch, dim * batch, batch),
                               q.storage_offset()).contiguous()
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
        return out.view(batch, num_q * dim).t()
