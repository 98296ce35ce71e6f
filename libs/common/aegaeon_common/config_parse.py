"""Validation helpers for config sections: typed fields, sizes with units, clear errors."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 1 << 10,
    "m": 10**6, "mb": 10**6, "mib": 1 << 20,
    "g": 10**9, "gb": 10**9, "gib": 1 << 30,
    "t": 10**12, "tb": 10**12, "tib": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A config file (or section) that does not validate; names the file and the field."""

    def __init__(self, source: str, field: str, problem: str) -> None:
        super().__init__(f"{source}: {field}: {problem}")
        self.source = source
        self.field = field
        self.problem = problem


def parse_bytes(value: object) -> int:
    """``512``, ``"64MiB"``, ``"1.5GB"`` -> bytes. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("a size, not a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size must not be negative")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ValueError(f"{value!r} is not a size (like 512MiB)")


def _coerce(hint: Any, value: Any, name: str) -> Any:
    """Check/convert one YAML value to the field's type; ValueError on mismatch."""
    if name.endswith("_bytes"):
        return parse_bytes(value)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union or (origin is not None and type(None) in args):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, name)
    if origin is tuple:
        items = value if isinstance(value, list | tuple) else [value]
        return tuple(_coerce(args[0], v, name) for v in items)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return value
    if hint is Path:
        if not isinstance(value, str):
            raise ValueError(f"expected a path, got {value!r}")
        return Path(value)
    raise ValueError(f"unsupported type {hint!r}")


def build_section(cls: type[T], raw: Any, source: str, section: str) -> T:
    """Build the frozen dataclass ``cls`` from a YAML map.

    A field ``x_bytes`` may be written ``x`` with a unit (``device_memory: 512MiB``)
    and a field ``x_s`` may be written ``x`` (seconds).
    """
    if not isinstance(raw, dict):
        raise ConfigError(source, section, "must be a map")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    aliases = {}
    for name in fields:
        for suffix in ("_bytes", "_s"):
            if name.endswith(suffix):
                aliases[name[: -len(suffix)]] = name
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        name = aliases.get(str(key), str(key))
        if name not in fields:
            known = ", ".join(sorted(set(fields) | set(aliases)))
            raise ConfigError(source, f"{section}.{key}", f"unknown field (known: {known})")
        try:
            kwargs[name] = _coerce(hints[name], value, name)
        except ValueError as exc:
            raise ConfigError(source, f"{section}.{key}", str(exc)) from None
    for name, f in fields.items():
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if missing and name not in kwargs:
            raise ConfigError(source, f"{section}.{name}", "is required")
    return cls(**kwargs)
