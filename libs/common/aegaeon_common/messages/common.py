"""Messages any channel may carry."""

from __future__ import annotations

from dataclasses import dataclass

from aegaeon_common.wire import Message


@dataclass(frozen=True)
class ErrorReply(Message):
    """A typed refusal: ``code`` is machine-readable, ``message`` is for people."""

    TAG = "error"
    code: str
    message: str
    detail: dict[str, int | float | str] | None = None
