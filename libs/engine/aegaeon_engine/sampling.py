"""Sampling parameters and batched sampling with per-request generators.

A seeded request draws its randomness only from its own generator, one
uniform number per step, so its tokens do not depend on which other requests
share the batch. A row is sampled by inverting its CDF: the first token whose
cumulative probability exceeds ``u`` times the row's total. One uniform per
row instead of a ``[vocab]`` row of noise (the exponential race) makes a
sampled step's draw ~10x cheaper; tokens of zero probability (cut by top-k or
top-p) add nothing to the CDF, so they are never drawn.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` is greedy; ``top_k == 0``
    is off; ``seed`` makes the request reproducible regardless of batching."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: {why}, got {getattr(self, name)!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise fail("temperature", "must be a finite number >= 0")
        p = self.top_p
        if not isinstance(p, int | float) or isinstance(p, bool) or not 0 < p <= 1:
            raise fail("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise fail("top_k", "must be an int >= 0 (0 = off)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise fail("seed", "must be None or an int in [0, 2**63)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise fail("max_tokens", "must be an int >= 1")
        stops = self.stop_token_ids
        if not isinstance(stops, list | tuple) or not all(is_int(i) and i >= 0 for i in stops):
            raise fail("stop_token_ids", "must be a sequence of token ids >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        if not isinstance(self.ignore_eos, bool):
            raise fail("ignore_eos", "must be a bool")

    @property
    def greedy(self) -> bool:
        """True when the argmax is always taken (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """A generator seeded with ``seed`` (None when unseeded or greedy)."""
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


class Sampler:
    """Picks one token per row of a ``[B, vocab]`` logits batch."""

    def __init__(self, device: str | torch.device = "cpu", seed: int | None = None) -> None:
        """Unseeded requests share one generator, seeded from ``seed`` or torch's RNG."""
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[int]:
        """Token ids for each row; ``generators[i]`` is row i's own (None: the shared one)."""
        if all(p.greedy for p in params):
            return list(logits.argmax(-1).tolist())
        rows, vocab = logits.shape
        dev = logits.device
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
        scores = logits.float() / temps[:, None]
        if any(0 < p.top_k < vocab for p in params):
            ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
            top = scores.topk(max(ks), dim=-1).values
            kth = top.gather(1, torch.tensor(ks, device=dev)[:, None] - 1)
            kth[torch.tensor([k == vocab for k in ks], device=dev)] = -math.inf
            scores = scores.masked_fill(scores < kth, -math.inf)
        if any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p if p.top_p < 1 else 2.0 for p in params], device=dev)
            ordered, order = scores.sort(-1, descending=True)
            probs = ordered.softmax(-1)
            # drop a token once the tokens above it already hold top_p of the mass
            drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
            drop[:, 0] = False
            scores = scores.scatter(1, order, ordered.masked_fill(drop, -math.inf))
        cdf = scores.softmax(-1).cumsum(-1)
        if all(g is None for g in generators):
            u = torch.rand(rows, 1, generator=self.generator, device=dev)
        else:
            u = torch.cat([
                torch.rand(1, 1, generator=g if g is not None else self.generator, device=dev)
                for g in generators
            ])  # fmt: skip
        tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_(max=vocab - 1)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            index = torch.tensor(greedy, device=dev)
            tokens[index] = logits[index].argmax(-1)
        return list(tokens.tolist())
