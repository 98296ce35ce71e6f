"""``GET /v1/models``, ``/health``, ``/ready``, ``/metrics``, ``/v1/aegaeon/*``."""

from __future__ import annotations

import os
import time
from importlib import metadata

from aegaeon_common.config import Config
from aegaeon_common.http_side import ServiceAddress, metrics_response, read_http_address
from aiohttp import web

from aegaeon_proxy.admin_models import model_rows
from aegaeon_proxy.auth import allowed, model_not_found
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.jsonfmt import json_response
from aegaeon_proxy.state import STATE

OWNER = "aegaeon"
_STARTED = int(time.time())

__all__ = [
    "aegaeon_services",
    "aegaeon_stats",
    "health",
    "list_models",
    "metrics",
    "ready",
    "retrieve_model",
    "service_names",
    "version",
]


def _model_obj(request: web.Request, name: str) -> dict[str, object]:
    """One model as vLLM lists it: a LoRA adapter's ``parent`` is its base and its
    ``root`` its adapter directory; a model's ``root`` is itself, its ``parent`` null.
    Beside them ``state`` (``serving``, or ``unavailable`` with the ``error`` that says
    why: its checkpoint cannot be read)."""
    models = request.app[STATE].models
    model = models.model_config(name)
    base = model.base if model is not None else None
    obj: dict[str, object] = {
        "id": name, "object": "model", "created": _STARTED, "owned_by": OWNER,
        "root": str(model.path) if model is not None and base is not None else name,
        "parent": base, "state": "serving"}  # fmt: skip
    unavailable = models.unavailable(name)
    if unavailable is not None:
        obj.update(state="unavailable", error=unavailable)
    return obj


async def list_models(request: web.Request) -> web.Response:
    """The served models: the configured ones, changed by the admin endpoints (never
    derived from which workers are alive); an unavailable one is listed as such."""
    models = request.app[STATE].models
    names = [n for n in models.names() if allowed(request, n)]
    data = [_model_obj(request, n) for n in names]
    return json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    models = request.app[STATE].models
    if not models.serving(name) or not allowed(request, name):
        raise model_not_found(name)
    return json_response(_model_obj(request, name))


def _version() -> str:
    try:
        return metadata.version("aegaeon")
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


async def version(request: web.Request) -> web.Response:
    """``GET /version``: the server's version, as vLLM answers it."""
    return json_response({"version": _version()})


async def health(request: web.Request) -> web.Response:
    """Liveness: the proxy answers; the backend's state is reported, not judged."""
    state = request.app[STATE]
    body = {
        "status": "ok",
        "service": "proxy",
        "role": "proxy",
        "pid": os.getpid(),
        "ready": state.ready(),
        "draining": state.readiness.draining,
        "backend": state.backend.health(),
    }
    return json_response(body)


async def ready(request: web.Request) -> web.Response:
    """200 once every configured instance is up, 503 until then and while draining."""
    state = request.app[STATE]
    if state.ready():
        return json_response({"ready": True})
    code = "draining" if state.readiness.draining else "not_ready"
    raise APIError(503, f"the proxy is not ready ({code})", code=code)


async def metrics(request: web.Request) -> web.Response:
    """The proxy's registry (its own metrics, vLLM's families and the backend's
    collectors); the vLLM gauges read the backend's instances first."""
    proxy_metrics = request.app[STATE].metrics
    await proxy_metrics.vllm_gauges.refresh()
    return metrics_response(proxy_metrics.registry)


def service_names(config: Config) -> list[tuple[str, str]]:
    """``(name, role)`` of every service of the node besides the proxy, in start order
    (``aegaeon_cli.node`` starts the same set)."""
    return [("cachemgr", "cachemgr")] + [(f"{kind}-{i}", kind)
                                         for kind, i in config.worker_instances]


async def aegaeon_services(request: web.Request) -> web.Response:
    """``GET /v1/aegaeon/services``: every service's health, readiness and metrics URLs
    (the proxy's own first; the others as they recorded them in the run directory, or
    with many nodes every node's, as they registered: ``node/cachemgr``,
    ``node/prefill-0``, ...)."""
    state = request.app[STATE]
    services: list[dict[str, str]] = []
    if state.url is not None:
        services.append(ServiceAddress("proxy", "proxy", state.url).to_dict())
    listed = state.backend.services()
    if listed is None:  # the ones of the run directory
        found = (read_http_address(state.config.run_dir, n) for n, _ in service_names(state.config))
        listed = [address for address in found if address is not None]
    services += [address.to_dict() for address in listed]
    return json_response({"services": services})


async def aegaeon_stats(request: web.Request) -> web.Response:
    """``GET /v1/aegaeon/stats[?light=1]``: the backend's detailed counters as JSON
    (benchmarks read switches, turns, per-request timings and cache stats here;
    ``light`` leaves the record lists out); 404 if it has none."""
    light = request.query.get("light", "") in ("1", "true")  # counters only, no records
    out = await request.app[STATE].backend.stats(light=light)
    if out is None:
        raise APIError(404, "this backend reports no detailed stats", code="not_found")
    # per model: live settings, requests in flight, Model Cache state and load progress
    cache = out.get("cache")
    model_cache = cache.get("model_cache") if isinstance(cache, dict) else None
    out["models"] = model_rows(request.app[STATE].models, model_cache)
    return json_response(out)
