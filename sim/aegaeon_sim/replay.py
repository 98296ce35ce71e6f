"""Replay a live `aegaeon bench serve` run in the simulator and compare the two.

Input: ``TRACE`` (``bench serve --trace``), ``TRACE.stats.json`` (the
services' final stats: ``layout``, each instance's start-up ``latency``
profile, switch and turn records, request timings) and
``TRACE.summary.json`` (the run's settings and scoring SLO). The planner's
own settings (its SLO, the round bound, prefetch, KV room) are not in the
stats: they come from the run's effective serve config (``--serve-config``,
by default ``TRACE``'s directory's ``run/config.yaml``, where `aegaeon bench
sweep` and the tests leave it), else the config defaults.

The workload is the trace's own requests: the same ids, models, prompt and
output lengths, and arrivals (offsets from the run's start, each delayed by
its measured client-to-proxy lag); it is checked against a regeneration
from the summary's ``WorkloadSpec`` and seed (:func:`workload_check`). The
simulated token times get the measured delivery lag and are scored with the
run's SLO against the planned arrivals, like the live ones; the simulation
ends where the live run did (duration + grace: open requests are charged
every missing token). Running and comparing: :mod:`aegaeon_sim.replay_run`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aegaeon_common.config import BaselineConfig, InstancesConfig, SchedulerConfig, SLOConfig
from aegaeon_common.config_parse import build_section
from aegaeon_sched import SLO, LatencyModel, Request, load_path_for
from aegaeon_workload.plan import ModelLimits, PlannedRequest, plan_requests
from aegaeon_workload.trace import RunFiles, TraceRecord, read_trace

from aegaeon_sim.node import NodeSpec
from aegaeon_sim.node_costs import measure, without_measurements

ARENA_SLACK_BYTES = 1 << 20  # as the live proxy's static-mux budget (cluster.placement.Baselines)


@dataclass(frozen=True)
class ReplayCase:
    name: str
    records: list[TraceRecord]
    stats: dict[str, Any]
    settings: dict[str, Any]
    scoring_slo: SLO
    start_s: float
    end_s: float  # simulated time at which the live run ended its requests
    spec: NodeSpec
    config_source: str
    measured: bool = True  # costs measured from the run (else the profiles alone)


@dataclass(frozen=True)
class _Planner:
    """What the live planner and instances were told (the serve config's sections)."""

    slo: SLOConfig
    sched: SchedulerConfig
    decode: InstancesConfig | None  # None: no config (then no KV room is known)
    baseline: BaselineConfig
    source: str


def _planner_config(path: Path | None) -> _Planner:
    if path is None or not path.exists():
        return _Planner(SLOConfig(), SchedulerConfig(), None, BaselineConfig(),
                        "config defaults")  # fmt: skip
    raw = yaml.safe_load(path.read_text()) or {}
    slo = build_section(SLOConfig, raw.get("slo") or {}, str(path), "slo")
    sched = build_section(SchedulerConfig, raw.get("scheduler") or {}, str(path), "scheduler")
    decode = build_section(InstancesConfig, raw.get("decode") or {}, str(path), "decode")
    baseline = build_section(BaselineConfig, raw.get("baseline") or {}, str(path), "baseline")
    return _Planner(slo, sched, decode, baseline, str(path))


def load_case(
    trace: Path,
    *,
    serve_config: Path | None = None,
    switch_model: str = "measured",
    measured_costs: bool = True,
) -> ReplayCase:
    """Everything a replay needs from a live run's files (see the module docstring)."""
    files = RunFiles(trace)
    records = read_trace(trace)
    stats = json.loads(files.stats.read_text())
    summary = json.loads(files.summary.read_text())
    if "layout" not in stats or not stats.get("latency"):
        raise ValueError(f"{files.stats}: no layout/latency (a run from before they were recorded)")
    layout = stats["layout"]
    config_path = serve_config or trace.parent / "run" / "config.yaml"
    planner = _planner_config(config_path)
    slo_cfg, sched, source = planner.slo, planner.sched, planner.source
    kv_bytes = planner.decode.kv_memory_bytes if planner.decode is not None else None
    arena = (planner.decode.device_memory_bytes - planner.decode.kv_memory_bytes
             if planner.decode is not None else None)  # fmt: skip
    policy = str(layout["policy"])
    profiles = stats["latency"]
    any_profile = LatencyModel.from_dict(next(iter(profiles.values())))
    costs = measure(stats, [r.to_json() for r in records])
    if not measured_costs:
        costs = without_measurements(costs)
    capacity = {} if kv_bytes is None else {
        m: kv_bytes // s.kv_bytes_per_token for m, s in any_profile.specs.items()
    }  # fmt: skip
    spec = NodeSpec(
        policy=policy, num_prefill=int(layout["prefill"]),
        num_decode=int(layout["decode"]), unified=bool(layout["unified"]),
        hybrid_prefill=bool(layout["hybrid_prefill"]), profiles=profiles,
        planner_slo=SLO(slo_cfg.ttft_s, slo_cfg.tbt_s), costs=costs,
        q_max_s=float(layout.get("q_max_s", sched.q_max_s)),
        round_ttft_fraction=sched.round_ttft_fraction,
        max_batch_size=int(layout.get("max_batch_size", sched.max_batch_size)),
        max_group_size=int(layout.get("max_group_size", sched.max_group_size)),
        prefetch=sched.prefetch, capacity_tokens=capacity, switch_model=switch_model,
        load_path=load_path_for(policy, planner.baseline.load_gb_s, planner.baseline.init_s),
        kv_region_bytes=kv_bytes,
        weights_budget_bytes=None if arena is None else max(arena - ARENA_SLACK_BYTES, 0),
        token_hold=sched.token_hold,
    )  # fmt: skip
    settings = summary["settings"]
    result = summary["result"]
    start_s = float(summary["start_s"])
    return ReplayCase(
        name=str(trace), records=records, stats=stats, settings=settings,
        scoring_slo=SLO(float(result["ttft_s"]), float(result["tbt_s"])), start_s=start_s,
        end_s=float(settings["duration_s"]) + float(settings["grace_s"]), spec=spec,
        config_source=source, measured=measured_costs,
    )  # fmt: skip


def plan(case: ReplayCase, rps_per_model: float) -> list[PlannedRequest]:
    """The requests ``bench serve`` sends at ``rps_per_model`` with the run's settings
    (models, seed, lengths, limits)."""
    s = case.settings
    limits = {m: ModelLimits(**v) for m, v in s["limits"].items()}
    return plan_requests(
        s["models"], limits, rps_per_model=rps_per_model, duration_s=s["duration_s"],
        seed=s["seed"], input_scale=s["input_scale"], output_scale=s["output_scale"],
    )  # fmt: skip


def workload_check(case: ReplayCase) -> str:
    """Regenerate the run's requests from its WorkloadSpec + seed; compare with the trace."""
    planned = plan(case, case.settings["rps_per_model"])
    live = {r.request_id: r for r in case.records}
    bad = [
        p.request_id for p in planned
        if (r := live.get(p.request_id)) is None or r.model != p.model
        or r.prompt_tokens != p.prompt_len or r.expected_tokens != p.max_tokens
        or not math.isclose(r.arrival_s - case.start_s, p.offset_s, abs_tol=1e-6)
    ]  # fmt: skip
    if bad or len(planned) != len(live):
        return f"DIFFERENT: {len(bad)} of {len(planned)} planned requests differ (e.g. {bad[:3]})"
    return f"identical ({len(planned)} requests regenerated from WorkloadSpec + seed)"


def arrival_lags(case: ReplayCase) -> list[float]:
    """Per request (trace order): when the proxy saw it, after its planned arrival
    (the measured median for a request the services have no timing of)."""
    proxy = {str(t["request_id"]): float(t["arrival_s"]) for t in case.stats.get("timings") or []}
    median = case.spec.costs.arrival_lag_s
    return [
        proxy[r.server_id] - r.arrival_s if r.server_id in proxy else median
        for r in case.records
    ]


def sim_requests(case: ReplayCase, lags: Sequence[float] | None = None) -> list[Request]:
    """The run's requests as the simulated proxy sees them: arrivals (offsets from
    the run's start) delayed by ``lags`` (default: the median arrival lag)."""
    lags = lags or [case.spec.costs.arrival_lag_s] * len(case.records)
    return [
        Request(r.request_id, r.model, r.arrival_s - case.start_s + lag, int(r.prompt_tokens or 1),
                r.expected_tokens, r.expected_tokens)
        for r, lag in zip(case.records, lags, strict=True)
    ]  # fmt: skip


