"""The steady load of the reliability benchmarks, and how each of its requests ended.

Each request is a streamed ``/v1/completions`` with its own ``timeout``. It ends
one of four ways (:data:`OUTCOMES`):

* ``completed``: a finish_reason, then ``[DONE]``;
* ``error``: the server answered with an error in OpenAI's shape (an HTTP
  error, or an ``{"error"}`` event in the stream): a clean, typed ending;
* ``connection``: the connection dropped with no answer (the proxy itself
  died): the client knows at once, nothing hangs;
* ``hung``: nothing ended it within ``hang_s`` (its timeout plus a margin):
  the client gave up. A correct server never leaves one.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from aegaeon_bench.node.http_client import sse_events

OUTCOMES = ("completed", "error", "connection", "hung")
BACKOFF_S = 0.25  # a client's pause after a 429/503 or a dropped connection
HANG_MARGIN_S = 15.0  # past a request's own timeout before the client calls it hung
WORDS = ("alpha", "river", "stone", "market", "cloud", "engine", "garden", "signal", "harbor",
         "lantern", "copper", "meadow", "orbit", "thread", "vessel", "winter")

__all__ = ["OUTCOMES", "Attempt", "LoadDriver", "request_body", "send"]


@dataclass
class Attempt:
    """One request and how it ended."""

    seq: int
    model: str
    start_s: float
    end_s: float | None = None
    outcome: str | None = None  # one of OUTCOMES, once ended
    status: int | None = None
    code: str | None = None  # the error's code (error outcome)
    retry_after: str | None = None  # the error answer's Retry-After header
    num_events: int = 0  # SSE events with text
    first_s: float | None = None  # when the first of them came (a stream decoding since)

    @property
    def open(self) -> bool:
        return self.outcome is None


def request_body(model: str, rng: random.Random, max_tokens: int, timeout_s: float,
                 stream: bool = True) -> dict[str, Any]:  # fmt: skip
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": stream, "timeout": timeout_s}  # fmt: skip
    return body


def _error_code(payload: Any) -> str | None:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        code = payload["error"].get("code")
        return str(code) if code is not None else "error"
    return None


async def _consume(resp: aiohttp.ClientResponse, attempt: Attempt) -> None:
    """Read a 200 stream to its end; sets the outcome."""
    finished = False
    async for _, event in sse_events(resp):
        if event is None:
            attempt.outcome = "completed" if finished else "error"
            attempt.code = attempt.code or (None if finished else "no_finish")
            return
        code = _error_code(event)
        if code is not None:
            attempt.code = code
            continue  # [DONE] follows the error event
        for choice in event.get("choices") or []:
            if choice.get("text") and attempt.first_s is None:
                attempt.first_s = time.time()
            attempt.num_events += bool(choice.get("text"))
            finished = finished or choice.get("finish_reason") is not None
    attempt.outcome = "connection"  # the stream stopped with no [DONE]
    attempt.code = attempt.code or "stream_cut"


async def send(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], attempt: Attempt,
    hang_s: float, headers: dict[str, str] | None = None,
) -> Attempt:  # fmt: skip
    """POST ``body`` to ``url`` and classify how it ended (never raises for the
    server's doing)."""
    try:
        async with asyncio.timeout(hang_s):
            async with session.post(url, json=body, headers=headers) as resp:
                attempt.status = resp.status
                attempt.retry_after = resp.headers.get("Retry-After")
                if resp.status != 200:
                    text = await resp.read()
                    try:
                        attempt.code = _error_code(json.loads(text)) or f"http_{resp.status}"
                    except ValueError:
                        attempt.code = f"http_{resp.status}_not_json"
                    attempt.outcome = "error"
                elif body.get("stream"):
                    await _consume(resp, attempt)
                else:
                    payload = await resp.json()
                    attempt.outcome = "completed" if "choices" in payload else "error"
    except TimeoutError:
        attempt.outcome, attempt.code = "hung", "client_gave_up"
    except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
        attempt.outcome, attempt.code = "connection", type(exc).__name__
    attempt.end_s = time.time()
    return attempt


@dataclass
class LoadDriver:
    """``concurrency`` clients, each sending one request after another (closed loop),
    to ``base_url`` and ``more_urls`` in turn (proxy replicas); ``stream``: streamed
    completions (False: plain ones, each status an answer; None: every other one)."""

    base_url: str
    models: Sequence[str]
    concurrency: int
    seed: int = 0
    max_tokens: tuple[int, int] = (8, 48)
    timeout_s: float = 30.0
    headers: dict[str, str] | None = None
    more_urls: Sequence[str] = ()
    stream: bool | None = True
    attempts: list[Attempt] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._running = asyncio.Event()
        self._running.set()
        self._stopped = False
        self._seq = 0

    def pause(self) -> None:
        """Send no new request (those open go on)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stopped = True
        self._running.set()

    def in_flight(self) -> list[Attempt]:
        return [a for a in self.attempts if a.open]

    async def drained(self, timeout_s: float) -> bool:
        """Wait until no request is open (True) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return not self.in_flight()

    async def run(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._client(session) for _ in range(self.concurrency)))

    async def _client(self, session: aiohttp.ClientSession) -> None:
        urls = [f"{u}/v1/completions" for u in (self.base_url, *self.more_urls)]
        while True:
            await self._running.wait()
            if self._stopped:
                return
            model = self._rng.choice(list(self.models))
            self._seq += 1
            stream = self.stream if self.stream is not None else bool(self._seq % 2)
            body = request_body(model, self._rng, self._rng.randint(*self.max_tokens),
                                self.timeout_s, stream)  # fmt: skip
            attempt = Attempt(self._seq, model, time.time())
            self.attempts.append(attempt)
            url = urls[self._seq % len(urls)]
            await send(session, url, body, attempt, self.timeout_s + HANG_MARGIN_S, self.headers)
            if attempt.outcome == "connection" or attempt.status in (429, 503):
                await asyncio.sleep(BACKOFF_S)  # restarting or full: don't spin
