"""JSON schemas as OpenAI's strict mode reads them."""

from __future__ import annotations

from typing import Any

__all__ = ["closed"]

# keywords whose value is a schema, or a list or map of schemas
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else",
        "propertyNames", "unevaluatedItems")
_MANY = ("anyOf", "allOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and says nothing about others (OpenAI's strict mode): a model held to
    it writes only the keys the schema names. A copy; the input is left as it was."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(s) for k, s in out[key].items()}
    return out
