"""Sampling parameters and batched sampling with per-request generators.

A seeded request draws its randomness only from its own generator, one
uniform number per step, so its tokens do not depend on which other requests
share the batch. A row is sampled by inverting its CDF: the first token whose
cumulative probability exceeds ``u`` times the row's total. One uniform per
row instead of a ``[vocab]`` row of noise (the exponential race) makes a
sampled step's draw ~10x cheaper; tokens of zero probability (cut by top-k or
top-p) add nothing to the CDF, so they are never drawn.

Rows whose parameters ask for more than temperature, top-k and top-p (a
grammar, penalties, ``logit_bias``, ``allowed_token_ids``, ``min_tokens``,
``min_p``) get their logits processed first, in vLLM's order: the allowed
tokens (``allowed_token_ids``, the grammar's mask), ``min_tokens`` (no stop
token before it), ``logit_bias``, the repetition, frequency and presence
penalties; then temperature, ``min_p``, top-k, top-p. What a row's later
tokens depend on (its prompt, its tokens so far, its grammar) is its
:class:`RowState`, kept by the caller. A batch of plain rows never pays for
any of it.

The parameters are :class:`~aegaeon_common.messages.structs.SamplingParams`, the
one shape a request's sampling fields take from the HTTP request to here.

Log-probabilities (:func:`top_logprobs`) are those of the model's logits as
they came, before any of the above, as OpenAI and vLLM report them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from aegaeon_common.messages.structs import MAX_LOGPROBS, SamplingParams, TokenLogprobs

__all__ = ["MAX_LOGPROBS", "RowState", "Sampler", "SamplingParams", "TokenLogprobs",
           "TokenMask", "make_generator", "process_logits", "top_logprobs"]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator seeded with the request's ``seed`` (None when unseeded or greedy)."""
    if params.seed is None or params.greedy:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


class TokenMask(Protocol):
    """A grammar's state (``aegaeon_runtime.grammar``): the tokens allowed next."""

    def fill_bitmask(self, words: torch.Tensor) -> None:
        """Write the allowed tokens as bits into ``words`` (int32 ``[ceil(vocab / 32)]``
        on the CPU; bit ``i % 32`` of word ``i // 32`` is token ``i``)."""
        ...


@dataclass
class RowState:
    """What a sequence's next token depends on beyond its logits and parameters; its
    owner keeps it across steps (and appends each new token to ``output_ids``)."""

    prompt_ids: Sequence[int] = ()  # for the repetition penalty
    output_ids: Sequence[int] = ()  # generated so far: penalties, min_tokens
    grammar: TokenMask | None = None


def top_logprobs(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Each row's log-probability of ``token_ids[row]`` and its ``k`` most likely
    tokens, from the logits as the model gave them (before temperature or any
    processing, as OpenAI and vLLM report them)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(token_ids), device=logits.device)[:, None]
    picked = logp.gather(1, index)
    ranks = ((logp > picked).sum(-1) + 1).tolist()
    chosen = picked[:, 0].tolist()
    if k <= 0:
        return [TokenLogprobs(c, [], [], r) for c, r in zip(chosen, ranks, strict=True)]
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [TokenLogprobs(c, ids, lps, r) for c, ids, lps, r
            in zip(chosen, top.indices.tolist(), top.values.tolist(), ranks, strict=True)]


def _bitmask_to_bool(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 bitmasks ``[B, W]`` as booleans ``[B, vocab]`` (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words[:, :, None] >> shifts) & 1).flatten(1).bool()
    if allowed.shape[1] < vocab:  # tokens past the grammar's vocabulary: never
        tail = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool,
                           device=words.device)
        allowed = torch.cat([allowed, tail], dim=1)
    return allowed[:, :vocab]


def _mask(out: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[RowState]) -> None:
    """Only the tokens each row's grammar and ``allowed_token_ids`` allow (in place). A
    row left with no token at all (a grammar in error) may only stop."""
    masked = [i for i, (p, r) in enumerate(zip(params, rows, strict=True))
              if p.allowed_token_ids or r.grammar is not None]
    if not masked:
        return
    vocab, dev = out.shape[1], out.device
    words = torch.full((len(masked), (vocab + 31) // 32), -1, dtype=torch.int32)
    for j, i in enumerate(masked):
        grammar = rows[i].grammar
        if grammar is not None:
            grammar.fill_bitmask(words[j])
    allow = _bitmask_to_bool(words.to(dev), vocab)
    for j, i in enumerate(masked):
        p = params[i]
        if p.allowed_token_ids:
            only = torch.zeros(vocab, dtype=torch.bool, device=dev)
            only[[t for t in p.allowed_token_ids if t < vocab]] = True
            allow[j] &= only
        if not bool(allow[j].any()) and p.stop_token_ids:
            allow[j, [t for t in p.stop_token_ids if t < vocab]] = True
    index = torch.tensor(masked, device=dev)
    out[index] = out[index].masked_fill(~allow, -math.inf)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                   rows: Sequence[RowState]) -> torch.Tensor:
    """The logits after the allowed tokens, ``min_tokens``, ``logit_bias`` and the
    penalties of each row (a new float32 tensor; rows without any are copied)."""
    out = logits.float().clone()
    vocab, dev = out.shape[1], out.device
    _mask(out, params, rows)
    for i, (p, r) in enumerate(zip(params, rows, strict=True)):
        if p.min_tokens and len(r.output_ids) < p.min_tokens and p.stop_token_ids:
            out[i, [t for t in p.stop_token_ids if t < vocab]] = -math.inf
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            out[i, ids] += torch.tensor([float(p.logit_bias[t]) for t in ids], device=dev)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*r.prompt_ids, *r.output_ids}), dtype=torch.long,
                                device=dev)
            if seen.numel():
                row = out[i, seen]
                out[i, seen] = torch.where(row > 0, row / p.repetition_penalty,
                                           row * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
            counts = torch.bincount(torch.tensor(list(r.output_ids), device=dev),
                                    minlength=vocab)[:vocab].float()
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


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
               generators: Sequence[torch.Generator | None],
               states: Sequence[RowState] | None = None) -> list[int]:
        """Token ids for each row; ``generators[i]`` is row i's own (None: the shared one),
        ``states[i]`` what its processing needs (None: no row asks for any)."""
        if any(p.processed for p in params):
            logits = process_logits(logits, params, states or [RowState()] * len(params))
        if all(p.greedy for p in params):
            return list(logits.argmax(-1).tolist())
        rows, vocab = logits.shape
        dev = logits.device
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=dev)
        scores = logits.float() / temps[:, None]
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
            probs = scores.softmax(-1)
            floor = probs.max(-1, keepdim=True).values * min_p[:, None]
            scores = scores.masked_fill(probs < floor, -math.inf)
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
