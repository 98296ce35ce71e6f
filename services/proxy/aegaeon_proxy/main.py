"""``aegaeon proxy --config FILE``: the OpenAI-compatible front of a deployment."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("proxy", help="run the OpenAI-compatible proxy")
    parser.add_argument("--config", type=Path, required=True, help="deployment YAML")
    add_api_key_args(parser)
    parser.set_defaults(func=run)


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` / ``--api-key-file`` (shared with ``aegaeon serve``)."""
    parser.add_argument(
        "--api-key", action="append", default=[], metavar="KEY[:MODEL,...]",
        help="accept this API key (Authorization: Bearer KEY), optionally only for the "
        "models named; repeat for several keys (also proxy.api_keys in the config)",
    )  # fmt: skip
    parser.add_argument("--api-key-file", action="append", default=[], type=Path,
                        metavar="FILE", help="API keys, one a line (KEY[:MODEL,...])")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import sys

    from aegaeon_common.config import (
        ConfigError,
        api_key_entries,
        load_config_or_exit,
        with_api_keys,
    )
    from aegaeon_common.process import run_service

    from aegaeon_proxy.cluster.backend import ClusterBackend
    from aegaeon_proxy.server import ProxyServer

    config = load_config_or_exit(args.config, "proxy")
    try:
        entries = api_key_entries(args.api_key, args.api_key_file)
        config = with_api_keys(config, entries, "--api-key")
    except ConfigError as exc:
        print(f"aegaeon proxy: {exc}", file=sys.stderr)
        return 2
    if config.distributed:  # one replica of the proxy layer over many nodes
        from aegaeon_proxy.cluster.distributed import DistributedBackend

        return run_service("proxy", ProxyServer(config, DistributedBackend(config)).serve)
    return run_service("proxy", ProxyServer(config, ClusterBackend(config)).serve)
