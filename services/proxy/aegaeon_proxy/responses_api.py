"""``POST /v1/responses``: OpenAI's Responses API, stateless, on the chat code path.

The request becomes a chat request (:func:`chat_body`): ``instructions`` a
system message first; ``input`` a string (one user message) or a list of
items (messages with ``input_text``/``output_text`` parts, the model's earlier
``function_call`` items and the client's ``function_call_output`` items);
``tools`` (function tools), ``tool_choice``, ``text.format`` (``text``,
``json_object``, ``json_schema``), ``max_output_tokens``, ``temperature``,
``top_p``. It is then validated, prefilled and decoded as
``/v1/chat/completions`` would; an error names the Responses field
(``text.format.schema``, ``input[2].content``, ...).

Nothing is stored: ``previous_response_id`` (or ``conversation``) is a 400
saying so, the client sends the whole conversation in ``input``.

The answer is a ``response`` object whose ``output`` holds a ``message`` item
(its ``output_text``) and a ``function_call`` item per tool call; status
``completed``, or ``incomplete`` (``max_output_tokens``) at the length limit.
Streamed, the events the OpenAI SDK reads: ``response.created``,
``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ...
``.done``, ``response.content_part.done``, ``response.output_item.done``
(``response.function_call_arguments.delta``/``.done`` for calls), and
``response.completed`` (or ``response.incomplete``), each with its
``sequence_number``.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from aegaeon_proxy.errors import APIError, invalid
from aegaeon_proxy.generation import Generation
from aegaeon_proxy.handlers import read_body
from aegaeon_proxy.intake import CHAT_COMPLETIONS, prepare
from aegaeon_proxy.jsonfmt import json_response
from aegaeon_proxy.request_fields import FieldTable, check_fields
from aegaeon_proxy.request_ids import HEADER, REQUEST_ID
from aegaeon_proxy.sse import SSEWriter
from aegaeon_proxy.state import STATE
from aegaeon_proxy.tool_calls import ToolCallParser

JSON = dict[str, Any]

__all__ = ["create_response"]

FIELDS = FieldTable.of(
    ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
     "tool_choice", "text", "stream", "parallel_tool_calls", "previous_response_id",
     "conversation", "seed", "top_k", "stop", "priority", "timeout"],
    ["reasoning", "include", "background", "max_tool_calls", "prompt", "truncation",
     "top_logprobs", "stream_options"],
)  # fmt: skip
# chat fields as a Responses client knows them (a 400 names the field it sent)
PARAM_NAMES = (("response_format.json_schema.schema", "text.format.schema"),
               ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
               ("max_completion_tokens", "max_output_tokens"), ("messages", "input"))


def _new(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _content(where: str, content: Any) -> str | list[JSON]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"'{where}' must be a string or a list of content parts")
    parts: list[JSON] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise invalid(f"{where}[{j}]", f"'{where}[{j}]' must be a text part "
                          "(input_text or output_text; only text is supported)")  # fmt: skip
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _messages(body: Mapping[str, Any]) -> list[JSON]:
    """``instructions`` and ``input`` as chat messages."""
    messages: list[JSON] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "'instructions' must be a string")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input", "'input' must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"'{where}' must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role", f"'{where}.role' must be user, system, "
                              "developer or assistant")  # fmt: skip
            messages.append({"role": role,
                             "content": _content(f"{where}.content", item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or _new("call"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"),
                                                                       str):
                raise invalid(where, f"'{where}' must have a 'name' and 'arguments' strings")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # the calls of one turn together
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise invalid(f"{where}.output", f"'{where}.output' must be a string")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output})
        else:
            raise invalid(f"{where}.type", f"'{where}.type' {str(kind)[:40]!r} is not supported "
                          "(message, function_call, function_call_output)")  # fmt: skip
    return messages


def _tools(body: Mapping[str, Any]) -> list[JSON] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"tools[{i}].type", f"'tools[{i}]' must be a function tool (only "
                          "function tools are supported)")  # fmt: skip
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: Any) -> JSON | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid("text", "'text' must be an object")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid("text.format", "'text.format' must be an object")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"),
            "strict": fmt.get("strict")}}  # fmt: skip
    return {"type": fmt.get("type")}


def chat_body(body: Mapping[str, Any]) -> JSON:
    """The chat request a Responses request asks for."""
    check_fields(body, FIELDS)
    for stateful in ("previous_response_id", "conversation"):
        if body.get(stateful) is not None:
            raise APIError(400, f"'{stateful}' is not supported: this server keeps no state "
                           "between requests; send the whole conversation in 'input'",
                           param=stateful, code="stateless")  # fmt: skip
    chat: JSON = {"model": body.get("model"), "messages": _messages(body)}
    same = ("temperature", "top_p", "stream", "parallel_tool_calls", "seed", "top_k", "stop",
            "priority", "timeout")  # fmt: skip
    chat.update({k: body[k] for k in same if body.get(k) is not None})
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def _renamed(exc: APIError) -> APIError:
    """A chat field's error as the Responses field's."""
    param = exc.param
    for chat, ours in PARAM_NAMES:
        if param is not None and param.startswith(chat):
            exc.message = exc.message.replace(chat, ours)
            exc.param = ours + param[len(chat):]
            break
    return exc


class _Output:
    """The ``response`` object and its events, as the answer comes."""

    def __init__(self, body: Mapping[str, Any], gen: Generation) -> None:
        self.body = body
        self.gen = gen
        self.id = f"resp_{gen.req.request_id}"
        self.created = int(gen.req.arrival_s)
        self.sequence = 0
        self.message_id = _new("msg")
        self.text = ""
        self.calls: list[JSON] = []
        self.finish: str | None = None

    def event(self, kind: str, **fields: Any) -> JSON:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def message(self, status: str) -> JSON:
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": [self.part()] if status != "in_progress" else []}

    def part(self) -> JSON:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def call_item(self, call: JSON, arguments: str | None = None) -> JSON:
        function = call["function"]
        return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"] if arguments is None else arguments,
                "status": "completed" if arguments is None else "in_progress"}  # fmt: skip

    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return "incomplete" if self.finish == "length" else "completed"

    def response(self) -> JSON:
        output: list[JSON] = []
        if self.finish is not None:
            if self.text or not self.calls:
                output.append(self.message("completed"))
            output += [self.call_item(c) for c in self.calls]
        body, usage = self.body, None
        if self.finish is not None:
            prompt, completion = self.gen.prompt_tokens, self.gen.completion_tokens
            usage = {"input_tokens": prompt, "output_tokens": completion,
                     "total_tokens": prompt + completion,
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                     "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": self.status(), "model": self.gen.req.model, "output": output,
            "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if self.status() == "incomplete" else None),
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": body.get("text") or {"format": {"type": "text"}},
            "previous_response_id": None, "store": False, "metadata": body.get("metadata") or {},
            "usage": usage,
        }  # fmt: skip


async def create_response(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses`` (see the module docstring)."""
    body = await read_body(request)
    try:
        spec, gen = await prepare(request, CHAT_COMPLETIONS, chat_body(body))
    except APIError as exc:
        raise _renamed(exc) from None
    try:
        await gen.admitted()
        out = _Output(body, gen)
        parser = spec.prompt.tools.parser() if spec.prompt.tools is not None else None
        if spec.params.stream:
            return await _stream(request, out, parser)
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for delta in deltas:
                out.text += delta.text
                out.finish = delta.finish_reason or out.finish
        if parser is not None:
            out.text, calls = parser.whole(out.text)
            out.calls = calls or []
        out.finish = out.finish or "stop"
        return json_response(out.response())
    finally:
        await gen.close()


async def _stream(request: web.Request, out: _Output,
                  parser: ToolCallParser | None) -> web.StreamResponse:  # fmt: skip
    sse = SSEWriter(request, request.app[STATE].config.proxy.write_timeout_s)
    sse.response.headers[HEADER] = request[REQUEST_ID]
    return await sse.stream(_events(out, parser, sse.flush), named=True, sentinel=False)


async def _events(out: _Output, parser: ToolCallParser | None,
                  before_wait: Callable[[], Awaitable[None]]) -> AsyncGenerator[JSON, None]:
    """The stream's events in order (each names its ``type``); a failure's error last."""
    send = out.event
    opened = False

    def text(piece: str) -> list[JSON]:
        nonlocal opened
        if not piece:
            return []
        events = []
        if not opened:
            opened = True
            events += [
                send("response.output_item.added", output_index=0,
                     item=out.message("in_progress")),
                send("response.content_part.added", item_id=out.message_id, output_index=0,
                     content_index=0, part={**out.part(), "text": ""}),
            ]  # fmt: skip
        out.text += piece
        events.append(send("response.output_text.delta", item_id=out.message_id,
                           output_index=0, content_index=0, delta=piece, logprobs=[]))
        return events

    try:
        yield send("response.created", response=out.response())
        yield send("response.in_progress", response=out.response())
        async with contextlib.aclosing(out.gen.deltas(before_wait)) as deltas:
            async for delta in deltas:
                piece = delta.text
                if parser is not None:  # its calls (parser.calls) are sent after the text
                    piece, _ = parser.push(piece, final=delta.finish_reason is not None)
                for event in text(piece):
                    yield event
                out.finish = delta.finish_reason or out.finish
        out.finish = out.finish or "stop"
        if opened:
            yield send("response.output_text.done", item_id=out.message_id, output_index=0,
                       content_index=0, text=out.text, logprobs=[])
            yield send("response.content_part.done", item_id=out.message_id, output_index=0,
                       content_index=0, part=out.part())
            yield send("response.output_item.done", output_index=0,
                       item=out.message("completed"))
        out.calls = parser.calls if parser is not None else []
        for k, call in enumerate(out.calls, start=1 if opened else 0):
            item = out.call_item(call)
            yield send("response.output_item.added", output_index=k,
                       item=out.call_item(call, arguments=""))
            yield send("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=k, delta=item["arguments"])
            yield send("response.function_call_arguments.done", item_id=item["id"],
                       output_index=k, arguments=item["arguments"])
            yield send("response.output_item.done", output_index=k, item=item)
        final = out.response()
        yield send(f"response.{final['status']}", response=final)
    except APIError as exc:
        yield send("error", code=exc.code, message=exc.message, param=exc.param)
