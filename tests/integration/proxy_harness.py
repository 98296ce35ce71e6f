"""The proxy on a real port with the real engine, in a background thread.

``ProxyServer`` + ``LocalEngineBackend`` run on their own event loop in a
thread, so tests can use blocking clients (the official ``openai`` package,
httpx) against ``http://127.0.0.1:PORT``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import tempfile
import threading
import urllib.parse
from functools import cache
from pathlib import Path
from typing import Any

from aegaeon_common.config import Config, ModelConfig, ProxyConfig
from aegaeon_proxy.local_backend import LocalEngineBackend
from aegaeon_proxy.server import ProxyServer

START_TIMEOUT_S = 60.0


@cache
def market_dir() -> Path:
    """The market's ``small`` profile, built once per machine (shared with the unit tests)."""
    from aegaeon_market import ensure_market

    root = Path(tempfile.gettempdir()) / f"aegaeon-proxy-test-market-{os.getuid()}"
    ensure_market(root, num_models=4, seed=0, profile="small", progress=False)
    return root


class ServerThread:
    """Start with :meth:`start`, stop with :meth:`stop`; ``url`` is the proxy's base URL."""

    def __init__(self, config: Config, kv_cache_bytes: int = 32 << 20) -> None:
        self.config = config
        self.backend = LocalEngineBackend(config, kv_cache_bytes=kv_cache_bytes, max_num_seqs=8)
        self.server = ProxyServer(config, self.backend)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="proxy-test-server", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise TimeoutError("proxy did not start")
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.server.start()
        except BaseException as exc:
            self._error = exc
            self._started.set()
            raise
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await self.server.stop()


def proxy_config(models: list[str], **proxy: object) -> Config:
    market = market_dir()
    return Config(
        models=tuple(ModelConfig(name, market / name) for name in models),
        proxy=ProxyConfig(port=0, **proxy),  # type: ignore[arg-type]
        dtype="bfloat16",
    )


class Raw:
    """Plain HTTP to the proxy with the standard library (for what a client library hides)."""

    def __init__(self, url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80

    def connection(self, timeout_s: float = 30.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def request(
        self, method: str, path: str, body: bytes | dict[str, Any] | None = None,
        timeout_s: float = 30.0,
    ) -> tuple[int, dict[str, str], str]:  # fmt: skip
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn = self.connection(timeout_s)
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read().decode()
        finally:
            conn.close()

    def json(self, path: str) -> Any:
        return json.loads(self.request("GET", path)[2])
