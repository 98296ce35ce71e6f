"""A generation request read into what the rest of its handling needs.

:func:`prepare` checks a completions or chat body once, in this order: the fields
the endpoint knows, the sampling fields, the key's access to the model and its
assets, the SLO class, the prompt (tokenized, truncated), the structured-output
grammar and the request id; then the request is completed for its model (its
sampling defaults, max_tokens against the window) and the generation submitted.
An :class:`Endpoint` row says how the two endpoints differ (which fields, how the
prompt becomes ids, which response shapes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from aegaeon_common.logs import get_logger
from aiohttp import web

from aegaeon_proxy.answers import AnswerSpec
from aegaeon_proxy.assets import ModelAssets
from aegaeon_proxy.auth import API_KEY
from aegaeon_proxy.generation import Generation
from aegaeon_proxy.model_access import model_assets
from aegaeon_proxy.params import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    Checker,
    parse_common,
)
from aegaeon_proxy.prompts import (
    CHAT_PROMPT_FIELDS,
    Prompt,
    build_request,
    chat_prompt,
    completion_prompt,
)
from aegaeon_proxy.request_fields import DEFAULT_ONLY_NAMES, FieldTable, check_fields
from aegaeon_proxy.request_ids import ACCESS, request_id_of
from aegaeon_proxy.responses import CHAT, COMPLETION, Shapes
from aegaeon_proxy.slo_classes import resolve
from aegaeon_proxy.state import STATE
from aegaeon_proxy.structured import STRUCTURED_FIELDS, constraint_of, grammar_for
from aegaeon_proxy.tool_calls import OPEN as TOOL_CALL_OPEN

OFFLOAD_BODY_BYTES = 16 << 10  # prompts larger than this are tokenized on a thread

log = get_logger("proxy")

__all__ = ["CHAT_COMPLETIONS", "COMPLETIONS", "Endpoint", "prepare"]

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


async def prepare(request: web.Request, endpoint: Endpoint,
                  body: Mapping[str, Any]) -> tuple[AnswerSpec, Generation]:
    """Check ``body``, tokenize, submit: the answer's spec and the generation."""
    state = request.app[STATE]
    arrival_s = time.time()
    proxy = state.config.proxy
    check_fields(body, endpoint.known)
    params = parse_common(body, endpoint.fields)
    assets = await model_assets(request, state, params.model)
    slo = resolve(state.config, params.model, state.models.settings(params.model),
                  request.get(API_KEY), priority=params.priority, ttft_s=params.ttft_s,
                  tbt_s=params.tbt_s, model_slo=state.slo(params.model))  # fmt: skip
    if (request.content_length or 0) > OFFLOAD_BODY_BYTES:
        prompt = await asyncio.to_thread(endpoint.prompt, body, assets)
    else:
        prompt = endpoint.prompt(body, assets)
    grammar = await grammar_for(constraint_of(body, prompt.tools, assets.special_texts))
    # the model's tool-call tags are special tokens: the text must show them (vLLM, too,
    # keeps special tokens in the text of a request with tools)
    tags_shown = prompt.tools is not None and TOOL_CALL_OPEN in assets.special_texts
    request_id = request_id_of(request, body)
    request[ACCESS].prompt_tokens = len(prompt.ids)
    req = build_request(request_id, params, prompt.ids, assets, chat=endpoint.chat,
                        arrival_s=arrival_s, grammar=grammar)  # fmt: skip
    req = replace(req, priority=slo.priority, ttft_s=slo.ttft_s, tbt_s=slo.tbt_s,
                  slo_class=slo.slo_class)  # fmt: skip
    # the server's deadline; a request's own `timeout` may only shorten it
    timeout_s = min(params.timeout_s or proxy.request_timeout_s, proxy.request_timeout_s)
    gen = Generation(
        state, assets, req, stop=params.stop, timeout_s=timeout_s, slo=slo.targets,
        skip_special_tokens=params.skip_special_tokens and not tags_shown,
        access=request[ACCESS], keep_alive_s=params.keep_alive_s,
    )  # fmt: skip
    log.debug("request_accepted", request_id=request_id, model=params.model,
              prompt_tokens=len(prompt.ids), max_tokens=req.sampling.max_tokens,
              slo_class=slo.slo_class)  # fmt: skip
    return AnswerSpec(params, assets, endpoint.shapes, endpoint.chat, prompt), gen
