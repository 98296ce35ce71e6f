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
from functools import cached_property
from typing import Any

from aegaeon_proxy.assets import ModelAssets
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.generation import Delta, Generation
from aegaeon_proxy.logprobs import LogprobFormat
from aegaeon_proxy.params import CommonParams
from aegaeon_proxy.prompts import Prompt
from aegaeon_proxy.responses import JSON, ChoiceResult, Head, Shapes, Usage
from aegaeon_proxy.tool_calls import ToolCallParser

__all__ = ["Answer", "AnswerSpec"]


@dataclass(frozen=True)
class AnswerSpec:
    """What the answer needs of the request besides its deltas."""

    params: CommonParams
    assets: ModelAssets
    shapes: Shapes
    chat: bool
    prompt: Prompt  # its ids, what `echo` repeats, chat's tools


@dataclass
class _ChoiceLog:
    """One choice's accumulated answer."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
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
        self.want_logprobs = p.sampling.logprobs >= 0
        # completions: the prompt first; chat (vLLM's): the last, assistant's, message
        self.echo = p.echo and spec.prompt.text is not None
        self.choices = [_ChoiceLog(parser=spec.prompt.tools.parser() if spec.prompt.tools else None)
                        for _ in range(p.sampling.n)]  # fmt: skip
        self.format = LogprobFormat(spec.assets, p.tokens_as_ids, chat=spec.chat,
                                    n=p.sampling.n)  # fmt: skip

    def _extras(self) -> tuple[list[JSON], JSON]:
        """vLLM's additions to each choice and to the response: ``token_ids`` and
        ``prompt_token_ids``, and ``prompt_logprobs`` when asked (not echo's): on each
        choice of a completion, on a chat response."""
        p = self.spec.params
        response: JSON = {"prompt_token_ids": self.spec.prompt.ids} if p.return_token_ids else {}
        shared: JSON = {}
        if p.sampling.prompt_logprobs >= 0:
            (response if self.spec.chat else shared)["prompt_logprobs"] = self._prompt_logprobs
        choices = [{"token_ids": c.token_ids, **shared} if p.return_token_ids else shared
                   for c in self.choices]  # fmt: skip
        return choices, response

    @cached_property
    def _prompt_logprobs(self) -> list[JSON | None] | None:
        """vLLM's ``prompt_logprobs``, made once for every choice (the prompt is scored
        by the time a choice ends)."""
        scored = self.gen.prompt_logprobs
        return None if scored is None else self.format.prompt(self.spec.prompt.ids, scored)

    @cached_property
    def _echoed_logprobs(self) -> JSON | None:
        """The echoed prompt's log-probabilities, made once for every choice."""
        return self.format.echo(self.spec.prompt.ids, self.gen.prompt_logprobs)

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
        choice_extras, response_extra = self._extras()
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
                echoed = self._echoed_logprobs if self.echo else None
                logprobs = self.format.whole(choice.token_ids, choice.logprobs, echoed)
            if self.echo:
                text = f"{self.spec.prompt.text}{text}"
            results.append(ChoiceResult(index, text, finish, logprobs, tool_calls,
                                        choice_extras[index]))  # fmt: skip
        usage = Usage(self.gen.prompt_tokens, self.gen.completion_tokens)
        return self.spec.shapes.response(self.head, results, usage, response_extra)

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
                    yield shapes.delta(head, index, self.spec.prompt.text or "", None,
                                       usage_field)  # fmt: skip
            # the echoed prompt's log-probabilities come with the first token
            echoed = not (self.echo and self.want_logprobs)
            # Each token is its own chunk; those a busy proxy finds ready leave in one
            # write (flushed whenever the next token is not there yet).
            async with contextlib.aclosing(self.gen.deltas(before_wait)) as deltas:
                async for delta in deltas:
                    out = self._delta_chunks(delta, usage_field)
                    if not echoed:
                        echoed = True
                        out[:0] = [shapes.delta(head, index, "", self._echoed_logprobs,
                                                usage_field)
                                   for index in range(len(self.choices))]  # fmt: skip
                    for chunk in out:
                        yield chunk
            if usage_field:
                yield shapes.usage(head, Usage(self.gen.prompt_tokens,
                                               self.gen.completion_tokens))  # fmt: skip
        except APIError as exc:
            yield exc.body()  # the error event (then [DONE])

    def _delta_chunks(self, delta: Delta, usage_field: bool) -> list[JSON]:
        shapes, head = self.spec.shapes, self.head
        choice = self.choices[delta.index]
        choice.token_ids += delta.token_ids
        finish: str | None = delta.finish_reason
        extra = self._extras()[0][delta.index] if finish is not None else {}
        logprobs = (self.format.delta(delta.index, delta.token_ids, delta.logprobs)
                    if self.want_logprobs else None)  # fmt: skip
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
            chunk = shapes.finish(head, delta.index, finish, usage_field)
            chunk["choices"][0].update(extra)
            out.append(chunk)
        return out
