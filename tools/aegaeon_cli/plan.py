"""``aegaeon plan --gpus SPEC``: what ``aegaeon serve --gpus SPEC`` would choose here.

Prints the plan (placement, tensor-parallel groups, device memory, KV regions,
Model Cache, CPU KV cache, compose's ``shm_size`` and start period, and why)
and starts nothing; ``--write FILE`` also writes the planned config. A
container that runs one service plans its own part with ``--only``:
``prefill`` / ``decode`` (its kind's instances on the GPUs it sees, alone on
them) or ``cachemgr`` (the host's memory) -- the Kubernetes pods do this;
compose plans the whole node once (its ``plan`` service) and every container
reads that plan.

``--assume-gpus 8x80GB`` (``--assume-memory``, ``--shm-size``) plans for a
machine that is not this one: no GPU is asked.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from aegaeon_common.config_parse import parse_bytes
from aegaeon_common.market_index import MARKET_DIR_HELP
from aegaeon_common.usage import at_least_one, parsed_by

_DOCKER_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def docker_size(text: str) -> int:
    """A size as Docker reads ``shm_size`` (``48g``, ``512m``, ``1.5GB``): binary units,
    whatever the case or a trailing ``b``/``ib``."""
    match = _DOCKER_SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (like 48g or 512m)")
    shift = {"": 0, "b": 0, "k": 10, "m": 20, "g": 30, "t": 40}[match.group(2).lower()]
    return int(float(match.group(1)) * (1 << shift))


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("plan", help="show (or write) how --gpus places and sizes instances")
    parser.add_argument("--config", type=Path, help="deployment YAML (default: the embedded "
                        "default over --market)")  # fmt: skip
    parser.add_argument("--market", type=Path, help=MARKET_DIR_HELP)
    parser.add_argument("--gpus", help="all | 0,1,...: the GPUs (CUDA indices) to place on "
                        "(default with --assume-gpus: all)")  # fmt: skip
    parser.add_argument("--tp", type=at_least_one, help="tensor-parallel size: each instance "
                        "a group of N GPUs (default: the config's, else the smallest that "
                        "fits the largest model)")  # fmt: skip
    parser.add_argument("--only", choices=("prefill", "decode", "cachemgr"),
                        help="plan one service's part (a container's): its kind's instances "
                        "alone on the GPUs it sees, or the cachemgr's memory")  # fmt: skip
    parser.add_argument("--assume-gpus", metavar="SPEC", help="plan for GPUs that are not "
                        "here, each idle: 8x80GB, 24GB, 40GiB,40GiB (no GPU is asked)")
    parser.add_argument("--assume-memory", type=parsed_by(parse_bytes), metavar="SIZE",
                        help="the host's MemAvailable (default: /proc/meminfo's), e.g. 1TB")
    parser.add_argument("--shm-size", type=docker_size, metavar="SIZE", help="the /dev/shm "
                        "the cachemgr will have, as compose's shm_size (48g: 48 GiB); "
                        "default: this machine's free /dev/shm")  # fmt: skip
    parser.add_argument("--write", type=Path, help="write the planned config here (may be "
                        "--config itself)")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import ConfigError, config_from_dict
    from aegaeon_common.kept import write_atomic
    from aegaeon_common.usage import fail
    from aegaeon_sched.gpu_spec import assumed_gpus
    from aegaeon_sched.placement import PlacementError

    from aegaeon_cli.machine import Assumed, explicit_counts, planned_yaml, sized, with_tp
    from aegaeon_cli.serve import deployment

    gpus = args.gpus if args.gpus is not None or args.assume_gpus is None else "all"
    if gpus is None and args.only != "cachemgr":
        return fail("aegaeon plan", "--gpus all|0,1,... (or --assume-gpus, or --only cachemgr)")
    try:
        assumed = Assumed(
            tuple(assumed_gpus(args.assume_gpus, parse_bytes)) if args.assume_gpus else None,
            args.assume_memory, args.shm_size)
        raw, base, source = deployment(args.config, args.market)
        raw = with_tp(raw, args.tp)
        config = config_from_dict(raw, source=source, base=base)
        # the embedded default's counts are not the user's: the plan picks them
        counts = explicit_counts(raw) if args.config is not None else (None, None)
        config, out, plan = sized(raw, config, gpus, counts, args.only, base=base,
                                  assumed=assumed)  # fmt: skip
    except (OSError, ConfigError, PlacementError) as exc:
        return fail("aegaeon plan", exc)
    print(plan.describe(), flush=True)
    if args.write is not None:
        write_atomic(args.write, planned_yaml(out, config, plan))
    return 0
