"""What the handlers share: config, backend, text assets, metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from aegaeon_common.config import Config
from aiohttp import web

from aegaeon_proxy.assets import AssetRegistry
from aegaeon_proxy.backend import Backend
from aegaeon_proxy.metrics import ProxyMetrics

__all__ = ["STATE", "ProxyState"]


@dataclass
class ProxyState:
    config: Config
    backend: Backend
    assets: AssetRegistry
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)

    @classmethod
    def create(cls, config: Config, backend: Backend) -> ProxyState:
        return cls(config=config, backend=backend, assets=AssetRegistry(config.models))


STATE: web.AppKey[ProxyState] = web.AppKey("aegaeon_proxy_state", ProxyState)
