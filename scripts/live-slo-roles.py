#!/usr/bin/env python3
"""Issue 19's side-by-side figures live: one `aegaeon serve` node per run, `bench serve` against it.

    python scripts/live-slo-roles.py classes [--models 8 --rps 0.675 --duration 60]
    python scripts/live-slo-roles.py roles   [--models 8 --rps 0.1 --burst on=5,period=20,factor=10]

``classes``: the same class-mixed trace (``--priority-mix``) against a node with
``slo_classes.enabled: false`` (the single-SLO scheduler) and one with classes
on. ``roles``: the same ON/OFF trace (``--burst``) against ``roles.enabled``
false and true. Each run's `bench serve --json` line is written to
``OUT/<run>.json`` with the load average before and after; nothing else runs
a node meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from aegaeon_bench.node.launch import aegaeon_argv, slo_config, start_node
from aegaeon_common.usage import OneLineParser

RUNS = {
    "classes": {"single-slo": {"slo_classes": {"enabled": False}},
                "multi-slo": {"slo_classes": {"enabled": True}}},
    "roles": {"fixed": {"roles": {"enabled": False}},
              "dynamic": {"roles": {"enabled": True}}},
}  # fmt: skip


def main() -> int:
    ap = OneLineParser(description=__doc__)
    ap.add_argument("compare", choices=sorted(RUNS))
    ap.add_argument("--market", type=Path, default=Path("market"))
    ap.add_argument("--models", type=int, default=8)
    ap.add_argument("--rps", type=float)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix", default="interactive=0.3,batch=0.7")
    ap.add_argument("--burst", default="on=5,period=20,factor=10,first=5")
    ap.add_argument("--out", type=Path, default=Path("runs/slo-roles"))
    ap.add_argument("--only", help="comma-separated runs (default: both)")
    ap.add_argument("--max-kv-blocks", type=int,
                    help="proxy.max_kv_blocks (default: derived from the decoders' device KV)")
    args = ap.parse_args()
    args.market = args.market.resolve()
    rps = args.rps if args.rps is not None else (0.675 if args.compare == "classes" else 0.1)
    runs = RUNS[args.compare]
    names = args.only.split(",") if args.only else list(runs)
    for name in names:
        out = args.out / f"{args.compare}-{name}"
        config = slo_config(args.market, None, 10.0, 0.1, out)
        raw = yaml.safe_load(config.read_text())
        raw.update(runs[name])
        if args.max_kv_blocks is not None:
            raw["proxy"] = {**(raw.get("proxy") or {}), "max_kv_blocks": args.max_kv_blocks}
        config.write_text(yaml.safe_dump(raw, sort_keys=False))
        node = start_node(args.market, "aegaeon", out, config)
        try:
            load_before = os.getloadavg()
            argv = ["bench", "serve", "--url", node.url, "--models", str(args.models),
                    "--rps", str(rps), "--duration", str(args.duration), "--seed", str(args.seed),
                    "--market", str(args.market), "--json", "--quiet",
                    "--trace", str(out / "trace.jsonl")]  # fmt: skip
            argv += (["--priority-mix", args.mix] if args.compare == "classes"
                     else ["--burst", args.burst])  # fmt: skip
            done = subprocess.run(aegaeon_argv(*argv), capture_output=True, text=True, check=False)
            load_after = os.getloadavg()
        finally:
            node.stop()
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return done.returncode
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["load_before"], result["load_after"] = load_before, load_after
        result["run"], result["rps_per_model"] = name, rps
        (args.out / f"{args.compare}-{name}.json").write_text(json.dumps(result, indent=1))
        classes = result.get("by_class", {})
        print(f"{name}: attainment {result['slo_attainment']:.3f}, "
              + ", ".join(f"{c} {v['slo_attainment']:.3f} ({v['completed']}/{v['requests']})"
                          for c, v in classes.items())
              + f", load {load_before[0]:.1f} -> {load_after[0]:.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
