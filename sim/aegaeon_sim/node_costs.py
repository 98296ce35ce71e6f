"""The costs of a live node that its latency profiles do not hold, measured from its own records.

A live run leaves, in ``TRACE.stats.json`` (the final ``/v1/aegaeon/stats``),
every model switch (``switches``: critical-path ``total_s``, copy ``load_s``,
``prefetched``), every decode turn (``turns``: wall span, ``switch_s`` = time
before the first step, ``kv_wait_s``, ``steps``), each instance's counters
(engine seconds of decode steps ``decode_s``) and per-request timings
(``prefill_compute_s`` and the prefill's wall time). From them, and from the
client's trace:

- switches: ``fixed + bytes / rate`` fitted to the per-model medians of the
  switches that were not prefetched (Eq. 4 of the instances' profiles holds
  only the copy: it misses the fixed part); the prefetch thread's copies
  (``load_s`` of prefetched switches) the same way; activating a model whose
  prefetch completed: the first quartile of the prefetched switches' totals
  (the others still waited for their copy);
- prefill: Eq. 5 refitted to the measured prefill compute times (batch 1, so
  each request is one exact sample): the start-up profile samples prompts of
  16-256 tokens and extrapolates to ShareGPT's ~600 (it underestimates them
  1.2-1.9x here), scaled so that it spends the run's measured prefill
  seconds (``prefill_scale``); plus the prefill's wall time beyond compute and switch
  (KV allocation and the swap-out order), median;
- decode: the engine's step time (Eq. 6 plus a cold first step after a
  switch, or Eq. 6 scaled) and the decode loop's own time per step and per
  turn, from the turn records: :mod:`aegaeon_sim.node_turns`;
- lags: proxy arrival minus planned arrival (HTTP, tokenising), and first
  token at the client minus the end of its prefill (ZeroMQ, proxy, SSE), medians.

Where a run has too few records of a kind, the :data:`CPU_DEFAULTS` (measured
on this project's 2-core CPU node, the sweep runs of docs/results.md) stand in.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aegaeon_sched import LatencyModel, PrefillSample

from aegaeon_sim.node_turns import DecodeCosts, decode_costs
from aegaeon_sim.switching import LinearCopy, SwitchCosts

MIN_RECORDS = 5


@dataclass(frozen=True)
class NodeCosts:
    """Measured costs of one node (see the module docstring); times in seconds."""

    switch: SwitchCosts
    step_overhead_s: float
    turn_overhead_s: float
    prefill_overhead_s: float
    arrival_lag_s: float
    delivery_lag_s: float
    # Eq. 5 refitted to the run's prefills: model (or "*") -> (C1, C2, C3).
    prefill_coef: Mapping[str, tuple[float, ...]]
    # Decode engine time: Eq. 6 x decode_scale, plus cold_step_s on the first
    # step of a turn that began with a switch (node_turns.py).
    decode_scale: float = 1.0
    cold_step_s: float = 0.0
    # Per-model factor on top of decode_scale (node_turns.py; 1 when absent).
    model_scale: Mapping[str, float] = field(default_factory=dict)
    # Eq. 5 (as refitted) x prefill_scale spends the run's measured prefill seconds.
    prefill_scale: float = 1.0
    # Live turns that began with a switch and decoded, and the steps of all turns.
    switch_turns: int = 0
    turn_steps: int = 0

    def describe(self) -> dict[str, Any]:
        s = self.switch
        return {
            "switch_fixed_ms": 1e3 * s.load.fixed_s, "switch_gb_per_s": s.load.bytes_per_s / 1e9,
            "prefetch_fixed_ms": 1e3 * s.prefetch.fixed_s,
            "prefetch_gb_per_s": s.prefetch.bytes_per_s / 1e9, "bind_ms": 1e3 * s.bind_s,
            "switch_records": s.num_records, "step_overhead_ms": 1e3 * self.step_overhead_s,
            "turn_overhead_ms": 1e3 * self.turn_overhead_s,
            "prefill_overhead_ms": 1e3 * self.prefill_overhead_s,
            "arrival_lag_ms": 1e3 * self.arrival_lag_s,
            "delivery_lag_ms": 1e3 * self.delivery_lag_s,
            "prefill_refit_models": sorted(self.prefill_coef),
            "decode_scale": self.decode_scale, "cold_step_ms": 1e3 * self.cold_step_s,
            "model_scale": dict(self.model_scale), "prefill_scale": self.prefill_scale,
            "switch_turns": self.switch_turns, "turn_steps": self.turn_steps,
        }  # fmt: skip


# Medians over this node's sweep runs (docs/results.md); used only
# where a run has fewer than MIN_RECORDS records of a kind.
CPU_DEFAULTS = NodeCosts(
    switch=SwitchCosts(LinearCopy(0.4e-3, 7.0e9), LinearCopy(0.4e-3, 4.0e9), 0.15e-3),
    step_overhead_s=0.25e-3,
    turn_overhead_s=1.5e-3,
    prefill_overhead_s=1.0e-3,
    arrival_lag_s=2.0e-3,
    delivery_lag_s=1.5e-3,
    prefill_coef={},
)


def _median(values: Sequence[float], default: float) -> float:
    return statistics.median(values) if len(values) >= MIN_RECORDS else default


def fit_copy(points: Iterable[tuple[int, float]], default: LinearCopy) -> LinearCopy:
    """``fixed + bytes / rate`` through the per-size medians of (bytes, seconds)."""
    by_size: dict[int, list[float]] = {}
    for nbytes, seconds in points:
        by_size.setdefault(nbytes, []).append(seconds)
    if sum(len(v) for v in by_size.values()) < MIN_RECORDS:
        return default
    xs = sorted(by_size)
    ys = [statistics.median(by_size[x]) for x in xs]
    if len(xs) == 1:
        return LinearCopy(default.fixed_s, xs[0] / max(ys[0] - default.fixed_s, 1e-6))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    if slope <= 0:  # copies did not grow with size (noise): a pure rate
        return LinearCopy(0.0, sum(xs) / max(sum(ys), 1e-9))
    fixed = max(0.0, my - slope * mx)
    return LinearCopy(fixed, 1.0 / slope)


def switch_costs(stats: Mapping[str, Any], weight_bytes: Mapping[str, int]) -> SwitchCosts:
    records = [s for s in stats.get("switches") or [] if s.get("to_model") in weight_bytes]
    cold = [(weight_bytes[s["to_model"]], float(s["total_s"])) for s in records
            if not s["prefetched"]]  # fmt: skip
    warm = [s for s in records if s["prefetched"]]
    d = CPU_DEFAULTS.switch
    load = fit_copy(cold, d.load)
    prefetch = fit_copy(((weight_bytes[s["to_model"]], float(s["load_s"])) for s in warm),
                        d.prefetch)  # fmt: skip
    totals = sorted(float(s["total_s"]) for s in warm)
    bind = totals[len(totals) // 4] if len(totals) >= MIN_RECORDS else d.bind_s
    return SwitchCosts(load, prefetch, bind, len(records))


def lags(stats: Mapping[str, Any], trace: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    """(arrival lag, first-token delivery lag) medians, client clock vs the services'."""
    timings = {t["request_id"]: t for t in stats.get("timings") or []}
    arrive: list[float] = []
    deliver: list[float] = []
    for r in trace:
        t = timings.get(r.get("server_id"))
        if t is None:
            continue
        arrive.append(float(t["arrival_s"]) - float(r["arrival_s"]))
        if r["token_times_s"]:
            done = float(t["arrival_s"]) + float(t["prefill_wait_s"]) + float(t["prefill_s"])
            deliver.append(float(r["token_times_s"][0]) - done)
    d = CPU_DEFAULTS
    return _median(arrive, d.arrival_lag_s), max(0.0, _median(deliver, d.delivery_lag_s))


def prefill_samples(
    stats: Mapping[str, Any], trace: Sequence[Mapping[str, Any]]
) -> tuple[list[PrefillSample], list[float]]:
    """Measured prefill compute per request (a unified instance reports only the
    prefill's wall time: that), and each prefill's wall time beyond compute and switch."""
    samples: list[PrefillSample] = []
    extra_s: list[float] = []
    lengths = {str(r.get("server_id")): int(r.get("prompt_tokens") or 0) for r in trace}
    for t in stats.get("timings") or []:
        prompt = lengths.get(str(t["request_id"]), 0)
        extra = t.get("extra") or {}
        compute = extra.get("prefill_compute_s")
        if compute is not None:
            switch = float(extra.get("switch_s", 0.0))
            extra_s.append(float(t["prefill_s"]) - float(compute) - switch)
        elif float(t.get("prefill_s") or 0.0) > 0:
            compute = t["prefill_s"]
        if prompt > 0 and compute is not None:
            samples.append(PrefillSample(str(t["model"]), (prompt,), float(compute)))
    return samples, extra_s


def refit_prefill(
    profile: LatencyModel, samples: Sequence[PrefillSample]
) -> dict[str, tuple[float, ...]]:
    """Eq. 5 coefficients fitted to ``samples`` (per model with enough, and shared)."""
    if len(samples) < MIN_RECORDS:
        return {}
    fitted = LatencyModel.from_dict(profile.to_dict())
    fitted.fit_prefill(samples)
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.model] = counts.get(s.model, 0) + 1
    keep = {"*"} | {m for m, n in counts.items() if n >= MIN_RECORDS}
    return {m: fitted.prefill_coefficients(m) for m in keep}


def prefill_scale(
    profile: LatencyModel,
    coef: Mapping[str, tuple[float, ...]],
    samples: Sequence[PrefillSample],
) -> float:
    """Measured prefill seconds over what the refitted Eq. 5 gives for the same
    prompts. The fit weighs relative errors (what a planner's estimate needs),
    which on these right-skewed times leaves its sum below the measured one
    (8-10% on the request-level node); a simulation must spend the run's
    prefill seconds."""
    if len(samples) < MIN_RECORDS:
        return 1.0
    lat = LatencyModel.from_dict(profile.to_dict())
    for model, c in coef.items():
        lat.set_prefill_coefficients(model, c)
    fitted = sum(lat.prefill_s(s.model, s.prompt_lens) for s in samples)
    return sum(s.seconds for s in samples) / fitted if fitted > 0 else 1.0


def measure(stats: Mapping[str, Any], trace: Sequence[Mapping[str, Any]]) -> NodeCosts:
    """Everything above from one run's stats (with its profiles) and client trace."""
    profiles = {k: LatencyModel.from_dict(v) for k, v in (stats.get("latency") or {}).items()}
    prefill = next((p for k, p in profiles.items() if k.startswith("prefill-")), None)
    profile = prefill or next(iter(profiles.values()))
    weights = {m: s.weight_bytes for m, s in profile.specs.items()}
    d = CPU_DEFAULTS
    default_decode = DecodeCosts(d.step_overhead_s, d.turn_overhead_s, 0.0, 1.0, 0, 0)
    dc = decode_costs(stats, trace, profiles, default_decode)
    arrival, delivery = lags(stats, trace)
    samples, extra = prefill_samples(stats, trace)
    coef = refit_prefill(profile, samples)
    return NodeCosts(
        switch=switch_costs(stats, weights),
        step_overhead_s=dc.step_overhead_s,
        turn_overhead_s=dc.turn_overhead_s,
        prefill_overhead_s=max(0.0, _median(extra, d.prefill_overhead_s)),
        arrival_lag_s=arrival,
        delivery_lag_s=delivery,
        prefill_coef=coef,
        decode_scale=dc.decode_scale,
        cold_step_s=dc.cold_step_s,
        model_scale=dc.model_scale,
        prefill_scale=prefill_scale(profile, coef, samples),
        switch_turns=dc.switch_turns,
        turn_steps=dc.turn_steps,
    )


def without_measurements(costs: NodeCosts) -> NodeCosts:
    """Only what the profiles say: Eq. 4 switches (see ``replay``), no overheads or lags."""
    return replace(
        costs, step_overhead_s=0.0, turn_overhead_s=0.0, prefill_overhead_s=0.0,
        arrival_lag_s=0.0, delivery_lag_s=0.0, prefill_coef={}, decode_scale=1.0,
        cold_step_s=0.0, model_scale={}, prefill_scale=1.0,
    )  # fmt: skip
