"""Structured outputs: what a request asks its text to follow, as one llguidance grammar.

The constraint comes from one of (a second is a 400 naming it):

* OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``
  (``{"type": "text"}`` asks for nothing; ``strict: true`` closes every object
  to the keys it names, as OpenAI's strict mode does);
* vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ...}``, and the top-level fields of earlier releases:
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (Lark
  or GBNF);
* a tool choice that forces a call (:meth:`~aegaeon_proxy.tool_calls.ToolSetup.grammar`).

It becomes llguidance's grammar text (JSON as the json module writes it: ``", "``
and ``": "`` between items, no other whitespace, so a small model cannot wander
into endless blank lines), checked here: a schema, regex or grammar llguidance
refuses is a 400 naming the field it came in. The instances compile it against
the model's tokenizer (:mod:`aegaeon_runtime.grammar`, cached per model and
grammar) and mask every sampled token with it. Converting and checking run on
a worker thread (never on the event loop) and are cached per constraint.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import llguidance

from aegaeon_proxy.errors import APIError, invalid
from aegaeon_proxy.json_schemas import closed
from aegaeon_proxy.tool_calls import JSON_STYLE, ToolSetup

if TYPE_CHECKING:  # a typing-only name of llguidance's stubs
    from llguidance._lib import JsonCompileOptions

__all__ = ["STRUCTURED_FIELDS", "Constraint", "constraint_of", "grammar_for"]

# the request fields that may carry a constraint (request_fields: honoured)
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")
MAX_CACHED = 256
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Constraint:
    """One constraint as asked: its kind (``json``, ``regex``, ``choice``, ``grammar``,
    ``lark``), its text, and the field it came in (named by a 400)."""

    kind: str
    text: str
    param: str


def _schema(param: str, value: Any, strict: bool = False) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise invalid(param, f"'{param}' is not valid JSON: {exc}") from None
    if not isinstance(value, dict | bool):
        raise invalid(param, f"'{param}' must be a JSON schema (an object)")
    if strict:
        value = closed(value)
    return Constraint("json", json.dumps(value, sort_keys=True), param)


def _string(param: str, value: Any, kind: str) -> Constraint:
    if not isinstance(value, str) or not value:
        raise invalid(param, f"'{param}' must be a non-empty string")
    return Constraint(kind, value, param)


def _choice(param: str, value: Any) -> Constraint:
    if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in value)):
        raise invalid(param, f"'{param}' must be a list of 1 to {MAX_CHOICES} non-empty "
                      "strings")  # fmt: skip
    lark = "start: " + " | ".join(json.dumps(c) for c in value)
    return Constraint("lark", lark, param)


def _response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(param, "'response_format' must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json", '{"type": "object"}', param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        where = f"{param}.json_schema"
        if not isinstance(spec, dict):
            raise invalid(where, f"'{where}' must be an object with a 'schema'")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise invalid(f"{where}.strict", f"'{where}.strict' must be a boolean")
        schema = spec.get("schema", {"type": "object"})  # OpenAI: schema is optional
        return _schema(f"{where}.schema", schema, strict=spec.get("strict") is True)
    raise invalid(f"{param}.type", "'response_format.type' must be 'text', 'json_object' "
                  f"or 'json_schema', got {kind[:40]!r}")  # fmt: skip


def _structured_outputs(value: Any) -> Constraint | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid(param, "'structured_outputs' must be an object")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    known = {"json", "regex", "choice", "grammar", "json_object"}
    for key in given:
        if key not in known:
            raise invalid(f"{param}.{key}", f"'{param}.{key}' is not supported (one of "
                          f"{', '.join(sorted(known))})")  # fmt: skip
    if len(given) > 1:
        raise invalid(param, f"'{param}' may hold one constraint, got {', '.join(given)}")
    if not given:
        return None
    key, inner = next(iter(given.items()))
    where = f"{param}.{key}"
    if key == "json":
        return _schema(where, inner)
    if key == "json_object":
        return Constraint("json", '{"type": "object"}', where)
    if key == "regex":
        return _string(where, inner, "regex")
    if key == "choice":
        return _choice(where, inner)
    return _string(where, inner, "grammar")


_READERS: dict[str, Any] = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": lambda v: _schema("guided_json", v),
    "guided_regex": lambda v: _string("guided_regex", v, "regex"),
    "guided_choice": lambda v: _choice("guided_choice", v),
    "guided_grammar": lambda v: _string("guided_grammar", v, "grammar"),
}


def constraint_of(body: Mapping[str, Any], tools: ToolSetup | None = None,
                  special: frozenset[str] = frozenset()) -> Constraint | None:
    """The request's one constraint (None: its text is free); ``special``: the model's
    special tokens (a forced tool call's tags may be among them)."""
    found: Constraint | None = None
    for name in STRUCTURED_FIELDS:
        if body.get(name) is None:
            continue
        constraint = _READERS[name](body[name])
        if constraint is None:
            continue
        if found is not None:
            raise invalid(name, f"'{name}' and '{found.param}' both constrain the output; "
                          "send one")  # fmt: skip
        found = constraint
    forced = tools.grammar(special) if tools is not None else None
    if forced is not None:
        if found is not None:
            raise invalid(found.param, f"'{found.param}' cannot be combined with a "
                          "'tool_choice' that forces a call")  # fmt: skip
        found = Constraint("lark", forced, "tools")
    return found


def _compile(constraint: Constraint) -> str:
    """llguidance's grammar text; ValueError with llguidance's reason when it refuses."""
    matcher = llguidance.LLMatcher
    if constraint.kind == "json":
        style = cast("JsonCompileOptions", JSON_STYLE)
        grammar = matcher.grammar_from_json_schema(constraint.text, defaults=style)
    elif constraint.kind == "regex":
        grammar = matcher.grammar_from_regex(constraint.text)
    elif constraint.kind == "lark":
        grammar = matcher.grammar_from_lark(constraint.text)
    else:  # Lark or GBNF (vLLM's guided_grammar took either)
        grammar = llguidance.grammar_from("grammar", constraint.text)
    error = matcher.validate_grammar(grammar)
    if error:
        raise ValueError(error)
    return str(grammar)


_CACHE: OrderedDict[tuple[str, str], str | ValueError] = OrderedDict()


async def grammar_for(constraint: Constraint | None) -> str:
    """The grammar the instances enforce ('' without a constraint); a 400 naming the
    field of a schema, regex or grammar llguidance refuses."""
    if constraint is None:
        return ""
    key = (constraint.kind, constraint.text)
    found = _CACHE.get(key)
    if found is None:
        try:
            found = await asyncio.to_thread(_compile, constraint)
        except ValueError as exc:
            found = exc
        _CACHE[key] = found
        while len(_CACHE) > MAX_CACHED:
            _CACHE.popitem(last=False)
    _CACHE.move_to_end(key)
    if isinstance(found, ValueError):
        reason = str(found).strip().splitlines()[0][:300] if str(found).strip() else "invalid"
        raise APIError(400, f"'{constraint.param}' cannot be enforced: {reason}",
                       param=constraint.param, code="invalid_grammar")
    return found
