"""``aegaeon bench sweep``: the live policy comparison this project exists for.

For each policy and each number of models, start the whole system with only
the policy changed (`aegaeon serve --policy P` on the same market, the same
workers), drive it with `aegaeon bench serve` (the same seeded workload for
every policy), stop it, and record the point. The result is the largest
number of models each policy serves at >= 90% SLO attainment, a sweep file
(``bench/aegaeon_bench/report/sweep_schema.py``) and a PNG of attainment vs models.

Every node plans for the SLO the sweep scores with (its config's ``slo`` is
set from ``--ttft``/``--tbt``).

Scaling: the defaults keep the ratios that decide the comparison at the
paper's values, from the H800 step times its artifact profiled
(``aegaeon_sim.hardware.PUBLISHED_H800_MS``) and this node's live runs:

- TBT / decode step: the paper's 6:2:2 mix steps in ~12 ms at small batches
  and ~1k-token contexts, so TBT 100 ms is ~8 steps; here a step in a
  running node is 2.5-3 ms: TBT 25 ms.
- TTFT / service time of a request (prefill + ~290 steps): ~3.5 s on the
  H800, TTFT 10 s is ~3 of them; here ~0.66 s: TTFT 2 s.
- prefill / decode step: a ShareGPT prompt (~700 tokens) prefills in ~2
  H800 steps but in 25-30 steps here (a CPU's prefill is compute-bound):
  ``--input-scale 0.25`` (~175 tokens, ~7 steps) narrows the gap.
- rate x service time (Theorem 3.1's lambda T): Fig. 11a is 0.1 RPS x 3.5 s =
  0.35; here 0.5 RPS x 0.66 s = 0.33.

docs/results.md has this sweep, the earlier full-length-prompt sweeps (0.3
and 1 RPS) and the other scalings tried.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aegaeon_bench import common

POLICIES = "aegaeon,request-level,request-level-sjf"
TARGET = 0.9


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = common.add_bench(
        sub, "sweep", "live policy comparison: attainment vs number of models", __doc__)
    parser.add_argument("--policies", default=POLICIES, help=f"comma-separated ({POLICIES})")
    parser.add_argument("--models", default="3,4,5,6,7,8,9,10,11,12,13,14,16",
                        help="model counts (3,4,...,14,16)")
    parser.add_argument("--rps", type=float, default=0.5, help="requests/s per model (0.5)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (60)")
    common.add_slo_arguments(parser, 2.0, 0.025)
    parser.add_argument("--input-scale", type=float, default=0.25,
                        help="prompt lengths x this (0.25: the scaling above)")
    parser.add_argument("--output-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--market", type=Path, help="market (default: "
                        "runs/sweep-market-smallN, N the largest count, built)")
    parser.add_argument("--config", type=Path, help="deployment YAML for every node")
    common.add_api_key_argument(parser)
    parser.add_argument("--out", type=Path, default=Path("runs/sweep"), help="output dir")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every point (default: stop a policy after 2 points below 90%%)")
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    parser.set_defaults(func=run)


def _bench_serve(url: str, models: int, args: argparse.Namespace, trace: Path) -> dict[str, Any]:
    from aegaeon_bench.node.launch import bench_serve_argv

    argv = bench_serve_argv(url, models=models, rps=args.rps, duration=args.duration,
                            ttft=args.ttft, tbt=args.tbt, seed=args.seed,
                            input_scale=args.input_scale, output_scale=args.output_scale,
                            market=args.market, trace=trace)  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          env=common.key_env(common.api_key(args)))  # fmt: skip
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    return result


def max_models_at(points: list[tuple[int, float]], target: float = TARGET) -> int:
    """The largest model count with this and every smaller point >= target (0 if none)."""
    best = 0
    for models, attainment in sorted(points):
        if attainment < target:
            break
        best = models
    return best


def _plot(sweep_path: Path) -> Path | str:
    """The sweep's PNG beside its JSON, or why there is none (no matplotlib)."""
    from aegaeon_bench.report.plotting import PlotsUnavailableError, use_agg
    from aegaeon_bench.report.sweep_schema import load_sweep

    try:
        use_agg()
    except PlotsUnavailableError as exc:
        return f"none ({exc})"
    from aegaeon_bench.report.timeline import plot_sweep

    return plot_sweep(load_sweep(sweep_path), sweep_path.with_name("sweep.png"))


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import read_config_file

    from aegaeon_bench.node.launch import NodeError, slo_config, start_node
    from aegaeon_bench.report.sweep_schema import SweepPoint, dump_sweep

    if args.config is not None:
        read_config_file(args.config)  # a bad file: one line (ConfigError) before any build
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    counts = sorted({int(n) for n in args.models.split(",")})
    args.out.mkdir(parents=True, exist_ok=True)
    if args.market is None:
        from aegaeon_market import ensure_market

        args.market = Path("runs") / f"sweep-market-small{max(counts)}"
        ensure_market(args.market, num_models=max(counts), profile="small")
    args.market = args.market.resolve()
    try:
        config = slo_config(args.market, args.config, args.ttft, args.tbt, args.out)
    except (OSError, NodeError) as exc:
        print(f"aegaeon bench sweep: --config: {exc}", file=sys.stderr)
        return 2
    points: list[SweepPoint] = []
    best: dict[str, int] = {}
    for policy in policies:
        below = 0
        series: list[tuple[int, float]] = []
        for models in counts:
            point_dir = args.out / f"{policy}-{models}"
            started = time.monotonic()
            try:
                node = start_node(args.market, policy, point_dir, config)
            except NodeError as exc:
                print(f"aegaeon bench sweep: {exc}", file=sys.stderr)
                return 1
            try:
                result = _bench_serve(node.url, models, args, point_dir / "trace.jsonl")
            finally:
                node.stop()
            attainment = float(result["slo_attainment"])
            series.append((models, attainment))
            points.append(SweepPoint.from_result(policy, models, result, rps_per_model=args.rps,
                                                 trace=str(point_dir / "trace.jsonl")))
            print(f"{policy:>20} {models:3d} models: attainment {attainment:6.1%}  "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            below = below + 1 if attainment < TARGET else 0
            if below >= 2 and not args.keep_going:
                break
        best[policy] = max_models_at(series)
    meta = {
        "ttft_s": args.ttft, "tbt_s": args.tbt, "rps_per_model": args.rps,
        "duration_s": args.duration, "input_scale": args.input_scale,
        "output_scale": args.output_scale, "seed": args.seed, "market": str(args.market),
    }  # fmt: skip
    sweep_path = args.out / "sweep.json"
    dump_sweep(sweep_path, points, meta)
    png = _plot(sweep_path)
    print(f"\n{'policy':>20}  max models at >= 90%")
    for policy, n in best.items():
        print(f"{policy:>20}  {n}")
    base = best.get("request-level")
    ratio = best["aegaeon"] / base if base and "aegaeon" in best else None
    if ratio is not None:
        print(f"aegaeon / request-level = {ratio:.2f}x")
    print(f"sweep: {sweep_path}\nplot: {png}")
    if args.json:
        print(json.dumps({"max_models_at_90": best, "aegaeon_over_request_level": ratio,
                          "sweep": str(sweep_path), "plot": str(png),
                          "points": [p.to_json() for p in points]}))  # fmt: skip
    return 0
