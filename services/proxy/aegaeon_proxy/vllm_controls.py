"""vLLM's sleep mode on the lifecycle admin: ``/sleep``, ``/wake_up``, ``/is_sleeping``.

Routers and operators' scripts call these on a vLLM server to free its
accelerator and take it back. Here they act on one model (``?model=NAME``) or,
without ``model``, on every served model (a vLLM server serves one):

* ``POST /sleep[?model=NAME][&level=1|2]``: the model leaves every device (its
  prefetch cancelled, or scaled down where it is the active model); its
  weights stay in the host Model Cache, as vLLM's level-1 sleep keeps them in
  CPU memory. Level 2 (vLLM: discard the weights) is taken as level 1: the
  Model Cache evicts under its own budget.
* ``POST /wake_up[?model=NAME][&tags=weights,kv_cache]``: the model is switched
  onto the least busy prefill instance (where its next request starts), from
  the Model Cache (from disk if that evicted it). ``tags`` is accepted; weights
  and KV come back together here.
* ``GET /is_sleeping[?model=NAME]``: 200 ``{"is_sleeping": bool}``: on no device
  (every served model, without ``model``).

The answers carry ``{"is_sleeping": ..., "models": {name: bool}}``. Unlike
vLLM, a request for a sleeping model is served: its first prefill switches it
in, as any model switch does. A device with work of the model queued keeps it
through a ``/sleep`` (it is needed): ``is_sleeping`` then says false. They sit
with the other admin endpoints, with their auth (an admin key when keys are
configured, on the API port and ``proxy.admin_port`` alike); unknown model: 404; a backend
without sleep: 501. With replicated proxies the instances of every node are
told, and every replica answers ``is_sleeping`` from the instances' registry
records (the models on their devices, every heartbeat).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from aegaeon_proxy.admin_models import unknown_model
from aegaeon_proxy.errors import invalid
from aegaeon_proxy.jsonfmt import json_response
from aegaeon_proxy.state import STATE

__all__ = ["ROUTES"]

SLEEP_LEVELS = ("1", "2")
WAKE_TAGS = frozenset({"weights", "kv_cache"})


def _models(request: web.Request) -> list[str]:
    """The model ``?model=`` names (404 if it is not served), else every served one."""
    models = request.app[STATE].models
    name = request.query.get("model")
    if name is None:
        return models.names()
    if not models.serving(name):
        raise unknown_model(name)
    return [name]


def _answer(sleeping: dict[str, bool]) -> web.Response:
    return json_response({"is_sleeping": bool(sleeping) and all(sleeping.values()),
                          "models": sleeping})  # fmt: skip


async def _set(request: web.Request, awake: bool) -> web.Response:
    backend = request.app[STATE].backend
    sleeping: dict[str, bool] = {}
    for name in _models(request):
        sleeping[name] = await backend.models.set_model_awake(name, awake)
    return _answer(sleeping)


async def sleep(request: web.Request) -> web.Response:
    """``POST /sleep``: off every device (see the module docstring)."""
    level = request.query.get("level", "1")
    if level not in SLEEP_LEVELS:
        raise invalid("level", f"'level' must be 1 or 2, got {level[:20]!r}")
    return await _set(request, awake=False)


async def wake_up(request: web.Request) -> web.Response:
    """``POST /wake_up``: onto a device (see the module docstring)."""
    tags = [t for value in request.query.getall("tags", []) for t in value.split(",") if t]
    unknown = [t for t in tags if t not in WAKE_TAGS]
    if unknown:
        raise invalid("tags", f"'tags' may name weights and kv_cache, got {unknown[0][:20]!r}")
    return await _set(request, awake=True)


async def is_sleeping(request: web.Request) -> web.Response:
    """``GET /is_sleeping``: whether the model is on no device."""
    backend = request.app[STATE].backend
    return _answer({name: backend.models.model_sleeping(name) for name in _models(request)})


ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/sleep", sleep),
    ("POST", "/wake_up", wake_up),
    ("GET", "/is_sleeping", is_sleeping),
]
