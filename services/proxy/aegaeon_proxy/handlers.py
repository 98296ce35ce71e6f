"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one code path.

:func:`generate` reads the body, has :func:`aegaeon_proxy.intake.prepare` check it
and submit the generation (an :class:`~aegaeon_proxy.intake.Endpoint` row says how
the two endpoints differ), and answers. Errors
before the first byte is sent are HTTP errors; after (streaming), an
``{"error": ...}`` event followed by ``[DONE]``.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from aegaeon_proxy.answers import Answer, AnswerSpec
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.generation import Generation
from aegaeon_proxy.http_io import SSEWriter, read_json_object
from aegaeon_proxy.intake import CHAT_COMPLETIONS, COMPLETIONS, Endpoint, prepare
from aegaeon_proxy.request_ids import ACCESS, HEADER, REQUEST_ID
from aegaeon_proxy.responses import Head, Shapes
from aegaeon_proxy.state import STATE

__all__ = ["chat_completions", "completions", "finished", "head_of", "read_body"]


async def read_body(request: web.Request) -> dict[str, Any]:
    """A generation's body (503 while the proxy drains)."""
    state = request.app[STATE]
    if state.readiness.draining:
        raise APIError(503, "the proxy is draining (shutting down)", code="draining")
    proxy = state.config.proxy
    return await read_json_object(request, proxy.max_body_bytes, proxy.read_timeout_s)


def finished(request: web.Request, spec: AnswerSpec, gen: Generation) -> None:
    """What ends every generation's handling: the access log's counts, Ollama's
    ``keep_alive`` (from the end of the request)."""
    access = request[ACCESS]
    access.output_tokens, access.ttft_s = gen.completion_tokens, gen.ttft_s
    access.outcome = gen.outcome or "client_closed"
    if spec.params.keep_alive_s is not None:
        request.app[STATE].keep_alive.after(spec.params.model, spec.params.keep_alive_s)


def head_of(gen: Generation, shapes: Shapes) -> Head:
    """What every object of the answer shares; its id is the request's, prefixed."""
    return Head(id=f"{shapes.id_prefix}-{gen.req.request_id}", created=int(gen.req.arrival_s),
                model=gen.req.model)  # fmt: skip


async def generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """Validate, tokenize, submit, and answer in one piece or as SSE."""
    body = await read_body(request)
    spec, gen = await prepare(request, endpoint, body)
    params = spec.params
    try:
        await gen.admitted()  # past the admission bounds it waits for room, or is a 429
        answer = Answer(spec, gen, head_of(gen, endpoint.shapes))
        if params.stream:
            sse = SSEWriter(request, request.app[STATE].config.proxy.write_timeout_s)
            sse.response.headers[HEADER] = request[REQUEST_ID]  # sent as the stream opens
            return await answer.stream(request, sse)
        return await answer.respond()
    finally:
        await gen.close()  # a disconnect (cancellation) or error: free the backend request
        finished(request, spec, gen)


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT_COMPLETIONS)
