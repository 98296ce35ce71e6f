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
import sys
from pathlib import Path
from typing import Any

import yaml
from aegaeon_common.config import Config, ConfigError, config_from_dict
from aegaeon_common.kept import write_atomic
from aegaeon_common.ports import NoFreePortsError, free_ports
from aegaeon_common.process import is_ready, private_dir

from aegaeon_cli.supervisor import DRAIN_MARGIN_S, Child, StartupError, Supervisor, python_argv

PORT_STRIDE = 100  # node i's instances from base_port + PORT_STRIDE * i


def _write(path: Path, raw: dict[str, Any]) -> None:
    """The member's config, this user's only (0600: it may hold API keys), atomically."""
    private_dir(path.parent)
    write_atomic(path, yaml.safe_dump(raw, sort_keys=False))


def _instances(raw: dict[str, Any]) -> int:
    """Command ports one node needs (its prefill and decode instances)."""
    count = 0
    for kind in ("prefill", "decode"):
        section = raw.get(kind) or {}
        count += int(section.get("instances", 1)) if isinstance(section, dict) else 1
    return max(count, 1)


def _free_ports(count: int, taken: set[int]) -> int:
    try:
        return free_ports(count, taken)
    except NoFreePortsError as exc:
        raise StartupError(str(exc)) from None


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


def _member(raw: dict[str, Any], **sections: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for key, value in sections.items():
        out[key] = {**(out.get(key) or {}), **value} if isinstance(value, dict) else value
    return out


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
        port = _free_ports(1, taken)
        store_url = f"redis://127.0.0.1:{port}/0"
        children.append(_redis_child(root, port))
    # one run, one namespace: a Redis shared with an earlier run (--store-url) holds
    # that run's records (models removed at run time, their settings), not this one's;
    # a namespace the config names is kept (a deployment that means to share them)
    configured_store = raw.get("store") or {}
    namespace = configured_store.get("namespace") or f"aegaeon-{secrets.token_hex(4)}"
    store = {"kind": "redis", "url": store_url, "namespace": namespace}
    per_node = _instances(raw)
    configured = (raw.get("node") or {}).get("base_port")
    for i in range(nodes):
        run_dir = root / f"node-{i}"
        # a configured base_port: node i from base_port + 100 i; else free ports of this
        # machine (several clusters, or tests, may run at once)
        base_port = (int(configured) + PORT_STRIDE * i if configured is not None
                     else _free_ports(per_node, taken))  # fmt: skip
        node = {"name": f"node-{i}", "advertise_address": "127.0.0.1", "base_port": base_port}
        member = _member(raw, node=node, store=store, run_dir=str(run_dir))
        config_from_dict(member, source=f"{source} (node-{i})", base=base)  # validate
        path = run_dir / "config.yaml"
        _write(path, member)
        # its own supervisor stops its instances, then its cachemgr, each stage within
        # drain + margin, and kills (stacks first) what overstays: let it
        node_stop_s = 2 * (float(raw.get("drain_timeout", 30.0)) + DRAIN_MARGIN_S) + 5.0
        child = Child(name=f"node-{i}", argv=python_argv("node", "--config", str(path)),
                      ready=lambda: False, log_path=root / f"node-{i}.log", stage=1,
                      stop_timeout_s=node_stop_s)  # fmt: skip
        child.ready = _ready(child, run_dir, "node")
        children.append(child)
    port = int((raw.get("proxy") or {}).get("port", 8000))
    configs = []
    for r in range(proxies):
        run_dir = root / f"proxy-{r}"
        member = _member(raw, store=store, run_dir=str(run_dir),
                         node={"name": f"proxy-{r}", "advertise_address": "127.0.0.1"},
                         proxy={"port": port + r})  # fmt: skip
        configs.append(config_from_dict(member, source=f"{source} (proxy-{r})", base=base))
        path = run_dir / "config.yaml"
        _write(path, member)
        child = Child(name=f"proxy-{r}", argv=python_argv("proxy", "--config", str(path)),
                      ready=lambda: False, log_path=root / f"proxy-{r}.log", stage=2)  # fmt: skip
        child.ready = _ready(child, run_dir, "proxy")
        children.append(child)
    return children, configs


def _ready(child: Child, run_dir: Path, name: str) -> Any:
    def ready() -> bool:
        return child.proc is not None and is_ready(run_dir, name, child.proc.pid)

    return ready


def run_cluster(raw: dict[str, Any], base: Path, source: str, nodes: int, proxies: int,
                store_url: str | None) -> int:  # fmt: skip
    from aegaeon_cli.supervisor import install_stop_handlers, supervise

    try:
        children, configs = cluster_children(raw, base, source, nodes, proxies, store_url)
    except (ConfigError, StartupError) as exc:
        print(f"aegaeon serve: {exc}", file=sys.stderr)
        return 2
    drain_s = float(raw.get("drain_timeout", 30.0))
    sup = Supervisor(children, stop_timeout_s=drain_s + DRAIN_MARGIN_S)
    install_stop_handlers(sup)

    def announce() -> None:
        urls = ", ".join(f"http://{c.proxy.host}:{c.proxy.port}/v1" for c in configs)
        print(f"Aegaeon is serving {len(configs[0].models)} models on {nodes} nodes behind "
              f"{proxies} proxy replicas: {urls}", flush=True)  # fmt: skip
        print(f"Store: {configs[0].store.url.rpartition('@')[2]}; run dirs under "
              f"{raw['run_dir']}. Press Ctrl-C to stop.", flush=True)  # fmt: skip

    return supervise(sup, announce, "aegaeon serve")  # each node's supervisor cleans its shm


__all__ = ["cluster_children", "run_cluster"]
