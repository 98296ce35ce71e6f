"""Live run + replay: is the simulator right about this machine?

``python -m aegaeon_sim.live_check --market DIR --out DIR CASE [CASE ...]``
runs each case live (`aegaeon serve` with the case's policy and SLO, driven
by `aegaeon bench serve --trace`), stops the node, replays the trace in the
simulator (:mod:`aegaeon_sim.replay`) and prints the table of live vs
simulated attainment. A case is ``POLICY:MODELS:RPS:TTFT:TBT[:SCALE]``, e.g.
``aegaeon:8:0.3:2:0.025`` (SCALE multiplies ShareGPT's input and output
lengths). The serve config gives the planner the same SLO the run is scored
with (the decode round bound and Eq. 2's TBT follow it).

This is a benchmark, not a test: live attainment depends on how fast and how
busy the machine is. CI replays a recorded run instead
(tests/unit/test_sim_replay_trace.py, exact numbers); the agreement measured
here is recorded in docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LiveCase:
    policy: str
    models: int
    rps: float
    ttft_s: float
    tbt_s: float
    scale: float = 1.0  # ShareGPT input and output lengths x this
    duration_s: float = 60.0
    seed: int = 0
    grace_s: float = 30.0

    @classmethod
    def parse(cls, text: str, duration_s: float, seed: int) -> LiveCase:
        parts = text.split(":")
        if len(parts) not in (5, 6):
            raise ValueError(f"{text!r}: expected POLICY:MODELS:RPS:TTFT:TBT[:SCALE]")
        scale = float(parts[5]) if len(parts) == 6 else 1.0
        return cls(parts[0], int(parts[1]), float(parts[2]), float(parts[3]), float(parts[4]),
                   scale, duration_s, seed)  # fmt: skip

    @property
    def label(self) -> str:
        return (f"{self.policy}-m{self.models}-r{self.rps:g}-slo{self.ttft_s:g}_{self.tbt_s:g}"
                f"-x{self.scale:g}-s{self.seed}")  # fmt: skip


def run_bench(
    url: str, market: Path, case: LiveCase, trace: Path, timeout_s: float = 600.0
) -> None:
    """`aegaeon bench serve` for ``case`` against ``url``, writing ``trace`` (+ its side files)."""
    from aegaeon_bench.node.launch import bench_serve_argv

    argv = bench_serve_argv(
        url, models=case.models, rps=case.rps, duration=case.duration_s, ttft=case.ttft_s,
        tbt=case.tbt_s, seed=case.seed, input_scale=case.scale, output_scale=case.scale,
        grace=case.grace_s, market=market, trace=trace,
    )  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench serve failed ({done.returncode}): {done.stderr[-2000:]}")


def run_live(market: Path, case: LiveCase, out: Path) -> Path:
    """Serve ``case`` live; returns the trace (``out/trace.jsonl``, run dir ``out/run``)."""
    from aegaeon_bench.node.launch import slo_config, start_node

    # `aegaeon serve`'s default config for ``market`` with the case's SLO
    config = slo_config(market, None, case.ttft_s, case.tbt_s, out)
    node = start_node(market, case.policy, out, config)
    trace = out / "trace.jsonl"
    try:
        run_bench(node.url, market, case, trace)
    finally:
        status = node.stop()
    if status != 0:
        raise RuntimeError(f"aegaeon serve exited {status}:\n{node.tail()}")
    return trace


def main(argv: list[str] | None = None) -> int:
    from aegaeon_sim.replay import load_case
    from aegaeon_sim.replay_run import compare_json, replay, table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", help="POLICY:MODELS:RPS:TTFT:TBT[:SCALE]")
    parser.add_argument("--market", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = []
    for text in args.cases:
        case = LiveCase.parse(text, args.duration, args.seed)
        started = time.monotonic()
        trace = run_live(args.market.resolve(), case, args.out / case.label)
        row = compare_json(replay(load_case(trace)))
        rows.append(row)
        print(f"{case.label}: live {100 * row['live']['attainment']:.1f}% sim "
              f"{100 * row['sim_attainment']:.1f}% ({row['diff_points']:+.1f}) "
              f"[{time.monotonic() - started:.0f} s]", file=sys.stderr, flush=True)  # fmt: skip
    (args.out / "replays.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
