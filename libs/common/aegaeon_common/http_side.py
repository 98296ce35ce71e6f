"""The small HTTP server every service that has no API port runs beside its sockets.

``GET /health`` (liveness: the process's event loop answers, and what the
service adds: an instance's compute thread makes progress; a body whose
``status`` is not ``ok`` is a 503), ``GET /ready``
(200 once the service is connected, loaded and warmed; 503 before that and
again while it drains) and ``GET /metrics`` (its registry, Prometheus text).
The proxy serves the same three on its API port with the helpers here.

Discovery: each service writes its bound address to ``RUN_DIR/NAME.http``
(JSON ``{"name", "role", "url"}``, atomically) and removes it on exit;
``aegaeon serve`` prints them and the proxy's ``/v1/aegaeon/services`` lists them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from aegaeon_common.env import read_env
from aegaeon_common.process import private_dir

if TYPE_CHECKING:
    from aegaeon_common.registry import InstanceRecord

__all__ = [
    "Readiness",
    "ServiceAddress",
    "SideServer",
    "advertised_url",
    "http_address_path",
    "metrics_response",
    "read_http_address",
    "remove_http_address",
    "with_http_urls",
    "write_http_address",
]

_ANY_HOST = ("0.0.0.0", "::", "")


class Readiness:
    """A service's readiness, set by its owner on its event loop.

    Ready once ``set_ready`` was called and not draining; ``reason`` says why
    not (for the 503 body and the logs).
    """

    def __init__(self) -> None:
        self._ready = False
        self.draining = False
        self.reason = "starting"

    @property
    def ok(self) -> bool:
        return self._ready and not self.draining

    def set_reason(self, reason: str) -> None:
        """What the service is waiting for now (while not ready)."""
        if not self._ready:
            self.reason = reason

    def set_ready(self) -> None:
        self._ready = True
        if not self.draining:
            self.reason = "ready"

    def set_draining(self) -> None:
        self.draining = True
        self.reason = "draining"

    def set_failed(self, reason: str) -> None:
        """Not ready again in this process (a stalled instance): ``reason`` says why."""
        self._ready = False
        self.reason = reason


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """The registry's Prometheus text exposition as an aiohttp response."""
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@dataclass(frozen=True)
class ServiceAddress:
    """Where a service's side HTTP server (or the proxy's API) listens."""

    name: str  # "cachemgr", "prefill-0", "decode-1", "proxy"
    role: str  # "cachemgr" | "prefill" | "decode" | "proxy"
    url: str  # http://host:port, no trailing slash

    def to_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "role": self.role,
            "health_url": f"{self.url}/health",
            "ready_url": f"{self.url}/ready",
            "metrics_url": f"{self.url}/metrics",
        }


def advertised_url(host: str, port: int) -> str:
    """``http://host:port`` as others reach it: a wildcard bind advertises
    ``AEGAEON_ADVERTISE_HOST`` or this machine's host name."""
    if host in _ANY_HOST:
        host = read_env().advertise_host or socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def http_address_path(run_dir: Path, name: str) -> Path:
    return run_dir / f"{name}.http"


def write_http_address(run_dir: Path, address: ServiceAddress) -> Path:
    """Record ``address`` in ``RUN_DIR/NAME.http`` (write aside, then rename)."""
    path = http_address_path(run_dir, address.name)
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"name": address.name, "role": address.role, "url": address.url}))
    tmp.replace(path)
    return path


def read_http_address(run_dir: Path, name: str) -> ServiceAddress | None:
    """The address service ``name`` recorded, or None (not started, or gone)."""
    try:
        data = json.loads(http_address_path(run_dir, name).read_text())
        return ServiceAddress(str(data["name"]), str(data["role"]), str(data["url"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def with_http_urls(record: InstanceRecord, run_dir: Path) -> InstanceRecord:
    """``record`` with its side HTTP server's URL and its node's cachemgr's, once each
    recorded it (the instance's own registrar and one node's proxy both fill them in)."""
    for field, service in (("http_url", record.instance_id), ("cachemgr_http_url", "cachemgr")):
        if not getattr(record, field):
            address = read_http_address(run_dir, service)
            if address is not None:
                record = msgspec.structs.replace(record, **{field: address.url})
    return record


def remove_http_address(run_dir: Path, name: str, url: str) -> None:
    """Remove ``NAME.http`` if it is still ours (a restarted service may have rewritten it)."""
    current = read_http_address(run_dir, name)
    if current is not None and current.url == url:
        with contextlib.suppress(OSError):
            http_address_path(run_dir, name).unlink()


class SideServer:
    """``/health``, ``/ready``, ``/metrics`` of one service on ``host:port`` (0: ephemeral).

    ``health`` adds service-specific fields to the ``/health`` body; it runs on
    the event loop and must only read.
    """

    def __init__(
        self,
        name: str,
        role: str,
        registry: CollectorRegistry,
        readiness: Readiness,
        *,
        host: str,
        port: int,
        run_dir: Path,
        health: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.name = name
        self.role = role
        self.registry = registry
        self.readiness = readiness
        self.host = host
        self.port = port
        self.run_dir = run_dir
        self._health = health
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._on_health)
        app.router.add_get("/ready", self._on_ready)
        app.router.add_get("/metrics", self._on_metrics)
        return app

    async def _on_health(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {
            "status": "ok",
            "service": self.name,
            "role": self.role,
            "pid": os.getpid(),
            "ready": self.readiness.ok,
            "draining": self.readiness.draining,
        }
        if self._health is not None:
            body.update(self._health())
        return web.json_response(body, status=200 if body["status"] == "ok" else 503)

    async def _on_ready(self, request: web.Request) -> web.Response:
        r = self.readiness
        status = 200 if r.ok else 503
        return web.json_response({"ready": r.ok, "reason": r.reason}, status=status)

    async def _on_metrics(self, request: web.Request) -> web.Response:
        return metrics_response(self.registry)

    async def start(self) -> str:
        """Listen and record the address; returns the URL."""
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        addresses = self._runner.addresses
        port = int(addresses[0][1]) if addresses else self.port
        self.url = advertised_url(self.host, port)
        write_http_address(self.run_dir, ServiceAddress(self.name, self.role, self.url))
        return self.url

    async def stop(self) -> None:
        if self.url is not None:
            remove_http_address(self.run_dir, self.name, self.url)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
