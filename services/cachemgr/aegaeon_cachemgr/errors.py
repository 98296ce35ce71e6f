"""The cachemgr's one error type: a code from the message schema and the numbers behind it."""

from __future__ import annotations

from aegaeon_common.messages.common import ErrorReply


class CacheError(Exception):
    """A refused request. ``code`` is one of ``messages.cache.ERROR_CODES``."""

    def __init__(self, code: str, message: str, detail: dict[str, int | float | str] | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.detail = detail

    def reply(self) -> ErrorReply:
        return ErrorReply(self.code, self.message, self.detail)
