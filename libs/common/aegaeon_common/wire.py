"""Typed, tagged, versioned msgpack messages. Never pickle.

A message is a frozen dataclass deriving from :class:`Message` with an explicit
string ``TAG``. On the wire it is a msgpack map ``{"v": WIRE_VERSION, "t": TAG,
<field>: <value>, ...}``. A :class:`Channel` decodes with the exact union of the
types a socket may carry: an unknown tag, another version, a missing field or
a value of the wrong type raises :class:`WireError`, which services answer with
a typed error reply instead of crashing.

Field types supported: ``bool``, ``int``, ``float``, ``str``, ``bytes``,
``None`` unions, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]`` and nested
:class:`Struct` dataclasses (encoded as maps without a tag). New fields are
added only with defaults, so an older peer's message still decodes.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, TypeVar, Union

import msgpack

WIRE_VERSION = 1

M = TypeVar("M", bound="Message")
S = TypeVar("S", bound="Struct")


class WireError(ValueError):
    """A frame that is not a valid message of the channel."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class Struct:
    """Base of plain data carried inside messages (frozen dataclasses)."""

    __slots__ = ()


class Message(Struct):
    """Base of every message. Subclasses are frozen dataclasses with a ``TAG``."""

    __slots__ = ()
    TAG: ClassVar[str]


Decoder = Callable[[Any, str], Any]
_DECODERS: dict[type[Struct], tuple[tuple[str, Decoder, bool], ...]] = {}


def _fail(path: str, want: str, got: object) -> WireError:
    return WireError("bad_field", f"{path}: expected {want}, got {type(got).__name__}")


def _scalar(kind: type) -> Decoder:
    def decode(value: Any, path: str) -> Any:
        # bool is an int in Python; refuse it where an int or float is wanted.
        if isinstance(value, bool) and kind is not bool:
            raise _fail(path, kind.__name__, value)
        if kind is float and isinstance(value, int):
            return float(value)
        if not isinstance(value, kind):
            raise _fail(path, kind.__name__, value)
        return value

    return decode


def _decoder_for(hint: Any) -> Decoder:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return lambda value, path: value
    if hint is type(None):

        def decode_none(value: Any, path: str) -> None:
            if value is not None:
                raise _fail(path, "null", value)

        return decode_none
    if origin in (Union, types.UnionType):
        options = [_decoder_for(a) for a in args]
        names = " | ".join(getattr(a, "__name__", str(a)) for a in args)

        def decode_union(value: Any, path: str) -> Any:
            for option in options:
                try:
                    return option(value, path)
                except WireError:
                    continue
            raise _fail(path, names, value)

        return decode_union
    if origin is list or origin is tuple:
        item = _decoder_for(args[0])
        as_tuple = origin is tuple

        def decode_seq(value: Any, path: str) -> Any:
            if not isinstance(value, list | tuple):
                raise _fail(path, "array", value)
            items = [item(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return tuple(items) if as_tuple else items

        return decode_seq
    if origin is dict:
        val = _decoder_for(args[1])

        def decode_map(value: Any, path: str) -> Any:
            if not isinstance(value, dict):
                raise _fail(path, "map", value)
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise _fail(f"{path} key", "str", k)
                out[k] = val(v, f"{path}.{k}")
            return out

        return decode_map
    if isinstance(hint, type) and issubclass(hint, Struct):
        return lambda value, path: _decode_struct(hint, value, path)
    if hint in (bool, int, float, str, bytes):
        return _scalar(hint)
    raise TypeError(f"unsupported wire field type {hint!r}")


def _fields(cls: type[Struct]) -> tuple[tuple[str, Decoder, bool], ...]:
    cached = _DECODERS.get(cls)
    if cached is None:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass")
        hints = typing.get_type_hints(cls)
        cached = tuple(
            (
                f.name,
                _decoder_for(hints[f.name]),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
        )
        _DECODERS[cls] = cached
    return cached


def _decode_struct(cls: type[S], value: Any, path: str) -> S:
    if not isinstance(value, dict):
        raise _fail(path, cls.__name__, value)
    kwargs: dict[str, Any] = {}
    for name, decode, required in _fields(cls):
        if name in value:
            kwargs[name] = decode(value[name], f"{path}.{name}")
        elif required:
            raise WireError("missing_field", f"{path}.{name} is required")
    return cls(**kwargs)


def _plain(value: Any) -> Any:
    if isinstance(value, Struct):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}  # type: ignore[arg-type]
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_plain(struct: Struct) -> dict[str, Any]:
    """A struct as plain msgpack/JSON-able data (no tag, no version)."""
    out = _plain(struct)
    assert isinstance(out, dict)
    return out


def from_plain(cls: type[S], data: Any, path: str | None = None) -> S:
    """Decode plain data into ``cls``, validating every field."""
    return _decode_struct(cls, data, path or cls.__name__)


def encode(msg: Message) -> bytes:
    """One message as one msgpack frame."""
    body = _plain(msg)
    body["v"] = WIRE_VERSION
    body["t"] = msg.TAG
    out = msgpack.packb(body, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


class Channel:
    """The exact set of message types one socket direction carries."""

    def __init__(self, name: str, message_types: Iterable[type[Message]]) -> None:
        self.name = name
        self._types: dict[str, type[Message]] = {}
        for cls in message_types:
            if cls.TAG in self._types:
                raise TypeError(f"{name}: duplicate tag {cls.TAG!r}")
            _fields(cls)  # validate the field types once, at import
            self._types[cls.TAG] = cls

    @property
    def tags(self) -> frozenset[str]:
        return frozenset(self._types)

    def decode(self, frame: bytes) -> Message:
        """Decode one frame; raises :class:`WireError` on anything but a valid message."""
        try:
            body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
            raise WireError("malformed", f"{self.name}: not a msgpack frame ({exc})") from None
        if not isinstance(body, dict):
            raise WireError("malformed", f"{self.name}: frame is not a map")
        version = body.pop("v", None)
        if version != WIRE_VERSION:
            raise WireError("bad_version", f"{self.name}: version {version!r}, want {WIRE_VERSION}")
        tag = body.pop("t", None)
        cls = self._types.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise WireError("unknown_tag", f"{self.name}: unknown message tag {tag!r}")
        return _decode_struct(cls, body, tag)

    def decode_as(self, frame: bytes, cls: type[M]) -> M:
        msg = self.decode(frame)
        if not isinstance(msg, cls):
            raise WireError("unexpected", f"{self.name}: wanted {cls.TAG}, got {msg.TAG}")
        return msg
