"""One generation: submit to the backend, turn its token stream into safe text.

Owns the parts between token ids and text deltas: the stop token (not shown),
incremental detokenizing, stop strings (a match cancels the backend request
so its resources are freed), the request deadline, usage counts, TTFT/TBT.
Whatever way the consumer stops (finish, error, client disconnect, i.e. task
cancellation), ``close()`` cancels the backend request if it is still open.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Literal

from aegaeon_common.messages.structs import RequestTimings

from aegaeon_proxy.assets import ModelAssets
from aegaeon_proxy.backend import (
    FAULT_CODES,
    FAULT_RETRY_AFTER_S,
    Backend,
    BackendError,
    GenerationRequest,
    TokenChunk,
    TokenStream,
)
from aegaeon_proxy.detokenizer import IncrementalDetokenizer
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.metrics import ProxyMetrics
from aegaeon_proxy.model_table import ModelSettingsTable, unavailable_error
from aegaeon_proxy.stop_strings import StopStringMatcher
from aegaeon_proxy.vllm_metrics import VllmRequest

ClientFinish = Literal["stop", "length"]

__all__ = ["ClientFinish", "Generation"]


class Generation:
    """Iterate :meth:`deltas` for text; then read ``finish_reason`` and the usage counts."""

    def __init__(
        self,
        backend: Backend,
        assets: ModelAssets,
        req: GenerationRequest,
        *,
        stop: Sequence[str],
        metrics: ProxyMetrics,
        timeout_s: float,
        slo: tuple[float, float] = (10.0, 0.1),
        models: ModelSettingsTable | None = None,
    ) -> None:
        """``slo``: the model's (TTFT, TBT) targets in seconds; token k meets its
        deadline when it arrives by arrival + TTFT + k x TBT. ``models``: the live
        model table, which counts the model's requests in flight (``max_concurrency``;
        a removed model waits for them)."""
        self._models = models
        self.req = req
        self._backend = backend
        self._metrics = metrics
        self._detok = IncrementalDetokenizer(assets.tokenizer)
        self._stop = StopStringMatcher(stop)
        self._stop_ids = frozenset(req.sampling.stop_token_ids)
        # the arrival on the monotonic clock: latencies count from when the front accepted it
        self._start = time.monotonic() - max(0.0, time.time() - req.arrival_s)
        self._recorded = False
        self._timeout_s = timeout_s
        self._deadline = self._start + timeout_s
        self._last_token_at: float | None = None
        self._stream: TokenStream | None = None
        self._open = False  # submitted, and its stream has not ended
        self._ttft_s, self._tbt_s = slo
        self.completion_tokens = 0
        self.finish_reason: ClientFinish | None = None
        # How it ended, for aegaeon_requests_total (metrics.OUTCOMES); None: the
        # consumer stopped reading first (a client disconnect).
        self.outcome: str | None = None
        self._vllm: VllmRequest | None = None  # its vllm:* observations, once submitted
        self._timings: RequestTimings | None = None  # the instances' (finishing chunk)

    @property
    def prompt_tokens(self) -> int:
        return len(self.req.prompt_token_ids)

    def submit(self) -> None:
        """Hand the request to the backend; 429/503 :class:`APIError` if it refuses
        (or the model's ``max_concurrency`` does), 404 if the model was removed."""
        if self._models is not None:
            try:
                self._models.enter(self.req.model)
            except APIError as exc:
                if exc.status in (429, 503):  # max_concurrency, or an unreadable checkpoint
                    self._metrics.requests.labels(self.req.model, "rejected").inc()
                raise
        try:
            self._stream = self._backend.submit(self.req)
        except BackendError as exc:
            self._left()
            self._metrics.requests.labels(self.req.model, "rejected").inc()
            raise APIError(exc.status, exc.message, code=exc.code,
                           retry_after_s=exc.retry_after_s) from None
        except BaseException:
            self._left()
            raise
        self._open = True
        model = self.req.model
        self._metrics.num_open += 1
        self._metrics.in_flight.labels(model).inc()
        self._metrics.prompt_tokens.labels(model).inc(self.prompt_tokens)
        self._vllm = self._metrics.vllm.request(
            model, self.prompt_tokens, self.req.sampling.max_tokens, self._start
        )

    async def admitted(self) -> None:
        """Wait while the backend holds the request for room (past the admission bounds);
        a 429 :class:`APIError` if its wait ended without room, a 504 at its deadline."""
        assert self._stream is not None, "submit() first"
        try:
            async with asyncio.timeout_at(self._loop_deadline()):
                await self._stream.admitted()
        except TimeoutError:
            raise await self._deadline_passed() from None
        except BackendError as exc:
            self._open = False
            self.outcome = "rejected"
            raise APIError(exc.status, exc.message, code=exc.code,
                           retry_after_s=exc.retry_after_s) from None

    async def deltas(
        self, before_wait: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncGenerator[str, None]:
        """Text as it becomes safe to send ('' never yielded); raises APIError on failure.

        ``before_wait`` is awaited whenever the next chunk is not there yet, so
        a consumer may hold what it got while more is ready (one socket write
        for the tokens a busy proxy finds queued) and send it before a wait.
        """
        assert self._stream is not None, "submit() first"
        try:
            while self.finish_reason is None:
                if before_wait is not None and not self._stream.ready():
                    await before_wait()
                chunk = await self._next(self._stream)
                text = self._on_chunk(chunk)
                if self._stop.stopped:
                    self.finish_reason = self.outcome = "stop"
                    await self.close()
                elif chunk.finish_reason is not None:
                    self._open = False
                    self._timings = chunk.timings
                    self.finish_reason = self._client_finish(chunk)
                    text += self._stop.push(self._detok.finish()).text
                    if self._stop.stopped:
                        self.finish_reason = "stop"
                    self.outcome = self.finish_reason
                    text += self._stop.flush()
                if text:
                    yield text
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

    def _on_chunk(self, chunk: TokenChunk) -> str:
        ids = list(chunk.token_ids)
        if not ids:
            return ""
        self._observe_tokens(len(ids))
        # the token that matched stop_token_ids ends generation and is not shown
        for i, token_id in enumerate(ids):
            if token_id in self._stop_ids:
                ids = ids[:i]
                break
        return self._stop.push(self._detok.push(ids)).text if ids else ""

    def _client_finish(self, chunk: TokenChunk) -> ClientFinish:
        reason = chunk.finish_reason
        if reason in ("stop", "length"):
            return reason
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
            m.ttft.labels(model).observe(now - self._start)
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
        if self._vllm is not None:
            self._vllm.tokens(n, now)

    def _left(self) -> None:
        if self._models is not None:
            self._models.leave(self.req.model)

    def _record_end(self) -> None:
        if self._stream is None or self._recorded:
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
        self._left()
        m.requests.labels(model, outcome).inc()
        now = time.monotonic()
        m.e2e.labels(model).observe(now - self._start)
        if self._vllm is not None:
            self._vllm.end(outcome, now, self._timings)
