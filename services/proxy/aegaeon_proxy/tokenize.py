"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``/tokenize`` takes a completion prompt (``prompt``, with ``add_special_tokens``,
default true) or chat ``messages`` (rendered by the model's chat template as
``/v1/chat/completions`` renders them: ``add_generation_prompt`` default true,
``continue_final_message``, ``chat_template``, ``chat_template_kwargs``,
``tools``; ``add_special_tokens`` default false) and answers ``{count,
max_model_len, tokens, token_strs}`` (``token_strs`` with
``return_token_strs``). ``/detokenize`` takes ``tokens`` and answers
``{prompt}`` (special tokens kept, as vLLM decodes).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from aegaeon_proxy.assets import ModelAssets
from aegaeon_proxy.errors import invalid
from aegaeon_proxy.http_io import read_json_object
from aegaeon_proxy.jsonfmt import json_response
from aegaeon_proxy.model_access import model_assets
from aegaeon_proxy.params import check_string
from aegaeon_proxy.prompts import (
    CHAT_PROMPT_FIELDS,
    bool_field,
    check_ids,
    render_chat,
    request_tools,
)
from aegaeon_proxy.request_fields import FieldTable, check_fields
from aegaeon_proxy.request_ids import ACCESS
from aegaeon_proxy.state import STATE

__all__ = ["detokenize", "tokenize"]

COMPLETION_FIELDS = FieldTable.of(["model", "prompt", "add_special_tokens", "return_token_strs"])
CHAT_FIELDS = FieldTable.of(["model", "add_special_tokens", "return_token_strs", "tools",
                             *CHAT_PROMPT_FIELDS], ["media_io_kwargs", "mm_processor_kwargs",
                                                    "response_format"])  # fmt: skip
DETOKENIZE_FIELDS = FieldTable.of(["model", "tokens"])


async def _body_and_assets(
    request: web.Request, fields: FieldTable | None
) -> tuple[dict[str, Any], ModelAssets]:
    state = request.app[STATE]
    body = await read_json_object(request)
    if fields is None:
        fields = CHAT_FIELDS if "messages" in body else COMPLETION_FIELDS
    check_fields(body, fields)
    model = check_string("model", body.get("model"))
    return body, await model_assets(request, state, model)


def _encode(body: dict[str, Any], assets: ModelAssets) -> list[int]:
    if "messages" in body:
        text = render_chat(body, assets, request_tools(body))
        return assets.encode(text, add_special_tokens=bool_field(body, "add_special_tokens",
                                                                 False))  # fmt: skip
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "'prompt' must be a string (or send 'messages')")
    return assets.encode(prompt, add_special_tokens=bool_field(body, "add_special_tokens", True))


async def tokenize(request: web.Request) -> web.Response:
    body, assets = await _body_and_assets(request, None)
    ids = await asyncio.to_thread(_encode, body, assets)
    request[ACCESS].prompt_tokens = len(ids)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": assets.max_model_len,
                           "tokens": ids, "token_strs": None}  # fmt: skip
    if bool_field(body, "return_token_strs", False):
        out["token_strs"] = [assets.tokenizer.id_to_token(i) or "" for i in ids]
    return json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    body, assets = await _body_and_assets(request, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid("tokens", "'tokens' must be a list of token ids")
    ids = check_ids("tokens", tokens, assets)
    request[ACCESS].prompt_tokens = len(ids)
    text = await asyncio.to_thread(assets.text_of, ids)
    return json_response({"prompt": text})
