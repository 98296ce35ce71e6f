"""A real Prometheus beside a running node: the project's scrape config
(``docker/monitoring/prometheus-node.yml``), its targets taken from the proxy's
``GET /v1/aegaeon/services``, and PromQL queries against it.

``scripts/prometheus`` runs it in the foreground (it installs Debian's package when
missing); the ``prometheus`` test scrapes a live node with it and runs every panel
query of the project's dashboard and of vLLM's example dashboard.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from aegaeon_common.env import read_env
from aegaeon_common.kept import write_atomic

from aegaeon_bench.node.client import auth_headers
from aegaeon_bench.node.http_client import Reply, fetch_sync
from aegaeon_bench.node.launch import interrupt

REPO = Path(__file__).resolve().parents[3]
MONITORING = REPO / "docker" / "monitoring"
NODE_CONFIG = MONITORING / "prometheus-node.yml"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "aegaeon.json"
ROLES = ("proxy", "cachemgr", "prefill", "decode")
READY_TIMEOUT_S = 60.0
REFRESH_S = 15.0  # how often scripts/prometheus re-reads the node's services


class PrometheusError(RuntimeError):
    """Prometheus is missing, did not start, or answered a query with an error."""


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise PrometheusError("no prometheus binary on PATH: run scripts/prometheus once "
                              "(it installs Debian's package), or apt-get install prometheus")
    return found


def fetch_services(proxy_url: str, api_key: str | None = None) -> list[dict[str, str]]:
    """Every service the proxy lists (``GET /v1/aegaeon/services``)."""
    url = proxy_url.rstrip("/") + "/v1/aegaeon/services"
    body = _json(fetch_sync("GET", url, headers=auth_headers(api_key), timeout_s=30), url)
    services = body.get("services") if isinstance(body, dict) else None
    if not isinstance(services, list):
        raise PrometheusError(f"{proxy_url}/v1/aegaeon/services: no 'services' list")
    return [s for s in services if isinstance(s, dict)]


def _json(reply: Reply, what: str) -> Any:
    """A 200 answer's JSON; PrometheusError naming ``what`` for anything else."""
    if reply.status != 200:
        raise PrometheusError(f"{what}: HTTP {reply.status} {reply.text()[:300]}")
    try:
        return reply.json()
    except ValueError:
        raise PrometheusError(f"{what}: not JSON: {reply.text()[:300]}") from None


def target_groups(services: list[dict[str, str]]) -> dict[str, list[dict[str, Any]]]:
    """File-SD groups per role: ``{role: [{"targets": [host:port], "labels": {...}}]}``.
    A service's metrics path must be ``/metrics`` (every service's is)."""
    groups: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
    for service in services:
        role = service.get("role", "")
        url = urllib.parse.urlsplit(service.get("metrics_url", ""))
        if role not in groups or url.path != "/metrics" or not url.netloc:
            continue
        groups[role].append({"targets": [url.netloc], "labels": {"service": service["name"]}})
    return groups


def write_targets(directory: Path, services: list[dict[str, str]]) -> None:
    """One JSON file per role under ``directory/targets``, each written atomically
    (Prometheus reloads a file when it changes and never sees half of one)."""
    targets = directory / "targets"
    targets.mkdir(parents=True, exist_ok=True)
    for role, groups in target_groups(services).items():
        write_atomic(targets / f"{role}.json", json.dumps(groups, indent=1))


def write_config(directory: Path, listen: str, scrape_interval: str | None = None,
                 api_key: str | None = None) -> Path:  # fmt: skip
    """The project's node scrape config in ``directory``, its own job pointed at
    ``listen`` and, if given, another scrape interval. ``api_key`` (an admin key: the
    proxy's ``/metrics`` needs one once it has keys) goes to a file of its own there
    (0600), which the proxy job's ``authorization`` names: never into the config."""
    config = yaml.safe_load(NODE_CONFIG.read_text())
    if scrape_interval is not None:
        config["global"]["scrape_interval"] = scrape_interval
    for job in config["scrape_configs"]:
        if job["job_name"] == "prometheus":
            job["static_configs"] = [{"targets": [listen]}]
        if job["job_name"] == "aegaeon-proxy" and api_key:
            key_file = directory / "proxy-key"
            write_atomic(key_file, api_key)  # 0600
            job["authorization"] = {"type": "Bearer", "credentials_file": str(key_file.resolve())}
    path = directory / "prometheus.yml"
    write_atomic(path, yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Prometheus:
    """A running Prometheus server and its HTTP API."""

    url: str
    directory: Path
    proc: subprocess.Popen[bytes]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on a PromQL error)."""
        qs = urllib.parse.urlencode({"query": expr})
        body = _json(fetch_sync("GET", f"{self.url}/api/v1/query?{qs}", timeout_s=30), expr)
        if body.get("status") != "success":
            raise PrometheusError(f"{expr}: {body}")
        data = body["data"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def targets_up(self) -> dict[str, str]:
        """``{scrape URL: health}`` of every active target."""
        url = f"{self.url}/api/v1/targets"
        active = _json(fetch_sync("GET", url, timeout_s=30), url)["data"]["activeTargets"]
        return {t["scrapeUrl"]: t["health"] for t in active}

    def log_tail(self, num_lines: int = 30) -> str:
        path = self.directory / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


@contextmanager
def running(directory: Path, port: int, scrape_interval: str | None = None,
            api_key: str | None = None) -> Iterator[Prometheus]:  # fmt: skip
    """Start Prometheus on ``127.0.0.1:port`` with the config and targets in
    ``directory`` (``api_key``: see :func:`write_config`); stop it (SIGTERM, then
    SIGKILL) on the way out."""
    listen = f"127.0.0.1:{port}"
    config = write_config(directory, listen, scrape_interval, api_key)
    (directory / "targets").mkdir(exist_ok=True)
    log = (directory / "prometheus.log").open("wb")
    argv = [
        prometheus_binary(), f"--config.file={config}", f"--web.listen-address={listen}",
        f"--storage.tsdb.path={directory / 'data'}", "--storage.tsdb.retention.time=1d",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=directory)
    log.close()
    server = Prometheus(f"http://{listen}", directory, proc)
    try:
        _wait_ready(server)
        yield server
    finally:
        interrupt(proc, 30.0, signal.SIGTERM)


def _wait_ready(server: Prometheus) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise PrometheusError(f"prometheus exited ({server.proc.returncode}):\n"
                                  f"{server.log_tail()}")  # fmt: skip
        try:
            if fetch_sync("GET", f"{server.url}/-/ready", timeout_s=5).status == 200:
                return
        except OSError:  # not listening yet
            pass
        time.sleep(0.2)
    raise PrometheusError(f"prometheus not ready in {READY_TIMEOUT_S} s:\n{server.log_tail()}")


# -- dashboards ---------------------------------------------------------------------------

_VARIABLE = re.compile(r"\$(\{)?(__rate_interval|model_name|model)(?(1)\})")


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every panel target of a Grafana dashboard JSON."""
    board = json.loads(path.read_text())
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((str(panel.get("title", "")), str(target["expr"])))

    walk(board.get("panels", []))
    return out


def instantiate(expr: str, model: str, rate_interval: str) -> str:
    """A panel query with Grafana's variables filled in: ``$model``/``$model_name``
    by one model name (as Grafana fills a single value), ``$__rate_interval`` by
    ``rate_interval``."""

    def fill(match: re.Match[str]) -> str:
        return rate_interval if match.group(2) == "__rate_interval" else model

    return _VARIABLE.sub(fill, expr)


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    values = [float(sample["value"][1]) for sample in result]
    return [v for v in values if math.isfinite(v)]


# -- scripts/prometheus ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from aegaeon_common.usage import OneLineParser, port_number

    parser = OneLineParser(
        prog="scripts/prometheus",
        description="Run Prometheus with the project's scrape config against a node "
        "started by `aegaeon serve` (targets from its proxy's /v1/aegaeon/services).",
    )
    parser.add_argument("--proxy", default="http://127.0.0.1:8000", help="the node's proxy URL")
    parser.add_argument("--port", type=port_number, default=9090,
                        help="Prometheus listens here")  # fmt: skip
    parser.add_argument("--dir", type=Path, default=None,
                        help="config, targets and data (default: a temporary directory)")
    parser.add_argument("--scrape-interval", default=None, help="e.g. 1s (default: the config's)")
    parser.add_argument("--api-key", default=read_env().api_key,
                        help="an admin key of the proxy when it has keys: it lists the services "
                        "and Prometheus scrapes the proxy's /metrics with it "
                        "(default: $AEGAEON_API_KEY)")
    args = parser.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="aegaeon-prometheus-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        write_targets(directory, fetch_services(args.proxy, args.api_key))
    except (OSError, PrometheusError) as exc:
        print(f"scripts/prometheus: cannot list the node's services at {args.proxy}: {exc}",
              file=sys.stderr)
        return 2
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with running(directory, args.port, args.scrape_interval, args.api_key) as server:
            print(f"prometheus at {server.url} scraping the node at {args.proxy} "
                  f"(config, targets and data in {directory}); Ctrl-C stops it", flush=True)
            next_refresh = time.monotonic() + REFRESH_S
            while not stop and server.proc.poll() is None:
                time.sleep(0.5)
                if time.monotonic() >= next_refresh:
                    next_refresh += REFRESH_S
                    # the node restarting: keep the last targets
                    with contextlib.suppress(OSError, PrometheusError):
                        write_targets(directory, fetch_services(args.proxy, args.api_key))
    except PrometheusError as exc:
        print(f"scripts/prometheus: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
