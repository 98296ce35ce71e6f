"""A seeded request resumed on another instance continues its own random stream."""

from __future__ import annotations

import torch
from aegaeon_engine import Sampler, SamplingParams
from aegaeon_engine.sampling import make_generator
from aegaeon_runtime.sampling import resume_generator


def test_resumed_generator_continues_the_stream_of_one_engine() -> None:
    vocab = 64
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(5))
    sampler = Sampler("cpu", seed=0)

    def tokens(gen: torch.Generator | None, steps: range) -> list[int]:
        return [sampler.sample(logits[i:i + 1], [params], [gen])[0] for i in steps]

    alone = tokens(make_generator(params, torch.device("cpu")), range(12))
    for drawn in (1, 5):  # the prefill instance drew the first token (or a few)
        resumed = resume_generator(params, torch.device("cpu"), drawn)
        assert tokens(resumed, range(drawn, 12)) == alone[drawn:]
    assert resume_generator(SamplingParams(temperature=0.0), torch.device("cpu"), 3) is None
