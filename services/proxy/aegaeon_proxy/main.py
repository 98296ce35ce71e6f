"""``aegaeon proxy --config FILE``: the OpenAI-compatible front of a deployment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("proxy", help="run the OpenAI-compatible proxy")
    parser.add_argument("--config", type=Path, required=True, help="deployment YAML")
    parser.add_argument(
        "--local",
        action="store_true",
        help="generate in this process with the engine on a thread (development; no instances)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import load_config_or_exit
    from aegaeon_common.process import run_service

    from aegaeon_proxy.backend import Backend
    from aegaeon_proxy.build import build_backend
    from aegaeon_proxy.local_backend import LocalEngineBackend
    from aegaeon_proxy.server import ProxyServer

    config = load_config_or_exit(args.config, "proxy")
    try:
        backend: Backend = LocalEngineBackend(config) if args.local else build_backend(config)
    except NotImplementedError as exc:
        print(f"aegaeon proxy: {exc}", file=sys.stderr)
        return 1
    return run_service("proxy", ProxyServer(config, backend).serve)
