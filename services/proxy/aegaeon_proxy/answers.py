"""A generation's deltas as the endpoint's answer: the whole response object, or the
stream's chunks.

One :class:`Answer` per request keeps what its choices said (text, tokens,
log-probabilities, finish) and renders each object complete in the endpoint's shapes
(:mod:`aegaeon_proxy.responses`): OpenAI's objects, log-probabilities
(:mod:`aegaeon_proxy.logprobs`), completions' ``echo`` (the prompt before the
completion, its tokens' log-probabilities first), vLLM's ``prompt_logprobs``,
``return_token_ids`` and ``return_tokens_as_token_ids``, and chat's tool calls
(:mod:`aegaeon_proxy.tool_calls`: parsed from each choice's text; streamed as
``delta.tool_calls`` fragments).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aegaeon_proxy.assets import ModelAssets
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.generation import Delta, Generation
from aegaeon_proxy.logprobs import LogprobFormat
from aegaeon_proxy.params import CommonParams
from aegaeon_proxy.responses import JSON, ChoiceResult, Head, Shapes, Usage
from aegaeon_proxy.tool_calls import ToolCallParser, ToolSetup

__all__ = ["Answer", "AnswerSpec"]


@dataclass(frozen=True)
class AnswerSpec:
    """What the answer needs of the request besides its deltas."""

    params: CommonParams
    assets: ModelAssets
    shapes: Shapes
    chat: bool
    prompt_ids: list[int]
    prompt_text: str | None = None  # completions: the prompt as sent (echo)
    tools: ToolSetup | None = None  # chat: the tools the model may call


@dataclass
class _ChoiceLog:
    """One choice's accumulated answer."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    offset: int = 0  # completions' text_offset of the next token
    finish: str | None = None
    parser: ToolCallParser | None = None


class Answer:
    """See the module docstring."""

    def __init__(self, spec: AnswerSpec, gen: Generation) -> None:
        self.spec = spec
        self.gen = gen
        # what every object of the answer shares; its id is the request's, prefixed
        self.head = Head(id=f"{spec.shapes.id_prefix}-{gen.req.request_id}",
                         created=int(gen.req.arrival_s), model=gen.req.model)  # fmt: skip
        p = spec.params
        self.format = LogprobFormat(spec.assets, p.tokens_as_ids)
        self.want_logprobs = p.sampling.logprobs >= 0
        # completions: the prompt first; chat (vLLM's): the last, assistant's, message
        self.echo = p.echo and (not spec.chat or spec.prompt_text is not None)
        self.choices = [_ChoiceLog(parser=spec.tools.parser() if spec.tools else None)
                        for _ in range(p.sampling.n)]  # fmt: skip

    # ---- the pieces ----------------------------------------------------------------
    def _echo_text(self) -> str:
        if self.spec.prompt_text is not None:
            return self.spec.prompt_text
        return self.spec.assets.decode(self.spec.prompt_ids)

    def _echo_logprobs(self) -> JSON | None:
        """The prompt's tokens in completions' shape (the first without a log-probability)."""
        if not self.want_logprobs or self.spec.chat:
            return None
        scored = list(self.gen.prompt_logprobs or ())
        lps = [None, *scored][: len(self.spec.prompt_ids)]
        lps += [None] * (len(self.spec.prompt_ids) - len(lps))
        return self.format.completion(self.spec.prompt_ids, lps)

    def _logprobs(self, choice: _ChoiceLog, delta: Delta) -> JSON | None:
        """``delta``'s tokens' log-probabilities in the endpoint's shape."""
        if not self.want_logprobs or not delta.logprobs:
            return None
        ids = list(delta.token_ids[: len(delta.logprobs)])
        if self.spec.chat:
            return {"content": self.format.chat(ids, delta.logprobs)}
        obj = self.format.completion(ids, delta.logprobs, choice.offset)
        choice.offset = obj["text_offset"][-1] + len(obj["tokens"][-1]) if ids else choice.offset
        return obj

    def _extra(self, choice: _ChoiceLog) -> JSON:
        p = self.spec.params
        out: JSON = {}
        if p.return_token_ids:
            out["token_ids"] = choice.token_ids
        if p.sampling.prompt_logprobs >= 0 and not self.spec.chat:  # asked (not echo's)
            out["prompt_logprobs"] = self._prompt_logprobs()
        return out

    def _prompt_logprobs(self) -> list[JSON | None] | None:
        scored = self.gen.prompt_logprobs
        return None if scored is None else self.format.prompt(self.spec.prompt_ids, scored)

    def _response_extra(self) -> JSON:
        p = self.spec.params
        out: JSON = {}
        if p.return_token_ids:
            out["prompt_token_ids"] = self.spec.prompt_ids
        if p.sampling.prompt_logprobs >= 0 and self.spec.chat:
            out["prompt_logprobs"] = self._prompt_logprobs()
        return out

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.gen.prompt_tokens,
                     completion_tokens=self.gen.completion_tokens)  # fmt: skip

    # ---- whole -----------------------------------------------------------------------
    async def whole(self) -> JSON:
        """The response object, once every choice has ended."""
        async with contextlib.aclosing(self.gen.deltas()) as deltas:
            async for delta in deltas:
                choice = self.choices[delta.index]
                choice.parts.append(delta.text)
                choice.token_ids += delta.token_ids
                choice.logprobs += delta.logprobs
                if delta.finish_reason is not None:
                    choice.finish = delta.finish_reason
        results = []
        for index, choice in enumerate(self.choices):
            text = "".join(choice.parts)
            finish = choice.finish or "stop"
            tool_calls = None
            if choice.parser is not None:
                text, tool_calls = choice.parser.whole(text)
                if tool_calls:
                    finish = "tool_calls"
            logprobs = None
            if self.want_logprobs:
                ids = choice.token_ids[: len(choice.logprobs)]
                logprobs = ({"content": self.format.chat(ids, choice.logprobs)} if self.spec.chat
                            else self.format.completion(ids, choice.logprobs))  # fmt: skip
            if self.echo:
                text = self._echo_text() + text
                echoed = self._echo_logprobs()
                if echoed is not None and logprobs is not None:
                    logprobs = _joined(echoed, logprobs)
            results.append(ChoiceResult(index, text, finish, logprobs, tool_calls,
                                        self._extra(choice)))  # fmt: skip
        return self.spec.shapes.response(self.head, results, self.usage(), self._response_extra())

    # ---- streamed ---------------------------------------------------------------------
    async def chunks(
        self, before_wait: Callable[[], Awaitable[None]]
    ) -> AsyncGenerator[JSON, None]:
        """The stream's chunks in order: the opening ones, the echoed prompt, those of
        each delta, the usage; a failure's error object last. ``before_wait`` is awaited
        whenever the next delta is not there yet (:meth:`Generation.deltas`)."""
        shapes, head = self.spec.shapes, self.head
        usage_field = self.spec.params.include_usage
        try:
            for chunk in shapes.opening(head, len(self.choices), usage_field):
                yield chunk
            if self.echo:
                for index in range(len(self.choices)):
                    yield shapes.delta(head, index, self._echo_text(), None, usage_field)
            echoed = False
            # Each token is its own chunk; those a busy proxy finds ready leave in one
            # write (flushed whenever the next token is not there yet).
            async with contextlib.aclosing(self.gen.deltas(before_wait)) as deltas:
                async for delta in deltas:
                    if self.echo and self.want_logprobs and not echoed:
                        echoed = True  # the prompt's log-probabilities came with the first
                        for index in range(len(self.choices)):
                            yield shapes.delta(head, index, "", self._echo_logprobs(),
                                               usage_field)  # fmt: skip
                    for chunk in self._delta_chunks(delta, usage_field):
                        yield chunk
            if usage_field:
                yield shapes.usage(head, self.usage())
        except APIError as exc:
            yield exc.body()  # the error event (then [DONE])

    def _delta_chunks(self, delta: Delta, usage_field: bool) -> list[JSON]:
        shapes, head = self.spec.shapes, self.head
        choice = self.choices[delta.index]
        choice.token_ids += delta.token_ids
        logprobs = self._logprobs(choice, delta)
        finish: str | None = delta.finish_reason
        out: list[JSON] = []
        if choice.parser is not None:
            text, calls = choice.parser.push(delta.text, final=finish is not None)
            if text or logprobs is not None:
                out.append(shapes.delta(head, delta.index, text, logprobs, usage_field))
            out += [shapes.delta(head, delta.index, "", None, usage_field, [call])
                    for call in calls]  # fmt: skip
            if finish is not None and choice.parser.called:
                finish = "tool_calls"
        elif delta.text or logprobs is not None:
            out.append(shapes.delta(head, delta.index, delta.text, logprobs, usage_field))
        if finish is not None:
            extra = self._extra(choice)
            chunk = shapes.finish(head, delta.index, finish, usage_field)
            if extra:
                chunk["choices"][0].update(extra)
            out.append(chunk)
        return out


def _joined(first: JSON, second: JSON) -> JSON:
    """Two completions ``logprobs`` objects as one (the second's offsets after the first's
    text)."""
    end = (first["text_offset"][-1] + len(first["tokens"][-1])) if first["tokens"] else 0
    return {
        "tokens": first["tokens"] + second["tokens"],
        "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
        "text_offset": first["text_offset"] + [end + o for o in second["text_offset"]],
    }
