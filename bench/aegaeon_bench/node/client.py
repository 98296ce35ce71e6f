"""The HTTP side of `bench serve`: one streaming completion, the model list, the stats.

A request is ``POST /v1/completions`` with the prompt as token ids,
``max_tokens`` and ``ignore_eos`` (forced length), ``stream`` with usage.
:func:`stream_completion` fills a :class:`Progress` as SSE events arrive, so
whoever cancels it at the run's deadline still has what came (the tokens
that arrived count; the rest are missed).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aegaeon_workload.plan import PlannedRequest

from aegaeon_bench.node.http_client import fetch_sync, sse_events

ERROR_TEXT_CHARS = 300
NEEDS_KEY = "the node wants an API key: --api-key KEY or $AEGAEON_API_KEY"


class ServiceError(RuntimeError):
    """The service answered something a benchmark cannot use (``status``: the HTTP
    status it answered with, when that was the trouble)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers that carry ``api_key`` (none without one): every bench client's
    session and request is made with them."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def status_error(what: str, status: int) -> ServiceError:
    """``what`` answered ``status``; a 401 says how to give the key."""
    hint = f" ({NEEDS_KEY})" if status == 401 else ""
    return ServiceError(f"{what}: HTTP {status}{hint}", status)


@dataclass
class Progress:
    """What has happened to one request so far (mutated while it streams)."""

    planned: PlannedRequest
    arrival_s: float
    sent_s: float | None = None
    event_times_s: list[float] = field(default_factory=list)
    num_tokens: int | None = None  # the final usage's completion_tokens
    server_id: str | None = None  # the services' request id (X-Request-Id, else the "id")
    finish_s: float | None = None  # when the event with the finish_reason came
    done: bool = False  # the stream ended with [DONE] after a finish_reason
    error: str | None = None
    status: int | None = None  # the HTTP status
    error_code: str | None = None  # the error's code (OpenAI's shape), when it ended in one

    @property
    def ok(self) -> bool:
        return self.done and self.error is None


def completion_body(planned: PlannedRequest, timeout_s: float | None = None) -> dict[str, Any]:
    """The request; ``timeout_s``: its own deadline (the server ends it past that)."""
    extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
    if planned.priority is not None:
        extra["priority"] = planned.priority
    return {
        **extra,
        "model": planned.model,
        "prompt": planned.prompt_ids(),
        "max_tokens": planned.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _on_event(progress: Progress, event: dict[str, Any], now_s: float) -> bool:
    """Record one SSE event; True once it finished the request (a finish_reason)."""
    if "error" in event:
        error = event["error"]
        progress.error = (
            f"stream error: {error.get('message') if isinstance(error, dict) else error}"
        )
        progress.error_code = str(error.get("code")) if isinstance(error, dict) else "error"
        return False
    if progress.server_id is None and isinstance(event.get("id"), str):
        progress.server_id = event["id"]
    usage = event.get("usage")
    if isinstance(usage, dict) and "completion_tokens" in usage:
        progress.num_tokens = int(usage["completion_tokens"])
    finished = False
    for choice in event.get("choices") or []:
        if choice.get("text"):
            progress.event_times_s.append(now_s)
        if choice.get("finish_reason") is not None:
            finished = True
            progress.finish_s = now_s
    return finished


async def stream_completion(
    session: aiohttp.ClientSession, base_url: str, progress: Progress,
    timeout_s: float | None = None,
) -> None:  # fmt: skip
    """Send the request and read its stream to the end; errors land in ``progress.error``."""
    body = completion_body(progress.planned, timeout_s)
    progress.sent_s = time.time()
    finished = False
    try:
        async with session.post(f"{base_url}/v1/completions", json=body) as resp:
            progress.status = resp.status
            progress.server_id = resp.headers.get("X-Request-Id")  # the stats' request_id
            if resp.status != 200:
                text = await resp.text()
                hint = f" ({NEEDS_KEY})" if resp.status == 401 else ""
                progress.error = f"HTTP {resp.status}{hint}: {text[:ERROR_TEXT_CHARS]}"
                progress.error_code = _code_of(text) or f"http_{resp.status}"
                return
            async for now_s, event in sse_events(resp):
                if event is None:
                    progress.done = finished
                    break
                finished = _on_event(progress, event, now_s) or finished
    except (aiohttp.ClientError, ValueError) as exc:  # ValueError: a bad JSON event
        progress.error = f"{type(exc).__name__}: {exc}"
        return
    if not progress.done and progress.error is None:
        progress.error = "the stream ended without a finish"


def _code_of(text: str) -> str | None:
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None
    return str(error.get("code")) if isinstance(error, dict) else None


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        if resp.status != 200:
            raise status_error(f"GET {url}", resp.status)
        return await resp.json()


async def list_models(session: aiohttp.ClientSession, base_url: str) -> list[str]:
    """The ids of ``GET /v1/models``, in the server's order."""
    return _model_ids(await get_json(session, f"{base_url}/v1/models"), base_url)


def served_models(base_url: str, api_key: str | None = None) -> list[str]:
    """:func:`list_models` from code that runs no event loop (``fetch_sync``)."""
    url = f"{base_url}/v1/models"
    reply = fetch_sync("GET", url, headers=auth_headers(api_key), timeout_s=30)
    if reply.status != 200:
        raise status_error(f"GET {url}", reply.status)
    return _model_ids(reply.json(), base_url)


def _model_ids(listing: Any, base_url: str) -> list[str]:
    try:
        return [str(m["id"]) for m in listing["data"]]
    except (KeyError, TypeError) as exc:
        raise ServiceError(f"GET {base_url}/v1/models: unexpected answer ({exc})") from None


async def get_stats(
    session: aiohttp.ClientSession, base_url: str, light: bool = False
) -> dict[str, Any] | None:
    """``GET /v1/aegaeon/stats`` (``light``: counters only), or ``None`` when the
    backend keeps no stats (404)."""
    query = "?light=1" if light else ""
    async with session.get(f"{base_url}/v1/aegaeon/stats{query}") as resp:
        if resp.status == 404:
            return None
        if resp.status in (401, 403):  # a node with keys: the stats need an admin key
            raise ServiceError(f"GET /v1/aegaeon/stats: HTTP {resp.status}: the node's "
                               "stats need an admin key (--admin-key on the node)",
                               resp.status)  # fmt: skip
        if resp.status != 200:
            raise status_error("GET /v1/aegaeon/stats", resp.status)
        stats = await resp.json()
    if not isinstance(stats, dict):
        raise ServiceError("GET /v1/aegaeon/stats: not a JSON object")
    return stats
