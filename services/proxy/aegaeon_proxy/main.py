"""``aegaeon proxy --config FILE``: the OpenAI-compatible front of a deployment."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("proxy", help="run the OpenAI-compatible proxy")
    parser.add_argument("--config", type=Path, required=True, help="deployment YAML")
    add_api_key_args(parser)
    parser.set_defaults(func=run)


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    """``--api-key`` / ``--api-key-file`` / ``--admin-key`` / ``--admin-key-file``
    (shared with ``aegaeon serve``)."""
    parser.add_argument(
        "--api-key", action="append", default=[], metavar="KEY[:MODEL,...]",
        help="accept this user key (Authorization: Bearer KEY) for the API, optionally only "
        "for the models named; repeat for several keys (also proxy.api_keys in the config)",
    )  # fmt: skip
    parser.add_argument("--api-key-file", action="append", default=[], type=Path,
                        metavar="FILE", help="user keys, one a line (KEY[:MODEL,...])")  # fmt: skip
    parser.add_argument(
        "--admin-key", action="append", default=[], metavar="KEY",
        help="accept this admin key: the API and what changes or reveals the node "
        "(/v1/aegaeon/*, /metrics, /sleep, /wake_up, /is_sleeping), which user keys may "
        "not call; repeat for several (also proxy.admin_keys in the config)",
    )  # fmt: skip
    parser.add_argument("--admin-key-file", action="append", default=[], type=Path,
                        metavar="FILE", help="admin keys, one a line")  # fmt: skip


def key_entries(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The keys the command line gives, as ``proxy.api_keys`` entries (user keys, then
    admin keys); a ConfigError for a file that cannot be read."""
    from aegaeon_common.config import api_key_entries

    users = api_key_entries(args.api_key, args.api_key_file)
    return users + api_key_entries(args.admin_key, args.admin_key_file, admin=True)


def run(args: argparse.Namespace) -> int:
    import sys

    from aegaeon_common.config import ConfigError, load_config_or_exit, with_api_keys
    from aegaeon_common.process import run_service

    from aegaeon_proxy.cluster.backend import ClusterBackend
    from aegaeon_proxy.server import ProxyServer

    config = load_config_or_exit(args.config, "proxy")
    try:
        config = with_api_keys(config, key_entries(args), "--api-key/--admin-key")
    except ConfigError as exc:
        print(f"aegaeon proxy: {exc}", file=sys.stderr)
        return 2
    # Algorithms 1-2 (or a request-level baseline) over the store: the memory store on one
    # node, Redis for many (one replica of the proxy layer)
    return run_service("proxy", ProxyServer(config, ClusterBackend(config)).serve)
