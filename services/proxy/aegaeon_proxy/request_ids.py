"""Request ids and the access log.

Every request has an id: the client's ``X-Request-Id`` header when it sends one
(printable ASCII, at most :data:`MAX_ID_CHARS`; anything else is a 400 naming
the header), else a new one. The id is echoed in the response's
``X-Request-Id`` header, bound to every log line written while the request is
handled (structlog's context variables), and is the generation's id in the
backend: its stats entries and the instances' log lines carry it.

One info-level line per finished API request (``request_done``) records its
id, method, path, status, model, prompt and output tokens, time to first token
and total time: the handler fills an :class:`AccessRecord` as it goes.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from aegaeon_common.logs import get_logger
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from aegaeon_proxy.errors import APIError, invalid
from aegaeon_proxy.sse import CLIENT_GONE

CLIENT_CLOSED = 499  # nginx's status for "the client went away first"

HEADER = "X-Request-Id"
MAX_ID_CHARS = 128

log = get_logger("proxy")

__all__ = ["ACCESS", "HEADER", "REQUEST_ID", "AccessRecord", "check_request_id", "middleware",
           "request_id_of"]


@dataclass
class AccessRecord:
    """What the access log line of one request says beyond its status (handlers fill it)."""

    started_s: float = field(default_factory=time.monotonic)
    model: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    outcome: str | None = None  # how a generation ended (finish reason, error, ...)


REQUEST_ID: web.RequestKey[str] = web.RequestKey("aegaeon_request_id", str)
ACCESS: web.RequestKey[AccessRecord] = web.RequestKey("aegaeon_access", AccessRecord)


def check_request_id(value: str, param: str = HEADER) -> str:
    """A client's request id, or a 400 naming where it came from."""
    if not 0 < len(value) <= MAX_ID_CHARS or not all(33 <= ord(c) < 127 for c in value):
        raise APIError(400, f"'{param}' must be 1 to {MAX_ID_CHARS} printable ASCII characters "
                       "without spaces", param=param, code="invalid_request_id")  # fmt: skip
    return value


def request_id_of(request: web.Request, body: Mapping[str, Any]) -> str:
    """The generation's id: the ``X-Request-Id`` header's, else vLLM's ``request_id``
    field, else the one the middleware made up."""
    if HEADER not in request.headers and body.get("request_id") is not None:
        given = body["request_id"]
        if not isinstance(given, str):
            raise invalid("request_id", "'request_id' must be a string")
        request[REQUEST_ID] = check_request_id(given, "request_id")
    return request[REQUEST_ID]


def middleware(logged: Callable[[web.Request], bool]) -> Middleware:
    """The outermost middleware: the id in and out, the context of every log line, and
    the access line of each request ``logged`` says is an API request."""

    @web.middleware
    async def request_ids(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get(HEADER)
        request[ACCESS] = AccessRecord()
        try:
            request[REQUEST_ID] = check_request_id(given) if given is not None else _new_id()
        except APIError as exc:
            request[REQUEST_ID] = _new_id()
            return _finish(request, exc.response(), logged)
        structlog.contextvars.bind_contextvars(request_id=request[REQUEST_ID])
        try:
            response = await handler(request)
        except BaseException:  # the client went away (its handler cancelled)
            if logged(request):
                _log(request, CLIENT_CLOSED)
            raise
        finally:
            structlog.contextvars.unbind_contextvars("request_id")
        return _finish(request, response, logged)

    return request_ids


def _new_id() -> str:
    return secrets.token_hex(16)


def _finish(request: web.Request, response: web.StreamResponse,
            logged: Callable[[web.Request], bool]) -> web.StreamResponse:
    if not response.prepared:  # a stream sent its headers when it began (SSEWriter)
        response.headers[HEADER] = request[REQUEST_ID]
    if logged(request):
        _log(request, CLIENT_CLOSED if request.get(CLIENT_GONE) else response.status)
    return response


def _log(request: web.Request, status: int) -> None:
    record = request[ACCESS]
    log.info("request_done", request_id=request[REQUEST_ID], method=request.method,
             path=request.path, status=status, model=record.model,
             prompt_tokens=record.prompt_tokens, output_tokens=record.output_tokens,
             ttft_s=_rounded(record.ttft_s), total_s=_rounded(time.monotonic() - record.started_s),
             outcome=record.outcome)  # fmt: skip


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
