"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one code path.

:func:`generate` reads the body, has :func:`aegaeon_proxy.intake.prepare` check it
once and submit the generation (an :class:`~aegaeon_proxy.intake.Endpoint` row says
how the two endpoints differ), and hands the answer's response object to
``json_response`` or its chunks to the SSE writer. Errors before the first byte is
sent are HTTP errors; after (streaming), an ``{"error": ...}`` event followed by
``[DONE]``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from aegaeon_proxy.answers import Answer
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.http_io import read_json_object
from aegaeon_proxy.intake import CHAT_COMPLETIONS, COMPLETIONS, Endpoint, prepare
from aegaeon_proxy.jsonfmt import json_response
from aegaeon_proxy.request_ids import HEADER, REQUEST_ID
from aegaeon_proxy.sse import SSEWriter
from aegaeon_proxy.state import STATE

__all__ = ["chat_completions", "completions", "read_body"]


async def read_body(request: web.Request) -> dict[str, Any]:
    """A generation's body (503 while the proxy drains)."""
    state = request.app[STATE]
    if state.readiness.draining:
        raise APIError(503, "the proxy is draining (shutting down)", code="draining")
    return await read_json_object(request)


async def generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """Read, check, submit, and answer in one piece or as SSE."""
    body = await read_body(request)
    spec, gen = await prepare(request, endpoint, body)
    try:
        await gen.admitted()  # past the admission bounds it waits for room, or is a 429
        answer = Answer(spec, gen)
        if spec.params.stream:
            sse = SSEWriter(request, request.app[STATE].config.proxy.write_timeout_s)
            sse.response.headers[HEADER] = request[REQUEST_ID]  # sent as the stream opens
            return await sse.stream(answer.chunks(sse.flush))
        return json_response(await answer.whole())
    finally:
        await gen.close()  # a disconnect (cancellation) or error: free the backend request


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT_COMPLETIONS)
