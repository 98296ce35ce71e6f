"""``POST /v1/completions`` and ``POST /v1/chat/completions``: one code path.

An :class:`Endpoint` row says how the two differ (which fields, how the prompt
becomes ids, which response shapes); :func:`generate` does the rest. Errors
before the first byte is sent are HTTP errors; after (streaming), an
``{"error": ...}`` event followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from aegaeon_common.logs import get_logger
from aiohttp import web

from aegaeon_proxy.admin_models import quarantine
from aegaeon_proxy.answers import Answer, AnswerSpec
from aegaeon_proxy.assets import AssetError, ModelAssets
from aegaeon_proxy.auth import API_KEY, allowed, model_not_found
from aegaeon_proxy.errors import APIError, invalid
from aegaeon_proxy.generation import Generation
from aegaeon_proxy.http_io import SSEWriter, read_json_object
from aegaeon_proxy.model_table import unavailable_error
from aegaeon_proxy.params import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    Checker,
    parse_common,
    with_model_defaults,
)
from aegaeon_proxy.prompts import (
    CHAT_PROMPT_FIELDS,
    Prompt,
    build_request,
    chat_prompt,
    completion_prompt,
    truncated,
)
from aegaeon_proxy.request_fields import DEFAULT_ONLY_NAMES, FieldTable, check_fields
from aegaeon_proxy.request_ids import ACCESS, HEADER, REQUEST_ID, check_request_id
from aegaeon_proxy.responses import CHAT, COMPLETION, Head, Shapes
from aegaeon_proxy.slo_classes import resolve
from aegaeon_proxy.state import STATE, ProxyState
from aegaeon_proxy.structured import STRUCTURED_FIELDS, constraint_of, grammar_for
from aegaeon_proxy.tool_calls import OPEN

OFFLOAD_BODY_BYTES = 16 << 10  # prompts larger than this are tokenized on a thread

log = get_logger("proxy")

__all__ = ["CHAT_COMPLETIONS", "chat_completions", "completions", "finished", "head_of",
           "load_assets_for", "prepare", "read_body"]

PromptFn = Callable[[Mapping[str, Any], ModelAssets], Prompt]


@dataclass(frozen=True)
class Endpoint:
    fields: Mapping[str, tuple[str, Checker]]
    known: FieldTable  # every field the endpoint knows (others are a 400)
    prompt: PromptFn
    shapes: Shapes
    chat: bool


# what both endpoints honour besides the sampling fields (params.FIELDS)
_COMMON = ("model", "request_id", "add_special_tokens", "truncate_prompt_tokens",
           *STRUCTURED_FIELDS)
COMPLETIONS = Endpoint(
    COMPLETION_FIELDS, FieldTable.of([*COMPLETION_FIELDS, *_COMMON, "prompt"], DEFAULT_ONLY_NAMES),
    completion_prompt, COMPLETION, chat=False,
)  # fmt: skip
CHAT_COMPLETIONS = Endpoint(
    CHAT_FIELDS, FieldTable.of([*CHAT_FIELDS, *_COMMON, *CHAT_PROMPT_FIELDS], DEFAULT_ONLY_NAMES),
    chat_prompt, CHAT, chat=True,
)  # fmt: skip


def request_id_of(request: web.Request, body: Mapping[str, Any]) -> str:
    """The generation's id: the ``X-Request-Id`` header's, else vLLM's ``request_id``
    field, else the one the middleware made up."""
    if HEADER not in request.headers and body.get("request_id") is not None:
        given = body["request_id"]
        if not isinstance(given, str):
            raise invalid("request_id", "'request_id' must be a string")
        request[REQUEST_ID] = check_request_id(given, "request_id")
    return request[REQUEST_ID]


async def load_assets_for(state: ProxyState, model: str) -> ModelAssets:
    """A served model's text assets, bounded by what the deployment's KV holds per
    request; 404 for a model not served, 503 ``model_unavailable`` for a checkpoint or
    tokenizer that cannot be read (quarantined)."""
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
    bound = state.backend.context_limit(model)
    if bound is not None and bound < assets.max_model_len:
        assets = replace(assets, max_model_len=bound)
    return assets


async def read_body(request: web.Request) -> dict[str, Any]:
    """A generation's body (503 while the proxy drains)."""
    state = request.app[STATE]
    if state.readiness.draining:
        raise APIError(503, "the proxy is draining (shutting down)", code="draining")
    proxy = state.config.proxy
    return await read_json_object(request, proxy.max_body_bytes, proxy.read_timeout_s)


async def prepare(request: web.Request, endpoint: Endpoint,
                  body: Mapping[str, Any]) -> tuple[AnswerSpec, Generation]:
    """Validate ``body``, tokenize, submit: the answer's spec and the generation."""
    state = request.app[STATE]
    arrival_s = time.time()
    proxy = state.config.proxy
    check_fields(body, endpoint.known)
    params = parse_common(body, endpoint.fields)
    request[ACCESS].model = params.model
    if not allowed(request, params.model):
        raise model_not_found(params.model)
    slo = resolve(state.config, params.model, state.model_settings(params.model),
                  request.get(API_KEY), priority=params.priority, ttft_s=params.ttft_s,
                  tbt_s=params.tbt_s, model_slo=state.slo(params.model))  # fmt: skip
    assets = await load_assets_for(state, params.model)
    params = with_model_defaults(params, body, assets.sampling_defaults)
    if (request.content_length or 0) > OFFLOAD_BODY_BYTES:
        prompt = await asyncio.to_thread(endpoint.prompt, body, assets)
    else:
        prompt = endpoint.prompt(body, assets)
    prompt_ids = truncated(prompt.ids, body, assets)
    grammar = await grammar_for(constraint_of(body, prompt.tools, assets.special_texts))
    request_id = request_id_of(request, body)
    request[ACCESS].prompt_tokens = len(prompt_ids)
    req = build_request(request_id, params, prompt_ids, assets, chat=endpoint.chat,
                        arrival_s=arrival_s, grammar=grammar)  # fmt: skip
    req = replace(req, priority=slo.priority, ttft_s=slo.ttft_s, tbt_s=slo.tbt_s,
                  slo_class=slo.slo_class)  # fmt: skip
    # the server's deadline; a request's own `timeout` may only shorten it
    timeout_s = min(params.timeout_s or proxy.request_timeout_s, proxy.request_timeout_s)
    gen = Generation(
        state.backend, assets, req, stop=params.stop, metrics=state.metrics, timeout_s=timeout_s,
        slo=slo.targets, models=state.models,
        skip_special_tokens=params.skip_special_tokens and not _tags_special(prompt, assets),
    )  # fmt: skip
    gen.submit()
    log.debug("request_accepted", request_id=request_id, model=params.model,
              prompt_tokens=len(prompt_ids), max_tokens=req.sampling.max_tokens,
              slo_class=slo.slo_class)  # fmt: skip
    spec = AnswerSpec(params, assets, endpoint.shapes, endpoint.chat, prompt_ids, prompt.text,
                      prompt.tools)  # fmt: skip
    return spec, gen


def _tags_special(prompt: Prompt, assets: ModelAssets) -> bool:
    """The model's tool-call tags are special tokens: its text must show them (vLLM, too,
    keeps special tokens in the text of a request with tools)."""
    return prompt.tools is not None and OPEN in assets.special_texts


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
    spec, gen = await prepare(request, endpoint, await read_body(request))
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
