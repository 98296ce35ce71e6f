"""Attention kernels: torch SDPA everywhere, flash-attn for prefill on CUDA if installed.

Decode attention runs one query per head with ``enable_gqa`` (K/V are never
repeated) and no causal mask: a decode query sees its whole context; only the
padding of shorter sequences is masked.
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
        """Causal self-attention of one sequence: ``[T, H, D]`` inputs -> ``[T, Hq * D]``."""
        num_tokens = q.shape[0]
        if self.flash is not None:
            q_, k_, v_ = (_unit_last(x)[None] for x in (q, k, v))
            out = self.flash(q_, k_, v_, causal=True)
            return out[0].reshape(num_tokens, -1)  # type: ignore[no-any-return]
        q_, k_, v_ = (_unit_last(x.transpose(0, 1))[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out[0].transpose(0, 1).reshape(num_tokens, -1)

    def masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """New tokens ``q [T, Hq, D]`` of one sequence over its context ``k/v [Hkv, S, D]``.

        ``mask [T, S]`` is True where a query may attend (causal with an offset).
        """
        num_tokens = q.shape[0]
        out = F.scaled_dot_product_attention(_unit_last(q.transpose(0, 1))[None], k[None],
                                             v[None], attn_mask=mask,
                                             enable_gqa=q.shape[1] != k.shape[0])
        return out[0].transpose(0, 1).reshape(num_tokens, -1)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """One query per sequence: ``q [B, Hq, D]``, ``k/v [B, Hkv, T, D]`` -> ``[B, Hq * D]``.

        ``mask [B, 1, 1, T]`` (True = attend) hides the padding of shorter
        sequences; ``None`` when all sequences have length ``T``.
        """
        batch, num_q, dim = q.shape
        # [B, Hq, 1, D], copied: SDPA's fused CPU kernel wants it dense (else: math path).
        # One query per head with enable_gqa takes its decode path, ~1.6x faster
        # than folding each GQA group into the query axis.
        queries = q.reshape(batch, num_q, 1, dim).contiguous()
        out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask,
                                             enable_gqa=num_q != k.shape[1])
        return out.view(batch, num_q * dim)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # fused attention kernels need a unit stride in head_dim
    return x if x.stride(-1) == 1 else x.contiguous()
