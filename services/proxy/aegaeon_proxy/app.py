"""The aiohttp application: routes, the error middleware, the backend's lifecycle."""

from __future__ import annotations

import asyncio

from aegaeon_common.config import Config
from aegaeon_common.logs import get_logger
from aiohttp import web
from aiohttp.typedefs import Handler

from aegaeon_proxy import (
    admin_models,
    handlers,
    info,
    lora_adapters,
    request_ids,
    responses_api,
    tokenize,
    vllm_controls,
)
from aegaeon_proxy.auth import ROUTE_ACCESS, Access, KeyRing
from aegaeon_proxy.backend import Backend, BackendError
from aegaeon_proxy.errors import APIError, backend_api_error
from aegaeon_proxy.http_io import CLOSE_CONNECTION
from aegaeon_proxy.request_ids import CLIENT_CLOSED
from aegaeon_proxy.sse import CLIENT_GONE, STREAMING
from aegaeon_proxy.state import STATE, ProxyState

log = get_logger("proxy")

__all__ = ["ACCESS", "make_admin_app", "make_app"]

# The list a route is in declares who may call it once keys are configured
# (:data:`ACCESS`, enforced by ``auth.KeyRing``): a new route is one line in one list.
Route = tuple[str, str, Handler]
PROBES: list[Route] = [  # open: liveness and readiness probes
    ("GET", "/health", info.health),
    ("GET", "/ready", info.ready),
]
PUBLIC: list[Route] = [  # the API: any key (a model-limited key for its models)
    ("POST", "/v1/completions", handlers.completions),
    ("POST", "/v1/chat/completions", handlers.chat_completions),
    ("POST", "/v1/responses", responses_api.create_response),
    ("GET", "/v1/models", info.list_models),
    ("GET", "/v1/models/{model}", info.retrieve_model),
    ("POST", "/tokenize", tokenize.tokenize),
    ("POST", "/detokenize", tokenize.detokenize),
    ("GET", "/version", info.version),
]
# the API's requests, each recorded by one access log line (request_ids)
ACCESS_LOGGED = frozenset(path for _, path, _ in PUBLIC)
# Operators' endpoints, what changes or reveals the node (run-time LoRA adapter
# loading too): an admin key; on the API port, or alone on ``proxy.admin_port``.
ADMIN: list[Route] = [
    ("GET", "/metrics", info.metrics),
    ("GET", "/v1/aegaeon/stats", info.aegaeon_stats),
    ("GET", "/v1/aegaeon/services", info.aegaeon_services),
    *admin_models.ROUTES,  # model lifecycle: list, add, change, remove
    *vllm_controls.ROUTES,  # vLLM's /sleep, /wake_up, /is_sleeping
    *lora_adapters.ROUTES,  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter
]
ACCESS: dict[Access, list[Route]] = {
    Access.OPEN: PROBES,
    Access.USER: PUBLIC,
    Access.ADMIN: ADMIN,
}


def add_routes(app: web.Application, config: Config, *kinds: Access) -> None:
    """The routes of ``kinds`` (:data:`ACCESS`) in ``app``, each with its access rule,
    and the key check (``config.proxy``'s keys) in front of them."""
    app[ROUTE_ACCESS] = {}
    for access in kinds:
        for method, path, handler in ACCESS[access]:
            app[ROUTE_ACCESS][app.router.add_route(method, path, handler)] = access
    app.middlewares.append(KeyRing(config.proxy.keys).middleware())


def _endpoint(request: web.Request) -> str:
    route = request.match_info.route.resource
    return route.canonical if route is not None else "other"


def _access_logged(request: web.Request) -> bool:
    return _endpoint(request) in ACCESS_LOGGED


@web.middleware
async def api_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as an OpenAI error object (a backend's refusal with its status and
    code); counts requests by status."""
    counter = request.app[STATE].metrics.http_requests
    try:
        response = await handler(request)
    except APIError as exc:
        response = exc.response()
    except BackendError as exc:
        response = backend_api_error(exc).response()
    except web.HTTPException as exc:  # routing: unknown path, wrong method
        if exc.status < 400:
            raise
        response = APIError(
            exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_")
        ).response()
    except (asyncio.CancelledError, ConnectionResetError):
        counter.labels(_endpoint(request), str(CLIENT_CLOSED)).inc()
        raise
    except Exception:
        # a server bug: a 500 with the traceback logged, never a client's fault
        counter.labels(_endpoint(request), "500").inc()
        log.exception("unhandled_error", path=request.path)
        if request.get(STREAMING):
            raise
        return APIError(500, "internal server error", code="internal_error").response()
    if request.get(CLOSE_CONNECTION):
        response.force_close()
    status = CLIENT_CLOSED if request.get(CLIENT_GONE) else response.status
    counter.labels(_endpoint(request), str(status)).inc()
    return response


def make_app(config: Config, backend: Backend) -> web.Application:
    """The proxy as an aiohttp application; it starts and stops ``backend`` with itself.

    With ``proxy.admin_port`` set, the admin routes are left out (see
    :func:`make_admin_app`); with keys, every route but the probes needs one, the
    admin routes an admin key.
    """
    app = web.Application(client_max_size=config.proxy.max_body_bytes,
                          middlewares=[request_ids.middleware(_access_logged),
                                       api_errors])  # fmt: skip
    app[STATE] = ProxyState.create(config, backend)
    admin = [Access.ADMIN] if config.proxy.admin_port is None else []
    add_routes(app, config, Access.USER, Access.OPEN, *admin)

    async def start_backend(app: web.Application) -> None:
        state = app[STATE]
        shared = state.backend.models
        shared.follow_model_settings(state.models.update)  # PATCHes of other replicas
        shared.follow_served(admin_models.follow_served(state))  # their adds, removals
        shared.follow_unavailable(state.models.follow_unavailable)  # unreadable
        await state.backend.start()

    async def stop_backend(app: web.Application) -> None:
        for task in list(app[STATE].models.background):  # removals still waiting
            task.cancel()
        app[STATE].keep_alive.close()
        await app[STATE].backend.stop()

    app.on_startup.append(start_backend)
    app.on_cleanup.append(stop_backend)
    return app


def make_admin_app(state: ProxyState) -> web.Application:
    """``/metrics``, ``/v1/aegaeon/*`` and the probes on their own port
    (``proxy.admin_host:admin_port``, loopback by default): with keys configured,
    an admin key is asked there as on the API port (a Service or a sidecar may
    expose the port)."""
    app = web.Application(middlewares=[request_ids.middleware(_access_logged), api_errors])
    app[STATE] = state
    add_routes(app, state.config, Access.ADMIN, Access.OPEN)
    return app
