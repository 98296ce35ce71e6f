"""``aegaeon node --config FILE``: one node of many (its cachemgr and instances, no proxy).

The config names the node (``node.name``, ``node.advertise_address``) and the
shared store (``store.kind: redis``); the node's instances register there and
the proxy replicas find them. The node is supervised like ``aegaeon serve``
(a dead child restarts; SIGTERM drains every instance, the cachemgr last) and
writes ``RUN_DIR/node.ready`` once every instance is ready.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("node", help="run one node's cachemgr and instances (many nodes)")
    parser.add_argument("--config", type=Path, required=True,
                        help="deployment YAML with node and store (kind: redis) sections")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import load_config_or_exit
    from aegaeon_common.logs import setup_logging
    from aegaeon_common.process import mark_ready, private_dir

    from aegaeon_cli.node import build_children
    from aegaeon_cli.supervisor import (
        DRAIN_MARGIN_S,
        Supervisor,
        install_stop_handlers,
        supervise,
    )

    setup_logging("node")
    config = load_config_or_exit(args.config, "node")
    if not config.distributed:
        print(f"aegaeon node: {args.config}: store.kind: a node of many needs the shared "
              "store (redis); one machine alone is `aegaeon serve`", file=sys.stderr)  # fmt: skip
        return 2
    private_dir(config.run_dir)
    children = [c for c in build_children(config, args.config.resolve()) if c.name != "proxy"]
    sup = Supervisor(children, stop_timeout_s=config.drain_timeout_s + DRAIN_MARGIN_S)
    install_stop_handlers(sup)
    def announce() -> None:
        names = ", ".join(c.name for c in children)
        print(f"node {config.node.name} ready: {names} (instances at "
              f"{config.node.advertise_address})", flush=True)  # fmt: skip
        mark_ready(config.run_dir, "node")

    return supervise(sup, announce, "aegaeon node", config.shm_prefix)
