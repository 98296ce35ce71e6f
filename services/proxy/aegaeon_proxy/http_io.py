"""Request bodies in: size-limited JSON objects, read within a deadline, through orjson
(RFC 8259 strict: no NaN or Infinity, valid UTF-8 only, integers within 64 bits)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from aegaeon_proxy.errors import APIError
from aegaeon_proxy.state import STATE

# request key: the connection is closed after the response (its request was not read to the end)
CLOSE_CONNECTION: web.RequestKey[bool] = web.RequestKey("aegaeon_close_connection", bool)

__all__ = ["CLOSE_CONNECTION", "read_json_object"]


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 413 when over ``proxy.max_body_bytes``, 408 when it has
    not all arrived within ``proxy.read_timeout_s`` (a client sending a byte a second),
    400 when it is not a JSON object."""
    proxy = request.app[STATE].config.proxy
    max_bytes, timeout_s = proxy.max_body_bytes, proxy.read_timeout_s
    too_large = APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large")
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        request[CLOSE_CONNECTION] = True  # the rest of the body may still trickle in
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="body_timeout") from None  # fmt: skip
    if len(raw) > max_bytes:
        raise too_large
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:  # also invalid UTF-8, NaN, ints past 64 bits, depth
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body
