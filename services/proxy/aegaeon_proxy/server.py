"""Run the proxy's application on a TCP port until told to stop."""

from __future__ import annotations

import asyncio

from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aegaeon_common.process import mark_ready
from aiohttp import web

from aegaeon_proxy.app import make_app
from aegaeon_proxy.backend import Backend

READY_POLL_S = 0.1

log = get_logger("proxy")

__all__ = ["ProxyServer"]


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
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.proxy.host}:{self.port}"

    async def start(self) -> None:
        """Start the backend (through the app) and listen."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.proxy.host, self.config.proxy.port)
        await site.start()
        addresses = self._runner.addresses  # (host, port, ...) of the bound sockets
        self.port = int(addresses[0][1]) if addresses else self.config.proxy.port
        log.info("listening", url=self.url, models=list(self.config.model_names))

    async def stop(self) -> None:
        """Stop listening and stop the backend."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait_backend_ready(self, stop: asyncio.Event) -> bool:
        while not self.backend.ready():
            if stop.is_set():
                return False
            await asyncio.sleep(READY_POLL_S)
        return True

    async def serve(self, stop: asyncio.Event) -> None:
        """``run_service`` entry: serve until ``stop`` is set; mark ready once the backend is."""
        await self.start()
        try:
            if await self.wait_backend_ready(stop):
                mark_ready(self.config.run_dir, "proxy")
                log.info("ready")
            await stop.wait()
        finally:
            await self.stop()
