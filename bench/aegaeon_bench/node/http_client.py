"""The one HTTP client of the bench and the tests: aiohttp (the proxy's own library), and
the one reader of server-sent events.

- :func:`fetch`: one request on a session, its whole answer as a :class:`Reply`
  (any status: an error answer is a reply like another).
- :func:`fetch_sync`: the same from code that runs no event loop (a CLI step, a
  poll, a test): a session and a loop of its own for the one request. A refused or
  cut connection raises :class:`ConnectionError`, a timeout :class:`TimeoutError`
  (both ``OSError``, as the standard library's clients raise).
- :func:`sse_events`: a streaming answer's events as they come; :func:`sse_payloads`:
  a whole answer's events, checked as the proxy frames them.

Raw sockets stay where a test or benchmark means to break the wire (a body a byte a
second, a reader that never reads).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

TIMEOUT_S = 120.0  # a busy machine: a model switch or a queue may stand before the answer


@dataclass(frozen=True)
class Reply:
    """One answer: its status, headers (names as sent) and body."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        """The body as JSON (``None`` for an empty one); ValueError when it is not JSON."""
        return json.loads(self.body) if self.body else None

    def data(self) -> Any:
        """The body as JSON when it is JSON, else as text."""
        try:
            return self.json()
        except ValueError:
            return self.text()

    def header(self, name: str, default: str = "") -> str:
        """A header's value, its name in any case."""
        wanted = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == wanted), default)


async def fetch(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None,
    headers: Mapping[str, str] | None = None,
) -> Reply:  # fmt: skip
    """``method url`` with ``body`` as JSON (none: no body), read to its end."""
    async with session.request(method, url, json=body, headers=dict(headers or {})) as resp:
        return Reply(resp.status, await resp.read(), dict(resp.headers))


def fetch_sync(
    method: str, url: str, body: Any = None, headers: Mapping[str, str] | None = None,
    timeout_s: float = TIMEOUT_S,
) -> Reply:  # fmt: skip
    """:func:`fetch` on a session and an event loop of its own (see the module docstring);
    from a coroutine, await :func:`fetch` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError(f"fetch_sync({method} {url}) inside an event loop: await fetch()")

    async def one() -> Reply:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await fetch(session, method, url, body, headers)

    try:
        return asyncio.run(one())
    except aiohttp.ClientError as exc:
        raise ConnectionError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, Any]]:
    """The SSE reader: ``(time.time() when its bytes came, the JSON)`` per ``data:``
    event, ``(t, None)`` for ``[DONE]``, then no more (nor where the stream is cut);
    ValueError on an event that is not JSON. Lines other than ``data:`` (comments,
    ``event:``) are passed over, as another server (the bench's peers) may send them."""
    pending = b""  # whatever the socket has is read at once: one wake-up, not one per event
    async for data in resp.content.iter_any():
        now_s = time.time()
        *lines, pending = (pending + data).split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                yield now_s, None
                return
            yield now_s, json.loads(payload)


def sse_payloads(body: bytes) -> list[bytes]:
    """A whole SSE answer's event payloads, ``[DONE]`` left off, checked as the proxy
    frames them: every event one ``data: `` line and a blank line, the last one
    ``data: [DONE]``. ValueError naming the first frame that is not."""
    frames = body.split(b"\n\n")
    if frames[-1] != b"" or frames[-2:-1] != [b"data: [DONE]"]:
        raise ValueError(f"stream does not end with [DONE]: {body[-80:]!r}")
    for frame in frames[:-2]:
        if not frame.startswith(b"data: ") or b"\n" in frame:
            raise ValueError(f"not one SSE data line: {frame[:80]!r}")
    return [frame[len(b"data: ") :] for frame in frames[:-2]]
