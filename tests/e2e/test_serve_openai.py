"""Through `aegaeon serve` with the official `openai` client: what a user does."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from http_support import call_json
from serve_harness import Served, until


def _models(served: Served) -> list[str]:
    return [m.id for m in served.client().models.list().data]


def test_models_come_from_the_market(served: Served, small_market: Path) -> None:
    index = json.loads((small_market / "market.json").read_text())
    assert _models(served) == [m["name"] for m in index["models"]]


def test_three_models_stream_and_not(served: Served) -> None:
    client = served.client()
    models = _models(served)[:3]
    assert len(set(models)) == 3
    results: dict[str, tuple[str, str]] = {}

    def one(model: str) -> None:
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me about ships."}],
            max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.completion_tokens == 12
        stream = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        pieces, usage, finish = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 12
        results[model] = (chat.choices[0].message.content or "", "".join(pieces))

    threads = [threading.Thread(target=one, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert sorted(results) == sorted(models)
    assert all(stream_text for _, stream_text in results.values())


def _engine_alone(model_dir: Path, prompt_ids: list[int], num_tokens: int) -> list[int]:
    from aegaeon_engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    return llm.generate([prompt_ids], params)[0]


def test_greedy_tokens_equal_the_engine_alone_across_switches(
    served: Served, small_market: Path
) -> None:
    """A -> B -> A on the same instances gives A the same tokens as a fresh engine."""
    from tokenizers import Tokenizer

    client = served.client()
    model_a, model_b = _models(served)[:2]
    prompt_ids = [5, 17, 99, 3, 250, 41, 7, 12, 600, 33, 21, 8, 19, 77, 101, 4, 16, 2]
    n = 24
    want = _engine_alone(small_market / model_a, prompt_ids, n)
    tokenizer = Tokenizer.from_file(str(small_market / model_a / "tokenizer.json"))
    want_text = tokenizer.decode(want, skip_special_tokens=True)

    def ask(model: str) -> str:
        reply = client.completions.create(
            model=model, prompt=prompt_ids, max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return reply.choices[0].text

    first = ask(model_a)
    ask(model_b)  # forces both instances to switch away from A ...
    again = ask(model_a)  # ... and back
    assert first == want_text
    assert again == want_text


def _stats(served: Served) -> dict[str, object]:
    return served.get_json("/v1/aegaeon/stats")


def _kv_in_use(served: Served) -> tuple[float, float]:
    stats = _stats(served)
    cache = stats["cache"]
    assert isinstance(cache, dict)
    host_used = float(cache["kv"]["used_bytes"]) + float(cache["kv"]["move_list_blocks"])
    instances = stats["instance_stats"]
    assert isinstance(instances, dict)
    device_used = sum(
        float(s["counters"].get("kv_used_bytes", 0.0)) for s in instances.values() if s
    )
    return host_used, device_used


def test_disconnect_cancels_and_frees_every_block(served: Served) -> None:
    model = _models(served)[0]
    cancelled = _stats(served)["counters"]["cancelled"]  # type: ignore[index]  # a shared node
    body = {"model": model, "prompt": "Keep talking", "max_tokens": 1000, "ignore_eos": True,
            "stream": True, "temperature": 0}  # fmt: skip

    async def leave_mid_stream() -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            resp = await session.post(f"{served.url}/v1/completions", json=body)
            assert resp.status == 200
            seen = 0
            while seen < 20:  # some tokens are flowing: the request holds KV on the instances
                line = await resp.content.readline()
                assert line, "the stream ended before 20 events"
                seen += line.startswith(b"data: {")
            resp.close()  # the client goes away mid-stream: its connection closed

    asyncio.run(leave_mid_stream())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _kv_in_use(served) == (0.0, 0.0) and _stats(served)["counters"]["cancelled"] > cancelled:  # type: ignore[index]
            break
        time.sleep(0.5)  # heartbeats report every 0.5 s
    assert _kv_in_use(served) == (0.0, 0.0)


def test_stats_count_nothing_once_a_request_has_returned(served: Served) -> None:
    """Issue 43: right after a long request returned, its decode instance still showed
    its KV blocks and sequence (the last heartbeat's). The README's promise: once an
    answer is back, no instance counts the request's sequence, and the instance that
    ended it none of its KV; blocks a copy to the host cache still reads (the prefill
    instance's handoff) count until that instance's next heartbeat (0.5 s)."""
    client = served.client()
    model = _models(served)[0]
    prompt = "Tell me about ships and the sea. " * 12
    for max_tokens in (1, 300):  # ends at its first token (prefill) / on a decoder
        client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        stats = served.get_json("/v1/aegaeon/stats?light=1")
        assert stats["open_requests"] == 0
        instances = stats["instances"]
        assert isinstance(instances, list) and instances
        for inst in instances:
            assert inst["open_sequences"] == 0, (max_tokens, inst)
            if max_tokens == 1 or inst["kind"] == "decode":
                assert inst["kv_blocks_in_use"] == 0, (max_tokens, inst)

        def quiet() -> bool:
            held = served.get_json("/v1/aegaeon/stats?light=1")["instances"]
            return all(i["kv_blocks_in_use"] == 0 for i in held)  # type: ignore[union-attr]

        until("every instance's KV blocks free", quiet, 5.0)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "no-such-model", "prompt": "x"}, 404),
        ({"prompt": "x", "max_tokens": -1}, 400),
        ({"prompt": "x", "temperature": -0.5}, 400),
        ({"prompt": "x", "top_p": 0}, 400),
        ({"prompt": [1] * 100000, "max_tokens": 4}, 400),
    ],
)
def test_bad_requests_get_openai_errors_and_serving_goes_on(
    served: Served, body: dict[str, object], status: int
) -> None:
    model = _models(served)[0]
    got, error = call_json(served.url, "POST", "/v1/completions", {"model": model, **body})
    assert got == status, error
    assert set(error["error"]) >= {"message", "type", "param", "code"}
    ok = served.client().completions.create(model=model, prompt="Hi", max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_seeded_completion_streams_what_it_answers(served: Served) -> None:
    """The same seed gives the same text, streamed or not; other seeds differ."""
    client = served.client()
    model = _models(served)[0]
    args: dict[str, Any] = dict(model=model, prompt="Once upon a time", max_tokens=8,
                                temperature=0.9, seed=11,
                                extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**args)
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 8
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **args))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert client.completions.create(**args).choices[0].text == whole.choices[0].text
    others = [client.completions.create(**{**args, "seed": s}).choices[0].text for s in (1, 2, 3)]
    assert any(text != whole.choices[0].text for text in others)


def test_chat_streams_what_it_answers(served: Served) -> None:
    client = served.client()
    args: dict[str, Any] = dict(model=_models(served)[1], max_completion_tokens=6,
                                messages=[{"role": "user", "content": "Hi! 👋"}], temperature=0,
                                extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**args)
    assert whole.id.startswith("chatcmpl-") and whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        whole.choices[0].message.content)
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"


def test_stop_string_trims_the_engine_text(served: Served) -> None:
    client = served.client()
    args: dict[str, Any] = dict(model=_models(served)[0], prompt="The weather today",
                                max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    assert len(full) > 4
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expect = full[: full.find(stop)]
    chunks = list(client.completions.create(stop=[stop], stream=True, **args))
    streamed = ("".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason)
    choice = client.completions.create(stop=stop, **args).choices[0]
    assert streamed == (choice.text, choice.finish_reason) == (expect, "stop")


def test_a_prompt_past_the_window_is_context_length_exceeded(served: Served) -> None:
    client = served.client()
    model = _models(served)[0]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[5] * 9000, max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    ok = client.completions.create(model=model, prompt="x", max_tokens=1,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    assert ok.usage is not None and ok.usage.completion_tokens == 1
