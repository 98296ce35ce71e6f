"""``aegaeon sim``: the discrete-event simulator of the paper's cluster.

    aegaeon sim --figure 11a|11b|11c|12|13 [--json] [--seed N] [--out DIR] [--duration S]
    aegaeon sim --theorem [--json]
    aegaeon sim --policy aegaeon --models 70 --rps 0.1      # one experiment

Nothing heavy is imported at module level (matplotlib only when plotting).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aegaeon_bench.sim.runner import Scenario

DEFAULT_DURATION_S = 300.0


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
    mode.add_argument("--policy", help="run one experiment with this policy")
    parser.add_argument("--models", type=int, default=40, help="with --policy")
    parser.add_argument("--rps", type=float, default=0.1, help="per model, with --policy")
    parser.add_argument("--input-scale", type=float, default=1.0, help="with --policy")
    parser.add_argument("--output-scale", type=float, default=1.0, help="with --policy")
    parser.add_argument("--slo-scale", type=float, default=1.0, help="with --policy")
    parser.add_argument("--policies", help="comma-separated subset for --figure")
    parser.add_argument("--points", help="comma-separated x values overriding the figure's grid")
    parser.add_argument(
        "--duration", type=float, default=DEFAULT_DURATION_S, help="seconds of arrivals"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--q-max", type=float, default=4.0, help="Aegaeon's Q_MAX (s)")
    parser.add_argument(
        "--baseline-switch-gbps",
        type=float,
        help="request-level switch = weight bytes / this rate (default: Eq. 4 like Aegaeon; "
        "the paper's artifact charged 16)",
    )
    parser.add_argument("--out", type=Path, default=Path("sim-out"), help="directory for PNGs")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON summary")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.theorem:
        summary = _theorem(args)
    elif args.figure:
        summary = _figure(args)
    else:
        summary = _single(args)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


def _progress(args: argparse.Namespace, line: str) -> None:
    if not args.quiet:
        print(line, file=sys.stderr, flush=True)


def _base(args: argparse.Namespace) -> Scenario:
    from aegaeon_bench.sim.runner import Scenario

    gbps = args.baseline_switch_gbps
    return Scenario(
        "aegaeon", 1, 0.0, duration_s=args.duration, seed=args.seed, q_max_s=args.q_max,
        baseline_switch_bytes_per_s=gbps * 1e9 if gbps else None,
    )  # fmt: skip


def _single(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict, replace

    from aegaeon_bench.sim.runner import run_scenario

    sc = replace(
        _base(args), policy=args.policy, num_models=args.models, rps_per_model=args.rps,
        input_scale=args.input_scale, output_scale=args.output_scale, slo_scale=args.slo_scale,
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
        f"hidden by prefetch), wall {result.wall_s:.1f} s"
    )
    return {"scenario": asdict(sc), "report": asdict(rep), "switches": result.num_switches}


def _figure(args: argparse.Namespace) -> dict[str, Any]:
    from aegaeon_bench.sim.figures import FIGURES, POLICY_LABELS, crossing_at, max_at, sweep
    from aegaeon_bench.sim.plots import plot_figure

    panels = FIGURES[args.figure]
    policies = args.policies.split(",") if args.policies else list(POLICY_LABELS)
    xs = [float(v) for v in args.points.split(",")] if args.points else None
    results = {}
    for panel in panels:
        results[panel.key] = sweep(
            panel, policies, _base(args), xs=xs, progress=lambda line: _progress(args, line)
        )
    png = plot_figure(
        args.figure, panels, results, args.out / f"fig{args.figure}.png",
        note=f"H800 x16 (6 prefill + 10 decode for Aegaeon), {args.duration:g} s of arrivals, "
        f"seed {args.seed}, Q_MAX {args.q_max:g} s, baseline switch "
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


def _theorem(args: argparse.Namespace) -> dict[str, Any]:
    from aegaeon_bench.sim.theorem import PAPER_FIG4, TheoremCase, check

    cases = [
        PAPER_FIG4,
        TheoremCase(100, 0.037, 16.79, "exponential"),
        TheoremCase(40, 0.1, 3.0),
        TheoremCase(70, 0.1, 30.0, "exponential"),
        TheoremCase(20, 0.5, 10.0, "exponential"),
    ]
    rows = []
    horizon = max(args.duration, 20000.0)
    for case in cases:
        simulated, expected = check(case, horizon_s=horizon, seed=args.seed)
        rows.append({
            "num_models": case.num_models, "rate": case.rate, "service_s": case.service_s,
            "service": case.service, "simulated": round(simulated, 3),
            "expected": round(expected, 3), "rel_error": round(simulated / expected - 1, 4),
        })  # fmt: skip
        print(
            f"M={case.num_models:3d} lambda={case.rate:<6g} T={case.service_s:<6g} "
            f"({case.service:11s}) simulated E[m]={simulated:7.2f} formula={expected:7.2f}"
        )
    served = _theorem_served(args)
    png = _theorem_plot(args)
    return {"theorem": "3.1", "horizon_s": horizon, "cases": rows, "served": served,
            "png": str(png)}  # fmt: skip


def _theorem_served(args: argparse.Namespace) -> dict[str, Any]:
    """The active-model count of a served (request-level) run against the formula."""
    from dataclasses import replace

    from aegaeon_bench.sim.runner import run_scenario
    from aegaeon_bench.sim.theorem import serving_check

    sc = replace(_base(args), policy="request-level", num_models=40, rps_per_model=0.1,
                 duration_s=max(args.duration, 1200.0))  # fmt: skip
    result = run_scenario(sc, keep_traces=True)
    spans = [
        (t.request_id.split("/")[0], t.arrival_s, t.token_times_s[-1])
        for t in result.traces if t.token_times_s
    ]  # fmt: skip
    active, expected, mean_t = serving_check(spans, sc.num_models, sc.rps_per_model,
                                             60.0, sc.duration_s)  # fmt: skip
    print(
        f"served run (request-level, {sc.num_models} models x {sc.rps_per_model} RPS): "
        f"mean T={mean_t:.2f} s, active models {active:.2f}, formula {expected:.2f}"
    )
    return {"num_models": sc.num_models, "rate": sc.rps_per_model, "mean_service_s": mean_t,
            "simulated": round(active, 3), "expected": round(expected, 3)}  # fmt: skip


def _theorem_plot(args: argparse.Namespace) -> Path:
    """Fig. 4 of the paper: the active-model count over time, M=100, lambda=0.037, T=16.79."""
    import random

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aegaeon_bench.sim.theorem import PAPER_FIG4, active_count_series, active_intervals

    intervals = active_intervals(PAPER_FIG4, 1200.0, random.Random(args.seed))
    series = active_count_series(intervals, 200.0, 1200.0)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.step([t for t, _ in series], [c for _, c in series], where="post", lw=0.8)
    ax.axhline(PAPER_FIG4.expected, color="red", ls="--",
               label=f"M(1 - e^(-lambda T)) = {PAPER_FIG4.expected:.2f}")  # fmt: skip
    ax.set_xlabel("time (s)")
    ax.set_ylabel("active models")
    ax.set_title("Theorem 3.1: M=100, lambda=0.037, T=16.79 s (simulated)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out: Path = args.out / "theorem31.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")
    return out
