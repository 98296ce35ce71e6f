"""The GPU paper scenario predicted by the simulator, beside what it measured.

``python -m aegaeon_sim.gpu_predict INPUT.json --json``: INPUT is what
``scripts/gpu-check --scenario paper`` writes after its runs (the logs
folder, the rate ladder, each policy's runs and measured attainment, the
aegaeon node's last trace). The simulator is calibrated once, from the
aegaeon node (:func:`aegaeon_sim.replay.load_case` on its last run: the
instances' start-up profiles, with their measured copy rate, and the costs
:mod:`aegaeon_sim.node_costs` measures from every switch, turn and request
timing the node recorded: switch fixed part and GB/s, per-model decode step
and prefill times, turn and step overheads, arrival and delivery lags). That
one node then plays each policy (request-level: the same instances unified,
as the live baseline runs them) at every rate of the ladder, on the
requests the live run sent at that rate (the same seeded plan, arrivals
delayed by the measured median lag), until the run's end (its duration +
grace), scored with the run's SLO. The answer: per policy and rate the
predicted attainment and, where a run measured it, the measured one and the
difference; the sustainable rate at 90% and the ratio from the predicted
curve (:mod:`aegaeon_bench.gpu_check.paper_stats`, as for the measured).
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
from aegaeon_common.config import UNIFIED_POLICIES
from aegaeon_sched import Request, RequestTrace, summarize
from aegaeon_workload.plan import ModelLimits, plan_requests

from aegaeon_sim.node import NodeSpec, simulate_node
from aegaeon_sim.replay import ReplayCase, load_case


def policy_spec(spec: NodeSpec, policy: str) -> NodeSpec:
    """The calibrated node with ``policy``: a request-level policy runs every instance
    unified (its instances take any instance's profile), Aegaeon as calibrated."""
    unified = policy in UNIFIED_POLICIES
    return replace(spec, policy=policy, unified=unified,
                   hybrid_prefill=spec.hybrid_prefill and not unified)  # fmt: skip


def planned(case: ReplayCase, rps_per_model: float) -> list[Request]:
    """The requests ``bench serve`` sends at ``rps_per_model`` with the case's settings
    (model, seed, lengths, limits), as the proxy sees them (the median arrival lag)."""
    s = case.settings
    limits = {m: ModelLimits(**v) for m, v in s["limits"].items()}
    plan = plan_requests(
        s["models"], limits, rps_per_model=rps_per_model, duration_s=s["duration_s"],
        seed=s["seed"], input_scale=s["input_scale"], output_scale=s["output_scale"],
    )  # fmt: skip
    lag = case.spec.costs.arrival_lag_s
    return [Request(p.request_id, p.model, p.offset_s + lag, p.prompt_len, p.max_tokens,
                    p.max_tokens) for p in plan]  # fmt: skip


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


def predict(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The prediction for the scenario ``inputs`` describes (module docstring)."""
    logs = Path(inputs["logs"])
    calibration = logs / str(inputs["calibration_trace"])
    config = logs / str(inputs["calibration_config"])
    case = load_case(calibration, serve_config=config if config.exists() else None)
    plan = inputs["plan"]
    out: dict[str, Any] = {
        "calibration": {"trace": calibration.name, "node": case.spec.policy,
                        "costs": case.spec.costs.describe(),
                        "profile_copy_gb_s": {i: round(float(p["pcie_bytes_per_s"]) / 1e9, 3)
                                              for i, p in case.spec.profiles.items()}},
        "policies": {},
    }  # fmt: skip
    for policy in inputs["policies"]:
        spec = policy_spec(case.spec, policy)
        measured = {float(r["rps_per_model"]): r.get("slo_attainment")
                    for r in inputs["runs"].get(policy) or []}  # fmt: skip
        points = []
        for rate in sorted(set(inputs["ladder"]) | set(measured)):
            point = {"rps_per_model": rate,
                     **predict_attainment(case, spec, rate, float(plan["load_s"]),
                                          float(plan["grace_s"]))}  # fmt: skip
            live = measured.get(rate)
            if rate in measured:
                point["measured"] = live
                point["diff_points"] = (None if live is None
                                        else round(100 * (point["predicted"] - live), 2))
            points.append(point)
        out["policies"][policy] = {
            "points": points,
            "sustainable": sustainable_rate([(p["rps_per_model"], p["predicted"])
                                             for p in points]),
        }  # fmt: skip
    policies = out["policies"]
    if "aegaeon" in policies and "request-level" in policies:
        out["ratio"] = rate_ratio(policies["aegaeon"]["sustainable"],
                                  policies["request-level"]["sustainable"])
    return out


def table(result: Mapping[str, Any]) -> str:
    lines = [f"{'policy':14s} {'RPS/model':>10s} {'predicted':>10s} {'measured':>9s}"]
    for policy, entry in result["policies"].items():
        for p in entry["points"]:
            live = p.get("measured")
            lines.append(f"{policy:14s} {p['rps_per_model']:10.4g} {100 * p['predicted']:9.1f}% "
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
