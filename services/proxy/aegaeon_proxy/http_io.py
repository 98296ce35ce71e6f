"""Request bodies in (size-limited JSON objects) and server-sent events out, through
orjson (RFC 8259 strict: no NaN or Infinity, valid UTF-8 only, integers within 64 bits)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import orjson
from aiohttp import web

from aegaeon_proxy.errors import APIError
from aegaeon_proxy.jsonfmt import sse_event

# request keys: the SSE response has been sent; the client disconnected mid-stream
STREAMING: web.RequestKey[bool] = web.RequestKey("aegaeon_streaming", bool)
CLIENT_GONE: web.RequestKey[bool] = web.RequestKey("aegaeon_client_gone", bool)
# the connection is closed after the response (its request was not read to the end)
CLOSE_CONNECTION: web.RequestKey[bool] = web.RequestKey("aegaeon_close_connection", bool)

__all__ = ["CLIENT_GONE", "CLOSE_CONNECTION", "STREAMING", "SSEWriter", "read_json_object"]


async def read_json_object(
    request: web.Request, max_bytes: int, timeout_s: float | None = None
) -> dict[str, Any]:
    """The body as a JSON object; 413 when over ``max_bytes``, 408 when it has not all
    arrived within ``timeout_s`` (a client sending a byte a second), 400 when it is
    not a JSON object."""
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


class SSEWriter:
    """OpenAI's framing: ``data: {json}\\n\\n`` per event, ``data: [DONE]\\n\\n`` last."""

    def __init__(self, request: web.Request, write_timeout_s: float | None = None) -> None:
        """``write_timeout_s``: a write the client does not take within it (a reader
        that stopped reading, its socket buffers full) cuts the connection."""
        self._request = request
        self._write_timeout_s = write_timeout_s
        self.response = web.StreamResponse(
            status=200,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.response.content_type = "text/event-stream"
        self.response.charset = "utf-8"
        self._held: list[bytes] = []

    async def open(self) -> None:
        self._request[STREAMING] = True
        await self.response.prepare(self._request)

    def add(self, obj: Any, event: str | None = None) -> None:
        """Queue an event (named ``event``: an ``event:`` line first); it leaves with the
        next :meth:`flush`, :meth:`send` or :meth:`done`."""
        self._held.append(sse_event(obj, event))

    async def flush(self) -> None:
        """Write the queued events, as one write; ``ConnectionResetError`` when the
        client is gone or did not take the write within the write timeout."""
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            await self._bounded(self.response.write(data))

    async def _bounded(self, write: Awaitable[None]) -> None:
        try:
            async with asyncio.timeout(self._write_timeout_s):
                await write
        except TimeoutError:
            transport = self._request.transport
            if transport is not None:
                transport.abort()  # drop what the kernel and aiohttp still buffer
            raise ConnectionResetError("the client did not read the stream") from None

    async def send(self, obj: Any) -> None:
        self.add(obj)
        await self.flush()

    async def done(self, sentinel: bool = True) -> None:
        """The last events, then the end of the stream (after ``data: [DONE]``, as chat
        and completions end; ``sentinel=False``: without, as Responses streams end)."""
        if sentinel:
            self._held.append(b"data: [DONE]\n\n")
        await self.flush()
        await self._bounded(self.response.write_eof())
