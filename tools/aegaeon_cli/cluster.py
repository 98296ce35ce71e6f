"""``aegaeon serve --nodes N [--proxies R]``: the multi-node shape on one machine.

Children of one supervisor, in stages: a private ``redis-server`` (unless
``--store-url`` names one), then ``N`` nodes (``aegaeon node``: a cachemgr and
its instances each, a process group and a run directory of their own,
instances on tcp at 127.0.0.1, ports ``base_port + 100 i``), then ``R`` proxy
replicas (``aegaeon proxy``, API ports ``port .. port + R - 1``), all sharing
the store. Each node's and replica's effective config is written to its run
directory. The same shape runs across machines from the same commands
(``deploy/k8s``).
"""

from __future__ import annotations

import copy
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any

import yaml
from aegaeon_common.config import Config, ConfigError, config_from_dict
from aegaeon_common.kept import write_atomic
from aegaeon_common.ports import NoFreePortsError, free_ports
from aegaeon_common.process import private_dir

from aegaeon_cli.machine import explicit_counts
from aegaeon_cli.supervisor import (
    DRAIN_MARGIN_S,
    Child,
    StartupError,
    marked_ready,
    python_argv,
)

PORT_STRIDE = 100  # node i's instances from base_port + PORT_STRIDE * i


def _redis_child(root: Path, port: int) -> Child:
    binary = shutil.which("redis-server")
    if binary is None:
        raise StartupError("redis-server is not installed (Debian: apt-get install "
                           "redis-server), or give --store-url")  # fmt: skip
    # no persistence: after a restart (the supervisor's, empty) every record is rebuilt by
    # its owner and the replicas write the run-time changes back (docs/reliability.md)
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(root)]  # fmt: skip

    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return Child(name="redis", argv=argv, ready=ready, log_path=root / "redis.log", stage=0)


def cluster_children(
    raw: dict[str, Any], base: Path, source: str, nodes: int, proxies: int,
    store_url: str | None,
) -> tuple[list[Child], list[Config]]:
    """The children of the multi-node shape and the configs of its proxy replicas."""
    if nodes < 1 or proxies < 1:
        raise ConfigError(source, "--nodes/--proxies", "at least one node and one proxy")
    root = Path(str(raw["run_dir"]))
    private_dir(root)
    children: list[Child] = []
    taken: set[int] = set()
    if store_url is None:
        port = free_ports(1, taken)
        store_url = f"redis://127.0.0.1:{port}/0"
        children.append(_redis_child(root, port))
    # one run, one namespace: a Redis shared with an earlier run (--store-url) holds
    # that run's records (models removed at run time, their settings), not this one's;
    # a namespace the config names is kept (a deployment that means to share them)
    configured_store = raw.get("store") or {}
    namespace = configured_store.get("namespace") or f"aegaeon-{secrets.token_hex(4)}"
    store = {"kind": "redis", "url": store_url, "namespace": namespace}

    def member(name: str, command: str, stage: int, stop_timeout_s: float | None = None,
               **sections: Any) -> Config:
        """Add the child running ``aegaeon COMMAND`` over ``raw`` with ``sections`` merged
        in; its config, validated and written to its run directory."""
        run_dir = root / name
        merged = copy.deepcopy(raw)
        for key, value in {"store": store, "run_dir": str(run_dir), **sections}.items():
            merged[key] = {**(merged.get(key) or {}), **value} if isinstance(value, dict) else value
        config = config_from_dict(merged, source=f"{source} ({name})", base=base)  # validate
        path = run_dir / "config.yaml"
        private_dir(run_dir)
        write_atomic(path, yaml.safe_dump(merged, sort_keys=False))  # 0600: may hold API keys
        child = Child(name=name, argv=python_argv(command, "--config", str(path)),
                      ready=lambda: False, log_path=root / f"{name}.log", stage=stage,
                      stop_timeout_s=stop_timeout_s)  # fmt: skip
        child.ready = marked_ready(child, run_dir, command)
        children.append(child)
        return config

    # command ports one node needs (its prefill and decode instances)
    per_node = max(sum(1 if n is None else n for n in explicit_counts(raw)), 1)
    configured = (raw.get("node") or {}).get("base_port")
    # a node's own supervisor stops its instances, then its cachemgr, each stage within
    # drain + margin, and kills (stacks first) what overstays: let it
    node_stop_s = 2 * (float(raw.get("drain_timeout", 30.0)) + DRAIN_MARGIN_S) + 5.0
    for i in range(nodes):
        # a configured base_port: node i from base_port + 100 i; else free ports of this
        # machine (several clusters, or tests, may run at once)
        base_port = (int(configured) + PORT_STRIDE * i if configured is not None
                     else free_ports(per_node, taken))  # fmt: skip
        node = {"name": f"node-{i}", "advertise_address": "127.0.0.1", "base_port": base_port}
        member(f"node-{i}", "node", 1, node_stop_s, node=node)
    port = int((raw.get("proxy") or {}).get("port", 8000))
    configs = [member(f"proxy-{r}", "proxy", 2, proxy={"port": port + r},
                      node={"name": f"proxy-{r}", "advertise_address": "127.0.0.1"})
               for r in range(proxies)]  # fmt: skip
    return children, configs


def run_cluster(raw: dict[str, Any], base: Path, source: str, nodes: int, proxies: int,
                store_url: str | None) -> int:  # fmt: skip
    from aegaeon_common.usage import fail

    from aegaeon_cli.supervisor import supervise

    try:
        children, configs = cluster_children(raw, base, source, nodes, proxies, store_url)
    except (ConfigError, StartupError, NoFreePortsError) as exc:
        return fail("aegaeon serve", exc)

    def announce() -> None:
        urls = ", ".join(f"http://{c.proxy.host}:{c.proxy.port}/v1" for c in configs)
        print(f"Aegaeon is serving {len(configs[0].models)} models on {nodes} nodes behind "
              f"{proxies} proxy replicas: {urls}", flush=True)  # fmt: skip
        print(f"Store: {configs[0].store.url.rpartition('@')[2]}; run dirs under "
              f"{raw['run_dir']}. Press Ctrl-C to stop.", flush=True)  # fmt: skip

    # each node's supervisor cleans its shm
    return supervise(children, float(raw.get("drain_timeout", 30.0)), announce, "aegaeon serve")


__all__ = ["cluster_children", "run_cluster"]
