"""``aegaeon decode --config FILE --index I``: one decode instance.

With a request-level policy the same process is a unified instance (it
prefills the requests it is given, then decodes them).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from typing import Any, cast


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("decode", help="run one decode instance")
    parser.add_argument("--config", type=Path, required=True, help="deployment YAML file")
    parser.add_argument("--index", type=int, default=0, help="which decode instance")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import load_config_or_exit
    from aegaeon_common.process import run_service

    config = load_config_or_exit(args.config, "decode")
    from aegaeon_runtime.preflight import instance_preflight_or_exit

    instance_preflight_or_exit(config, "decode", args.index)
    from aegaeon_common.messages.decode import DECODE_CHANNEL, HYBRID_CHANNEL
    from aegaeon_runtime.decode.loop import DecodeLoop
    from aegaeon_runtime.service import LoopFactory, serve_instance

    channel, make_loop = DECODE_CHANNEL, cast(LoopFactory, DecodeLoop)
    if config.role_switching:
        # Roles move (roles.enabled): a decode instance takes prefill work when the
        # proxy turns it to the prefill role, prefills first as a hybrid does.
        channel, make_loop = HYBRID_CHANNEL, partial(DecodeLoop, hybrid=True)
    name = f"decode-{args.index}"
    return run_service(
        name,
        lambda stop: serve_instance(config, "decode", args.index, channel, make_loop, stop),
    )
