"""Sampling state of a request as it moves between instances.

A request of ``n`` sequences has one :class:`SeqSampling` per sequence: its
parameters (sequence ``i`` of a seeded request draws from its own seed, so
the ``n`` differ and each is reproducible), its generator advanced past the
draws made elsewhere, its engine :class:`~aegaeon_engine.sampling.RowState`
(prompt and tokens so far, for penalties and ``min_tokens``) and its grammar
state. :func:`sample_step` samples one token for each of a batch of them and
reports the log-probabilities those that asked for them want.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch
from aegaeon_common.messages.structs import SEED_RANGE, SamplingParams, TokenLogprobs
from aegaeon_engine.sampling import RowState, make_generator, top_logprobs

from aegaeon_runtime.grammar import GrammarCache, GrammarState
from aegaeon_runtime.port import SamplerPort

SIBLING_STRIDE = 0x9E3779B97F4A7C15  # sequence i of a seeded request: seed + i x this


def sequence_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence ``index``'s parameters: a seeded request's sequence ``i`` draws from its
    own seed, so the ``n`` sequences differ and each is reproducible."""
    if params.seed is None or not index:
        return params
    seed = (params.seed + index * SIBLING_STRIDE) % SEED_RANGE
    return msgspec.structs.replace(params, seed=seed)


def resume_generator(params: SamplingParams, device: torch.device,
                     num_drawn: int) -> torch.Generator | None:
    """A seeded request's generator, advanced past the ``num_drawn`` steps already
    sampled elsewhere, so a request continues the exact random stream it would have had
    on one engine. The sampler draws one uniform per step from a seeded request's own
    generator (``Sampler.sample``), so the same draws are made here and dropped."""
    gen = make_generator(params, device)
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


@dataclass
class SeqSampling:
    """One sequence's sampling state (see the module docstring)."""

    params: SamplingParams
    generator: torch.Generator | None
    state: RowState
    grammar: GrammarState | None = None

    @classmethod
    def start(cls, params: SamplingParams, index: int, *, model: str, device: torch.device,
              grammars: GrammarCache, prompt_ids: Sequence[int] = (),
              output_ids: list[int] | None = None) -> SeqSampling:  # fmt: skip
        """Sequence ``index`` of a request with ``output_ids`` generated so far (its
        generator and grammar advanced past them; the list is the state's own from
        now on: the caller appends each new token through :meth:`accept`)."""
        params = sequence_params(params, index)
        tokens = output_ids if output_ids is not None else []
        generator = resume_generator(params, device, len(tokens))
        grammar = grammars.state(model, params.grammar, tokens) if params.grammar else None
        return cls(params, generator, RowState(prompt_ids, tokens, grammar), grammar)

    def ready(self) -> bool:
        """Its grammar's matcher exists (it may step)."""
        return self.grammar is None or self.grammar.ready()

    def accept(self, token_id: int) -> None:
        """The token sampled for it: into its tokens so far and its grammar."""
        assert isinstance(self.state.output_ids, list)
        self.state.output_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)


def sample_step(sampler: SamplerPort, logits: torch.Tensor,
                seqs: Sequence[SeqSampling]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token for each row of ``logits`` (``[len(seqs), vocab]``), accepted into each
    sequence's state, and its log-probabilities where the sequence asked for them."""
    params = [s.params for s in seqs]
    tokens = sampler.sample(logits, params, [s.generator for s in seqs],
                            [s.state for s in seqs])
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    wanted = [i for i, p in enumerate(params) if p.logprobs >= 0]
    if wanted:
        k = max(params[i].logprobs for i in wanted)
        rows = logits[torch.tensor(wanted, device=logits.device)]
        found = top_logprobs(rows, [tokens[i] for i in wanted], k)
        for i, x in zip(wanted, found, strict=True):
            keep = params[i].logprobs
            out[i] = TokenLogprobs(x.logprob, x.top_ids[:keep], x.top_logprobs[:keep], x.rank)
    for seq, token in zip(seqs, tokens, strict=True):
        seq.accept(token)
    return tokens, out
