"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one code path.

An :class:`Endpoint` row says how the two differ (which fields, how the prompt
becomes ids, which response shapes); :func:`generate` does the rest. Errors
before the first byte is sent are HTTP errors; after (streaming), an
``{"error": ...}`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from aegaeon_common.logs import get_logger
from aiohttp import web

from aegaeon_proxy.admin_models import quarantine
from aegaeon_proxy.assets import AssetError, ModelAssets
from aegaeon_proxy.auth import API_KEY, allowed, model_not_found
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.generation import Generation
from aegaeon_proxy.http_io import CLIENT_GONE, SSEWriter, read_json_object
from aegaeon_proxy.jsonfmt import json_response
from aegaeon_proxy.model_table import unavailable_error
from aegaeon_proxy.params import (
    CHAT_FIELDS,
    FIELDS,
    Checker,
    CommonParams,
    parse_common,
    with_model_defaults,
)
from aegaeon_proxy.prompts import build_request, chat_prompt_ids, completion_prompt_ids
from aegaeon_proxy.responses import CHAT, COMPLETION, Head, Shapes, Usage, new_id
from aegaeon_proxy.slo_classes import resolve
from aegaeon_proxy.state import STATE, ProxyState

OFFLOAD_BODY_BYTES = 16 << 10  # prompts larger than this are tokenized on a thread

log = get_logger("proxy")

__all__ = ["chat_completions", "completions"]

PromptFn = Callable[[Mapping[str, Any], ModelAssets], list[int]]


@dataclass(frozen=True)
class Endpoint:
    fields: Mapping[str, tuple[str, Checker]]
    prompt_ids: PromptFn
    shapes: Shapes
    chat: bool


COMPLETIONS = Endpoint(FIELDS, completion_prompt_ids, COMPLETION, chat=False)
CHAT_COMPLETIONS = Endpoint(CHAT_FIELDS, chat_prompt_ids, CHAT, chat=True)


async def _assets(state: ProxyState, model: str) -> ModelAssets:
    if model not in state.assets:
        raise model_not_found(model)
    why = state.models.unavailable(model)
    if why is not None:  # its checkpoint cannot be read: refused before any tokenizing
        raise unavailable_error(model, why)
    try:
        assets = await state.assets.get(model)
    except AssetError as exc:  # its tokenizer files: unavailable, as a bad checkpoint is
        log.error("model_assets_failed", model=model, error=str(exc))
        await quarantine(state, model, str(exc))
        raise unavailable_error(model, str(exc)) from None
    # The deployment may hold fewer tokens of KV per request than the model's
    # window (device KV regions): the smaller bound is the context length.
    limit = getattr(state.backend, "context_limit", None)
    bound = limit(model) if limit is not None else None
    if bound is not None and bound < assets.max_model_len:
        assets = replace(assets, max_model_len=bound)
    return assets


async def _prepare(request: web.Request, endpoint: Endpoint) -> tuple[CommonParams, Generation]:
    state = request.app[STATE]
    arrival_s = time.time()
    if state.readiness.draining:
        raise APIError(503, "the proxy is draining (shutting down)", code="draining")
    proxy = state.config.proxy
    body = await read_json_object(request, proxy.max_body_bytes, proxy.read_timeout_s)
    params = parse_common(body, endpoint.fields)
    if not allowed(request, params.model):
        raise model_not_found(params.model)
    slo = resolve(state.config, params.model, state.model_settings(params.model),
                  request.get(API_KEY), priority=params.priority, ttft_s=params.ttft_s,
                  tbt_s=params.tbt_s, model_slo=state.slo(params.model))  # fmt: skip
    assets = await _assets(state, params.model)
    params = with_model_defaults(params, body, assets.sampling_defaults)
    if (request.content_length or 0) > OFFLOAD_BODY_BYTES:
        prompt_ids = await asyncio.to_thread(endpoint.prompt_ids, body, assets)
    else:
        prompt_ids = endpoint.prompt_ids(body, assets)
    request_id = new_id(endpoint.shapes.id_prefix)
    req = build_request(
        request_id, params, prompt_ids, assets, chat=endpoint.chat, arrival_s=arrival_s
    )
    req = replace(req, priority=slo.priority, ttft_s=slo.ttft_s, tbt_s=slo.tbt_s,
                  slo_class=slo.slo_class)  # fmt: skip
    # the server's deadline; a request's own `timeout` may only shorten it
    timeout_s = min(params.timeout_s or proxy.request_timeout_s, proxy.request_timeout_s)
    gen = Generation(
        state.backend, assets, req, stop=params.stop, metrics=state.metrics, timeout_s=timeout_s,
        slo=slo.targets, models=state.models,
    )  # fmt: skip
    gen.submit()
    log.debug("request_accepted", request_id=request_id, model=params.model,
              prompt_tokens=len(prompt_ids), max_tokens=req.sampling.max_tokens,
              slo_class=slo.slo_class)  # fmt: skip
    return params, gen


def _head(gen: Generation) -> Head:
    return Head(id=gen.req.request_id, created=int(gen.req.arrival_s), model=gen.req.model)


def _usage(gen: Generation) -> Usage:
    return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens)


async def _respond(gen: Generation, shapes: Shapes) -> web.Response:
    parts: list[str] = []
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for text in deltas:
            parts.append(text)
    assert gen.finish_reason is not None
    body = shapes.response(_head(gen), "".join(parts), gen.finish_reason, _usage(gen))
    return json_response(body)


async def _stream(
    request: web.Request, gen: Generation, params: CommonParams, shapes: Shapes
) -> web.StreamResponse:
    sse = SSEWriter(request, request.app[STATE].config.proxy.write_timeout_s)
    head = _head(gen)
    usage_field = params.include_usage
    try:
        await sse.open()
        first = shapes.first(head, usage_field)
        if first is not None:
            await sse.send(first)
        # Each token is its own event; the events a busy proxy finds ready
        # leave in one write (flushed whenever the next token is not there yet).
        async with contextlib.aclosing(gen.deltas(sse.flush)) as deltas:
            async for text in deltas:
                sse.add(shapes.delta(head, text, usage_field))
        assert gen.finish_reason is not None
        sse.add(shapes.finish(head, gen.finish_reason, usage_field))
        if usage_field:
            sse.add(shapes.usage(head, _usage(gen)))
    except APIError as exc:
        sse.add(exc.body())  # the error event, then [DONE]
    except ConnectionResetError:
        request[CLIENT_GONE] = True
        return sse.response
    try:
        await sse.done()
    except ConnectionResetError:
        request[CLIENT_GONE] = True
    return sse.response


async def generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """Validate, tokenize, submit, and answer in one piece or as SSE."""
    params, gen = await _prepare(request, endpoint)
    try:
        await gen.admitted()  # past the admission bounds it waits for room, or is a 429
        if params.stream:
            return await _stream(request, gen, params, endpoint.shapes)
        return await _respond(gen, endpoint.shapes)
    finally:
        await gen.close()  # a disconnect (cancellation) or error: free the backend request
        if params.keep_alive_s is not None:  # Ollama's: from the end of the request
            request.app[STATE].keep_alive.after(params.model, params.keep_alive_s)


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, CHAT_COMPLETIONS)
