"""Attention kernels: per device, the decode kernel that reads the paged KV in place,
and SDPA (or flash-attn) for prefill.

Decode attention is one query token per sequence over its whole context (no
causal mask). Where it runs:

- CPU: the native paged decode kernel (native.py) when it builds;
- CUDA (and the CPU under ``TRITON_INTERPRET=1``, in tests): the Triton kernel
  (gpu/paged_attention.py), which reads the block table and context lengths
  from device memory, so a captured CUDA graph replays any mix of lengths;
- else (``AEGAEON_NATIVE=0``, no compiler, no Triton): the torch path gathers
  the blocks of every sequence into dense rows once per layer and runs SDPA
  with one query per head and ``enable_gqa`` (K/V are never repeated), masking
  the padding of shorter sequences. Without the host's lengths (a static step)
  it gathers the table's whole width and masks by the device's lengths.

Prefill of a whole prompt on CUDA is SDPA with ``is_causal`` and no mask, on the
flash backend alone where it takes the inputs (dtype, head dim), else on
flash, memory-efficient or math; a chunk that continues a cached prefix runs
the Triton decode kernel with one row per new token (its context: the
positions up to its own) where Triton runs, else SDPA with an offset mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .model import AttendFn, KVViews
from .native import native_isa, native_ops

# SDPA's backends on CUDA, cuDNN's left out: it compiles (NVRTC) a kernel for every new
# shape, and a serving engine's shapes change every step (context lengths, batch sizes).
# Measured on an H200 (docs/results.md, GPU): 78% of a decode step compiling, ~40 ms
# per step where the kernels take ~3.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.MATH]


def _sdpa_backends(device: torch.device) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """What each SDPA call of an engine on ``device`` runs under."""
    if device.type == "cuda":
        return lambda: sdpa_kernel(_CUDA_SDPA_BACKENDS)
    return contextlib.nullcontext


def _flash_attn_func() -> Callable[..., Any] | None:
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return flash_attn_func  # type: ignore[no-any-return,unused-ignore]


class Attention:
    """Device-specific attention entry points (chosen once per engine)."""

    def __init__(self, device: torch.device, native: bool = True, isa: str | None = None,
                 triton: bool = False) -> None:
        """``native=False`` keeps the torch decode path even where the native kernel loads;
        ``isa`` picks the kernels' level (default: ``native_isa()``); ``triton``: decode
        on the Triton kernel (the caller checked that it runs here)."""
        self.device = torch.device(device)
        self.flash = _flash_attn_func() if self.device.type == "cuda" else None
        self._backends = _sdpa_backends(self.device)
        on_cpu = native and self.device.type == "cpu" and not triton
        self.native = native_ops(isa) if on_cpu else None
        self.isa = (isa or native_isa()) if self.native is not None else None
        self.triton = triton
        # (dtype, head dim, grouped) -> whether SDPA's flash backend takes a causal prefill
        self._flash_takes: dict[tuple[torch.dtype, int, bool], bool] = {}

    @property
    def decode_kernel(self) -> str:
        """The decode attention that runs: ``native-<level>``, ``triton`` or ``sdpa``."""
        if self.native is not None:
            return f"native-{self.isa}"
        return "triton" if self.triton else "sdpa"

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of one sequence: ``[T, H, D]`` inputs -> ``[T, Hq * D]``."""
        num_tokens = q.shape[0]
        if self.flash is not None:
            q_, k_, v_ = (_unit_last(x)[None] for x in (q, k, v))
            out = self.flash(q_, k_, v_, causal=True)
            return out[0].reshape(num_tokens, -1)  # type: ignore[no-any-return]
        q_, k_, v_ = (_unit_last(x.transpose(0, 1))[None] for x in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if self.device.type == "cuda":
            key = (q.dtype, q.shape[-1], gqa)
            if self._flash_takes.get(key, True):
                try:  # causal, no mask: the flash backend alone
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True,
                                                             enable_gqa=gqa)
                    self._flash_takes[key] = True
                    return out[0].transpose(0, 1).reshape(num_tokens, -1)
                except RuntimeError:  # no flash kernel for these inputs: asked once per key
                    self._flash_takes[key] = False
        with self._backends():
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=gqa)
        return out[0].transpose(0, 1).reshape(num_tokens, -1)

    def masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """New tokens ``q [T, Hq, D]`` of one sequence over its context ``k/v [Hkv, S, D]``.

        ``mask [T, S]`` is True where a query may attend (causal with an offset).
        """
        num_tokens = q.shape[0]
        with self._backends():
            out = F.scaled_dot_product_attention(_unit_last(q.transpose(0, 1))[None], k[None],
                                                 v[None], attn_mask=mask,
                                                 enable_gqa=q.shape[1] != k.shape[0])
        return out[0].transpose(0, 1).reshape(num_tokens, -1)

    def paged_decode(self, kv: KVViews, num_q_heads: int, block_table: torch.Tensor,
                     context_lens: torch.Tensor, lengths: Sequence[int] | None,
                     num_splits: int | None = None) -> AttendFn:
        """The attention of one decode step, for every layer: ``attend(layer, qkv)``.

        Sequence ``b`` (of ``B``) has ``lengths[b]`` positions (``context_lens``
        on the device) in blocks ``block_table[b]`` (``[B, max_blocks]``, integer,
        padded with any valid id); its query is ``qkv[b, :num_q_heads]``.
        ``lengths`` None: the host does not know them (a step captured in a CUDA
        graph); every kernel then reads ``context_lens`` alone. ``num_splits``: the
        Triton kernel's splits of each context (default: by batch size).
        """
        batch, dim = block_table.shape[0], kv.cache.shape[-1]
        if self.triton:
            from .gpu import interpreted
            from .gpu.paged_attention import num_splits_for, paged_decode

            splits = num_splits or (1 if interpreted() else
                                    num_splits_for(batch, kv.cache.shape[-2]))
            out_t = torch.empty(batch, num_q_heads, dim, dtype=kv.cache.dtype,
                                device=kv.cache.device)

            def attend_triton(layer: int, qkv: torch.Tensor) -> torch.Tensor:
                # one buffer per step: layer i's output is consumed by its o_proj
                paged_decode(out_t, qkv[:, :num_q_heads], kv.cache, layer, block_table,
                             context_lens, dim ** -0.5, splits)
                return out_t.view(batch, -1)

            return attend_triton
        if self.native is not None:
            paged, scale = self.native.paged_decode, dim ** -0.5
            out = torch.empty(batch, num_q_heads, dim, dtype=kv.cache.dtype,
                              device=kv.cache.device)

            def attend_native(layer: int, qkv: torch.Tensor) -> torch.Tensor:
                # one buffer per step: layer i's output is consumed by its o_proj
                paged(out, qkv[:, :num_q_heads], kv.cache, block_table, context_lens, layer,
                      scale)
                return out.view(batch, -1)

            return attend_native
        num_blocks = block_table.shape[1]
        max_len = max(lengths) if lengths is not None else num_blocks * kv.cache.shape[3]
        mask = None
        if lengths is None or min(lengths) != max_len:
            mask = torch.arange(max_len, device=block_table.device) < context_lens[:, None]
            mask = mask.view(batch, 1, 1, max_len)
        heads, tokens = kv.cache.shape[-2], num_blocks * kv.cache.shape[3]
        # K and V of the gathered rows as [B, heads, max_len, dim] views
        size = (batch, heads, max_len, dim)
        stride = (tokens * heads * dim, dim, heads * dim, 1)
        v_offset = batch * tokens * heads * dim
        rows = kv.gather_rows(block_table.view(-1))

        def attend_torch(layer: int, qkv: torch.Tensor) -> torch.Tensor:
            # one contiguous-row gather per layer: K of all blocks, then V
            both = kv.rows.index_select(0, rows[layer])
            return self.decode(qkv[:, :num_q_heads], both.as_strided(size, stride),
                               both.as_strided(size, stride, v_offset), mask)

        return attend_torch

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
        with self._backends():
            out = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask,
                                                 enable_gqa=num_q != k.shape[1])
        return out.view(batch, num_q * dim)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # fused attention kernels need a unit stride in head_dim
    return x if x.stride(-1) == 1 else x.contiguous()
