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

Log-probabilities (:func:`top_logprobs`) are those of the model's logits as
they came, before any of the above, as OpenAI and vLLM report them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's bound)


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
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    presence_penalty: float = 0.0  # in [-2, 2], on tokens generated at least once
    frequency_penalty: float = 0.0  # in [-2, 2], times how often each was generated
    repetition_penalty: float = 1.0  # > 0; on tokens of the prompt and generated ones
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    allowed_token_ids: tuple[int, ...] = ()  # only these (empty: any)
    min_tokens: int = 0  # no stop token before this many generated
    logprobs: int = -1  # top log-probabilities per generated token (-1: none)
    prompt_logprobs: int = -1  # per prompt token (-1: none)
    grammar: str = ""  # an llguidance grammar the tokens must follow ("": none)
    processed: bool = field(init=False, default=False, compare=False)

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

        def number(name: str, low: float, high: float) -> None:
            v = getattr(self, name)
            if (not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v)
                    or not low <= v <= high):
                raise fail(name, f"must be a number in [{low:g}, {high:g}]")

        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 1e-6, 1e6)
        bias = self.logit_bias
        if not isinstance(bias, Mapping) or not all(
                is_int(k) and k >= 0 and isinstance(v, int | float) and not isinstance(v, bool)
                and -100 <= v <= 100 for k, v in bias.items()):
            raise fail("logit_bias", "must map token ids >= 0 to numbers in [-100, 100]")
        allowed = self.allowed_token_ids
        if not isinstance(allowed, list | tuple) or not all(is_int(i) and i >= 0
                                                             for i in allowed):
            raise fail("allowed_token_ids", "must be a sequence of token ids >= 0")
        object.__setattr__(self, "allowed_token_ids", tuple(allowed))
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise fail("min_tokens", "must be an int in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            if not is_int(getattr(self, name)) or not -1 <= getattr(self, name) <= MAX_LOGPROBS:
                raise fail(name, f"must be an int in [-1, {MAX_LOGPROBS}] (-1: none)")
        if not isinstance(self.grammar, str):
            raise fail("grammar", "must be a string")
        # whether its logits need more than temperature, top-k and top-p (read every step)
        object.__setattr__(self, "processed", bool(
            self.grammar or self.logit_bias or self.allowed_token_ids or self.min_tokens
            or self.min_p or self.presence_penalty or self.frequency_penalty
            or self.repetition_penalty != 1.0))  # fmt: skip

    @property
    def greedy(self) -> bool:
        """True when the argmax is always taken (temperature 0 or top_k 1)."""
        return self.temperature == 0 or self.top_k == 1

    def make_generator(self, device: torch.device) -> torch.Generator | None:
        """A generator seeded with ``seed`` (None when unseeded or greedy)."""
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


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


class TokenLogprobs(NamedTuple):
    """One token's log-probability, its rank in the vocabulary (1: the most likely) and
    the ``k`` most likely tokens' (best first)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int = 1


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
