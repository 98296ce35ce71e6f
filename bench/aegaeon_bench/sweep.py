"""``aegaeon bench sweep``: the live policy comparison this project exists for.

For each policy and each number of models, start the whole system with only
the policy changed (`aegaeon serve --policy P` on the same market, the same
workers), drive it with `aegaeon bench serve` (the same seeded workload for
every policy), stop it, and record the point. The result is the largest
number of models each policy serves at >= 90% SLO attainment, a sweep file
(``bench/aegaeon_bench/sweep_schema.py``) and a PNG of attainment vs models.

Every node plans for the SLO the sweep scores with (its config's ``slo`` is
set from ``--ttft``/``--tbt``).

SLO scaling: the paper's TTFT 10 s / TBT 100 ms are set against an H800
stepping a 7B model in ~10 ms and serving a ShareGPT request in ~3-4 s.
This CPU steps the small market's models in ~2.5 ms and serves a request
in ~0.8 s, so the defaults keep the two ratios that decide the comparison:
TBT = 10 decode steps (25 ms), TTFT = ~2.5 service times (2 s), at 0.3
requests/s per model. Rate x service time (Theorem 3.1's lambda T) is 0.24
at 0.3 RPS and 0.8 at ``--rps 1`` (the paper's Fig. 11a/11b: 0.35/1.75);
docs/results.md has both sweeps and the other scalings tried. Use
``--output-scale``/``--input-scale`` with a TTFT scaled by the same factor
to shorten runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

POLICIES = "aegaeon,request-level,request-level-sjf"
TARGET = 0.9


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "sweep", help="live policy comparison: attainment vs number of models",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--policies", default=POLICIES, help=f"comma-separated ({POLICIES})")
    parser.add_argument("--models", default="4,6,8,10,12,14,16",
                        help="model counts (4,6,...,16)")
    parser.add_argument("--rps", type=float, default=0.3, help="requests/s per model (0.3)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (60)")
    parser.add_argument("--ttft", type=float, default=2.0, help="TTFT target, s (2)")
    parser.add_argument("--tbt", type=float, default=0.025, help="TBT target, s (0.025)")
    parser.add_argument("--input-scale", type=float, default=1.0)
    parser.add_argument("--output-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--market", type=Path,
        help="market (default: runs/sweep-market-smallN, N the largest count, built)",
    )
    parser.add_argument("--config", type=Path, help="deployment YAML for every node")
    parser.add_argument("--out", type=Path, default=Path("runs/sweep"), help="output dir")
    parser.add_argument(
        "--keep-going", action="store_true",
        help="run every point (default: stop a policy after 2 points below 90%%)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="last stdout line: a JSON object")
    parser.set_defaults(func=run)


def _bench_serve(url: str, models: int, args: argparse.Namespace, trace: Path) -> dict[str, Any]:
    from aegaeon_bench.sweep_node import aegaeon_argv

    argv = aegaeon_argv(
        "bench", "serve", "--url", url, "--models", str(models), "--rps", str(args.rps),
        "--duration", str(args.duration), "--ttft", str(args.ttft), "--tbt", str(args.tbt),
        "--seed", str(args.seed), "--input-scale", str(args.input_scale),
        "--output-scale", str(args.output_scale), "--market", str(args.market),
        "--trace", str(trace), "--json", "--quiet",
    )  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
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


def run(args: argparse.Namespace) -> int:
    import yaml

    from aegaeon_bench.report_timeline import plot_sweep
    from aegaeon_bench.sweep_node import NodeError, slo_config, start_node
    from aegaeon_bench.sweep_schema import SweepPoint, dump_sweep, load_sweep

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
    except (OSError, yaml.YAMLError, NodeError) as exc:
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
    png = plot_sweep(load_sweep(sweep_path), args.out / "sweep.png")
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
