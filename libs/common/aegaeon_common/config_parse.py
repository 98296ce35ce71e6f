"""Config sections on msgspec: typed fields, sizes with units, errors naming the file and field."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, TypeVar

import msgspec

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


def _dec_hook(kind: type, value: Any) -> Any:
    """msgspec's hook for the types it leaves to us: paths."""
    if kind is Path:
        if not isinstance(value, str):
            raise ValueError(f"expected a path, got {value!r}")
        return Path(value)
    raise NotImplementedError(kind)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(type(obj))


def plain(value: Any) -> Any:
    """A config struct as JSON data (paths as strings, sizes as ints, tuples as lists)."""
    return msgspec.json.decode(msgspec.json.encode(value, enc_hook=_enc_hook))


_AT = re.compile(r"^(?P<problem>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def build_section(cls: type[T], raw: Any, source: str, section: str) -> T:
    """Decode the frozen msgspec struct ``cls`` from a YAML map (``msgspec.convert``).

    A field ``x_bytes`` may be written ``x`` with a unit (``device_memory: 512MiB``)
    and a field ``x_s`` may be written ``x`` (seconds); a tuple field takes a
    single value as a one-item tuple. Errors name the file and the field as written.
    """
    if not isinstance(raw, dict):
        raise ConfigError(source, section, "must be a map")
    fields = {f.name: f for f in msgspec.structs.fields(cls)}  # type: ignore[arg-type]
    aliases = {}
    for name in fields:
        for suffix in ("_bytes", "_s"):
            if name.endswith(suffix):
                aliases[name[: -len(suffix)]] = name
    data: dict[str, Any] = {}
    written: dict[str, str] = {}
    for key, value in raw.items():
        name = aliases.get(str(key), str(key))
        if name not in fields:
            known = ", ".join(sorted(set(fields) | set(aliases)))
            raise ConfigError(source, f"{section}.{key}", f"unknown field (known: {known})")
        is_tuple = typing.get_origin(fields[name].type) is tuple
        if name.endswith("_bytes"):  # names carry units: a size, maybe written 512MiB
            try:
                data[name] = parse_bytes(value)
            except ValueError as exc:
                raise ConfigError(source, f"{section}.{key}", str(exc)) from None
        elif is_tuple and not isinstance(value, list | tuple):
            data[name] = [value]
        else:
            data[name] = value
        written[name] = str(key)
    try:
        return msgspec.convert(data, cls, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        assert match is not None
        problem, path = match.group("problem"), (match.group("path") or "").lstrip(".")
        missing = re.search(r"missing required field `(\w+)`", problem)
        head, _, rest = path.partition(".")
        if missing:
            field, problem = missing.group(1), "is required"
        else:
            field = written.get(head, head) + (f".{rest}" if rest else "")
            kind = fields[head].type if head in fields and not rest else None
            if typing.get_origin(kind) is typing.Literal:  # name the choices
                problem += f" (one of {', '.join(map(str, typing.get_args(kind)))})"
        raise ConfigError(source, f"{section}.{field}" if field else section, problem) from None
