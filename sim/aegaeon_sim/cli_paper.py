"""``aegaeon sim --scenario paper``'s arguments (light: argparse and its types, as the CLI parses
them before anything heavy is imported); the scenario: :mod:`aegaeon_sim.paper_scenario`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from aegaeon_common.usage import at_least_one, at_least_zero, positive_number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--scenario paper``'s options (``--policies``, ``--points``, ``--seed`` are shared)."""
    parser.add_argument("--calibration", type=Path, metavar="TRACE",
                        help="with --scenario paper: calibrate on this live run (bench serve "
                        "--trace, e.g. gpu-check's paper_probe-trace.jsonl; its serve config "
                        "with --serve-config); default: an uncalibrated H100")
    parser.add_argument("--paper-models", type=at_least_one, default=8,
                        help="with --scenario paper, uncalibrated: models (8)")
    parser.add_argument("--paper-load-s", type=positive_number, default=60.0,
                        help="with --scenario paper: seconds of arrivals per rate, at least (60)")
    parser.add_argument("--paper-grace-s", type=positive_number, default=30.0,
                        help="with --scenario paper: seconds after the last arrival (30)")
    parser.add_argument("--paper-min-requests", type=at_least_zero, default=30,
                        help="with --scenario paper: a low rate runs until this many arrive (30)")
    parser.add_argument("--load-gb-s", type=positive_number, default=16.0,
                        help="with --scenario paper: request-level-charged's load path, "
                        "baseline.load_gb_s (16)")
    parser.add_argument("--init-s", type=float, default=0.0,
                        help="with --scenario paper: its engine start-up, baseline.init_s (0)")


def check_arguments(args: argparse.Namespace, policies: Sequence[str]) -> None:
    """Bad values are one line (exit 2), as aegaeon serve's."""
    from aegaeon_common.config import POLICIES as SERVED

    unknown = [p for p in policies if p not in SERVED]
    if unknown:
        raise SystemExit(f"aegaeon sim: --policies: unknown {', '.join(unknown)} (served "
                         f"policies: {', '.join(SERVED)})")
    if not args.init_s >= 0:
        raise SystemExit("aegaeon sim: --init-s must be >= 0")
