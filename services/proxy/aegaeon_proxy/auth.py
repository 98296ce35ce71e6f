"""API keys: ``Authorization: Bearer KEY`` checked in constant time, keys limited to models.

With no key configured (``proxy.api_keys`` empty, no ``--api-key``) every
request passes. Otherwise every route but ``/health`` and ``/ready`` (probes)
needs one of the keys; a missing or wrong one is a 401 in OpenAI's shape. A
key limited to some models sees only those: another model is "not found" (as
OpenAI answers a model the key has no access to), and ``/v1/models`` lists
only its own. Keys are compared with :func:`hmac.compare_digest` against every
configured key (no early exit), so the time taken says nothing about which
key, or which prefix of one, matched. A key never reaches a log line.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from aegaeon_common.config import ApiKeyConfig
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from aegaeon_proxy.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready"})  # liveness and readiness probes

# the key that authenticated a request (absent: keys are off, or an open path)
API_KEY: web.RequestKey[ApiKeyConfig] = web.RequestKey("aegaeon_api_key", ApiKeyConfig)

__all__ = ["API_KEY", "KeyRing", "allowed", "model_not_found"]


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
        """An aiohttp middleware refusing requests without a valid key (401)."""

        @web.middleware
        async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not self.enabled or request.path in OPEN_PATHS:
                return await handler(request)
            entry = self.match(request.headers.get("Authorization"))
            if entry is None:
                missing = "Authorization" not in request.headers
                message = ("You didn't provide an API key (Authorization: Bearer KEY)."
                           if missing else "Incorrect API key provided.")  # fmt: skip
                raise APIError(401, message, code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            request[API_KEY] = entry
            return await handler(request)

        return require_key


def allowed(request: web.Request, model: str) -> bool:
    """Whether the request's key may use ``model`` (always, with keys off)."""
    entry = request.get(API_KEY)
    return entry is None or not entry.models or model in entry.models


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model '{model}' does not exist or you do not have access to it",
        param="model", code="model_not_found",
    )  # fmt: skip
