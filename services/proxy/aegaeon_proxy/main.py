"""``aegaeon proxy --config FILE``: the OpenAI-compatible front of a deployment."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("proxy", help="run the OpenAI-compatible proxy")
    parser.add_argument("--config", type=Path, required=True, help="deployment YAML")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import load_config_or_exit
    from aegaeon_common.process import run_service

    from aegaeon_proxy.cluster.backend import ClusterBackend
    from aegaeon_proxy.server import ProxyServer

    config = load_config_or_exit(args.config, "proxy")
    return run_service("proxy", ProxyServer(config, ClusterBackend(config)).serve)
