"""The processes of one node, in start order, derived from a config."""

from __future__ import annotations

from pathlib import Path

from aegaeon_common.config import Config
from aegaeon_common.http_side import read_http_address

from aegaeon_cli.supervisor import Child, marked_ready, python_argv


def _child(config: Config, name: str, argv: list[str], stage: int) -> Child:
    log_path = config.run_dir / f"{name}.log"
    # The instances map the cachemgr's memory. They and the proxy start at once with the
    # cachemgr: an instance builds what needs no cachemgr, then waits until it answers
    # (aegaeon_runtime.worker); the proxy binds the socket the instances report to, and
    # they reach it whichever comes up first.
    child = Child(name=name, argv=argv, ready=lambda: False, log_path=log_path, stage=stage,
                  maps_cache=stage == 1, start_early=stage > 0)  # fmt: skip

    def health_url() -> str | None:
        address = read_http_address(config.run_dir, name)
        return f"{address.url}/health" if address is not None else None

    child.ready = marked_ready(child, config.run_dir, name)
    child.health_url = health_url
    return child


def build_children(config: Config, config_path: Path) -> list[Child]:
    """cachemgr (stage 0), every instance (1), the proxy, which needs them all (2): all
    started at once, ready in that order, stopped in the reverse."""
    cfg = str(config_path)
    children = [_child(config, "cachemgr", python_argv("cachemgr", "--config", cfg), 0)]
    for kind, index in config.worker_instances:
        argv = python_argv(kind, "--config", cfg, "--index", str(index))
        children.append(_child(config, f"{kind}-{index}", argv, 1))
    children.append(_child(config, "proxy", python_argv("proxy", "--config", cfg), 2))
    return children
