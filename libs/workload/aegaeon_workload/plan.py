"""What `aegaeon bench serve` sends, and when: the plan of an open-loop run.

Arrivals and lengths come from the simulator's generator
(:func:`aegaeon_workload.synthetic.generate`): a Poisson process of rate
``rps`` per model, each model on its own seeded stream, and ShareGPT-like
lognormal lengths (input median 585 / mean 699 tokens, output median 265 /
mean 294 tokens, fitted to the ShareGPT traces of the paper's artifact),
scaled by ``input_scale`` / ``output_scale`` and clipped to each model's
window. A prompt is a list of random token ids of the drawn length (the
content does not matter to timing; ``ignore_eos`` forces the output length).

A model's vocabulary size and window come from its checkpoint's
``config.json`` (``vocab_size``, ``max_position_embeddings``) when the market
directory is known; otherwise from safe defaults that every tokenizer and
model of this project accepts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aegaeon_common.market_index import MarketError, load_market

from aegaeon_workload.mix import Burst, Mix, assign_classes, generate_bursty
from aegaeon_workload.synthetic import CONTEXT_LIMIT, WorkloadSpec, generate

# Every byte-level tokenizer has at least 256 ids; 2048 tokens fit every model here.
DEFAULT_VOCAB_SIZE = 256
DEFAULT_WINDOW = 2048


@dataclass(frozen=True)
class ModelLimits:
    """What a prompt of one model may hold."""

    vocab_size: int
    window: int  # prompt + completion tokens
    source: str  # the config.json read, or "default"


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the plan; its prompt ids are derived on demand from the seed."""

    request_id: str
    model: str
    offset_s: float  # arrival, seconds after the run's start
    prompt_len: int
    max_tokens: int
    vocab_size: int
    seed: int
    priority: str | None = None  # the request's SLO class (field "priority"); None: not sent

    def prompt_ids(self) -> list[int]:
        """The prompt: ``prompt_len`` random ids below ``vocab_size`` (deterministic)."""
        rng = random.Random(f"{self.seed}/prompt/{self.request_id}")
        return [rng.randrange(self.vocab_size) for _ in range(self.prompt_len)]


def _market_configs(market: Path) -> dict[str, Path]:
    """Model name -> its config.json, from the market's ``market.json`` (a LoRA
    adapter's: its base's, whose vocabulary and window it has)."""
    entries = load_market(market)
    paths = {e.name: e.path for e in entries}
    return {e.name: paths.get(e.base, e.path) / "config.json" for e in entries}


def _read_limits(config_path: Path) -> ModelLimits:
    try:
        config = json.loads(config_path.read_text())
        vocab = int(config["vocab_size"])
        window = int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MarketError(f"{config_path}: no vocab_size/max_position_embeddings ({exc})") from None
    return ModelLimits(vocab, window, str(config_path))


def model_limits(
    models: Sequence[str],
    market: Path | None,
    *,
    vocab_size: int | None = None,
    max_context: int | None = CONTEXT_LIMIT,
) -> dict[str, ModelLimits]:
    """Each model's limits: its config.json if the market has it, else the defaults.

    ``vocab_size`` overrides every model's vocabulary; ``max_context`` caps
    every window (default: the paper's 4096-token context, as the simulator).
    """
    configs = _market_configs(market) if market is not None else {}
    limits: dict[str, ModelLimits] = {}
    for name in models:
        path = configs.get(name)
        found = _read_limits(path) if path is not None else None
        base = found or ModelLimits(DEFAULT_VOCAB_SIZE, DEFAULT_WINDOW, "default")
        window = min(base.window, max_context) if max_context else base.window
        limits[name] = ModelLimits(vocab_size or base.vocab_size, window, base.source)
    return limits


def plan_requests(
    models: Sequence[str],
    limits: Mapping[str, ModelLimits],
    *,
    rps_per_model: float,
    duration_s: float,
    seed: int,
    input_scale: float = 1.0,
    output_scale: float = 1.0,
    mix: Mix = (),
    burst: Burst | None = None,
    prompt_tokens: int | None = None,
    output_tokens: int | None = None,
) -> list[PlannedRequest]:
    """The run's requests sorted by arrival (same seed, same plan). ``mix``: each
    request's SLO class drawn from it; ``burst``: ON/OFF arrivals, ``rps_per_model``
    the OFF rate (:mod:`aegaeon_workload.mix`, as the simulator draws them).
    ``prompt_tokens`` / ``output_tokens``: every request that long instead of the
    drawn length (the load other benchmark clients send: fixed lengths), clipped to
    the model's window as drawn lengths are."""
    spec = WorkloadSpec(
        models=tuple(models),
        rps_per_model=rps_per_model,
        duration_s=duration_s,
        seed=seed,
        input_scale=input_scale,
        output_scale=output_scale,
        context_limits=tuple(limits[m].window for m in models),
    )
    requests = generate_bursty(spec, burst) if burst is not None else generate(spec)
    classes = assign_classes(requests, mix, seed) if mix else {}

    def fixed(r_prompt: int, r_output: int, window: int) -> tuple[int, int]:
        prompt = prompt_tokens if prompt_tokens is not None else r_prompt
        output = output_tokens if output_tokens is not None else r_output
        prompt = max(1, min(prompt, window - 1))
        return prompt, max(1, min(output, window - prompt))

    lengths = {r.request_id: fixed(r.prompt_len, r.max_tokens, limits[r.model].window)
               for r in requests}  # fmt: skip
    return [
        PlannedRequest(
            request_id=r.request_id,
            model=r.model,
            offset_s=r.arrival_s,
            prompt_len=lengths[r.request_id][0],
            max_tokens=lengths[r.request_id][1],
            vocab_size=limits[r.model].vocab_size,
            seed=seed,
            priority=classes.get(r.request_id),
        )
        for r in requests
    ]
