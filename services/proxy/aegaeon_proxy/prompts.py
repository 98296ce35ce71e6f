"""From a validated body to prompt token ids and a :class:`GenerationRequest`.

Completions take a string or a list of token ids (also either wrapped in a
one-element list); the string is tokenized with the tokenizer's special tokens
(BOS), as transformers' ``tokenizer(prompt)`` does. Chat messages are rendered
with the model's chat template, which writes its own special tokens, and
tokenized without adding any.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import msgspec

from aegaeon_proxy.assets import ModelAssets
from aegaeon_proxy.backend import GenerationRequest
from aegaeon_proxy.chat_template import ChatTemplate, ChatTemplateError
from aegaeon_proxy.errors import APIError, invalid
from aegaeon_proxy.params import CommonParams, check_bool
from aegaeon_proxy.tool_calls import ToolSetup, tool_messages, tool_setup, tool_text

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

__all__ = ["CHAT_PROMPT_FIELDS", "Prompt", "bool_field", "build_request", "chat_prompt",
           "check_ids", "completion_prompt", "completion_prompt_ids",
           "render_chat", "request_tools"]


def check_ids(param: str, ids: list[Any], assets: ModelAssets) -> list[int]:
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise invalid(param, f"'{param}' must be a string or a list of token ids")
        if not 0 <= token_id < assets.vocab_size:
            raise invalid(
                param, f"token id {token_id} is outside the vocabulary (0..{assets.vocab_size - 1})"
            )
    return ids


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the generation needs it."""

    ids: list[int]
    # what `echo` repeats (None: nothing): the completion prompt, chat's last message
    text: str | None = None
    tools: ToolSetup | None = None  # chat: the tools the model may call


def completion_prompt(body: Mapping[str, Any], assets: ModelAssets) -> Prompt:
    """The prompt of a completions request."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ids = _truncated(completion_prompt_ids(body, assets), body, assets)
    if isinstance(prompt, str):
        return Prompt(ids, prompt)
    # token ids echo as their text (special tokens kept)
    return Prompt(ids, assets.text_of(ids) if bool_field(body, "echo", False) else None)


def completion_prompt_ids(body: Mapping[str, Any], assets: ModelAssets) -> list[int]:
    """The prompt of a completions request as token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise invalid("prompt", "only one prompt per request is supported")
    if isinstance(prompt, str):
        ids = assets.encode(prompt, add_special_tokens=bool_field(body, "add_special_tokens",
                                                                   True))
    elif isinstance(prompt, list):
        ids = check_ids("prompt", prompt, assets)
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


# the fields of a chat request render_chat reads
CHAT_PROMPT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                      "chat_template", "chat_template_kwargs", "documents", "reasoning_effort",
                      "tools", "tool_choice", "parallel_tool_calls")
MAX_TEMPLATES = 32
MAX_TEMPLATE_CHARS = 64 << 10


def bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    return default if value is None else check_bool(name, value)


def _own_template(source: Any, assets: ModelAssets) -> ChatTemplate:
    if not isinstance(source, str) or not source or len(source) > MAX_TEMPLATE_CHARS:
        raise invalid("chat_template", "'chat_template' must be a Jinja template of 1 to "
                      f"{MAX_TEMPLATE_CHARS} characters")  # fmt: skip
    special = assets.chat_template.special_tokens if assets.chat_template is not None else {}
    try:
        return _compiled(source, tuple(sorted(special.items())))
    except jinja2.TemplateError as exc:
        raise invalid("chat_template", f"'chat_template' is not a valid template: {exc}"
                      ) from None  # fmt: skip


@functools.lru_cache(maxsize=MAX_TEMPLATES)
def _compiled(source: str, special: tuple[tuple[str, str], ...]) -> ChatTemplate:
    """A request's own chat template, compiled once (by source and special tokens)."""
    return ChatTemplate(source, dict(special))


def request_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The request's ``tools`` (OpenAI's function tools), checked, as the chat template
    takes them; None without any."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be a list of tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise invalid(where, f"'{where}' must be a function tool "
                          "({'type': 'function', 'function': {...}})")  # fmt: skip
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", f"'{where}.function' must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.function.name", f"'{where}.function.name' must be a "
                          "non-empty string")  # fmt: skip
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters",
                          f"'{where}.function.parameters' must be a JSON schema object")
    return tools


def _template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` (and ``reasoning_effort``, which vLLM hands the template
    the same way): more variables for the template."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise invalid("reasoning_effort", "'reasoning_effort' must be a string")
        kwargs = {"reasoning_effort": effort, **kwargs}
    return kwargs


def _documents(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    docs = body.get("documents")
    if docs is None:
        return None
    if not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs):
        raise invalid("documents", "'documents' must be a list of objects")
    return docs


def _template(body: Mapping[str, Any], assets: ModelAssets) -> ChatTemplate:
    template = assets.chat_template
    if body.get("chat_template") is not None:
        template = _own_template(body["chat_template"], assets)
    if template is None:
        raise invalid("model", f"model '{assets.name}' has no chat template; use /v1/completions")
    return template


def render_chat(body: Mapping[str, Any], assets: ModelAssets,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The messages of a chat request rendered by the model's template (or the
    request's own ``chat_template``), with the request's template options and
    ``tools`` (written by :func:`~aegaeon_proxy.tool_calls.tool_messages` for a
    template that renders none)."""
    template = _template(body, assets)
    messages = tool_messages(_check_messages(body.get("messages")), tools, template)
    if template.takes_tools is False:
        tools = None  # in the messages now
    generation_prompt = bool_field(body, "add_generation_prompt", True)
    continue_final = bool_field(body, "continue_final_message", False)
    if continue_final and body.get("add_generation_prompt") is True:
        raise invalid("continue_final_message", "'continue_final_message' and "
                      "'add_generation_prompt' cannot both be true")  # fmt: skip
    try:
        return template.render(
            messages, add_generation_prompt=generation_prompt, tools=tools,
            documents=_documents(body), continue_final_message=continue_final,
            extra=_template_kwargs(body),
        )  # fmt: skip
    except ChatTemplateError as exc:
        raise invalid(
            "messages", f"the model's chat template rejected the messages: {exc}"
        ) from None


def chat_prompt(body: Mapping[str, Any], assets: ModelAssets) -> Prompt:
    """A chat request's prompt: its messages (and the tools it offers, unless
    ``tool_choice`` is ``none``) rendered by the model's template, as token ids (no
    special tokens added beyond the template's unless ``add_special_tokens``)."""
    tools = request_tools(body)
    setup = tool_setup(body, tools, _template(body, assets))
    text = render_chat(body, assets, tools if setup is not None else None)
    ids = assets.encode(text, add_special_tokens=bool_field(body, "add_special_tokens", False))
    if not ids:
        raise invalid("messages", "the rendered prompt is empty")
    last = body["messages"][-1]
    echoed = None  # vLLM's chat echo: the last message, when the answer continues its role
    if bool_field(body, "echo", False) and last.get("role") == "assistant":
        echoed = tool_text(last.get("content"))
    return Prompt(_truncated(ids, body, assets), echoed, setup)


def _truncated(ids: list[int], body: Mapping[str, Any], assets: ModelAssets) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last N tokens (-1: as many as the
    context window holds, less one for the completion)."""
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return ids
    if isinstance(value, bool) or not isinstance(value, int) or value < -1 or value == 0:
        raise invalid("truncate_prompt_tokens",
                      "'truncate_prompt_tokens' must be a positive integer or -1")  # fmt: skip
    keep = assets.max_model_len - 1 if value == -1 else value
    return ids[-keep:]


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
    grammar: str = "",
) -> GenerationRequest:
    """The request's sampling completed for its prompt and model: the model's sampling
    defaults where the body left the fields out, max_tokens resolved against the window,
    the model's EOS among the stop ids, the token ids the fields name checked;
    ``grammar``: llguidance's, the tokens must follow it."""
    defaults = {k: v for k, v in assets.sampling_defaults.items() if k not in params.given}
    asked = msgspec.structs.replace(params.sampling, **defaults)
    check_ids("stop_token_ids", list(asked.stop_token_ids), assets)
    check_ids("logit_bias", list(asked.logit_bias), assets)
    check_ids("allowed_token_ids", list(asked.allowed_token_ids), assets)
    prompt_param = "messages" if chat else "prompt"
    default = None if chat else COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = _max_tokens(params, len(prompt_ids), assets, prompt_param, default)
    if asked.min_tokens > max_tokens:
        raise invalid("min_tokens", f"'min_tokens' ({asked.min_tokens}) may not exceed the "
                      f"completion's max_tokens ({max_tokens})")  # fmt: skip
    eos = () if asked.ignore_eos else assets.eos_token_ids
    prompt_logprobs = asked.prompt_logprobs
    if params.echo and asked.logprobs >= 0 and not chat:  # the echoed prompt's tokens too
        prompt_logprobs = max(prompt_logprobs, asked.logprobs)
    sampling = msgspec.structs.replace(
        asked, max_tokens=max_tokens, grammar=grammar, prompt_logprobs=prompt_logprobs,
        stop_token_ids=tuple(dict.fromkeys((*asked.stop_token_ids, *eos))),
    )  # fmt: skip
    return GenerationRequest(
        request_id=request_id,
        model=params.model,
        prompt_token_ids=tuple(prompt_ids),
        sampling=sampling,
        arrival_s=time.time() if arrival_s is None else arrival_s,
        unit=assets.unit,
    )
