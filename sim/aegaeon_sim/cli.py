"""``aegaeon sim``: the discrete-event simulator of the paper's cluster.

    aegaeon sim --figure 11a|11b|11c|12|13 [--json] [--seed N] [--out DIR] [--duration S]
    aegaeon sim --theorem [--json] [--duration S]
    aegaeon sim --policy aegaeon --models 70 --rps 0.1      # one experiment
    aegaeon sim --replay TRACE [TRACE ...] [--json]         # a live run, simulated
    aegaeon sim --compare classes|roles [--json]            # SLO classes / role switching
    aegaeon sim --scenario paper [--calibration TRACE]      # one device, every served policy

Aegaeon's decode rounds are bounded by default (``--round-ttft-fraction``,
see aegaeon_sched.quota); ``--paper`` plans them with Eq. 2-3 exactly as
published. In the paper's cluster (``--figure``, ``--policy``) the request-level
baselines switch at ServerlessLLM's 16 GB/s, as the paper's artifact simulated
them (``--baseline-switch-gbps eq4`` gives them Aegaeon's Eq. 4 instead).
``--scenario paper`` plays the one-device scenario with the policies as
``aegaeon serve`` runs them: ``request-level`` switching at this system's
cost, ``request-level-charged`` paying ``--load-gb-s`` and ``--init-s``.

Nothing heavy is imported at module level (matplotlib only when plotting).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aegaeon_common.usage import at_least_one, at_least_zero, positive_number

from aegaeon_sim.cli_classes import add_arguments as add_compare_arguments
from aegaeon_sim.cli_classes import print_progress
from aegaeon_sim.cli_paper import add_arguments as add_paper_arguments
from aegaeon_sim.cli_replay import add_arguments as add_replay_arguments

if TYPE_CHECKING:
    from aegaeon_sim.runner import Scenario

DEFAULT_DURATION_S = 300.0
THEOREM_SERVED_S = 1200.0  # --theorem: the served run's seconds of arrivals by default
ROUND_TTFT_FRACTION = 0.7  # aegaeon_sched.ROUND_TTFT_FRACTION (checked in the tests)
SLLM_SWITCH_GBPS = 16.0  # runner.SLLM_SWITCH_BYTES_PER_S / 1e9 (checked in the tests)


def _fraction(value: str) -> float | None:
    return None if value.lower() == "none" else float(value)


def _gbps(value: str) -> float | None:
    return None if value.lower() == "eq4" else float(value)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "sim",
        help="discrete-event simulation of the paper's cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--figure", choices=["11a", "11b", "11c", "12", "13"])
    mode.add_argument("--theorem", action="store_true", help="check Theorem 3.1 by simulation")
    mode.add_argument("--policy", choices=_policy_names(), metavar="POLICY",
                      help=f"run one experiment with this policy ({', '.join(_policy_names())})")
    mode.add_argument(
        "--replay", nargs="+", metavar="TRACE",
        help="simulate the deployment and workload of live `bench serve --trace` runs "
        "and compare attainment (reads TRACE.stats.json and TRACE.summary.json)",
    )  # fmt: skip
    mode.add_argument(
        "--scenario", choices=["paper"],
        help="paper: the one-device paper scenario of `scripts/gpu-check --scenario paper` "
        "(every served policy: aegaeon, request-level-charged, request-level, static-mux) on "
        "one rate grid; see aegaeon_sim.paper_scenario",
    )  # fmt: skip
    mode.add_argument(
        "--compare", choices=["classes", "roles"],
        help="issue 19: multi- vs single-SLO at --load x capacity (classes), dynamic vs fixed "
        "roles on ON/OFF bursts (roles); see aegaeon_sim.cli_classes",
    )  # fmt: skip
    parser.add_argument("--models", type=at_least_one, default=40, help="with --policy")
    parser.add_argument("--rps", type=positive_number, default=0.1, help="per model, with --policy")
    parser.add_argument("--adapters", type=at_least_zero, default=0, metavar="N",
                        help="with --policy: N LoRA adapters per model, each its own request "
                             "stream of --rps (the models none); a base and its adapters are "
                             "one switching unit (0)")
    parser.add_argument("--adapter-rank", type=at_least_one, default=16,
                        help="with --adapters: their rank on q, k, v, o (16)")
    parser.add_argument("--input-scale", type=positive_number, default=1.0, help="with --policy")
    parser.add_argument("--output-scale", type=positive_number, default=1.0, help="with --policy")
    parser.add_argument("--slo-scale", type=positive_number, default=1.0, help="with --policy")
    parser.add_argument("--policies", type=_policy_list,
                        help="comma-separated subset for --figure")  # fmt: skip
    parser.add_argument("--points", type=_points,
                        help="comma-separated x values overriding the figure's grid")  # fmt: skip
    parser.add_argument(
        "--duration", type=positive_number, default=None,
        help=f"seconds of arrivals (default {DEFAULT_DURATION_S:g}; with --theorem: its served "
        f"run's, default {THEOREM_SERVED_S:g})",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--q-max", type=float, default=4.0, help="Aegaeon's Q_MAX (s)")
    parser.add_argument(
        "--round-ttft-fraction", type=_fraction, default=ROUND_TTFT_FRACTION,
        help=f"bound each decode round's quotas by this x TTFT; 'none': Eq. 3 only "
        f"(default {ROUND_TTFT_FRACTION})",
    )  # fmt: skip
    parser.add_argument(
        "--fresh-first", action="store_true",
        help="a batch that has not had a turn takes the next turn (re-plan mid-round)",
    )  # fmt: skip
    parser.add_argument(
        "--hybrid-prefill", action="store_true",
        help="prefill instances decode when no prefill waits (as the live system can)",
    )  # fmt: skip
    parser.add_argument(
        "--hybrid-placement", choices=["decode-share", "busy-share", "shortest"],
        default="decode-share",
        help="with --hybrid-prefill: a new decode batch goes to the fewest batches per unit "
        "of decode share (1 - prefill compute busy fraction, as the live proxy; default), "
        "the same counting the prefills' switches as busy (busy-share), or to the "
        "strictly shortest work list",
    )  # fmt: skip
    parser.add_argument(
        "--paper", action="store_true",
        help="Aegaeon's rounds exactly as published (no round bound, no fresh-first)",
    )  # fmt: skip
    parser.add_argument(
        "--switch-scale", type=positive_number, default=1.0,
        help="every switch copies this share of a model's bf16 bytes (0.5: FP8/Q8 weights)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline-switch-gbps", type=_gbps, default=SLLM_SWITCH_GBPS,
        help="request-level switch = weight bytes / this rate; 'eq4': Aegaeon's Eq. 4 "
        f"(default {SLLM_SWITCH_GBPS:g}: ServerlessLLM in the paper's artifact)",
    )  # fmt: skip
    add_replay_arguments(parser)
    add_compare_arguments(parser)
    add_paper_arguments(parser)
    parser.add_argument(
        "--jobs", type=at_least_one, default=_cpus(),
        help="with --figure: points simulated at once, one process each (default: the "
        f"CPUs this process may use, here {_cpus()})",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("sim-out"), help="directory for PNGs")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON summary")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from aegaeon_bench.report.plotting import PlotsUnavailableError

    try:
        return _main(args)
    except PlotsUnavailableError as exc:
        print(f"aegaeon sim: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.duration is None:
        args.duration = THEOREM_SERVED_S if args.theorem else DEFAULT_DURATION_S
    if args.theorem or args.figure:  # they draw: without matplotlib, say so before simulating
        from aegaeon_bench.report.plotting import use_agg

        use_agg()
    if args.theorem:
        from aegaeon_sim.cli_theorem import theorem

        summary = theorem(args, _base(args))
    elif args.replay:
        from aegaeon_sim.cli_replay import replay_main

        summary = replay_main(args)
    elif args.compare:
        from aegaeon_sim.cli_classes import compare

        summary = compare(args, _base(args))
    elif args.scenario:
        from aegaeon_sim.paper_scenario import run as run_scenario

        summary = run_scenario(args)
    elif args.figure:
        summary = _figure(args)
    else:
        summary = _single(args)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _policy_names() -> list[str]:
    from aegaeon_sched.factory import POLICIES

    return sorted(POLICIES)


def _policy_list(text: str) -> str:
    unknown = [p for p in text.split(",") if p not in _policy_names()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {unknown[0]!r} (policies: "
                                         f"{', '.join(_policy_names())})")  # fmt: skip
    return text


def _points(text: str) -> str:
    for value in text.split(","):
        positive_number(value)
    return text


def _base(args: argparse.Namespace) -> Scenario:
    from aegaeon_sim.runner import Scenario

    gbps = args.baseline_switch_gbps
    return Scenario(
        "aegaeon", 1, 0.0, duration_s=args.duration, seed=args.seed, q_max_s=args.q_max,
        round_ttft_fraction=None if args.paper else args.round_ttft_fraction,
        fresh_first=args.fresh_first and not args.paper, hybrid_prefill=args.hybrid_prefill,
        hybrid_placement=args.hybrid_placement,
        baseline_switch_bytes_per_s=gbps * 1e9 if gbps else None,
        switch_scale=args.switch_scale,
    )  # fmt: skip


def _planner_note(sc: Scenario) -> str:
    if sc.round_ttft_fraction is None and not sc.fresh_first and not sc.hybrid_prefill:
        return f"Eq. 2-3 as published (Q_MAX {sc.q_max_s:g} s)"
    parts = [f"Q_MAX {sc.q_max_s:g} s"]
    if sc.round_ttft_fraction is not None:
        parts.append(f"round quotas <= {sc.round_ttft_fraction:g} x TTFT")
    if sc.fresh_first:
        parts.append("fresh batches first")
    if sc.hybrid_prefill:
        parts.append(f"prefill instances decode when idle ({sc.hybrid_placement} placement)")
    return ", ".join(parts)


def _single(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict, replace

    from aegaeon_sim.runner import run_scenario

    sc = replace(
        _base(args), policy=args.policy, num_models=args.models, rps_per_model=args.rps,
        input_scale=args.input_scale, output_scale=args.output_scale, slo_scale=args.slo_scale,
        adapters_per_model=args.adapters, adapter_rank=args.adapter_rank,
    )  # fmt: skip
    result = run_scenario(sc, tbt_percentiles=True)
    rep = result.report
    print(
        f"{sc.policy}: {sc.num_models} models x {sc.rps_per_model} RPS, {sc.duration_s:g} s: "
        f"attainment {rep.attainment:.3f}, qos {rep.qos:.3f}, {rep.num_requests} requests "
        f"({rep.num_unfinished} unfinished, {result.num_rejected} rejected), "
        f"TTFT p50/p99 {rep.ttft_p50_s:.2f}/{rep.ttft_p99_s:.2f} s, "
        f"TBT p50/p99 {1e3 * rep.tbt_p50_s:.1f}/{1e3 * rep.tbt_p99_s:.0f} ms, "
        f"{result.num_switches} switches (decode: {result.near_instant_switch_share:.0%} "
        f"hidden by prefetch), {result.adapter_loads} adapter loads, wall {result.wall_s:.1f} s"
    )
    return {"scenario": asdict(sc), "report": asdict(rep), "switches": result.num_switches,
            "adapter_loads": result.adapter_loads}  # fmt: skip


def _figure(args: argparse.Namespace) -> dict[str, Any]:
    from aegaeon_sim.figures import FIGURE_POLICIES, FIGURES, crossing_at, max_at, sweep
    from aegaeon_sim.plots import plot_figure

    panels = FIGURES[args.figure]
    base = _base(args)
    planner = _planner_note(base)
    policies = args.policies.split(",") if args.policies else list(FIGURE_POLICIES)
    xs = [float(v) for v in args.points.split(",")] if args.points else None
    results = {}
    for panel in panels:
        results[panel.key] = sweep(
            panel, policies, base, xs=xs, jobs=args.jobs,
            progress=lambda line: print_progress(args, line),
        )  # fmt: skip
    png = plot_figure(
        args.figure, panels, results, args.out / f"fig{args.figure}.png",
        note=f"H800 x16 (6 prefill + 10 decode for Aegaeon), {args.duration:g} s of arrivals, "
        f"seed {args.seed}; Aegaeon: {planner}; request-level switch "
        + (f"{args.baseline_switch_gbps:g} GB/s" if args.baseline_switch_gbps else "Eq. 4"),
    )  # fmt: skip
    key = "max_rps_at_90" if args.figure == "11c" else "max_models_at_90"
    per_panel = {}
    for panel in panels:
        res = results[panel.key]
        per_panel[panel.key] = {
            key: {p: max_at(pts) for p, pts in res.items()},
            key + "_qos": {p: max_at(pts, "qos") for p, pts in res.items()},
            "crossing_at_90": {p: crossing_at(pts) for p, pts in res.items()},
            "points": {
                p: [[pt.x, round(pt.attainment, 4), round(pt.qos, 4)] for pt in pts]
                for p, pts in res.items()
            },
        }
        _print_table(panel.title, key, per_panel[panel.key])
    summary: dict[str, Any] = {
        "figure": args.figure,
        "png": str(png),
        "duration_s": args.duration,
        "seed": args.seed,
        "q_max_s": args.q_max,
        "planner": planner,
        "round_ttft_fraction": base.round_ttft_fraction,
        "fresh_first": base.fresh_first,
        "hybrid_prefill": args.hybrid_prefill,
        "hybrid_placement": args.hybrid_placement,
        "baseline_switch_gbps": args.baseline_switch_gbps,
        "metric": "token-deadline SLO attainment (qos: the artifact's per-request time fraction)",
        "points_format": "[x, attainment, qos]",
    }
    if len(panels) == 1:
        summary.update(per_panel[panels[0].key])
    else:
        summary[key] = {k: v[key] for k, v in per_panel.items()}
        summary[key + "_qos"] = {k: v[key + "_qos"] for k, v in per_panel.items()}
        summary["panels"] = per_panel
    print(f"wrote {png}")
    return summary


def _print_table(title: str, key: str, data: dict[str, Any]) -> None:
    print(f"== {title}")
    for policy in data[key]:
        pts = " ".join(f"{x:g}:{100 * a:.0f}" for x, a, _ in data["points"][policy])
        print(
            f"  {policy:18s} {key}={data[key][policy]} (qos: {data[key + '_qos'][policy]})  {pts}"
        )
