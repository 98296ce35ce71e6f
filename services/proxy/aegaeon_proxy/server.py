"""Run the proxy's application on a TCP port until told to stop, then drain."""

from __future__ import annotations

import asyncio
import socket
import time

from aegaeon_common.config import Config
from aegaeon_common.http_side import (
    ServiceAddress,
    advertised_url,
    remove_http_address,
    write_http_address,
)
from aegaeon_common.logs import get_logger
from aegaeon_common.process import mark_ready
from aiohttp import web

from aegaeon_proxy.app import make_admin_app, make_app
from aegaeon_proxy.backend import Backend
from aegaeon_proxy.state import STATE

READY_POLL_S = 0.1
# After answering a request whose body was not read to its end (413, 408), read what
# still comes for at most this long, then close (aiohttp's default is 10 s).
LINGER_S = 2.0
# After the drain (which waits for open requests), handlers still running are
# cancelled after this, not the HTTP server's default minute.
SHUTDOWN_GRACE_S = 5.0
DRAIN_POLL_S = 0.05

log = get_logger("proxy")

__all__ = ["ProxyServer"]


def listen_socket(host: str, port: int, send_buffer_bytes: int) -> socket.socket:
    """The API's listening socket; accepted connections inherit its send buffer size."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]  # fmt: skip
    sock = socket.create_server((host, port), family=family)
    if send_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    return sock


class ProxyServer:
    """The proxy on ``config.proxy.host:port`` (port 0 picks a free one).

    Client disconnects cancel their handler (``handler_cancellation``), which
    is how a disconnect frees the request in the backend.
    """

    def __init__(self, config: Config, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.app = make_app(config, backend)
        self._runner: web.AppRunner | None = None
        self._admin: web.AppRunner | None = None
        self.port: int | None = None
        self.admin_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.proxy.host}:{self.port}"

    async def start(self) -> None:
        """Start the backend (through the app) and listen (the admin port too, if set)."""
        proxy = self.config.proxy
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     lingering_time=LINGER_S, shutdown_timeout=SHUTDOWN_GRACE_S,
                                     keepalive_timeout=proxy.keepalive_timeout_s)  # fmt: skip
        await self._runner.setup()
        site = web.SockSite(self._runner, listen_socket(proxy.host, proxy.port,
                                                        proxy.send_buffer_bytes))  # fmt: skip
        await site.start()
        addresses = self._runner.addresses  # (host, port, ...) of the bound sockets
        self.port = int(addresses[0][1]) if addresses else proxy.port
        # where /health, /ready and /metrics are scraped: the admin port when there is one
        url = advertised_url(proxy.host, self.port)
        if proxy.admin_port is not None:
            self._admin = web.AppRunner(make_admin_app(self.app[STATE]), access_log=None,
                                        shutdown_timeout=SHUTDOWN_GRACE_S)  # fmt: skip
            await self._admin.setup()
            await web.TCPSite(self._admin, proxy.admin_host, proxy.admin_port).start()
            bound = self._admin.addresses
            self.admin_port = int(bound[0][1]) if bound else proxy.admin_port
            url = advertised_url(proxy.admin_host, self.admin_port)
            log.info("admin_listening", url=url)
        self.app[STATE].url = url
        write_http_address(self.config.run_dir, ServiceAddress("proxy", "proxy", url))
        log.info("listening", url=self.url, models=list(self.config.model_names),
                 api_keys=len(proxy.api_keys))  # fmt: skip

    async def stop(self) -> None:
        """Stop listening and stop the backend."""
        url = self.app[STATE].url
        if url is not None:
            remove_http_address(self.config.run_dir, "proxy", url)
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait_backend_ready(self, stop: asyncio.Event) -> bool:
        while not self.backend.ready():
            if stop.is_set():
                return False
            await asyncio.sleep(READY_POLL_S)
        return True

    async def drain(self, timeout_s: float) -> int:
        """Unready, refuse new generations, let open ones finish (up to ``timeout_s``);
        returns how many were still open."""
        state = self.app[STATE]
        state.readiness.set_draining()
        metrics = state.metrics
        log.info("draining", open_requests=metrics.num_open, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while metrics.num_open > 0 and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if metrics.num_open:
            log.warning("drain_timeout", open_requests=metrics.num_open)
        return metrics.num_open

    async def serve(self, stop: asyncio.Event) -> None:
        """``run_service`` entry: serve until ``stop`` (SIGTERM) is set, then drain;
        mark ready once the backend is."""
        await self.start()
        try:
            if await self.wait_backend_ready(stop):
                mark_ready(self.config.run_dir, "proxy")
                log.info("ready")
            await stop.wait()
            await self.drain(self.config.drain_timeout_s)
        finally:
            await self.stop()
