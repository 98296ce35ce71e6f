"""Synthetic workload: Poisson arrivals per model, ShareGPT-like lengths.

No dataset download. Lengths are lognormal, fitted to ShareGPT summary
figures: the median and mean of the (input, output) token lengths of the
request traces the paper's artifact sampled from ShareGPT
(``aegaeon/sim/simdata/synth-*-1.0-1.0.csv`` in the 25SOSP-Aegaeon
repository, 71.8k rows): input median 585 / mean 699 tokens, output median
265 / mean 294 tokens (their p90s are 1556 and 574; the fits give 1257 and
475, so the lognormal tails are lighter than the data's, which if anything
spares the request-level baselines some head-of-line blocking). A lognormal
with median ``M`` and mean ``A`` has ``mu = ln M``, ``sigma = sqrt(2 ln(A/M))``.

``input_scale``/``output_scale`` make ShareGPT-ix2/ox2 (section 7.1). A
request never exceeds the models' 4096-token context (or its model's entry of
``context_limits``, which live benchmarks set from the checkpoints' windows):
an over-long pair is scaled down proportionally (as the artifact does).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from aegaeon_sched import Request

CONTEXT_LIMIT = 4096


@dataclass(frozen=True)
class LogNormalLengths:
    median: float
    mean: float

    @property
    def mu(self) -> float:
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        return math.sqrt(2.0 * math.log(self.mean / self.median))

    def sample(self, rng: random.Random) -> int:
        return max(1, round(rng.lognormvariate(self.mu, self.sigma)))


SHAREGPT_INPUT = LogNormalLengths(median=585, mean=699)
SHAREGPT_OUTPUT = LogNormalLengths(median=265, mean=294)


@dataclass(frozen=True)
class WorkloadSpec:
    models: tuple[str, ...]
    rps_per_model: float
    duration_s: float
    seed: int
    input_scale: float = 1.0
    output_scale: float = 1.0
    # per model (aligned with ``models``): prompt + output tokens; empty = CONTEXT_LIMIT each
    context_limits: tuple[int, ...] = ()

    def context_limit(self, index: int) -> int:
        """The token budget (prompt + output) of the ``index``-th model's requests."""
        return self.context_limits[index] if self.context_limits else CONTEXT_LIMIT


def generate(spec: WorkloadSpec) -> list[Request]:
    """Requests sorted by arrival; ``max_tokens`` = ``oracle_output_len`` = the output length.

    Each model draws from its own seeded stream, so adding models leaves the
    existing models' arrivals unchanged.
    """
    requests: list[Request] = []
    for index, model in enumerate(spec.models):
        rng = random.Random(f"{spec.seed}/{index}")
        limit = spec.context_limit(index)
        t = 0.0
        n = 0
        while spec.rps_per_model > 0:
            t += rng.expovariate(spec.rps_per_model)
            if t > spec.duration_s:
                break
            prompt = max(1, round(SHAREGPT_INPUT.sample(rng) * spec.input_scale))
            output = max(1, round(SHAREGPT_OUTPUT.sample(rng) * spec.output_scale))
            if prompt + output > limit:
                scale = limit / (prompt + output)
                prompt = max(1, int(prompt * scale))
                output = max(1, int(output * scale))
            requests.append(Request(f"{model}/{n}", model, t, prompt, output, output))
            n += 1
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    return requests
