"""Tool calls: the request's ``tools`` and ``tool_choice``, the model's calls parsed back.

Two formats, as the market's families write them:

* **Hermes** (Qwen2, Qwen2.5, Qwen3, SmolLM2 and most chat models trained for
  tools): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, after any plain text;
* **Llama 3.1 JSON**: the whole answer is ``{"name": ..., "parameters": {...}}``
  (after ``<|python_tag|>`` when special tokens are shown), several separated
  by ``;``.

Which one a model speaks follows from its chat template (``<tool_call>`` or
``<|python_tag|>``). A template that does not render ``tools`` at all
(SmolLM2's, for one) gets them the way Qwen2.5's template writes them: a
Hermes system prompt listing the functions, tool results as
``<tool_response>`` blocks, earlier calls as ``<tool_call>`` blocks
(:func:`tool_messages`).

``tool_choice``: ``none`` (no tools shown, nothing parsed), ``auto`` (the model
may call; a block whose JSON does not parse, or names no such function, stays
plain text: broken JSON is never returned as a call), ``required`` and a named
function: the call is forced by constrained decoding (:meth:`ToolSetup.grammar`,
an llguidance Lark grammar embedding each function's JSON schema, closed to
keys it does not name as OpenAI's strict mode closes it), so even a small
model's arguments validate against the schema.

Calls come back as ``message.tool_calls`` with ``finish_reason:
"tool_calls"``; streamed, as ``delta.tool_calls`` fragments (the call's id,
type and name, then its arguments), which assemble to the same call.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aegaeon_proxy.chat_template import ChatTemplate
from aegaeon_proxy.errors import invalid
from aegaeon_proxy.json_schemas import closed
from aegaeon_proxy.stop_strings import partial_suffix

ToolFormat = Literal["hermes", "llama3_json"]
JSON = dict[str, Any]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# JSON held to the json module's style: ", " and ": " and no other whitespace (a small
# model cannot wander into endless blank lines inside a call)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PYTHON_TAG = "<|python_tag|>"

__all__ = ["ToolCallParser", "ToolSetup", "tool_format", "tool_messages", "tool_setup",
           "tool_text"]

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tool_format(template: ChatTemplate) -> ToolFormat:
    """The call format a model's chat template teaches it."""
    if PYTHON_TAG in template.source and OPEN not in template.source:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolSetup:
    """A chat request's tools, as checked: what to render, enforce and parse."""

    tools: list[JSON]  # as the request gave them ({"type": "function", "function": ...})
    choice: str  # "auto" | "required" | "named"
    named: str | None  # the function tool_choice names
    format: ToolFormat
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.format, self.names, self.parallel)

    def grammar(self, special: frozenset[str] = frozenset()) -> str | None:
        """The Lark grammar (llguidance's) that forces a call, for ``required`` and a
        named function; None for ``auto``. ``special``: the tokenizer's special tokens
        (a ``<tool_call>`` among them is the token, not its text)."""
        if self.choice == "auto":
            return None
        functions = [t["function"] for t in self.tools
                     if self.named is None or t["function"]["name"] == self.named]  # fmt: skip
        args = "parameters" if self.format == "llama3_json" else "arguments"
        schemas = [{"type": "object", "properties": {
            "name": {"const": f["name"]},
            args: closed(f.get("parameters") or {"type": "object"}),
        }, "required": ["name", args], "additionalProperties": False} for f in functions]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        schema = {**schema, "x-guidance": JSON_STYLE}  # JSON as json.dumps writes it
        call = "%json " + json.dumps(schema, separators=(",", ":"))
        if self.format == "llama3_json":
            return f"start: call\ncall: {call}\n"
        block = (f'call: {_literal(OPEN, special)} "\\n" json_call "\\n" '
                 f"{_literal(CLOSE, special)}\njson_call: {call}\n")
        many = 'start: call ("\\n" call)*\n' if self.parallel and self.named is None else (
            "start: call\n")
        return many + block


def _literal(text: str, special: frozenset[str]) -> str:
    """``text`` in a Lark grammar: the special token by that name, else the string."""
    return text if text in special else json.dumps(text)


def _function_of(choice: Any) -> str | None:
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


def tool_setup(body: Mapping[str, Any], tools: list[JSON] | None,
               template: ChatTemplate) -> ToolSetup | None:
    """The request's tool setup (None: no tools, or ``tool_choice: "none"``); 400s name
    ``tool_choice`` or ``parallel_tool_calls``."""
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    named = None
    if choice is None or choice in ("auto", "none", "required"):
        kind = choice or "auto"
    elif (named := _function_of(choice)) is not None:
        kind = "named"
    else:
        raise invalid("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip
    if not tools:
        if kind in ("required", "named"):
            raise invalid("tool_choice", f"'tool_choice' {kind!r} needs 'tools'")
        return None
    if kind == "none":
        return None
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        raise invalid("tool_choice", f"'tool_choice' names '{named}', which is not in 'tools'")
    return ToolSetup(tools, kind, named, tool_format(template), parallel is not False)


def tool_messages(messages: Sequence[Mapping[str, Any]], tools: list[JSON] | None,
                  template: ChatTemplate) -> list[dict[str, Any]]:
    """``messages`` as a template that renders no tools should see them (see the module
    docstring); the messages as they are for one that does."""
    if template.takes_tools:
        return [dict(m) for m in messages]
    out: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{tool_text(m.get('content'))}\n"
                 "</tool_response>"}  # fmt: skip
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(call) for call in m["tool_calls"]]
            m = {"role": "assistant", "content": "\n".join(
                [*([tool_text(m["content"])] if m.get("content") else []), *blocks])}
        out.append(m)
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = HERMES_SYSTEM.format(tools=listed)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": f"{tool_text(out[0].get('content'))}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def tool_text(content: Any) -> str:
    """A message's content as one string (text parts joined)."""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _call_block(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments
    payload = {"name": function.get("name", ""), "arguments": parsed}
    return f"{OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{CLOSE}"


class ToolCallParser:
    """One choice's text split into content and tool calls, whole or as it streams.

    Streaming holds back text that may begin a call (a prefix of ``<tool_call>``, or
    a Llama answer that begins with ``{``); once a call's text is complete it is
    parsed and sent as fragments, or, when it is not a valid call, sent as text.
    """

    def __init__(self, fmt: ToolFormat, names: frozenset[str], parallel: bool = True) -> None:
        self.format = fmt
        self.names = names
        self.parallel = parallel
        self.called = False
        self.calls: list[JSON] = []  # streaming: the calls sent as fragments so far, whole
        self._held = ""
        self._count = 0
        self._llama_json: bool | None = None  # a Llama answer is JSON (None: not known yet)

    # ---- parsing ----------------------------------------------------------------
    def _call(self, payload: str) -> JSON | None:
        """A call object from a call's JSON text, or None (not a call of these tools)."""
        try:
            data = json.loads(payload)
        except ValueError:
            return None
        args_key = "parameters" if self.format == "llama3_json" else "arguments"
        if not isinstance(data, dict) or data.get("name") not in self.names:
            return None
        arguments = data.get(args_key, data.get("arguments", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                "function": {"name": data["name"],
                             "arguments": json.dumps(arguments, ensure_ascii=False)}}

    def _hermes(self, text: str) -> tuple[str, list[JSON]] | None:
        """Content and calls of a finished Hermes answer; None when a block in it is not
        a valid call (the whole answer is then content). A last block the length limit
        cut short is dropped when complete calls came before it."""
        start = text.find(OPEN)
        if start < 0:
            return None
        calls: list[JSON] = []
        for match in re.finditer(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)",
                                 text[start:], flags=re.S):
            call = self._call(match.group(1).strip())
            if call is None:
                if match.group(2) or not calls:  # a closed block that is no call
                    return None
                break
            calls.append(call)
        return text[:start].rstrip(), calls

    def _llama(self, text: str) -> tuple[str, list[JSON]] | None:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return None
        calls = []
        for part in body.split(";"):
            call = self._call(part.strip())
            if call is None:
                return None
            calls.append(call)
        return "", calls

    def whole(self, text: str) -> tuple[str, list[JSON] | None]:
        """A finished answer as (content, calls or None)."""
        found = self._llama(text) if self.format == "llama3_json" else self._hermes(text)
        if found is None or not found[1]:
            return text, None
        content, calls = found
        if not self.parallel:
            calls = calls[:1]
        self.called = True
        return content, calls

    # ---- streaming --------------------------------------------------------------
    def push(self, text: str, final: bool = False) -> tuple[str, list[JSON]]:
        """More of the answer; returns the content that may be sent now and call
        fragments (``delta.tool_calls`` entries) completed by it."""
        self._held += text
        if self.format == "llama3_json":
            return self._push_llama(final)
        return self._push_hermes(final)

    def _fragments(self, calls: list[JSON]) -> list[JSON]:
        out: list[JSON] = []
        for call in calls:
            if not self.parallel and self._count >= 1:
                break
            function = call["function"]
            out.append({"index": self._count, "id": call["id"], "type": "function",
                        "function": {"name": function["name"], "arguments": ""}})
            out.append({"index": self._count, "function": {"arguments": function["arguments"]}})
            self.calls.append(call)
            self._count += 1
        if out:
            self.called = True
        return out

    def _push_hermes(self, final: bool) -> tuple[str, list[JSON]]:
        held = self._held
        start = held.find(OPEN)
        if start < 0:
            keep = partial_suffix(held, OPEN) if not final else 0
            self._held = held[len(held) - keep:] if keep else ""
            return held[: len(held) - keep], []
        content = held[:start] if not self.called else held[:start].strip()
        rest = held[start:]
        calls: list[JSON] = []
        while rest.startswith(OPEN):
            end = rest.find(CLOSE)
            if end < 0:
                break
            call = self._call(rest[len(OPEN):end].strip())
            if call is None:  # not a call: the block is text after all
                self._held = ""
                return content + rest, self._fragments(calls)
            calls.append(call)
            rest = rest[end + len(CLOSE):].lstrip()
        if final:
            self._held = ""
            if rest and not (self.called or calls):
                return content + rest, self._fragments(calls)
            return content, self._fragments(calls)
        self._held = rest
        return content, self._fragments(calls)

    def _push_llama(self, final: bool) -> tuple[str, list[JSON]]:
        if self._llama_json is None:
            lead = self._held.lstrip()
            if lead.startswith(PYTHON_TAG) or lead.startswith("{"):
                self._llama_json = True
            elif lead and not PYTHON_TAG.startswith(lead):
                self._llama_json = False
        if self._llama_json is False:
            text, self._held = self._held, ""
            return text, []
        if not final:
            return "", []
        text, self._held = self._held, ""
        found = self._llama(text)
        if found is None:
            return text, []
        return "", self._fragments(found[1])
