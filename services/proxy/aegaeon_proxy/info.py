"""``GET /v1/models``, ``/health``, ``/ready``, ``/metrics``."""

from __future__ import annotations

import time

from aiohttp import web

from aegaeon_proxy.errors import APIError
from aegaeon_proxy.state import STATE

OWNER = "aegaeon"
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STARTED = int(time.time())

__all__ = ["health", "list_models", "metrics", "ready", "retrieve_model"]


def _model_obj(name: str) -> dict[str, object]:
    return {"id": name, "object": "model", "created": _STARTED, "owned_by": OWNER}


async def list_models(request: web.Request) -> web.Response:
    """The configured registry (never derived from which workers are alive)."""
    names = request.app[STATE].config.model_names
    return web.json_response({"object": "list", "data": [_model_obj(n) for n in names]})


async def retrieve_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    if name not in request.app[STATE].config.model_names:
        raise APIError(
            404, f"The model '{name}' does not exist", param="model", code="model_not_found"
        )
    return web.json_response(_model_obj(name))


async def health(request: web.Request) -> web.Response:
    """Liveness: the proxy answers; the backend's state is reported, not judged."""
    state = request.app[STATE]
    body = {"status": "ok", "ready": state.backend.ready(), "backend": state.backend.health()}
    return web.json_response(body)


async def ready(request: web.Request) -> web.Response:
    """200 once every configured instance is up, 503 until then."""
    if request.app[STATE].backend.ready():
        return web.json_response({"ready": True})
    raise APIError(503, "the backend is not ready", code="not_ready")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    text = state.metrics.render() + state.backend.metrics()
    return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


async def aegaeon_stats(request: web.Request) -> web.Response:
    """``GET /v1/aegaeon/stats[?light=1]``: the backend's detailed counters as JSON
    (benchmarks read switches, turns, per-request timings and cache stats here;
    ``light`` leaves the record lists out); 404 if it has none."""
    stats = getattr(request.app[STATE].backend, "stats", None)
    if stats is None:
        raise APIError(404, "this backend reports no detailed stats", code="not_found")
    light = request.query.get("light", "") in ("1", "true")  # counters only, no records
    return web.json_response(await stats(light=light))
