"""Run a replay (:mod:`aegaeon_sim.replay`) and compare it with the live run.

The node is simulated
``replicas`` times: replica 0 with every request's own measured arrival lag,
the others with those lags shuffled among the requests (seeded). A node
like this one is chaotic at the level of single placements (which instance
a batch lands on flips with milliseconds, and then every later round
differs), so the live run is one sample of a distribution; the simulated
attainment reported is the mean over the replicas, with their range.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aegaeon_sched import RequestTrace, SLOReport, summarize
from aegaeon_workload.stats_json import instance_counter

from aegaeon_sim.node import NodeRun, simulate_node
from aegaeon_sim.replay import ReplayCase, arrival_lags, sim_requests, workload_check

DEFAULT_REPLICAS = 5


@dataclass
class ReplayResult:
    case: ReplayCase
    live: SLOReport
    sims: list[SLOReport]  # one per replica; [0] with the measured lags
    workload: str
    sim_traces: list[RequestTrace]  # replica 0's
    extras: dict[str, Any]

    @property
    def sim(self) -> SLOReport:
        return self.sims[0]

    @property
    def sim_attainment(self) -> float:
        return statistics.fmean(r.attainment for r in self.sims)

    @property
    def diff_points(self) -> float:
        return 100.0 * (self.sim_attainment - self.live.attainment)


def _traces(case: ReplayCase, run: NodeRun) -> list[RequestTrace]:
    """Simulated token times on the client's clock, scored from the planned arrivals."""
    delay = case.start_s + case.spec.costs.delivery_lag_s
    return [
        RequestTrace(r.request_id, r.arrival_s, t.expected_tokens,
                     [x + delay for x in t.token_times_s])
        for r, t in zip(case.records, run.traces, strict=True)
    ]  # fmt: skip


def replay(case: ReplayCase, replicas: int = DEFAULT_REPLICAS) -> ReplayResult:
    lags = arrival_lags(case)
    slo = case.scoring_slo
    reports: list[SLOReport] = []
    first: tuple[NodeRun, list[RequestTrace]] | None = None
    for i in range(max(1, replicas)):
        shuffled = list(lags)
        if i:
            random.Random(i).shuffle(shuffled)
        run = simulate_node(case.spec, sim_requests(case, shuffled), case.end_s)
        traces = _traces(case, run)
        reports.append(summarize(traces, slo))
        first = first or (run, traces)
    assert first is not None
    run, traces = first
    extras: dict[str, Any] = {
        "switches": {"live": round(instance_counter(case.stats, "switches")),
                     "sim": run.num_switches},
        "decode_steps": {"live": round(instance_counter(case.stats, "steps")),
                         "sim": run.num_steps},
        # seconds the live instances spent in decode steps (engine + sampling)
        "decode_engine_s": {"live": instance_counter(case.stats, "decode_s"),
                            "sim": run.engine_s},
        "mean_decode_share": run.decode_shares,
    }  # fmt: skip
    live = summarize([r.to_slo() for r in case.records], slo)
    return ReplayResult(case, live, reports, workload_check(case), traces, extras)


def compare_json(result: ReplayResult) -> dict[str, Any]:
    case, live, sim = result.case, result.live, result.sim
    keys = ("attainment", "qos", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s",
            "num_unfinished", "tokens_met", "tokens_expected")  # fmt: skip
    spec = case.spec
    attainments = [r.attainment for r in result.sims]
    return {
        "trace": case.name, "policy": spec.policy, "models": len(case.settings["models"]),
        "rps_per_model": case.settings["rps_per_model"], "requests": live.num_requests,
        "scoring_slo": {"ttft_s": case.scoring_slo.ttft_s, "tbt_s": case.scoring_slo.tbt_s},
        "planner": {"ttft_s": spec.planner_slo.ttft_s, "tbt_s": spec.planner_slo.tbt_s,
                    "q_max_s": spec.q_max_s, "round_ttft_fraction": spec.round_ttft_fraction,
                    "source": case.config_source},
        "layout": {"prefill": spec.num_prefill, "decode": spec.num_decode,
                   "unified": spec.unified, "hybrid_prefill": spec.hybrid_prefill},
        "switch_model": spec.switch_model, "costs": spec.costs.describe(),
        "workload": result.workload, "live": {k: getattr(live, k) for k in keys},
        "sim": {k: getattr(sim, k) for k in keys}, "sim_attainment": result.sim_attainment,
        "sim_attainment_replicas": attainments, "diff_points": result.diff_points,
        **result.extras,
    }  # fmt: skip


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Live vs simulated attainment (mean of the replicas, their range), one line per replay."""
    lines = [f"{'trace':48s} {'policy':14s} {'live':>7s} {'sim':>7s} {'diff':>7s}  sim range"]
    for r in rows:
        reps = r["sim_attainment_replicas"]
        span = f"{100 * min(reps):.1f}-{100 * max(reps):.1f}"
        lines.append(f"{str(r['trace'])[-48:]:48s} {r['policy']:14s} "
                     f"{100 * r['live']['attainment']:6.1f}% {100 * r['sim_attainment']:6.1f}% "
                     f"{r['diff_points']:+6.1f}  {span}")  # fmt: skip
    return "\n".join(lines)
