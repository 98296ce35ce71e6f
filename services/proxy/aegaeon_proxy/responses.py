"""OpenAI response and chunk objects, one shape-builder per endpoint.

``Shapes`` is the table that makes the two endpoints one code path: the
handler asks the endpoint's shapes for the final object, a content chunk, the
finish chunk and the usage chunk.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Protocol

JSON = dict[str, Any]

__all__ = ["CHAT", "COMPLETION", "JSON", "Shapes", "Usage", "new_id"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def as_json(self) -> JSON:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass(frozen=True)
class Head:
    """The fields every object of one response shares."""

    id: str
    created: int
    model: str

    def obj(self, kind: str, choices: list[JSON], **extra: Any) -> JSON:
        return {
            "id": self.id, "object": kind, "created": self.created, "model": self.model,
            "choices": choices, **extra,
        }  # fmt: skip


class Shapes(Protocol):
    id_prefix: str

    def response(self, head: Head, text: str, finish: str, usage: Usage) -> JSON: ...
    def first(self, head: Head, usage_field: bool) -> JSON | None: ...
    def delta(self, head: Head, text: str, usage_field: bool) -> JSON: ...
    def finish(self, head: Head, finish: str, usage_field: bool) -> JSON: ...
    def usage(self, head: Head, usage: Usage) -> JSON: ...


def _usage_null(usage_field: bool) -> JSON:
    # with include_usage, every chunk carries "usage": null and the last one the counts
    return {"usage": None} if usage_field else {}


class CompletionShapes:
    id_prefix = "cmpl"
    kind = "text_completion"

    def _choice(self, text: str, finish: str | None) -> JSON:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def response(self, head: Head, text: str, finish: str, usage: Usage) -> JSON:
        return head.obj(self.kind, [self._choice(text, finish)], usage=usage.as_json())

    def first(self, head: Head, usage_field: bool) -> JSON | None:
        return None

    def delta(self, head: Head, text: str, usage_field: bool) -> JSON:
        return head.obj(self.kind, [self._choice(text, None)], **_usage_null(usage_field))

    def finish(self, head: Head, finish: str, usage_field: bool) -> JSON:
        return head.obj(self.kind, [self._choice("", finish)], **_usage_null(usage_field))

    def usage(self, head: Head, usage: Usage) -> JSON:
        return head.obj(self.kind, [], usage=usage.as_json())


class ChatShapes:
    id_prefix = "chatcmpl"
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"

    def _chunk(self, head: Head, delta: JSON, finish: str | None, usage_field: bool) -> JSON:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return head.obj(self.chunk_kind, [choice], **_usage_null(usage_field))

    def response(self, head: Head, text: str, finish: str, usage: Usage) -> JSON:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return head.obj(self.kind, [choice], usage=usage.as_json())

    def first(self, head: Head, usage_field: bool) -> JSON | None:
        return self._chunk(head, {"role": "assistant", "content": ""}, None, usage_field)

    def delta(self, head: Head, text: str, usage_field: bool) -> JSON:
        return self._chunk(head, {"content": text}, None, usage_field)

    def finish(self, head: Head, finish: str, usage_field: bool) -> JSON:
        return self._chunk(head, {}, finish, usage_field)

    def usage(self, head: Head, usage: Usage) -> JSON:
        return head.obj(self.chunk_kind, [], usage=usage.as_json())


COMPLETION: Shapes = CompletionShapes()
CHAT: Shapes = ChatShapes()
