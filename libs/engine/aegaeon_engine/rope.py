"""Rotary embeddings as one gathered table row per position.

``rotate_half(x) * sin == roll(x, D/2) * sin_signed`` with the first half of
``sin_signed`` negated, so applying rope costs a roll, two multiplies and an
add for q and k together (model.forward). Frequencies and tables follow transformers' float32
computation exactly, then are cast to the serving dtype as transformers does.
"""

from __future__ import annotations

import math

import torch

from .spec import RopeSpec


def inv_freq(head_dim: int, rope: RopeSpec) -> torch.Tensor:
    """Inverse frequencies (float32, ``head_dim / 2``) for the rope ``kind``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    freq = 1.0 / (rope.theta ** exponents)
    if rope.kind == "linear":
        return freq / rope.factor
    if rope.kind == "llama3":
        old_len = rope.original_max_position
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


class RopeTable:
    """``[2, positions, head_dim]``: (cos, sin_signed) rows per position, grown on demand.

    Grows by doubling up to ``max_positions`` so a model that only ever sees
    short contexts never pays for a 128k-row table.
    """

    def __init__(self, head_dim: int, rope: RopeSpec, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.head_dim, self.max_positions = head_dim, max_positions
        self.dtype, self.device = dtype, device
        self._inv_freq = inv_freq(head_dim, rope)
        self.table = torch.empty(2, 0, head_dim, dtype=dtype, device=device)

    def ensure(self, num_positions: int) -> torch.Tensor:
        """The table, covering at least positions ``[0, num_positions)``."""
        if num_positions > self.table.shape[1]:
            if num_positions > self.max_positions:
                raise ValueError(f"position {num_positions - 1} is outside the model's "
                                 f"window of {self.max_positions}")
            size = min(max(num_positions, 2 * self.table.shape[1], 256), self.max_positions)
            self.table = self._build(size)
        return self.table

    def _build(self, size: int) -> torch.Tensor:
        positions = torch.arange(size, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(positions, self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        half = self.head_dim // 2
        sin[:, :half].neg_()
        return torch.stack((cos, sin)).to(self.device)
