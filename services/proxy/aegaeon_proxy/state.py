"""What the handlers share: config, backend, text assets, metrics, readiness."""

from __future__ import annotations

from dataclasses import dataclass, field

from aegaeon_common.config import Config
from aegaeon_common.http_side import Readiness
from aiohttp import web

from aegaeon_proxy.assets import AssetRegistry
from aegaeon_proxy.backend import Backend
from aegaeon_proxy.keep_alive import KeepAlive
from aegaeon_proxy.metrics import ProxyMetrics, UnavailableModels
from aegaeon_proxy.model_table import ModelSettingsTable

__all__ = ["STATE", "ProxyState"]


@dataclass
class ProxyState:
    config: Config
    backend: Backend
    assets: AssetRegistry
    # the models served now and their live model_settings (admin endpoints change them)
    models: ModelSettingsTable
    # Ollama's keep_alive of each model (the requests' last word)
    keep_alive: KeepAlive
    metrics: ProxyMetrics = field(default_factory=ProxyMetrics)
    # draining (SIGTERM): /ready answers 503 and new generations are refused
    readiness: Readiness = field(default_factory=Readiness)
    # where the proxy's API is reached (for /v1/aegaeon/services); set when it listens
    url: str | None = None

    @classmethod
    def create(cls, config: Config, backend: Backend) -> ProxyState:
        models = ModelSettingsTable(config.models, config.model_settings)
        state = cls(config=config, backend=backend, assets=AssetRegistry(config.models),
                    models=models, keep_alive=KeepAlive(backend.models, models))  # fmt: skip
        state.readiness.set_ready()  # the front is; the backend's readiness is its own
        backend.register_metrics(state.metrics.registry)
        state.metrics.registry.register(UnavailableModels(lambda: len(models.unavailable_models())))
        state.metrics.vllm_gauges.attach(state.models.names, backend.engine_snapshot,
                                         config.dtype, state.models.adapters)  # fmt: skip
        return state

    def ready(self) -> bool:
        return self.readiness.ok and self.backend.ready()

    def slo(self, model: str) -> tuple[float, float]:
        """The (TTFT, TBT) targets of ``model`` in seconds."""
        m = self.models.model_config(model)
        slo = self.config.slo
        ttft = m.ttft_s if m is not None and m.ttft_s is not None else slo.ttft_s
        tbt = m.tbt_s if m is not None and m.tbt_s is not None else slo.tbt_s
        return ttft, tbt


STATE: web.AppKey[ProxyState] = web.AppKey("aegaeon_proxy_state", ProxyState)
