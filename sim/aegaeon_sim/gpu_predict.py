"""The paper scenario predicted by the simulator, beside what it measured.

``python -m aegaeon_sim.gpu_predict INPUT.json --json``: INPUT is what
``scripts/gpu-check --scenario paper`` writes, once after its capacity probe
(to choose the rates: no runs yet) and once after its runs. Each policy is
calibrated on its own node when it ran (``calibration``: policy -> its last
run's trace and serve config: its own switches, steps and prefills), else on
the probe's node (``calibration_trace``): :func:`aegaeon_sim.replay.load_case`
reads the instances' start-up profiles, with their measured copy rate, and
:mod:`aegaeon_sim.node_costs` measures the costs the node recorded (switch
fixed part and GB/s, per-model decode step and prefill times, turn and step
overheads, arrival and delivery lags). The calibrated node then plays the
policy (:func:`policy_spec`: a request-level policy runs the same instances
unified, ``request-level-charged`` pays the load path of ``baseline``,
``static-mux`` holds what fits its instances' arenas) at every rate of
``grid`` and of its runs, on the requests ``bench serve`` sends at that rate
(the same seeded plan, arrivals delayed by the measured median lag), for the
run's duration (``plan``: at least ``load_s``, longer at a low rate so that
``min_requests`` arrive) plus grace, scored with the run's SLO. The answer:
per policy and rate the predicted attainment and, where a run measured it, the
measured one and the difference; the sustainable rate at 90% of the predicted
curve (:mod:`aegaeon_bench.gpu_check.paper_stats`, as for the measured) and
aegaeon's ratio to every other policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aegaeon_bench.gpu_check.paper_stats import rate_ratio, sustainable_rate
from aegaeon_common.config import UNIFIED_POLICIES, BaselineConfig
from aegaeon_sched import Request, RequestTrace, load_path_for, summarize

from aegaeon_sim.node import NodeSpec, simulate_node
from aegaeon_sim.replay import ReplayCase, load_case, plan


def policy_spec(spec: NodeSpec, policy: str, baseline: Mapping[str, Any] | None = None
                ) -> NodeSpec:  # fmt: skip
    """The calibrated node with ``policy``: a request-level policy (and static-mux) runs
    every instance unified (its instances take any instance's profile);
    ``request-level-charged`` pays ``baseline``'s load path (``load_gb_s``, ``init_s``,
    the config's defaults when absent); Aegaeon as calibrated."""
    unified = policy in UNIFIED_POLICIES
    defaults = BaselineConfig()
    base = baseline or {}
    path = load_path_for(policy, float(base.get("load_gb_s", defaults.load_gb_s)),
                         float(base.get("init_s", defaults.init_s)))  # fmt: skip
    return replace(spec, policy=policy, unified=unified, load_path=path,
                   hybrid_prefill=spec.hybrid_prefill and not unified)  # fmt: skip


def planned(case: ReplayCase, rps_per_model: float) -> list[Request]:
    """The requests ``bench serve`` sends at ``rps_per_model`` with the case's settings
    (model, seed, lengths, limits), as the proxy sees them (the median arrival lag)."""
    lag = case.spec.costs.arrival_lag_s
    return [Request(p.request_id, p.model, p.offset_s + lag, p.prompt_len, p.max_tokens,
                    p.max_tokens) for p in plan(case, rps_per_model)]  # fmt: skip


def predict_attainment(case: ReplayCase, spec: NodeSpec, rps_per_model: float,
                       duration_s: float, grace_s: float) -> dict[str, Any]:
    """One policy at one rate: the simulated run's attainment and counts."""
    settings = {**case.settings, "duration_s": duration_s, "grace_s": grace_s}
    rate_case = replace(case, settings=settings, end_s=duration_s + grace_s)
    requests = planned(rate_case, rps_per_model)
    run = simulate_node(spec, requests, rate_case.end_s)
    lag = spec.costs.arrival_lag_s
    delivery = spec.costs.delivery_lag_s
    traces = [RequestTrace(r.request_id, r.arrival_s - lag, t.expected_tokens,
                           [x + delivery for x in t.token_times_s])
              for r, t in zip(requests, run.traces, strict=True)]  # fmt: skip
    report = summarize(traces, case.scoring_slo)
    return {"predicted": report.attainment, "requests": len(requests),
            "unfinished": report.num_unfinished, "switches": run.num_switches}  # fmt: skip


def load_duration_s(plan: Mapping[str, Any], rps_per_model: float, num_models: int) -> float:
    """A run's seconds of arrivals at ``rps_per_model``: ``load_s``, longer when fewer
    than ``min_requests`` would arrive (as the scenario runs it)."""
    load_s = float(plan["load_s"])
    wanted = float(plan.get("min_requests") or 0)
    if wanted <= 0 or rps_per_model <= 0:
        return load_s
    return max(load_s, wanted / (rps_per_model * num_models))


def _case(logs: Path, trace: str, config: str | None) -> ReplayCase:
    """The node of ``trace`` (under ``logs``) with its serve ``config`` (under ``logs``, or
    absolute): a config named but missing is an error, not the defaults' KV room."""
    path = logs / config if config else None
    if path is not None and not path.is_file():
        raise FileNotFoundError(f"{path}: the serve config of {trace} is missing")
    return load_case(logs / trace, serve_config=path)


def _calibration(case: ReplayCase) -> dict[str, Any]:
    return {"trace": Path(case.name).name, "node": case.spec.policy,
            "costs": case.spec.costs.describe(),
            "profile_copy_gb_s": {i: round(float(p["pcie_bytes_per_s"]) / 1e9, 3)
                                  for i, p in case.spec.profiles.items()}}  # fmt: skip


def predict(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The prediction for the scenario ``inputs`` describes (module docstring)."""
    logs = Path(inputs["logs"])
    probe = _case(logs, str(inputs["calibration_trace"]), inputs.get("calibration_config"))
    own = {policy: _case(logs, str(where["trace"]), where.get("config"))
           for policy, where in (inputs.get("calibration") or {}).items()}  # fmt: skip
    return predict_on(probe, own, inputs)


def predict_on(probe: ReplayCase, own: Mapping[str, ReplayCase],
               inputs: Mapping[str, Any]) -> dict[str, Any]:  # fmt: skip
    """:func:`predict` on cases already made: ``own`` (policy -> its node's case) where
    a policy ran, else ``probe``'s (``inputs`` without the file names)."""
    plan = inputs["plan"]
    grid = [float(r) for r in inputs.get("grid") or inputs.get("ladder") or []]
    num_models = len(probe.settings["models"])
    out: dict[str, Any] = {"calibration": _calibration(probe), "policies": {}}
    for policy in inputs["policies"]:
        where = own.get(policy)
        case = where if where is not None else probe
        spec = policy_spec(case.spec, policy, inputs.get("baseline"))
        measured = {float(r["rps_per_model"]): r.get("slo_attainment")
                    for r in (inputs.get("runs") or {}).get(policy) or []}  # fmt: skip
        points = []
        for rate in sorted(set(grid) | set(measured)):
            duration = load_duration_s(plan, rate, num_models)
            point = {"rps_per_model": rate,
                     **predict_attainment(case, spec, rate, duration, float(plan["grace_s"]))}
            if rate in measured:
                live = measured[rate]
                point["measured"] = live
                point["diff_points"] = (None if live is None
                                        else round(100 * (point["predicted"] - live), 2))
            points.append(point)
        out["policies"][policy] = {
            "calibrated_on": _calibration(case) if where is not None else "probe",
            "points": points,
            "sustainable": sustainable_rate([(p["rps_per_model"], p["predicted"])
                                             for p in points]),
        }  # fmt: skip
    policies = out["policies"]
    if "aegaeon" in policies:
        out["ratios"] = {p: rate_ratio(policies["aegaeon"]["sustainable"], v["sustainable"])
                         for p, v in policies.items() if p != "aegaeon"}  # fmt: skip
        base = next((p for p in ("request-level-charged", "request-level") if p in policies),
                    None)  # fmt: skip
        if base is not None:
            out["ratio"] = out["ratios"][base]
    return out


def table(result: Mapping[str, Any]) -> str:
    lines = [f"{'policy':22s} {'RPS/model':>10s} {'predicted':>10s} {'measured':>9s}"]
    for policy, entry in result["policies"].items():
        for p in entry["points"]:
            live = p.get("measured")
            lines.append(f"{policy:22s} {p['rps_per_model']:10.4g} {100 * p['predicted']:9.1f}% "
                         f"{'' if live is None else f'{100 * live:8.1f}%'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_predict", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", type=Path, help="the scenario's prediction input (JSON)")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    args = parser.parse_args(argv)
    result = predict(json.loads(args.inputs.read_text()))
    print(table(result))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
