"""Server-sent events out (their JSON by orjson, :mod:`aegaeon_proxy.jsonfmt`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

from aiohttp import web

from aegaeon_proxy.jsonfmt import sse_event

JSON = dict[str, Any]

# request keys: the SSE response has been sent; the client disconnected mid-stream
STREAMING: web.RequestKey[bool] = web.RequestKey("aegaeon_streaming", bool)
CLIENT_GONE: web.RequestKey[bool] = web.RequestKey("aegaeon_client_gone", bool)

__all__ = ["CLIENT_GONE", "STREAMING", "SSEWriter"]


class SSEWriter:
    """OpenAI's framing: ``data: {json}\\n\\n`` per event, ``data: [DONE]\\n\\n`` last;
    the events that are ready leave in one write."""

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

    async def stream(self, events: AsyncGenerator[JSON, None], *, named: bool = False,
                     sentinel: bool = True) -> web.StreamResponse:  # fmt: skip
        """The whole stream: open it, write ``events`` (those that are ready leave in one
        write: ``events`` awaits :meth:`flush` before it waits), end it after
        ``data: [DONE]`` as chat and completions end (``sentinel=False``: without, as
        Responses streams end). ``named``: each event after an ``event:`` line naming
        its ``type`` (the Responses API's). A client gone, or one that does not read,
        marks the request (``CLIENT_GONE``)."""
        try:
            self._request[STREAMING] = True
            await self.response.prepare(self._request)
            async with contextlib.aclosing(events):
                async for event in events:
                    self._held.append(sse_event(event, event["type"] if named else None))
            if sentinel:
                self._held.append(b"data: [DONE]\n\n")
            await self.flush()
            await self._bounded(self.response.write_eof())
        except ConnectionResetError:
            self._request[CLIENT_GONE] = True
        return self.response

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
