"""Sampling state of a request as it moves between instances."""

from __future__ import annotations

import torch
from aegaeon_common.messages.structs import SamplingSpec
from aegaeon_engine import SamplingParams


def engine_params(spec: SamplingSpec) -> SamplingParams:
    """The wire's sampling spec as the engine's parameters (validated again there)."""
    return SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=max(spec.top_k, 0),
        seed=spec.seed,
        max_tokens=spec.max_tokens,
        stop_token_ids=tuple(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
    )


def resume_generator(
    params: SamplingParams, device: torch.device, vocab_size: int, num_drawn: int
) -> torch.Generator | None:
    """A seeded request's generator, advanced past the ``num_drawn`` steps already
    sampled elsewhere, so a request continues the exact random stream it would have had
    on one engine. The sampler draws one uniform per step from a seeded request's own
    generator (``Sampler.sample``), so the same draws are made here and dropped.
    ``vocab_size`` is kept for callers; the stream no longer depends on it."""
    del vocab_size
    gen = params.make_generator(device)
    if gen is not None:
        for _ in range(num_drawn):
            torch.rand(1, 1, generator=gen, device=device)
    return gen


def finish_reason(token_id: int, num_generated: int, params: SamplingParams) -> str | None:
    """``"stop"`` on a stop token (EOS is among them unless ignore_eos), ``"length"``
    once ``max_tokens`` tokens exist, else ``None``. ``num_generated`` counts
    ``token_id``."""
    if token_id in params.stop_token_ids:
        return "stop"
    if num_generated >= params.max_tokens:
        return "length"
    return None
