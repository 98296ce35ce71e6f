"""API keys: ``Authorization: Bearer KEY`` checked in constant time, and what each key may call.

Every route declares its :class:`Access` (``aegaeon_proxy.app`` files each route
under one): the probes are open, the API (inference, ``/v1/models``) takes any
key, and what changes or reveals the node (``/v1/aegaeon/*``, ``/metrics``,
``/sleep``, ``/wake_up``, ``/is_sleeping``) takes an admin key, on the API
port and on ``proxy.admin_port`` alike.

With no key configured (``proxy.api_keys`` and ``proxy.admin_keys`` empty, no
``--api-key`` / ``--admin-key``) every request passes: a local node. Otherwise
a missing or wrong key is a 401 and a user key on an admin route a 403
``insufficient_permissions`` naming the right it lacks, both in OpenAI's shape.
The 403 comes before the handler reads anything, so a key limited to some
models learns no other model's name from the admin routes; on the API it sees
only its models: another is "not found" (as OpenAI answers a model the key has
no access to), and ``/v1/models`` lists only its own. Keys are compared with
:func:`hmac.compare_digest` against every configured key (no early exit), so
the time taken says nothing about which key, or which prefix of one, matched.
A key never reaches a log line.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Sequence

from aegaeon_common.config import ApiKeyConfig
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from aegaeon_proxy.errors import APIError

__all__ = ["API_KEY", "ROUTE_ACCESS", "Access", "KeyRing", "allowed", "model_not_found"]


class Access(enum.Enum):
    """Who may call a route once keys are configured."""

    OPEN = "open"  # liveness and readiness probes: no key
    USER = "user"  # the API: any valid key (a model-limited one for its models)
    ADMIN = "admin"  # changes or reveals the node: an admin key


# the key that authenticated a request (absent: keys are off, or an open route)
API_KEY: web.RequestKey[ApiKeyConfig] = web.RequestKey("aegaeon_api_key", ApiKeyConfig)
# each registered route's Access; what matched no route (404, 405) is USER
ROUTE_ACCESS: web.AppKey[dict[web.AbstractRoute, Access]] = web.AppKey("aegaeon_route_access", dict)


class KeyRing:
    """The configured keys; :meth:`match` finds the one a header carries."""

    def __init__(self, keys: Sequence[ApiKeyConfig]) -> None:
        self._keys = [(k, k.key.encode()) for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def match(self, header: str | None) -> ApiKeyConfig | None:
        """The key ``header`` (``Bearer KEY``) carries, or None."""
        if header is None:
            return None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode("utf-8", "surrogateescape")
        found: ApiKeyConfig | None = None
        for entry, secret in self._keys:  # every key compared: no timing by position
            if hmac.compare_digest(given, secret):
                found = entry
        return found

    def middleware(self) -> Middleware:
        """An aiohttp middleware enforcing each route's :class:`Access` (401, 403)."""

        @web.middleware
        async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
            route = request.match_info.route
            access = request.app[ROUTE_ACCESS].get(route, Access.USER)
            if not self.enabled or access is Access.OPEN:
                return await handler(request)
            entry = self.match(request.headers.get("Authorization"))
            if entry is None:
                missing = "Authorization" not in request.headers
                message = ("You didn't provide an API key (Authorization: Bearer KEY)."
                           if missing else "Incorrect API key provided.")  # fmt: skip
                raise APIError(401, message, code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            if access is Access.ADMIN and not entry.admin:
                raise insufficient_permissions(request.method, route)
            request[API_KEY] = entry
            return await handler(request)

        return require_key


def insufficient_permissions(method: str, route: web.AbstractRoute) -> APIError:
    """The 403 of a user key on an admin route; it names the route as declared (its
    pattern, never the model the caller put in the path)."""
    path = route.resource.canonical if route.resource is not None else "this endpoint"
    return APIError(
        403, f"You have insufficient permissions for {method} {path}: it needs the 'admin' "
        "right, which this API key lacks (an admin key: --admin-key or proxy.admin_keys).",
        code="insufficient_permissions",
    )  # fmt: skip


def allowed(request: web.Request, model: str) -> bool:
    """Whether the request's key may use ``model`` (always, with keys off)."""
    entry = request.get(API_KEY)
    return entry is None or not entry.models or model in entry.models


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model '{model}' does not exist or you do not have access to it",
        param="model", code="model_not_found",
    )  # fmt: skip
