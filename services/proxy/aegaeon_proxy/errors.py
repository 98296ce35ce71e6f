"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from aegaeon_proxy.jsonfmt import json_response

if TYPE_CHECKING:
    from aegaeon_proxy.backend import BackendError

# status -> OpenAI error type, where it is not invalid_request_error (4xx) or
# server_error (5xx)
_TYPES: dict[int, str] = {
    408: "timeout",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An error answered to the client; ``param`` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return _TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return json_response(self.body(), status=self.status, headers=headers)


def backend_api_error(exc: BackendError) -> APIError:
    """A backend's refusal as the client's error: its status, message, code and wait."""
    return APIError(exc.status, exc.message, code=exc.code, retry_after_s=exc.retry_after_s)


def invalid(param: str, message: str, code: str | None = None) -> APIError:
    """A 400 about one request field."""
    return APIError(400, message, param=param, code=code)
