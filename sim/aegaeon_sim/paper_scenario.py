"""``aegaeon sim --scenario paper``: the one-device paper scenario, with the served policy names.

The scenario ``scripts/gpu-check --scenario paper`` runs live: K models (eight
7-8B ones in FP8) on one device shared by two instances (a prefill and a decode
one for ``aegaeon``, two unified ones for the baselines), each capped so that its
arena holds two of the largest model beside its KV region; every policy
(``aegaeon``, ``request-level-charged``, ``request-level``, ``static-mux``,
as ``aegaeon serve --policy`` names them) on one rate grid, the same requests at
each rate (one seed), the paper's SLO and ShareGPT-like lengths. It prints
each policy's predicted attainment per rate, its sustainable rate at 90%,
aegaeon's ratio to each, and the rates a live run would choose
(``aegaeon_bench.gpu_check.paper_plan``).

The node: ``--calibration TRACE`` (a live run's ``bench serve --trace``, such as
gpu-check's ``paper_probe-trace.jsonl``, with ``--serve-config``) is calibrated
as gpu-check's own prediction is (:mod:`aegaeon_sim.gpu_predict`); without it
an H100 (:func:`h100_case`) modelled from the datasheet (:mod:`aegaeon_sim.hardware`)
with this engine's measured eager decode step and host link (docs/results.md,
"On a GPU"): a sketch, not a calibration; the two instances sharing the
device do not slow each other there.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from aegaeon_bench.gpu_check.paper_plan import choose_rates, rate_grid
from aegaeon_sched import SLO, LatencyModel

from aegaeon_sim.cli_paper import check_arguments
from aegaeon_sim.gpu_predict import predict_on
from aegaeon_sim.hardware import H800, Arch, Hardware, latency_model
from aegaeon_sim.node import NodeSpec
from aegaeon_sim.node_costs import NodeCosts
from aegaeon_sim.replay import ARENA_SLACK_BYTES, ReplayCase, load_case
from aegaeon_sim.switching import LinearCopy, SwitchCosts

POLICIES = ("aegaeon", "request-level-charged", "request-level", "static-mux")
PAPER_SLO = SLO(ttft_s=10.0, tbt_s=0.1)
# the scenario's eight models: Llama-3.1-8B's shape (the live run mixes four 7-8B
# presets) with FP8 projections: 9.09 GB each as the market packs it
LLAMA31_8B = Arch("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128, 128256, 131072)
FP8_8B_BYTES = 9_090_000_000
# On the H100 (docs/results.md, 2026-11-27): the eager decode step of an 8B model
# took ~40 ms at batch 8 (host-bound, ~1.25 ms of launches per layer); scale-ups
# crossed the host link at 52 GB/s.
H100_EAGER = replace(H800, name="H100-80GB (eager engine)", decode_layer_overhead_s=1.25e-3,
                     prefill_layer_overhead_s=1.25e-3)  # fmt: skip
H100_LINK_BYTES_PER_S = 52e9
GiB = 1 << 30
H100_CAP_BYTES = 34 * GiB  # per instance: two 8B models + ~15 GiB of KV, two per 80 GB


def h100_case(num_models: int, load_s: float, grace_s: float, seed: int = 0,
              hw: Hardware = H100_EAGER) -> ReplayCase:  # fmt: skip
    """The uncalibrated node (module docstring) as a replay case of ``num_models``."""
    models = {f"m{i}-llama-3.1-8b": LLAMA31_8B for i in range(num_models)}
    lat = latency_model(models, hw)
    for name in models:
        lat.specs[name] = replace(lat.specs[name], weight_bytes=FP8_8B_BYTES)
    lat.pcie_bytes_per_s, lat.switch_beta = H100_LINK_BYTES_PER_S, 1.0
    profile = lat.to_dict()
    weights = 2 * FP8_8B_BYTES + ARENA_SLACK_BYTES
    kv = H100_CAP_BYTES - weights
    costs = NodeCosts(
        switch=SwitchCosts(LinearCopy(5e-3, H100_LINK_BYTES_PER_S),
                           LinearCopy(5e-3, H100_LINK_BYTES_PER_S), 1e-3),
        step_overhead_s=0.0, turn_overhead_s=2e-3, prefill_overhead_s=1e-3,
        arrival_lag_s=2e-3, delivery_lag_s=2e-3, prefill_coef={},
    )  # fmt: skip
    spec = NodeSpec(
        policy="aegaeon", num_prefill=1, num_decode=1, unified=False, hybrid_prefill=True,
        profiles={"prefill-0": profile, "decode-0": profile}, planner_slo=PAPER_SLO,
        costs=costs, capacity_tokens={m: kv // a.kv_bytes_per_token for m, a in models.items()},
        kv_region_bytes=kv, weights_budget_bytes=weights,
    )  # fmt: skip
    limits = {m: {"vocab_size": a.vocab, "window": 32768, "source": "preset"}
              for m, a in models.items()}  # fmt: skip
    settings = {"models": list(models), "limits": limits, "seed": seed, "input_scale": 1.0,
                "output_scale": 1.0, "duration_s": load_s, "grace_s": grace_s}  # fmt: skip
    return ReplayCase(name=f"{hw.name} (uncalibrated)", records=[], stats={},
                      settings=settings, scoring_slo=PAPER_SLO, start_s=0.0,
                      end_s=load_s + grace_s, spec=spec, config_source=hw.name,
                      measured=False)  # fmt: skip


def unit_rate(case: ReplayCase, num_instances: int = 2, mean_prompt: float = 699.0,
              mean_output: float = 294.0) -> float:
    """Requests/s per model at which the instances would be busy all the time serving one
    request at a time (as gpu-check's probe computes it): the profiles' prefill and
    decode of a mean request."""
    lat = LatencyModel.from_dict(next(iter(case.spec.profiles.values())))
    model = case.settings["models"][0]
    scale = case.settings.get("input_scale", 1.0), case.settings.get("output_scale", 1.0)
    prompt, output = int(mean_prompt * scale[0]), int(mean_output * scale[1])
    request_s = lat.prefill_one_s(model, prompt) + output * lat.decode_step_s(model, 1, prompt)
    return num_instances / (len(case.settings["models"]) * request_s)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The scenario (module docstring) from ``aegaeon sim``'s arguments."""
    policies = tuple(args.policies.split(",")) if args.policies else POLICIES
    check_arguments(args, policies)
    if args.calibration is not None:
        case = load_case(Path(args.calibration), serve_config=args.serve_config)
        source = f"calibrated on {args.calibration}"
    else:
        case = h100_case(args.paper_models, args.paper_load_s, args.paper_grace_s, args.seed)
        source = f"{case.name}: datasheet + measured eager step, not calibrated"
    unit = unit_rate(case)
    grid = ([float(x) for x in args.points.split(",")] if args.points
            else rate_grid(unit))  # fmt: skip
    inputs = {"plan": {"load_s": args.paper_load_s, "grace_s": args.paper_grace_s,
                       "min_requests": args.paper_min_requests},
              "grid": grid, "policies": list(policies),
              "baseline": {"load_gb_s": args.load_gb_s, "init_s": args.init_s}}  # fmt: skip
    result = predict_on(case, {}, inputs)
    chosen = {p: choose_rates(p, [(q["rps_per_model"], q["predicted"])
                                  for q in e["points"]]) for p, e in result["policies"].items()}
    print(f"paper scenario, {len(case.settings['models'])} models, {source}; unit "
          f"{unit:.4g} RPS per model; baseline load path {args.load_gb_s:g} GB/s + "
          f"{args.init_s:g} s")
    print(f"  {'RPS/model':>10}" + "".join(f"  {p:>22}" for p in policies))
    for i, rate in enumerate(grid):
        cells = [f"{100 * result['policies'][p]['points'][i]['predicted']:.1f}%"
                 for p in policies]  # fmt: skip
        print(f"  {rate:10.4g}" + "".join(f"  {c:>22}" for c in cells))
    for policy in policies:
        sustainable = result["policies"][policy]["sustainable"]
        ratio = (result.get("ratios") or {}).get(policy) or {}
        print(f"  {policy}: sustainable at 90% {sustainable.get('rps_per_model')} "
              f"({sustainable.get('kind')}); a live run would measure "
              f"{', '.join(f'{r:.4g}' for r in chosen[policy].rates)} ({chosen[policy].why})"
              + (f"; aegaeon / it {ratio['value']:.2f}x ({ratio.get('kind')})"
                 if ratio.get("value") is not None else ""))
    return {"scenario": "paper", "source": source, "unit_rps_per_model": unit, "grid": grid,
            "prediction": result,
            "plan": {p: {"rates": list(c.rates), "why": c.why} for p, c in chosen.items()}}
