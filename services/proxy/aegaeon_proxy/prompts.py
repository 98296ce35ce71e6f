"""From a validated body to prompt token ids and a :class:`GenerationRequest`.

Completions take a string or a list of token ids (also either wrapped in a
one-element list); the string is tokenized with the tokenizer's special tokens
(BOS), as transformers' ``tokenizer(prompt)`` does. Chat messages are rendered
with the model's chat template, which writes its own special tokens, and
tokenized without adding any.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from aegaeon_proxy.assets import ModelAssets
from aegaeon_proxy.backend import GenerationRequest, SamplingParams
from aegaeon_proxy.chat_template import ChatTemplateError
from aegaeon_proxy.errors import APIError, invalid
from aegaeon_proxy.params import CommonParams

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ENGINE_SEED_RANGE = 1 << 63  # int64 seeds fold into the engine's [0, 2**63)

__all__ = ["build_request", "chat_prompt_ids", "completion_prompt_ids"]


def _check_ids(param: str, ids: list[Any], assets: ModelAssets) -> list[int]:
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise invalid(param, f"'{param}' must be a string or a list of token ids")
        if not 0 <= token_id < assets.vocab_size:
            raise invalid(
                param, f"token id {token_id} is outside the vocabulary (0..{assets.vocab_size - 1})"
            )
    return ids


def completion_prompt_ids(body: Mapping[str, Any], assets: ModelAssets) -> list[int]:
    """The prompt of a completions request as token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise invalid("prompt", "only one prompt per request is supported")
    if isinstance(prompt, str):
        ids = assets.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list):
        ids = _check_ids("prompt", prompt, assets)
    else:
        raise invalid("prompt", "'prompt' must be a string or a list of token ids")
    if not ids:
        raise invalid("prompt", "the prompt is empty")
    return ids


def _check_content(param: str, content: Any) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise invalid(param, f"'{param}' must be a string or a list of content parts")
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid(where, f"'{where}' must be a text part (only text is supported)")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}.text", f"'{where}.text' must be a string")


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, f"'{where}' must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(
                f"{where}.role", f"'{where}.role' must be one of {', '.join(sorted(ROLES))}"
            )
        _check_content(f"{where}.content", message.get("content"))
        if message.get("content") is None and role != "assistant":
            raise invalid(f"{where}.content", f"'{where}.content' is required")
    return messages


def chat_prompt_ids(body: Mapping[str, Any], assets: ModelAssets) -> list[int]:
    """The messages of a chat request rendered by the model's template, as token ids."""
    messages = _check_messages(body.get("messages"))
    if assets.chat_template is None:
        raise invalid("model", f"model '{assets.name}' has no chat template; use /v1/completions")
    try:
        text = assets.chat_template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise invalid(
            "messages", f"the model's chat template rejected the messages: {exc}"
        ) from None
    ids = assets.encode(text, add_special_tokens=False)
    if not ids:
        raise invalid("messages", "the rendered prompt is empty")
    return ids


def _max_tokens(
    params: CommonParams,
    prompt_len: int,
    assets: ModelAssets,
    prompt_param: str,
    default: int | None,
) -> int:
    window = assets.max_model_len
    if prompt_len >= window:
        raise APIError(
            400,
            f"This model's maximum context length is {window} tokens, however your prompt has "
            f"{prompt_len} tokens. Please reduce the length of the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    room = window - prompt_len
    if params.max_tokens is None:
        return room if default is None else min(default, room)
    if params.max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {window} tokens, however you requested "
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in your prompt; "
            f"{params.max_tokens} for the completion). Please reduce the prompt or the completion "
            "length.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return params.max_tokens


def build_request(
    request_id: str,
    params: CommonParams,
    prompt_ids: list[int],
    assets: ModelAssets,
    *,
    chat: bool,
    arrival_s: float | None = None,
) -> GenerationRequest:
    """Resolve max_tokens against the window and add EOS to the stop ids."""
    _check_ids("stop_token_ids", list(params.stop_token_ids), assets)
    prompt_param = "messages" if chat else "prompt"
    default = None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = _max_tokens(params, len(prompt_ids), assets, prompt_param, default)
    eos = () if params.ignore_eos else assets.eos_token_ids
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=None if params.seed is None else params.seed % ENGINE_SEED_RANGE,
        stop_token_ids=tuple(dict.fromkeys((*params.stop_token_ids, *eos))),
        ignore_eos=params.ignore_eos,
    )
    return GenerationRequest(
        request_id=request_id,
        model=params.model,
        prompt_token_ids=tuple(prompt_ids),
        sampling=sampling,
        arrival_s=time.time() if arrival_s is None else arrival_s,
        unit=assets.unit,
    )
