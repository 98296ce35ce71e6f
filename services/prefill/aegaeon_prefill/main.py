"""``aegaeon prefill --config FILE --index I``: one prefill instance."""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any, cast


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("prefill", help="run one prefill instance")
    parser.add_argument("--config", type=Path, required=True, help="deployment YAML file")
    parser.add_argument("--index", type=int, default=0, help="which prefill instance")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import load_config_or_exit
    from aegaeon_common.process import run_service

    config = load_config_or_exit(args.config, "prefill")
    from aegaeon_runtime.preflight import instance_preflight_or_exit

    instance_preflight_or_exit(config, "prefill", args.index)
    from aegaeon_common.messages.decode import HYBRID_CHANNEL
    from aegaeon_common.messages.prefill import PREFILL_CHANNEL
    from aegaeon_runtime.prefill.loop import PrefillLoop
    from aegaeon_runtime.service import LoopFactory, serve_instance

    channel, make_loop = PREFILL_CHANNEL, cast(LoopFactory, PrefillLoop)
    if config.hybrid_prefill:
        # Decodes when no prefill waits: the decode instance's loop with prefills first.
        from aegaeon_runtime.decode.loop import DecodeLoop

        channel = HYBRID_CHANNEL
        make_loop = partial(DecodeLoop, hybrid=True)
    name = f"prefill-{args.index}"
    return run_service(
        name, lambda stop: serve_instance(config, "prefill", args.index, channel, make_loop, stop)
    )
