"""Typed, tagged, versioned msgpack messages on msgspec. Never pickle.

A message is a frozen :class:`msgspec.Struct` deriving from :class:`Message`
with an explicit string ``TAG`` (also its msgspec tag). On the wire it is a
msgpack map ``{"t": TAG, <field>: <value>, ..., "v": WIRE_VERSION}``; nested
:class:`Struct` values are maps without a tag. A :class:`Channel` decodes with
one msgspec decoder over the exact union of the types a socket may carry: a
frame that is not msgpack, another version, an unknown tag, a missing field or
a value of the wrong type raises :class:`WireError` with a code
(``malformed``, ``bad_version``, ``unknown_tag``, ``missing_field``,
``bad_field``), which services answer with a typed error reply instead of
crashing. Unknown fields are ignored and new fields are added only with
defaults, so an older peer's message still decodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Union

import msgspec

WIRE_VERSION = 1


class WireError(ValueError):
    """A frame that is not a valid message of the channel."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class _TaggedMeta(msgspec.StructMeta):
    """A class body's ``TAG`` becomes its msgspec tag: one string names a message."""

    def __new__(mcls, name: str, bases: tuple[type, ...], ns: dict[str, Any],
                **kwargs: Any) -> Any:  # fmt: skip
        tag = ns.get("TAG")
        if isinstance(tag, str) and "tag" not in kwargs:
            kwargs["tag"] = tag
        return super().__new__(mcls, name, bases, ns, **kwargs)


class Struct(msgspec.Struct, frozen=True, metaclass=_TaggedMeta):
    """Base of plain data carried inside messages."""


class Message(Struct, frozen=True, tag_field="t", kw_only=True):
    """Base of every message; a subclass sets ``TAG``. ``v`` is the wire version."""

    TAG: ClassVar[str]
    v: int = WIRE_VERSION


_ENCODER = msgspec.msgpack.Encoder()


class _Version(msgspec.Struct):
    """A frame's version alone (checked first: a missing one is no version of ours)."""

    v: Any = None


_VERSION = msgspec.msgpack.Decoder(_Version)


def encode(msg: Message) -> bytes:
    """One message as one msgpack frame."""
    return _ENCODER.encode(msg)


def to_plain(struct: Struct) -> dict[str, Any]:
    """A struct as plain msgpack/JSON-able data (no tag, no version)."""
    out = msgspec.to_builtins(struct, builtin_types=(bytes,))
    assert isinstance(out, dict)
    if isinstance(struct, Message):
        out.pop("t", None)
        out.pop("v", None)
    return out


class Channel:
    """The exact set of message types one socket direction carries."""

    def __init__(self, name: str, message_types: Iterable[type[Message]]) -> None:
        self.name = name
        self._types: dict[str, type[Message]] = {}
        for cls in message_types:
            if cls.TAG in self._types:
                raise TypeError(f"{name}: duplicate tag {cls.TAG!r}")
            self._types[cls.TAG] = cls
        union: Any = Union[tuple(self._types.values())]  # noqa: UP007 (a runtime union)
        self._decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(union)

    @property
    def tags(self) -> frozenset[str]:
        return frozenset(self._types)

    def decode(self, frame: bytes) -> Message:
        """Decode one frame; raises :class:`WireError` on anything but a valid message."""
        try:
            version = _VERSION.decode(frame).v
        except msgspec.ValidationError:
            raise WireError("malformed", f"{self.name}: frame is not a map") from None
        except msgspec.DecodeError as exc:
            raise WireError("malformed", f"{self.name}: not a msgpack frame ({exc})") from None
        if version != WIRE_VERSION:
            raise WireError("bad_version", f"{self.name}: version {version!r}, want {WIRE_VERSION}")
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as exc:
            raise self._invalid(frame, exc) from None

    def _invalid(self, frame: bytes, exc: msgspec.ValidationError) -> WireError:
        """Name what is wrong with a msgpack map of our version the channel refused."""
        body = msgspec.msgpack.decode(frame)
        tag = body.get("t")
        if not isinstance(tag, str) or tag not in self._types:
            return WireError("unknown_tag", f"{self.name}: unknown message tag {tag!r}")
        code = "missing_field" if "missing required field" in str(exc) else "bad_field"
        return WireError(code, f"{self.name}: {tag}: {exc}")
