"""`aegaeon serve`: every service of one node as local processes.

Without ``--config`` it serves the default market (built if missing) on the
CPU with one prefill and one decode instance whose device memory holds only a
few models at once, so model switching is real. ``--gpus all|0,1,...`` places the
instances one per GPU and sizes them and the cachemgr from the machine
(``aegaeon_sched.placement``, docs/gpu.md); without it nothing changes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from aegaeon_common.config import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    market_dtype,
    read_config_file,
)
from aegaeon_common.dtypes import DTYPE_BYTES
from aegaeon_common.kept import write_atomic
from aegaeon_common.logs import get_logger, setup_logging
from aegaeon_common.market_index import MARKET_DIR_HELP, load_market
from aegaeon_common.usage import at_least_one, port_number, positive_number
from aegaeon_proxy.main import add_api_key_args, key_entries
from aegaeon_sched.placement import PlacementError, Plan

log = get_logger("serve")

MiB = 1 << 20
GiB = 1 << 30


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("serve", help="start every service on this machine")
    parser.add_argument("--config", type=Path, help="deployment YAML (default: embedded)")
    parser.add_argument("--market", type=Path, help=MARKET_DIR_HELP)
    parser.add_argument("--host", help="proxy listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, help="proxy port (default 8000)")
    parser.add_argument(
        "--policy",
        help="aegaeon (default) | request-level (ServerlessLLM as the paper evaluated it: "
        "requests bound to an instance at arrival, switching with this system's switcher) | "
        "request-level-charged (the same, every scale-up paying ServerlessLLM's load path: "
        "baseline.load_gb_s, default 16, and baseline.init_s) | request-level-sjf "
        "(ServerlessLLM+) | request-level-global (one global FCFS queue) | "
        "request-level-global-sjf | static-mux (MuxServe: the models that fit stay resident "
        "per instance, requests for the rest refused with 503)",
    )
    parser.add_argument("--run-dir", type=Path, help="sockets, logs and the effective config")
    parser.add_argument("--nodes", type=at_least_one, help="many nodes on this machine: N "
                        "nodes (each a cachemgr and its instances) behind --proxies replicas "
                        "sharing Redis")  # fmt: skip
    parser.add_argument("--proxies", type=at_least_one,
                        help="with --nodes: proxy replicas (default 2), API ports --port, "
                        "--port + 1, ...")  # fmt: skip
    parser.add_argument("--store-url", help="with --nodes: an existing Redis (default: start "
                        "a private redis-server)")
    parser.add_argument("--gpus", help="all | 0,1,...: one instance per GPU (CUDA indices), "
                        "each sized from its GPU's free memory, the Model Cache from host memory "
                        "(docs/gpu.md); default: the config's devices and sizes")
    parser.add_argument("--device-memory", type=positive_number, metavar="GiB",
                        help="cap each instance's device memory (GiB, e.g. 36 or 0.5): its "
                        "weights arena (twice the largest model when that leaves a quarter for "
                        "KV, else once) and its KV region are sized inside it (with --gpus: "
                        "the smaller of the cap and its share of the GPU; on a CPU the "
                        "instance then copies weights into it instead of mapping them)")
    parser.add_argument("--tp", type=at_least_one, help="tensor parallelism: every prefill "
                        "and decode instance a group of N devices (one set of weights sharded "
                        "across them; prefill.tp / decode.tp); on the CPU, N processes over "
                        "gloo (default: the config's, 1)")  # fmt: skip
    add_api_key_args(parser)
    parser.set_defaults(func=run)


def default_config_dict(market: Path, port: int) -> dict[str, Any]:
    """The embedded default: 1 prefill + 1 decode instance on the CPU.

    Each worker's weights arena holds the largest model twice over (the active
    model plus one prefetched), far fewer than the market's models, so every
    change of model is a real switch through the Model Cache.
    """
    itemsize = DTYPE_BYTES[market_dtype(market)]  # the market's largest model, as served
    largest = max(e.params * itemsize for e in load_market(market))
    arena = 2 * largest + 16 * MiB
    return {
        "market": str(market),
        # The prefill instance decodes when idle (scheduler.prefill_decodes_when_idle),
        # so it gets the decode instance's KV room.
        "prefill": {"instances": 1, "device_memory_bytes": arena + 256 * MiB,
                    "kv_memory_bytes": 256 * MiB},
        "decode": {"instances": 1, "device_memory_bytes": arena + 256 * MiB,
                   "kv_memory_bytes": 256 * MiB},
        "cachemgr": {"kv_cache_bytes": 1 << 30},
        "proxy": {"port": port},
    }  # fmt: skip


def deployment(config: Path | None, market: Path | None,
               port: int = 8000) -> tuple[dict[str, Any], Path, str]:
    """The deployment as plain data: the file ``config`` (``market`` over the one it names,
    or supplying it), else the embedded default over ``market`` (default: $AEGAEON_MARKET
    or ./market); the folder its paths are relative to, and the name of its source."""
    if config is None:
        from aegaeon_market import default_market_dir

        market = (market or default_market_dir()).resolve()
        return default_config_dict(market, port), Path.cwd(), "<embedded default>"
    raw = read_config_file(config)
    if market is not None:
        raw["market"] = str(market.resolve())
    return raw, config.parent.resolve(), str(config)


def _effective_config(args: argparse.Namespace) -> tuple[Config, dict[str, Any], Plan | None]:
    """The deployment this run serves, as a Config and as plain data, and the
    ``--gpus`` plan that sized it (None without ``--gpus``)."""
    if args.config is not None and args.market is None:
        load_config(args.config)  # validate the file as written first
    if args.config is None:
        from aegaeon_market import default_market_dir, ensure_market

        market = (args.market or default_market_dir()).resolve()
        if not (market / "market.json").exists():  # an existing market is served as it is
            print(f"Building the default market in {market} ...", file=sys.stderr, flush=True)
            ensure_market(market, real_models=True)
    raw, base, source = deployment(args.config, args.market, args.port or 8000)
    if args.tp is not None:
        from aegaeon_cli.machine import with_tp

        raw = with_tp(raw, args.tp)
    proxy = dict(raw.get("proxy") or {})
    keys = key_entries(args)
    if keys:
        proxy["api_keys"] = [*(proxy.get("api_keys") or []), *keys]
    if args.host:
        proxy["host"] = args.host
    if args.port:
        proxy["port"] = args.port
    raw["proxy"] = proxy
    if args.policy:
        raw["scheduler"] = {**(raw.get("scheduler") or {}), "policy": args.policy}
    if args.run_dir:
        raw["run_dir"] = str(args.run_dir.resolve())
    elif not raw.get("run_dir"):
        raw["run_dir"] = f"/tmp/aegaeon-{os.getuid()}-{proxy.get('port', 8000)}"
    config = config_from_dict(raw, source=source, base=base)
    cap = None if args.device_memory is None else int(args.device_memory * GiB)
    if args.gpus is None:
        if cap is None:
            return config, raw, None
        from aegaeon_cli.machine import capped

        config, raw, lines = capped(raw, config, cap, base=base)
        print("Device memory cap (--device-memory):\n" + "\n".join(lines), file=sys.stderr,
              flush=True)  # fmt: skip
        return config, raw, None
    from aegaeon_cli.machine import explicit_counts, sized

    # the embedded default's counts are not the user's: with --gpus the plan picks them
    counts = explicit_counts(raw) if args.config is not None else (None, None)
    return sized(raw, config, args.gpus, counts, base=base, cap_bytes=cap)


def check_serve(market: Path, config: Path | None, policy: str | None = None) -> None:
    """What ``aegaeon serve --market MARKET [--config CONFIG] [--policy POLICY]`` checks
    before it starts anything (the config, then what it needs of this machine), for a
    tool about to start one (the benches): ConfigError, EnvError or PlacementError,
    each one line."""
    from aegaeon_runtime.preflight import check_machine, instance_devices

    from aegaeon_cli.machine import cuda_devices

    parser = argparse.ArgumentParser(prog="aegaeon")
    register(parser.add_subparsers())
    argv = ["serve", "--market", str(market)]
    argv += ["--config", str(config)] if config is not None else []
    argv += ["--policy", policy] if policy is not None else []
    args = parser.parse_args(argv)  # the serve defaults, every one, as `aegaeon serve` has them
    checked, _, _ = _effective_config(args)
    check_machine(checked, instance_devices(checked), cuda_devices)


def service_lines(config: Config, names: list[str]) -> list[str]:
    """One line per service: its health, readiness and metrics URLs (as it recorded them)."""
    from aegaeon_common.http_side import read_http_address

    lines = []
    width = max((len(n) for n in names), default=0)
    for name in names:
        address = read_http_address(config.run_dir, name)
        if address is None:
            lines.append(f"  {name:<{width}}  (no HTTP address recorded)")
            continue
        urls = address.to_dict()
        lines.append(f"  {name:<{width}}  health {urls['health_url']}  ready {urls['ready_url']}"
                     f"  metrics {urls['metrics_url']}")  # fmt: skip
    return lines


def run(args: argparse.Namespace) -> int:
    from aegaeon_common.env import EnvError
    from aegaeon_common.process import private_dir
    from aegaeon_common.usage import fail
    from aegaeon_runtime.preflight import check_machine, instance_devices

    from aegaeon_cli.checkpoints import unreadable_lines
    from aegaeon_cli.machine import cuda_devices, planned_yaml, with_absolute_paths
    from aegaeon_cli.node import build_children
    from aegaeon_cli.supervisor import supervise

    setup_logging("serve")
    if args.gpus is not None and args.nodes is not None:
        return fail("aegaeon serve", "--gpus places one node's instances; with --nodes every "
                    "node would take every GPU (give each node's config its devices)")
    if args.nodes is None and (args.proxies is not None or args.store_url is not None):
        flag = "--proxies" if args.proxies is not None else "--store-url"
        return fail("aegaeon serve", f"{flag} goes with --nodes N (many nodes on this "
                    "machine); one node has one proxy and no shared store")
    try:
        config, raw, plan = _effective_config(args)
        check_machine(config, instance_devices(config), cuda_devices)
    except (ConfigError, EnvError, PlacementError) as exc:
        return fail("aegaeon serve", exc)
    if plan is not None:
        print(plan.describe(), file=sys.stderr, flush=True)
    try:
        private_dir(config.run_dir)  # 0700: the node's sockets and files are this user's
    except OSError as exc:  # another user's, or a file
        return fail("aegaeon serve", f"run directory {config.run_dir}: {exc.strerror or exc}")
    effective = config.run_dir / "config.yaml"
    raw_abs = with_absolute_paths(raw, config)
    write_atomic(effective, planned_yaml(raw_abs, config, plan))  # may hold API keys
    for line in unreadable_lines(config):  # a file that changed since `market add`
        print(f"aegaeon serve: {line}", file=sys.stderr, flush=True)
    if args.nodes is not None:
        from aegaeon_cli.cluster import run_cluster

        base = args.config.parent.resolve() if args.config is not None else Path.cwd()
        return run_cluster(raw_abs, base, config.source, args.nodes,
                           2 if args.proxies is None else args.proxies, args.store_url)
    children = build_children(config, effective)
    url = f"http://{config.proxy.host}:{config.proxy.port}"

    def announce() -> None:
        names = ", ".join(config.model_names)
        print(f"Aegaeon is serving {len(config.models)} models at {url}/v1 ({names})", flush=True)
        print("Services (also at GET /v1/aegaeon/services):", flush=True)
        order = ["proxy", *(c.name for c in children if c.name != "proxy")]
        for line in service_lines(config, order):
            print(line, flush=True)
        print("Press Ctrl-C to stop.", flush=True)

    return supervise(children, config.drain_timeout_s, announce, "aegaeon serve",
                     config.shm_prefix)
