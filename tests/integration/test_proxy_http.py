"""The OpenAI-compatible API end to end: official client, real engine, small market models."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from proxy_harness import Raw, ServerThread, proxy_config

SMALL = "llama-gqa-5m"
OTHER = "qwen2-19m"
FORCE = {"ignore_eos": True}  # random weights: force exact lengths


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    thread = ServerThread(proxy_config([SMALL, OTHER])).start()
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _health(server: ServerThread) -> dict[str, Any]:
    return Raw(server.url).json("/health")  # type: ignore[no-any-return]


def _wait_idle(server: ServerThread, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _health(server)["backend"]["open_requests"]:
        assert time.monotonic() < deadline, "the backend request was not cancelled"
        time.sleep(0.02)


def test_models_ready_health(server: ServerThread, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [SMALL, OTHER]
    assert Raw(server.url).request("GET", "/ready")[0] == 200
    assert _health(server)["status"] == "ok"


def test_completion_stream_equals_non_stream_with_seed(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model=SMALL, prompt="Once upon a time", max_tokens=8,
                                temperature=0.9, seed=11, extra_body=FORCE)  # fmt: skip
    whole = client.completions.create(**args)
    assert whole.id.startswith("cmpl-")
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **args))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage
    again = client.completions.create(**args)
    assert again.choices[0].text == whole.choices[0].text  # same seed, same text
    other = [client.completions.create(**{**args, "seed": s}).choices[0].text for s in (1, 2, 3)]
    assert any(text != whole.choices[0].text for text in other)


def test_chat_stream_and_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi! 👋"}]
    args: dict[str, Any] = dict(model=SMALL, messages=messages, max_completion_tokens=6,
                                temperature=0, extra_body=FORCE)  # fmt: skip
    whole = client.chat.completions.create(**args)
    assert whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sse_framing(server: ServerThread) -> None:
    body = {"model": SMALL, "prompt": "Hello", "max_tokens": 3, "stream": True, **FORCE}
    status, headers, text = Raw(server.url).request("POST", "/v1/completions", body)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    frames = text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""]
    for frame in frames[:-2]:
        assert frame.startswith("data: ")
        assert json.loads(frame[6:])["object"] == "text_completion"


def test_stop_string_trims_and_finishes(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model=SMALL, prompt="The weather today", max_tokens=16,
                                temperature=0, extra_body=FORCE)  # fmt: skip
    full = client.completions.create(**args).choices[0].text
    assert len(full) > 4
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expect = full[: full.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(stop=[stop], stream=True, **args))
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.completions.create(stop=stop, **args).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert (text, finish) == (expect, "stop")


def test_model_switching(server: ServerThread, client: openai.OpenAI) -> None:
    before = _health(server)["backend"]["model_switches"]
    for model in (SMALL, OTHER, SMALL):
        out = client.completions.create(model=model, prompt="a", max_tokens=2, extra_body=FORCE)
        assert out.model == model
        assert out.usage is not None and out.usage.completion_tokens == 2
    assert _health(server)["backend"]["model_switches"] >= before + 2


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"n": 2}, openai.BadRequestError, "n"),
        ({"temperature": 3}, openai.BadRequestError, "temperature"),
        ({"top_p": 0}, openai.BadRequestError, "top_p"),
        ({"max_tokens": -1}, openai.BadRequestError, "max_tokens"),
        ({"stop": 7}, openai.BadRequestError, "stop"),
        ({"seed": "x"}, openai.BadRequestError, "seed"),
        ({"max_tokens": 10**6}, openai.BadRequestError, "max_tokens"),
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
    ],
)
def test_bad_inputs(client: openai.OpenAI, kwargs: dict[str, Any], error: type[Exception],
                    param: str) -> None:  # fmt: skip
    args: dict[str, Any] = {"model": SMALL, "prompt": "x", "max_tokens": 2, **kwargs}
    with pytest.raises(error) as info:  # type: ignore[call-overload]
        client.completions.create(**args)
    assert info.value.body["param"] == param  # type: ignore[attr-defined]


def test_context_length_and_malformed(server: ServerThread, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=SMALL, prompt=[5] * 9000, max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    for raw in (b"{", b"[]", b'{"model": 1}', b"\xff"):
        status, _, text = Raw(server.url).request("POST", "/v1/chat/completions", raw)
        assert status == 400
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    ok = client.completions.create(model=SMALL, prompt="x", max_tokens=1, extra_body=FORCE)
    assert ok.usage is not None and ok.usage.completion_tokens == 1


def test_disconnect_cancels(server: ServerThread) -> None:
    body = {"model": SMALL, "prompt": "go", "max_tokens": 5000, "stream": True, **FORCE}
    raw = Raw(server.url)
    conn = raw.connection()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: {")
    assert _health(server)["backend"]["open_requests"] == 1
    conn.close()  # the client goes away mid-stream
    _wait_idle(server)
    with pytest.raises(TimeoutError):
        raw.request("POST", "/v1/completions", {**body, "stream": False}, timeout_s=0.5)
    _wait_idle(server)  # and before a whole answer


def test_metrics(server: ServerThread) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    text = Raw(server.url).request("GET", "/metrics")[2]
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert 'aegaeon_proxy_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert f'aegaeon_ttft_seconds_count{{model="{SMALL}"}}' in text
    assert {"aegaeon_local_model_switches", "aegaeon_local_submitted_total"} <= names
