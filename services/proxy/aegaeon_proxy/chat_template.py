"""Render a model's ``chat_template`` as transformers' ``apply_chat_template`` does.

Same jinja2 set-up as transformers (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that does not escape HTML,
``raise_exception``, ``strftime_now``, the ``{% generation %}`` tag) and the
same variables: ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the named special tokens (``bos_token``,
``eos_token``, ...). Keys whose value is ``None`` are dropped from messages, as
transformers does.

Message content in the list-of-parts form is handed to templates that loop
over ``message['content']`` as is ("openai" content format) and joined into
one string (text parts, newline-separated) for templates that expect a string,
the way vLLM decides.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]

__all__ = ["ChatTemplate", "ChatTemplateError", "ContentFormat"]


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed on it."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (assistant masks unused)."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return isinstance(arg, jinja2.nodes.Const) and arg.value == "content"
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"


def detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """ "openai" when the template loops over a message's content, else "string"."""
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter):
            return "openai"
    return "string"


def _open_final(text: str, final: Mapping[str, Any]) -> str:
    """``text`` cut right after the final message's content, as transformers'
    ``continue_final_message`` does (the end-of-turn tokens after it go)."""
    content = final.get("content")
    if isinstance(content, list):
        content = _flatten(content)
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message needs a final message with content")
    at = text.rfind(content.strip())
    if at < 0:
        raise ChatTemplateError("the final message's content is not in the rendered prompt")
    return text[: at + len(content.strip())]


def _flatten(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    return "\n".join(str(part["text"]) for part in content if part.get("type") == "text")


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens bound."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = _environment()
        self.source = source
        ast = env.parse(source)
        self.content_format: ContentFormat = detect_content_format(ast)
        # whether it renders `tools` (else aegaeon_proxy.tool_calls writes them itself)
        self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(ast)
        self._template = env.from_string(source)
        self.special_tokens = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; raises :class:`ChatTemplateError` if the template refuses.

        ``extra``: more variables for the template (a request's ``chat_template_kwargs``,
        e.g. Qwen3's ``enable_thinking``); the named arguments win over them.
        ``continue_final_message``: the text ends inside the last message, open for the
        model to continue (transformers cuts what the template wrote after its content).
        """
        chat = [self._message(m) for m in messages]
        try:
            text = self._template.render(
                **{**self.special_tokens, **(extra or {})},
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc) or type(exc).__name__) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # a template indexing a message the client shaped unexpectedly
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None
        return _open_final(text, chat[-1]) if continue_final_message and chat else text

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in message.items() if v is not None}
        if self.content_format == "string" and "content" in out:
            out["content"] = _flatten(out["content"])
        return out
