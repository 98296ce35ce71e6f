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

from aegaeon_common.config import Config, ConfigError
from aegaeon_common.process import private_dir


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("node", help="run one node's cachemgr and instances (many nodes)")
    parser.add_argument("--config", type=Path, required=True,
                        help="deployment YAML with node and store (kind: redis) sections")
    parser.add_argument("--gpus", help="all | 0,1,...: one instance per GPU, sized from the "
                        "machine, as `aegaeon serve --gpus` (docs/gpu.md)")
    parser.set_defaults(func=run)


def _planned(args: argparse.Namespace, config: Config) -> tuple[Config, Path]:
    """With ``--gpus``: the config sized for this machine, written (plan at its head) to
    RUN_DIR/planned.yaml; else the config and its file as they are."""
    if args.gpus is None:
        return config, args.config.resolve()
    from aegaeon_common.config import read_config_file
    from aegaeon_common.kept import write_atomic

    from aegaeon_cli.machine import explicit_counts, planned_yaml, sized

    raw = read_config_file(args.config)
    base = args.config.parent.resolve()
    config, out, plan = sized(raw, config, args.gpus, explicit_counts(raw), base=base)
    print(plan.describe(), file=sys.stderr, flush=True)
    path = config.run_dir / "planned.yaml"  # paths made absolute: the file moves there
    private_dir(config.run_dir)
    write_atomic(path, planned_yaml(out, config, plan))
    return config, path


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.config import load_config_or_exit
    from aegaeon_common.env import EnvError
    from aegaeon_common.logs import setup_logging
    from aegaeon_common.process import mark_ready
    from aegaeon_common.usage import fail
    from aegaeon_runtime.preflight import check_machine, instance_devices
    from aegaeon_sched.placement import PlacementError

    from aegaeon_cli.machine import cuda_devices
    from aegaeon_cli.node import build_children
    from aegaeon_cli.supervisor import supervise

    setup_logging("node")
    config = load_config_or_exit(args.config, "node")
    if not config.distributed:
        return fail("aegaeon node", f"{args.config}: store.kind: a node of many needs the "
                    "shared store (redis); one machine alone is `aegaeon serve`")
    try:
        config, path = _planned(args, config)
        check_machine(config, instance_devices(config), cuda_devices)
    except (ConfigError, EnvError, PlacementError) as exc:
        return fail("aegaeon node", exc)
    private_dir(config.run_dir)
    children = [c for c in build_children(config, path) if c.name != "proxy"]

    def announce() -> None:
        names = ", ".join(c.name for c in children)
        print(f"node {config.node.name} ready: {names} (instances at "
              f"{config.node.advertise_address})", flush=True)  # fmt: skip
        mark_ready(config.run_dir, "node")

    return supervise(children, config.drain_timeout_s, announce, "aegaeon node",
                     config.shm_prefix)
