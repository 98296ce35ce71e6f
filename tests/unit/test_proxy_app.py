"""The HTTP front over a scripted backend: framing, errors, cancellation, metrics.

The backend is ``proxy_support.ScriptedBackend``, a test double that replays token
ids; the real engine behind the proxy is exercised in tests/e2e/test_serve_openai.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aegaeon_proxy.backend import BackendError, TokenQueue
from aegaeon_proxy.state import STATE
from http_support import samples_of
from proxy_support import MODEL, Client, ScriptedBackend, sse_chunks


async def test_completion_stream_framing_and_usage(client: Client, backend: ScriptedBackend,
                                                   tok: Any) -> None:  # fmt: skip
    backend.token_ids = tok.encode("Hello 🎉 world", add_special_tokens=False)
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 50,
            "stream_options": {"include_usage": True}}  # fmt: skip
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    chunks = await sse_chunks(resp)
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "Hello 🎉 world"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    n, p = len(backend.token_ids), len(tok.encode("Hi", add_special_tokens=True))
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": p, "completion_tokens": n,
                                   "total_tokens": p + n}  # fmt: skip


async def test_tokens_sent_together_leave_in_one_write_as_separate_events(
    client: Client, backend: ScriptedBackend, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiohttp import web

    writes: list[bytes] = []
    original = web.StreamResponse.write

    async def counting_write(self: web.StreamResponse, data: Any) -> None:
        writes.append(bytes(data))
        await original(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counting_write)

    backend.token_ids = tok.encode("one two three four five", add_special_tokens=False)
    backend.burst = True
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 50,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = await sse_chunks(await client.post("/v1/completions", json=body))
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    # one event per token, then the finish and the usage: as if written one by one
    assert len(chunks) == len(backend.token_ids) + 2
    assert "".join(texts) == "one two three four five"
    assert len(writes) == 1 and writes[0].decode().endswith("data: [DONE]\n\n")


async def test_chat_stream_first_chunk_has_role(client: Client, backend: ScriptedBackend,
                                                tok: Any) -> None:  # fmt: skip
    backend.token_ids = tok.encode("Sure.", add_special_tokens=False)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    chunks = await sse_chunks(await client.post("/v1/chat/completions", json=body))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[-1]  # only with include_usage
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Sure."


@pytest.mark.parametrize("grouped", [False, True], ids=["per_token", "grouped"])
async def test_stop_string_trims_and_cancels(client: Client, backend: ScriptedBackend, tok: Any,
                                             grouped: bool) -> None:  # fmt: skip
    backend.burst = grouped  # a stop string inside a group drops the tokens after it
    backend.token_ids = tok.encode("one two three four five", add_special_tokens=False)
    for stream in (False, True):
        backend.cancelled.clear()
        body = {"model": MODEL, "prompt": "x", "stop": ["ee f", "three"], "stream": stream}
        resp = await client.post("/v1/completions", json=body)
        if stream:
            chunks = await sse_chunks(resp)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            data = await resp.json()
            text, finish = data["choices"][0]["text"], data["choices"][0]["finish_reason"]
        assert (text, finish) == ("one two ", "stop")
        # a stream still open is cancelled (one whose group came with its end is not)
        open_ = [] if grouped else [backend.submitted[-1].request_id]
        assert backend.cancelled == open_


async def test_stop_token_is_not_shown(client: Client, backend: ScriptedBackend, tok: Any) -> None:
    backend.token_ids = [*tok.encode("done", add_special_tokens=False), tok.eos_token_ids[0]]
    backend.finish = "stop"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    data = await (await client.post("/v1/chat/completions", json=body)).json()
    choice = data["choices"][0]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": "done"},
                      "logprobs": None, "finish_reason": "stop"}  # fmt: skip
    assert data["object"] == "chat.completion"
    assert data["usage"]["completion_tokens"] == len(backend.token_ids)
    assert tok.eos_token_ids[0] in backend.submitted[-1].sampling.stop_token_ids


async def test_backend_refusals(client: Client, backend: ScriptedBackend) -> None:
    body = {"model": MODEL, "prompt": "x"}
    backend.refuse = BackendError.overloaded("queue full", retry_after_s=2.5)
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "3"
    error = (await resp.json())["error"]
    assert (error["message"], error["type"]) == ("queue full", "rate_limit_exceeded")
    backend.refuse = BackendError.unavailable("no decode instance")
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize("code", ["instance_failed", "store_unavailable"])
async def test_a_fault_ends_a_request_with_503_and_retry_after(
    client: Client, backend: ScriptedBackend, tok: Any, code: str
) -> None:
    """An instance that died or a shared store that failed under a request is not the
    request's doing: 503 with Retry-After (a client retries), never a 500."""
    backend.token_ids = tok.encode("a b", add_special_tokens=False)
    backend.finish, backend.code = "error", code
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    error = (await resp.json())["error"]
    assert error["code"] == code and "boom" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_held_for_room_is_answered_once_admitted_or_refused(
    client: Client, backend: ScriptedBackend, tok: Any, stream: bool
) -> None:
    """Past the admission bounds the backend holds a request; the front answers
    nothing until then: a 200 once admitted, a 429 (not an SSE stream) if refused."""
    backend.token_ids = tok.encode("a b", add_special_tokens=False)
    backend.hold = True
    body = {"model": MODEL, "prompt": "x", "stream": stream}

    async def held() -> tuple[asyncio.Task[Any], TokenQueue]:
        task = asyncio.create_task(client.post("/v1/completions", json=body))
        while not backend.submitted or task.done():
            assert not task.done(), "answered while held"
            await asyncio.sleep(0.01)
        queue = backend._queues[backend.submitted[-1].request_id]
        await asyncio.sleep(0.05)
        assert not task.done()  # still held: no status line yet
        return task, queue

    task, queue = await held()
    queue.admit()
    resp = await task
    assert resp.status == 200
    text = await resp.text()
    assert ("data: [DONE]" in text) if stream else ("a b" in text), text
    backend.submitted.clear()
    task, queue = await held()
    queue.refuse(BackendError.overloaded("no room before its TTFT", retry_after_s=2.0))
    resp = await task
    assert resp.status == 429 and resp.headers["Retry-After"] == "2"
    error = (await resp.json())["error"]
    assert error["code"] == "overloaded" and "no room" in error["message"]
    assert client.server.app[STATE].metrics.num_open == 0


async def test_backend_error_finish(client: Client, backend: ScriptedBackend, tok: Any) -> None:
    backend.token_ids = tok.encode("a b", add_special_tokens=False)
    backend.finish = "error"
    body = {"model": MODEL, "prompt": "x"}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 500
    assert "boom" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = await sse_chunks(resp)
    assert "boom" in chunks[-1]["error"]["message"]


async def _wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


async def test_disconnect_cancels(client: Client, backend: ScriptedBackend) -> None:
    backend.hang = True
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")  # role chunk
    resp.close()  # the client goes away mid-stream
    rid = backend.submitted[-1].request_id
    await _wait_for(lambda: rid in backend.cancelled)

    task = asyncio.create_task(
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    )
    await _wait_for(lambda: len(backend.submitted) == 2)
    task.cancel()  # the client goes away before the answer
    with pytest.raises(asyncio.CancelledError):
        await task
    rid = backend.submitted[-1].request_id
    await _wait_for(lambda: rid in backend.cancelled)


@pytest.mark.proxy(request_timeout_s=0.2)
async def test_request_timeout(client: Client, backend: ScriptedBackend) -> None:
    backend.hang = True
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert resp.status == 504
    assert backend.cancelled == [backend.submitted[-1].request_id]


async def test_models_health_ready_metrics(client: Client, backend: ScriptedBackend) -> None:
    data = await (await client.get("/v1/models")).json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [MODEL]
    assert (await client.get(f"/v1/models/{MODEL}")).status == 200
    assert (await client.get("/v1/models/nope")).status == 404
    backend.is_ready = False
    assert (await client.get("/ready")).status == 503
    assert (await client.get("/health")).status == 200
    backend.is_ready = True
    assert (await client.get("/ready")).status == 200
    backend.token_ids = [5, 6, 7]
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    text = await (await client.get("/metrics")).text()
    samples = samples_of(text)
    http = ("endpoint", "/v1/completions"), ("status", "200")
    assert samples[("aegaeon_proxy_http_requests_total", http)] == 1
    assert samples[("aegaeon_requests_total", (("model", MODEL), ("outcome", "length")))] == 1
    assert samples[("aegaeon_generation_tokens_total", (("model", MODEL),))] == 3
    assert samples[("aegaeon_ttft_seconds_count", (("model", MODEL),))] == 1
    assert samples[("aegaeon_tbt_seconds_count", (("model", MODEL),))] == 2
    assert samples[("aegaeon_slo_attainment_ratio", (("model", MODEL),))] == 1.0
    assert samples[("aegaeon_requests_in_flight", (("model", MODEL),))] == 0
    assert samples[("scripted_up", ())] == 1
    assert any(name == "process_resident_memory_bytes" for name, _ in samples)
    assert any(name == "process_open_fds" for name, _ in samples)


async def test_unknown_model_and_routes(client: Client) -> None:
    resp = await client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert resp.status == 404
    err = (await resp.json())["error"]
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert (await client.get("/v1/nothing")).status == 404
    resp = await client.get("/v1/completions")
    assert resp.status == 405
    assert "error" in await resp.json()


@pytest.mark.proxy(max_body_bytes=4096)
async def test_body_too_large(client: Client, backend: ScriptedBackend) -> None:
    body = {"model": MODEL, "prompt": "x" * 5000}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"

    async def chunked() -> AsyncIterator[bytes]:
        yield json.dumps(body).encode()

    resp = await client.post("/v1/completions", data=chunked())
    assert resp.status == 413
    backend.token_ids = [5]
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})).ok


def _cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "x", **fields}


def _chat(*content: Any, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": c} for c in content] or "hi"
    return {"model": MODEL, "messages": messages, **fields}


MALFORMED: list[bytes | dict[str, Any] | list[Any]] = [
    b"", b"{", b"nul", b"[]", b'"text"', b"42", b"null", b"\xff\xfe\x00garbage", b"{'a': 1}",
    b'{"model": NaN}', b'{"model": "' + MODEL.encode() + b'", "temperature": Infinity}',
    b"[" * 100_000, b'{"a":' * 50_000,
    {}, {"model": None}, {"model": ["x"]}, {"model": MODEL}, [1, 2, 3],
    {"model": "no-such-model", "prompt": "x"},
    _cmpl(prompt=None), _cmpl(prompt={"x": 1}), _cmpl(prompt=[[1, 2], [3]]), _cmpl(prompt=[1.5]),
    _cmpl(prompt=[99999999]), _cmpl(max_tokens=10**30), _cmpl(max_tokens=-5), _cmpl(n=9),
    _cmpl(temperature=[1]), _cmpl(top_p=-1), _cmpl(top_k=-7), _cmpl(seed={}),
    _cmpl(stop={"a": 1}), _cmpl(stop=[None]), _cmpl(stream=None, stream_options=3),
    _cmpl(stop_token_ids=[1.5]), _cmpl(logit_bias={"x": 5}), _cmpl(echo="yes"),
    _chat(), {"model": MODEL, "messages": [None]},
    _chat([{"type": "image_url", "image_url": {}}]), _chat([None]),
    {"model": MODEL, "messages": [{"role": 1, "content": "x"}]},
    _chat("x", max_completion_tokens=0), _chat("x", max_tokens=10**9), _chat("x" * 40_000),
]  # fmt: skip


@pytest.mark.proxy(max_body_bytes=200_000)
async def test_malformed_bodies_are_4xx_and_server_survives(
    client: Client, backend: ScriptedBackend
) -> None:
    backend.token_ids = [5, 6]
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in MALFORMED:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            resp = await client.post(path, data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
            assert 400 <= resp.status < 500, (path, body if len(data) < 200 else data[:50])
            err = (await resp.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert ok.status == 200
    assert (await ok.json())["usage"]["completion_tokens"] == 2
    text = await (await client.get("/metrics")).text()
    assert 'status="500"' not in text


async def test_draining_is_unready_and_refuses_new_generations(
    client: Client, backend: ScriptedBackend
) -> None:
    from aegaeon_proxy.state import STATE
    backend.token_ids = [5, 6]
    assert (await client.get("/ready")).status == 200
    client.server.app[STATE].readiness.set_draining()
    resp = await client.get("/ready")
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "draining"
    assert (await (await client.get("/health")).json())["draining"] is True
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "draining"
    assert backend.submitted == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_model_static_mux_placed_nowhere_is_a_503_naming_it(
    client: Client, backend: ScriptedBackend, stream: bool
) -> None:
    """``static-mux`` refuses the models it left unplaced (``Reject`` code ``no_slot``):
    the client gets a 503 saying so (a stream: the error event), never a 500."""
    reason = "model 'x' has no instance slot under static multiplexing (the models " \
             "resident on the instances: a, b)"
    backend.fail = (reason, "no_slot")
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": stream}
    resp = await client.post("/v1/completions", json=body)
    if stream:  # the stream is open: its error event, then [DONE]
        assert resp.status == 200
        error = (await sse_chunks(resp))[-1]["error"]  # [DONE] checked, left off
    else:
        assert resp.status == 503
        error = (await resp.json())["error"]
    assert error["code"] == "model_not_placed" and "static multiplexing" in error["message"]
    assert MODEL in error["message"]
