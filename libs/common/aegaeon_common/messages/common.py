"""Messages any channel may carry."""

from __future__ import annotations

from aegaeon_common.wire import Message


class ErrorReply(Message, frozen=True):
    """A typed refusal: ``code`` is machine-readable, ``message`` is for people."""

    TAG = "error"
    code: str
    message: str
    detail: dict[str, int | float | str] | None = None
