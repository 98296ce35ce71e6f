"""One generation: submitted to the backend when made, its token stream turned into
safe text, its end recorded (metrics, the access log's counts, Ollama's keep_alive).

Owns the parts between token ids and text deltas: the stop token (not shown),
incremental detokenizing, stop strings (a match ends that sequence; once every
sequence of the request has ended, the backend request is cancelled so its
resources are freed), the request deadline, usage counts, TTFT/TBT. A request
of ``n`` sequences has one :class:`_Choice` per sequence; each :class:`Delta`
names its choice and carries the log-probabilities of the tokens it consumed
(when the request asked for them). Whatever way the consumer stops (finish,
error, client disconnect, i.e. task cancellation), ``close()`` cancels the
backend request if it is still open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, cast

from aegaeon_common.messages.structs import RequestTimings, TokenLogprobs

from aegaeon_proxy.assets import ModelAssets
from aegaeon_proxy.backend import (
    FAULT_CODES,
    FAULT_RETRY_AFTER_S,
    BackendError,
    GenerationRequest,
    TokenChunk,
    TokenStream,
)
from aegaeon_proxy.detokenizer import IncrementalDetokenizer
from aegaeon_proxy.errors import APIError, backend_api_error
from aegaeon_proxy.model_table import unavailable_error
from aegaeon_proxy.request_ids import AccessRecord
from aegaeon_proxy.state import ProxyState
from aegaeon_proxy.stop_strings import StopStringMatcher

ClientFinish = Literal["stop", "length"]

__all__ = ["ClientFinish", "Delta", "Generation"]


@dataclass(frozen=True)
class Delta:
    """What one choice adds: text safe to send, the tokens consumed for it (their
    log-probabilities when asked), and the choice's finish reason when it ended."""

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] = ()
    finish_reason: ClientFinish | None = None


class _Choice:
    """One sequence's way from token ids to text."""

    def __init__(self, assets: ModelAssets, stop: Sequence[str], stop_ids: frozenset[int],
                 skip_special_tokens: bool, min_tokens: int) -> None:  # fmt: skip
        self.detok = IncrementalDetokenizer(assets.tokenizer, skip_special_tokens)
        self.stop = StopStringMatcher(stop)
        self.stop_ids = stop_ids
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.finish: ClientFinish | None = None

    def push(self, chunk: TokenChunk) -> list[Delta]:
        """A chunk of this choice's tokens (an instance's group), a delta per token: each
        reaches the client as its own event. A stop token ends the text: it is not
        shown, yet it stays among the tokens and log-probabilities (as vLLM reports
        them: lm-evaluation-harness counts on the generated token's entry); a stop
        string ends it too, the tokens after it are dropped."""
        out: list[Delta] = []
        for k, token_id in enumerate(chunk.token_ids):
            if self.finish is not None:
                break
            self.num_tokens += 1
            text = "" if token_id in self.stop_ids else self.detok.push((token_id,))
            if self.num_tokens > self.min_tokens:  # vLLM: no stop string before min_tokens
                text = self.stop.push(text)
            if self.stop.stopped:
                self.finish = "stop"
            out.append(Delta(chunk.index, text, (token_id,), chunk.logprobs[k:k + 1],
                             self.finish))  # fmt: skip
            if token_id in self.stop_ids:
                break
        return out

    def end(self, reason: ClientFinish) -> str:
        """The sequence ended (``reason``): the text held back, if it is not a stop."""
        text = self.stop.push(self.detok.finish())
        self.finish = "stop" if self.stop.stopped else reason
        return text + self.stop.flush()


class Generation:
    """Iterate :meth:`deltas` for text; then read ``finish_reason`` and the usage counts."""

    def __init__(
        self,
        state: ProxyState,
        assets: ModelAssets,
        req: GenerationRequest,
        *,
        stop: Sequence[str],
        timeout_s: float,
        slo: tuple[float, float] = (10.0, 0.1),
        skip_special_tokens: bool = True,
        access: AccessRecord,
        keep_alive_s: float | None = None,
    ) -> None:
        """Submit ``req`` to the proxy's backend. ``slo``: the model's (TTFT, TBT)
        targets in seconds; token k meets its deadline when it arrives by arrival + TTFT
        + k x TBT. The live model table counts the model's requests in flight
        (``max_concurrency``; a removed model waits for them). At the end, the request's
        ``access`` log record gets the counts, and Ollama's ``keep_alive_s`` starts."""
        self.req = req
        backend = self._backend = state.backend
        metrics = self._metrics = state.metrics
        models = self._models = state.models
        self._access = access
        self._keep_alive, self._keep_alive_s = state.keep_alive, keep_alive_s
        stop_ids = frozenset(req.sampling.stop_token_ids)
        self._choices = [_Choice(assets, stop, stop_ids, skip_special_tokens,
                                 req.sampling.min_tokens) for _ in range(req.sampling.n)]
        # with the first token, when the request asked (sampling.prompt_logprobs)
        self.prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
        # the arrival on the monotonic clock: latencies count from when the front accepted it
        self._start = time.monotonic() - max(0.0, time.time() - req.arrival_s)
        self._recorded = False
        self._timeout_s = timeout_s
        self._deadline = self._start + timeout_s
        self._last_token_at: float | None = None
        self._ttft_s, self._tbt_s = slo
        self.completion_tokens = 0
        self.ttft_s: float | None = None  # once the first token came
        self.finish_reason: ClientFinish | None = None
        # How it ended, for aegaeon_requests_total (metrics.OUTCOMES); None: the
        # consumer stopped reading first (a client disconnect).
        self.outcome: str | None = None
        self._timings: RequestTimings | None = None  # the instances' (finishing chunk)
        # Submitted now: 429/503 APIError if the backend refuses (or the model's
        # max_concurrency does), 404 if the model was removed meanwhile.
        try:
            models.enter(req.model)
        except APIError as exc:
            if exc.status in (429, 503):  # max_concurrency, or an unreadable checkpoint
                metrics.requests.labels(req.model, "rejected").inc()
            raise
        try:
            self._stream: TokenStream = backend.submit(req)
        except BackendError as exc:
            models.leave(req.model)
            metrics.requests.labels(req.model, "rejected").inc()
            raise backend_api_error(exc) from None
        except BaseException:
            models.leave(req.model)
            raise
        self._open = True  # its stream has not ended
        metrics.num_open += 1
        metrics.in_flight.labels(req.model).inc()
        metrics.prompt_tokens.labels(req.model).inc(self.prompt_tokens)
        self._vllm = metrics.vllm.request(req.model, self.prompt_tokens, req.sampling.max_tokens,
                                          self._start)  # its vllm:* observations

    @property
    def prompt_tokens(self) -> int:
        return len(self.req.prompt_token_ids)

    async def admitted(self) -> None:
        """Wait while the backend holds the request for room (past the admission bounds);
        a 429 :class:`APIError` if its wait ended without room, a 504 at its deadline."""
        try:
            async with asyncio.timeout_at(self._loop_deadline()):
                await self._stream.admitted()
        except TimeoutError:
            raise await self._deadline_passed() from None
        except BackendError as exc:
            self._open = False
            self.outcome = "rejected"
            raise backend_api_error(exc) from None

    async def deltas(
        self, before_wait: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncGenerator[Delta, None]:
        """Each choice's text as it becomes safe to send, a delta per token (its text may
        be empty while the detokenizer or a stop string holds it back), and its finish;
        raises APIError on failure.

        A chunk holds the tokens an instance sent together. ``before_wait`` is awaited
        whenever the next chunk is not there yet, so a consumer holds the deltas of
        what came together (and of whatever else a busy proxy finds queued) and sends
        them in one socket write before a wait.
        """
        choices = self._choices
        try:
            while self.finish_reason is None:
                if before_wait is not None and not self._stream.ready():
                    await before_wait()
                chunk = await self._next(self._stream)
                if chunk.token_ids:
                    self._observe_tokens(len(chunk.token_ids))
                if chunk.prompt_logprobs is not None:
                    self.prompt_logprobs = chunk.prompt_logprobs
                choice = choices[chunk.index] if 0 <= chunk.index < len(choices) else None
                if choice is not None and choice.finish is None:
                    out = choice.push(chunk)
                    ended = chunk.seq_finish or chunk.finish_reason
                    if choice.finish is None and ended is not None:
                        last = out.pop() if out else Delta(chunk.index, "")
                        text = last.text + choice.end(self._client_finish(chunk, ended))
                        out.append(replace(last, text=text, finish_reason=choice.finish))
                    for delta in out:  # a token whose text is held back still counts
                        if delta.text or delta.token_ids or delta.logprobs or delta.finish_reason:
                            yield delta
                if chunk.finish_reason is not None:
                    self._open = False
                    self._timings = chunk.timings
                    reason = self._client_finish(chunk, chunk.finish_reason)
                    for index, left in enumerate(choices):  # the stream ended them all
                        if left.finish is None:
                            yield Delta(index, left.end(reason), finish_reason=left.finish)
                if all(c.finish is not None for c in choices):
                    # every choice ended (a stop string may end them before the backend)
                    self.finish_reason = self.outcome = choices[0].finish
                    await self.close()
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel the backend request if it is still open (idempotent)."""
        if self._open:
            self._open = False
            await self._backend.cancel(self.req.request_id)
        self._record_end()

    async def _next(self, stream: TokenStream) -> TokenChunk:
        if stream.ready():  # no wait, so no deadline to arm
            return await anext(stream)
        try:
            async with asyncio.timeout_at(self._loop_deadline()):
                return await anext(stream)
        except TimeoutError:
            raise await self._deadline_passed() from None

    async def _deadline_passed(self) -> APIError:
        self.outcome = "timeout"
        await self.close()
        return APIError(
            504, f"the request's deadline passed ({self._timeout_s:g} s after it arrived; "
            "the request's `timeout` or the server's proxy.request_timeout)",
            code="deadline_exceeded",
        )

    def _loop_deadline(self) -> float:
        loop = asyncio.get_running_loop()
        return loop.time() + max(0.0, self._deadline - time.monotonic())

    def _client_finish(self, chunk: TokenChunk, reason: str) -> ClientFinish:
        """A sequence's or the stream's end as the client reads it; an APIError for a
        failure or a cancel by the server."""
        if reason in ("stop", "length"):
            return cast(ClientFinish, reason)
        if reason == "cancelled":
            self.outcome = "cancelled"
            raise APIError(503, "the request was cancelled by the server", code="cancelled")
        self.outcome = "error"
        message = f"generation failed: {chunk.error or 'unknown error'}"
        if chunk.code in FAULT_CODES:  # a fault, not this request's doing: retryable
            raise APIError(503, message, code=chunk.code, retry_after_s=FAULT_RETRY_AFTER_S)
        if chunk.code == "no_slot":  # static-mux placed its model on no instance
            raise APIError(503, f"model {self.req.model!r} is not served now: "
                           f"{chunk.error or 'no instance slot'}", code="model_not_placed")
        if chunk.code == "model_unavailable":  # its checkpoint cannot be read (quarantined)
            raise unavailable_error(self.req.model, chunk.error or "unknown error")
        raise APIError(500, message, code="backend_error")

    def _observe_tokens(self, n: int) -> None:
        now = time.monotonic()
        model = self.req.model
        m = self._metrics
        if self._last_token_at is None:
            self.ttft_s = now - self._start
            m.ttft.labels(model).observe(self.ttft_s)
        else:
            per_token = (now - self._last_token_at) / n
            tbt = m.tbt.labels(model)
            for _ in range(n):
                tbt.observe(per_token)
        # token k is due at arrival + TTFT + k x TBT (paper §2.1)
        first = self.completion_tokens
        late = now - self._start - self._ttft_s
        met = sum(1 for k in range(first, first + n) if late <= k * self._tbt_s)
        m.observe_slo(model, met, n - met)
        self._last_token_at = now
        self.completion_tokens += n
        m.generation_tokens.labels(model).inc(n)
        self._vllm.tokens(n, now)

    def _record_end(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        model = self.req.model
        m = self._metrics
        outcome = self.outcome or "client_closed"
        if outcome not in ("stop", "length", "client_closed"):
            # a failed request's tokens that never came missed their deadlines
            m.observe_slo(model, 0, max(0, self.req.sampling.max_tokens - self.completion_tokens))
        m.num_open -= 1
        m.in_flight.labels(model).dec()
        self._models.leave(model)
        m.requests.labels(model, outcome).inc()
        now = time.monotonic()
        m.e2e.labels(model).observe(now - self._start)
        self._vllm.end(outcome, now, self._timings)
        self._access.output_tokens, self._access.ttft_s = self.completion_tokens, self.ttft_s
        self._access.outcome = outcome
        if self._keep_alive_s is not None:  # Ollama's keep_alive counts from the end
            self._keep_alive.after(model, self._keep_alive_s)
