"""``aegaeon plan --gpus SPEC``: what ``aegaeon serve --gpus SPEC`` would choose here.

Prints the plan (placement, device memory, KV regions, Model Cache, CPU KV
cache, and why) and starts nothing; ``--write FILE`` also writes the planned
config. A container that runs one service plans its own part with ``--only``:
``prefill`` / ``decode`` (its kind's instances on the GPUs it sees, alone on
them) or ``cachemgr`` (the host's memory) -- the Kubernetes pods do this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from aegaeon_common.market_index import MARKET_DIR_HELP


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("plan", help="show (or write) how --gpus places and sizes instances")
    parser.add_argument("--config", type=Path, help="deployment YAML (default: the embedded "
                        "default over --market)")  # fmt: skip
    parser.add_argument("--market", type=Path, help=MARKET_DIR_HELP)
    parser.add_argument("--gpus", help="all | 0,1,...: the GPUs (CUDA indices) to place on")
    parser.add_argument("--only", choices=("prefill", "decode", "cachemgr"),
                        help="plan one service's part (a container's): its kind's instances "
                        "alone on the GPUs it sees, or the cachemgr's memory")  # fmt: skip
    parser.add_argument("--write", type=Path, help="write the planned config here (may be "
                        "--config itself)")  # fmt: skip
    parser.set_defaults(func=run)


def _raw(args: argparse.Namespace) -> tuple[dict[str, Any], Path, bool]:
    """The deployment as plain data, the folder its paths are relative to, and
    whether its instance counts are the user's."""
    from aegaeon_common.config import read_config_file

    if args.config is not None:
        raw = read_config_file(args.config)
        if args.market is not None:
            raw["market"] = str(args.market.resolve())
        return raw, args.config.parent.resolve(), True
    from aegaeon_market import default_market_dir

    from aegaeon_cli.serve import default_config_dict

    market = (args.market or default_market_dir()).resolve()
    return default_config_dict(market, 8000), Path.cwd(), False


def run(args: argparse.Namespace) -> int:
    import yaml
    from aegaeon_common.config import ConfigError, config_from_dict
    from aegaeon_sched.placement import PlacementError

    from aegaeon_cli.machine import explicit_counts, plan_comment, sized, with_absolute_paths

    if args.gpus is None and args.only != "cachemgr":
        print("aegaeon plan: --gpus all|0,1,... (or --only cachemgr)", file=sys.stderr)
        return 2
    try:
        raw, base, user_counts = _raw(args)
        source = str(args.config) if args.config else "<embedded default>"
        config = config_from_dict(raw, source=source, base=base)
        counts = explicit_counts(raw) if user_counts else (None, None)
        config, out, plan = sized(raw, config, args.gpus, counts, args.only, base=base)
    except (OSError, ConfigError, PlacementError) as exc:
        print(f"aegaeon plan: {exc}", file=sys.stderr)
        return 2
    print(plan.describe(), flush=True)
    if args.write is not None:
        text = yaml.safe_dump(with_absolute_paths(out, config), sort_keys=False)
        args.write.write_text(plan_comment(plan) + text)
    return 0
