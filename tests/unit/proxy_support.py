"""Shared helpers of the proxy unit tests: a small market of real checkpoints, and
:class:`ScriptedBackend`, a test double of the proxy's backend that replays token ids.

The real engine behind the proxy is exercised end to end in tests/e2e/test_serve_openai.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path
from typing import Any

from aegaeon_bench.node.http_client import sse_payloads
from aegaeon_common.config import Config, ModelConfig, ProxyConfig
from aegaeon_common.messages.structs import TokenLogprobs
from aegaeon_common.registry import INSTANCES, InstanceRecord, encode, instance_key
from aegaeon_common.store import Store
from aegaeon_proxy.app import make_app
from aegaeon_proxy.backend import (
    Backend,
    BackendError,
    FinishReason,
    GenerationRequest,
    TokenChunk,
    TokenQueue,
    TokenStream,
)
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Gauge


@cache
def market_dir() -> Path:
    """The market's ``small`` profile (Llama-3, Mistral, Qwen2 tokenizers), built once per machine.

    ``ensure_market`` reuses an existing identical market and is safe when
    several test processes ask at once.
    """
    from aegaeon_market import ensure_market

    root = Path(tempfile.gettempdir()) / f"aegaeon-proxy-test-market-{os.getuid()}"
    ensure_market(root, num_models=4, seed=0, profile="small", progress=False)
    return root


MODEL = "llama-gqa-5m"
Client = TestClient[Any, Any]  # the scripted proxy's client (the `client` fixture)


class ScriptedBackend(Backend):
    """Replays ``token_ids`` (one per step) then finishes; records cancels (none of the
    optional operations: their defaults)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_ids: list[int] = []
        self.finish: FinishReason = "length"
        self.code: str | None = None  # an "error" finish's code (None: a backend error)
        self.step_s = 0.0
        self.burst = False  # each sequence's tokens at once, in one chunk (as an instance
        # sends the steps of a turn together)
        self.hang = False  # send nothing until cancelled
        self.hold = False  # hold each request for room (admission) until the test says
        self.refuse: BackendError | None = None
        self.fail: tuple[str, str] | None = None  # (error, code): every request ends so
        self.is_ready = True
        self.submitted: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.played = 0  # tokens pushed, over every request
        self._queues: dict[str, TokenQueue] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()

    def ready(self) -> bool:
        return self.is_ready

    def health(self) -> dict[str, object]:
        return {"kind": "scripted"}

    def register_metrics(self, registry: CollectorRegistry) -> None:
        Gauge("scripted_up", "The scripted backend", registry=registry).set(1)

    def submit(self, req: GenerationRequest) -> TokenStream:
        if self.refuse is not None:
            raise self.refuse
        self.submitted.append(req)
        queue = TokenQueue()
        if self.hold:
            queue.hold()
        self._queues[req.request_id] = queue
        task = asyncio.get_running_loop().create_task(self._play(queue, req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return queue

    async def _play(self, queue: TokenQueue, req: GenerationRequest) -> None:
        try:
            await queue.admitted()
        except BackendError:
            return
        if self.hang:
            return
        if self.fail is not None:
            queue.finish("error", *self.fail)
            return
        s = req.sampling
        ids = self.token_ids[: s.max_tokens]
        prompt = [scripted_logprobs(t, s.prompt_logprobs) for t in req.prompt_token_ids[1:]]
        if self.burst and ids:
            for index in range(s.n):
                self.played += len(ids)
                lps = tuple(scripted_logprobs(t, s.logprobs) for t in ids if s.logprobs >= 0)
                queue.push(TokenChunk(
                    tuple(ids), self.finish if index == s.n - 1 else None, "boom", self.code,
                    index=index, seq_finish=self.finish, logprobs=lps,
                    prompt_logprobs=(tuple(prompt) if s.prompt_logprobs >= 0 and index == 0
                                     else None),
                ))  # fmt: skip
            return
        for i, token_id in enumerate(ids):
            for index in range(s.n):  # the n sequences say the same
                await asyncio.sleep(self.step_s)
                last = i == len(ids) - 1
                self.played += 1
                lps = (scripted_logprobs(token_id, s.logprobs),) if s.logprobs >= 0 else ()
                queue.push(TokenChunk(
                    (token_id,), self.finish if last and index == s.n - 1 else None, "boom",
                    self.code, index=index, seq_finish=self.finish if last else None,
                    logprobs=lps,
                    prompt_logprobs=tuple(prompt) if s.prompt_logprobs >= 0 and i == 0 else None,
                ))  # fmt: skip
        if not ids:
            queue.finish(self.finish, "boom")

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.finish("cancelled")


def scripted_logprobs(token_id: int, k: int) -> TokenLogprobs:
    """What the scripted backend reports for a token: log-probability -(id % 7) / 10,
    its top ``k`` the ids after it, each 0.1 less likely."""
    return TokenLogprobs(-(token_id % 7) / 10, [token_id + j for j in range(k)],
                         [-j / 10 for j in range(k)], 1)


def scripted_config(market: Path, **proxy: Any) -> Config:
    """The scripted proxy's config: one model of ``market``, these ``ProxyConfig`` fields."""
    return Config(models=(ModelConfig(MODEL, market / MODEL),), proxy=ProxyConfig(**proxy))


@asynccontextmanager
async def front(config: Config, backend: Backend) -> AsyncIterator[TestClient[Any, Any]]:
    """A client of the HTTP front of ``config`` over ``backend``, stopped on the way out."""
    async with TestClient(TestServer(make_app(config, backend))) as client:
        yield client


async def sse_chunks(resp: Any) -> list[Any]:
    """A streamed answer's events as JSON, ``[DONE]`` left off, its framing checked
    (``sse_payloads``: one ``data: `` line an event, ``[DONE]`` last)."""
    return [json.loads(payload) for payload in sse_payloads(await resp.read())]


def instance_record(node: str, kind: str, index: int = 0, **fields: Any) -> InstanceRecord:
    """The store's record of ``{node}/{kind}-{index}`` (model ``m``; ``fields`` set the rest)."""
    return InstanceRecord(**{  # type: ignore[arg-type]
        "v": 1, "instance_id": f"{node}/{kind}-{index}", "node": node, "kind": kind,
        "index": index, "address": "tcp://127.0.0.1:1", "incarnation": 1, "pid": 1,
        "capacity_tokens": {"m": 100}, "max_batch_size": 8, **fields})  # fmt: skip


async def put_records(store: Store, *records: InstanceRecord, ttl_s: float = 30.0) -> None:
    """``records`` in the store as their instances' heartbeats write them."""
    for record in records:
        await store.put(instance_key(record.instance_id), encode(record), ttl_s)
        await store.set_add(INSTANCES, record.instance_id)
