"""``aegaeon cachemgr --config FILE``: the node's cache manager process.

Imports nothing heavy at module level: the CLI table imports this module to
build its parser.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``cachemgr`` subcommand to the ``aegaeon`` CLI."""
    parser = subparsers.add_parser(
        "cachemgr",
        help="run the node's cache manager",
        description="Serve the node's Model Cache and unified CPU KV cache in shared memory "
        "to the workers (ZeroMQ ROUTER on the config's cachemgr address).",
    )
    parser.add_argument("--config", type=Path, required=True, help="deployment YAML file")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import load_config_or_exit
    from aegaeon_common.process import run_service

    config = load_config_or_exit(args.config, "cachemgr")
    from aegaeon_cachemgr.service import serve

    return run_service("cachemgr", lambda stop: serve(config, stop))
