"""Theorem 3.1 by simulation: E[active models] = M (1 - e^(-lambda T)).

Each of M models receives Poisson(lambda) requests; a request keeps its model
active for its service time (mean T). A model is active while at least one of
its requests is; the time average of the active count over a long horizon is
compared with the formula. The theorem's proof assumes a fixed T; for Poisson
arrivals the busy probability of an infinite-server queue is 1 - e^(-lambda E[S])
for any service distribution, so exponential service times are checked too.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TheoremCase:
    num_models: int
    rate: float  # lambda, requests per second per model
    service_s: float  # T
    service: str = "fixed"  # "fixed" or "exponential"

    @property
    def expected(self) -> float:
        return self.num_models * (1.0 - math.exp(-self.rate * self.service_s))


PAPER_FIG4 = TheoremCase(100, 0.037, 16.79)  # E[m] = 46.55


def active_intervals(
    case: TheoremCase, horizon_s: float, rng: random.Random
) -> list[list[tuple[float, float]]]:
    """Per model, the merged intervals during which it is active."""
    out: list[list[tuple[float, float]]] = []
    for _ in range(case.num_models):
        merged: list[tuple[float, float]] = []
        t = 0.0
        while True:
            t += rng.expovariate(case.rate)
            if t > horizon_s:
                break
            s = case.service_s if case.service == "fixed" else rng.expovariate(1 / case.service_s)
            if merged and t <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], t + s))
            else:
                merged.append((t, t + s))
        out.append(merged)
    return out


def active_count_series(
    intervals: list[list[tuple[float, float]]], start_s: float, end_s: float
) -> list[tuple[float, int]]:
    """The active-model count as a step function: (time, count from then on)."""
    edges: list[tuple[float, int]] = []
    for model in intervals:
        for a, b in model:
            edges.append((a, 1))
            edges.append((b, -1))
    edges.sort()
    series: list[tuple[float, int]] = []
    count = 0
    for t, delta in edges:
        if t > end_s:
            break
        count += delta
        if t >= start_s:
            series.append((t, count))
        elif series:
            series[-1] = (start_s, count)
        else:
            series.append((start_s, count))
    return series


def time_average(series: list[tuple[float, int]], end_s: float) -> float:
    if not series:
        return 0.0
    total = 0.0
    for (t0, c), (t1, _) in zip(series, [*series[1:], (end_s, 0)], strict=True):
        total += c * (t1 - t0)
    return total / (end_s - series[0][0])


def check(case: TheoremCase, *, horizon_s: float, seed: int) -> tuple[float, float]:
    """(simulated time-average active count, formula). Warm-up: the first
    ``10 T`` seconds, after which the count is stationary."""
    rng = random.Random(f"theorem/{seed}/{case}")
    intervals = active_intervals(case, horizon_s, rng)
    warmup = min(10 * case.service_s, horizon_s / 2)
    series = active_count_series(intervals, warmup, horizon_s)
    return time_average(series, horizon_s), case.expected


def serving_check(
    traces: list[tuple[str, float, float]],
    num_models: int,
    rate: float,
    start_s: float,
    end_s: float,
) -> tuple[float, float, float]:
    """Theorem 3.1 on a served run: (time-average active models, formula, mean T).

    ``traces``: (model, arrival, finish) of every request; a model is active
    while one of its requests is in the system (queued or running), and T is
    the mean time in the system.
    """  # fmt: skip
    per_model: dict[str, list[tuple[float, float]]] = {}
    for model, a, b in sorted(traces, key=lambda t: t[1]):
        merged = per_model.setdefault(model, [])
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    series = active_count_series(list(per_model.values()), start_s, end_s)
    mean_t = sum(b - a for _, a, b in traces) / len(traces)
    expected = num_models * (1.0 - math.exp(-rate * mean_t))
    return time_average(series, end_s), expected, mean_t
