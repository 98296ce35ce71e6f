"""OpenAI response and chunk objects, one shape-builder per endpoint.

``Shapes`` is the table that makes the two endpoints one code path: the
handler asks the endpoint's shapes for the final object, the opening chunks,
a content chunk, the finish chunk and the usage chunk. A response holds one
choice per sequence (``n``); a chunk names its choice by ``index``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]

__all__ = ["CHAT", "COMPLETION", "JSON", "ChoiceResult", "Head", "Shapes", "Usage"]


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


@dataclass
class ChoiceResult:
    """One choice of a whole (not streamed) answer."""

    index: int
    text: str
    finish_reason: str
    logprobs: JSON | None = None  # in the endpoint's shape
    tool_calls: list[JSON] | None = None  # chat: parsed from the text
    extra: JSON = field(default_factory=dict)  # vLLM's additions (token_ids, ...)


def _usage_null(usage_field: bool) -> JSON:
    # with include_usage, every chunk carries "usage": null and the last one the counts
    return {"usage": None} if usage_field else {}


class CompletionShapes:
    id_prefix = "cmpl"
    kind = "text_completion"

    def _choice(self, index: int, text: str, finish: str | None,
                logprobs: JSON | None = None) -> JSON:  # fmt: skip
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def response(self, head: Head, choices: list[ChoiceResult], usage: Usage,
                 extra: JSON) -> JSON:  # fmt: skip
        return head.obj(self.kind, [
            {**self._choice(c.index, c.text, c.finish_reason, c.logprobs), **c.extra}
            for c in choices], usage=usage.as_json(), **extra)  # fmt: skip

    def opening(self, head: Head, n: int, usage_field: bool) -> list[JSON]:
        return []

    def delta(self, head: Head, index: int, text: str, logprobs: JSON | None,
              usage_field: bool, tool_calls: list[JSON] | None = None) -> JSON:
        return head.obj(self.kind, [self._choice(index, text, None, logprobs)],
                        **_usage_null(usage_field))  # fmt: skip

    def finish(self, head: Head, index: int, finish: str, usage_field: bool) -> JSON:
        return head.obj(self.kind, [self._choice(index, "", finish)], **_usage_null(usage_field))

    def usage(self, head: Head, usage: Usage) -> JSON:
        return head.obj(self.kind, [], usage=usage.as_json())


class ChatShapes:
    id_prefix = "chatcmpl"
    kind = "chat.completion"
    chunk_kind = "chat.completion.chunk"

    def _chunk(self, head: Head, index: int, delta: JSON, finish: str | None,
               usage_field: bool, logprobs: JSON | None = None) -> JSON:  # fmt: skip
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return head.obj(self.chunk_kind, [choice], **_usage_null(usage_field))

    def response(self, head: Head, choices: list[ChoiceResult], usage: Usage,
                 extra: JSON) -> JSON:  # fmt: skip
        out = []
        for c in choices:
            message: JSON = {"role": "assistant", "content": c.text}
            if c.tool_calls:
                message = {"role": "assistant", "content": c.text or None,
                           "tool_calls": c.tool_calls}  # fmt: skip
            out.append({"index": c.index, "message": message, "logprobs": c.logprobs,
                        "finish_reason": c.finish_reason, **c.extra})  # fmt: skip
        return head.obj(self.kind, out, usage=usage.as_json(), **extra)

    def opening(self, head: Head, n: int, usage_field: bool) -> list[JSON]:
        return [self._chunk(head, i, {"role": "assistant", "content": ""}, None, usage_field)
                for i in range(n)]  # fmt: skip

    def delta(self, head: Head, index: int, text: str, logprobs: JSON | None,
              usage_field: bool, tool_calls: list[JSON] | None = None) -> JSON:
        delta: JSON = {"tool_calls": tool_calls} if tool_calls else {"content": text}
        return self._chunk(head, index, delta, None, usage_field, logprobs)

    def finish(self, head: Head, index: int, finish: str, usage_field: bool) -> JSON:
        return self._chunk(head, index, {}, finish, usage_field)

    def usage(self, head: Head, usage: Usage) -> JSON:
        return head.obj(self.chunk_kind, [], usage=usage.as_json())


# the endpoints' shapes: each makes the same objects (response, opening, delta, finish, usage)
Shapes = CompletionShapes | ChatShapes
COMPLETION: Shapes = CompletionShapes()
CHAT: Shapes = ChatShapes()
