"""``aegaeon sim --replay TRACE [TRACE ...]``: a live run's deployment and workload, simulated.

Prints, per trace, the live and the simulated SLO attainment and their
difference in points (plus TTFT/TBT percentiles, switches and decode steps
of both); ``--json``: the last stdout line is a JSON object with every
comparison (:func:`aegaeon_sim.replay.compare_json`).

``--replay-costs measured`` (default): the instances' start-up profiles
plus the costs measured from the run's own records (switches, per-step and
per-turn overheads, Eq. 5 refitted to the measured prefills, lags; see
:mod:`aegaeon_sim.node_costs`); ``profile``: the start-up profiles
alone (Eq. 4 switches, no overheads, no lags), to see what the measurements add.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--serve-config", type=Path,
        help="with --replay: the run's effective serve config, for the planner's SLO, round "
        "bound and KV room (default: TRACE's dir/run/config.yaml if present, else defaults)",
    )  # fmt: skip
    parser.add_argument(
        "--replicas", type=int, default=5,
        help="with --replay: simulations per trace (the first with each request's measured "
        "arrival lag, the others with the lags shuffled); attainment is their mean (5)",
    )  # fmt: skip
    parser.add_argument(
        "--replay-costs", choices=["measured", "profile"], default="measured",
        help="with --replay: the profiles plus the run's measured costs (default), or the "
        "start-up profiles alone",
    )  # fmt: skip


def replay_main(args: argparse.Namespace) -> dict[str, Any]:
    from aegaeon_sim.replay import load_case
    from aegaeon_sim.replay_run import compare_json, replay, table

    rows = []
    for trace in args.replay:
        try:
            case = load_case(
                Path(trace), serve_config=args.serve_config,
                switch_model="measured" if args.replay_costs == "measured" else "eq4",
                measured_costs=args.replay_costs == "measured",
            )  # fmt: skip
        except (OSError, ValueError, KeyError) as exc:
            print(f"aegaeon sim --replay: {trace}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        row = compare_json(replay(case, args.replicas))
        rows.append(row)
        _print_one(row)
    print(table(rows))
    return {"replays": rows, "replay_costs": args.replay_costs}


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.0f}"


def _print_one(row: dict[str, Any]) -> None:
    live, sim = row["live"], row["sim"]
    print(f"== {row['trace']}: {row['policy']}, {row['models']} models x "
          f"{row['rps_per_model']} RPS, {row['requests']} requests; workload {row['workload']}")
    print(f"   SLO TTFT {row['scoring_slo']['ttft_s']} s / TBT {row['scoring_slo']['tbt_s']} s; "
          f"planner from {row['planner']['source']}")
    for name, rep in (("live", live), ("sim", sim)):  # sim: replica 0
        print(f"   {name:4s} attainment {100 * rep['attainment']:5.1f}%  TTFT p50/p99 "
              f"{_ms(rep['ttft_p50_s'])}/{_ms(rep['ttft_p99_s'])} ms  TBT p50/p99 "
              f"{_ms(rep['tbt_p50_s'])}/{_ms(rep['tbt_p99_s'])} ms  unfinished "
              f"{rep['num_unfinished']}")
    reps = ", ".join(f"{100 * a:.1f}" for a in row["sim_attainment_replicas"])
    print(f"   sim attainment over {len(row['sim_attainment_replicas'])} replicas: "
          f"{100 * row['sim_attainment']:.1f}% ({reps})")
    print(f"   diff {row['diff_points']:+.1f} points; switches live/sim "
          f"{row['switches']['live']}/{row['switches']['sim']}, decode steps "
          f"{row['decode_steps']['live']}/{row['decode_steps']['sim']}")  # fmt: skip
