"""``aegaeon sim --theorem``: Theorem 3.1 (active-model count) by simulation."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the runner loads the instance loops (torch): when a scenario runs
    from aegaeon_sim.runner import Scenario


def theorem(args: argparse.Namespace, base: Scenario) -> dict[str, Any]:
    """Theorem 3.1: the formula against simulated active-model counts (synthetic
    cases over at least 20,000 s, and a served request-level run of ``--duration``
    seconds of arrivals), and the paper's Fig. 4 as a PNG."""
    from aegaeon_sim.theorem import PAPER_FIG4, TheoremCase, check

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
    served = _theorem_served(args, base)
    png = _theorem_plot(args)
    return {"theorem": "3.1", "horizon_s": horizon, "cases": rows, "served": served,
            "png": str(png)}  # fmt: skip


def _theorem_served(args: argparse.Namespace, base: Scenario) -> dict[str, Any]:
    """The active-model count of a served (request-level) run of ``--duration`` seconds of
    arrivals against the formula (counted after a minute, or half the run when shorter)."""
    from dataclasses import replace

    from aegaeon_sim.runner import run_scenario
    from aegaeon_sim.theorem import serving_check

    sc = replace(base, policy="request-level", num_models=40, rps_per_model=0.1,
                 duration_s=args.duration)  # fmt: skip
    result = run_scenario(sc, keep_traces=True)
    spans = [
        (t.request_id.split("/")[0], t.arrival_s, t.token_times_s[-1])
        for t in result.traces if t.token_times_s
    ]  # fmt: skip
    out = {"num_models": sc.num_models, "rate": sc.rps_per_model, "mean_service_s": None,
           "simulated": None, "expected": None}  # fmt: skip
    if not spans:
        print(f"served run (request-level, {sc.num_models} models x {sc.rps_per_model} RPS): "
              f"no request finished in {sc.duration_s:g} s of arrivals")
        return out
    active, expected, mean_t = serving_check(spans, sc.num_models, sc.rps_per_model,
                                             min(60.0, sc.duration_s / 2),
                                             sc.duration_s)  # fmt: skip
    print(
        f"served run (request-level, {sc.num_models} models x {sc.rps_per_model} RPS): "
        f"mean T={mean_t:.2f} s, active models {active:.2f}, formula {expected:.2f}"
    )
    return out | {"mean_service_s": mean_t, "simulated": round(active, 3),
                  "expected": round(expected, 3)}  # fmt: skip


def _theorem_plot(args: argparse.Namespace) -> Path:
    """Fig. 4 of the paper: the active-model count over time, M=100, lambda=0.037, T=16.79."""
    import random

    from aegaeon_bench.report.plotting import pyplot

    plt = pyplot()
    from aegaeon_sim.theorem import PAPER_FIG4, active_count_series, active_intervals

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
