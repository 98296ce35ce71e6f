"""The request surface beyond generation itself: request ids in and out, the access log,
vLLM's /tokenize, /detokenize and /version, chat template options (scripted backend)."""

from __future__ import annotations

from typing import Any

import structlog
from aegaeon_proxy.backend import GenerationRequest
from proxy_support import MODEL, Client, ScriptedBackend, sse_chunks

CHAT = [{"role": "user", "content": "Hello there"}]


async def test_request_id_in_out_and_in_every_line(client: Client, backend: ScriptedBackend,
                                                   tok: Any) -> None:  # fmt: skip
    backend.token_ids = tok.encode(" one two", add_special_tokens=False)
    with structlog.testing.capture_logs() as logs:
        resp = await client.post("/v1/completions", headers={"X-Request-Id": "trace-42"},
                                 json={"model": MODEL, "prompt": "Hi", "max_tokens": 8})
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "trace-42"
        body = await resp.json()
        assert body["id"] == "cmpl-trace-42"
        assert backend.submitted[-1].request_id == "trace-42"
        # streamed: the header leaves with the stream's start
        resp = await client.post("/v1/chat/completions", headers={"X-Request-Id": "s-1"},
                                 json={"model": MODEL, "messages": CHAT, "stream": True})
        assert resp.headers["X-Request-Id"] == "s-1"
        chunks = await sse_chunks(resp)
        assert {c["id"] for c in chunks} == {"chatcmpl-s-1"}
        # vLLM's request_id field, when no header
        resp = await client.post("/v1/completions",
                                 json={"model": MODEL, "prompt": "Hi", "request_id": "b-7"})
        assert resp.headers["X-Request-Id"] == "b-7"
        # none given: a new one, echoed
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        made = resp.headers["X-Request-Id"]
        assert len(made) == 32 and (await resp.json())["id"] == f"cmpl-{made}"
    done = [line for line in logs if line["event"] == "request_done"]
    assert [d["request_id"] for d in done] == ["trace-42", "s-1", "b-7", made]
    first = done[0]
    assert first["log_level"] == "info" and first["status"] == 200
    assert first["model"] == MODEL and first["output_tokens"] == len(backend.token_ids)
    assert first["prompt_tokens"] == len(tok.encode("Hi", add_special_tokens=True))
    assert first["ttft_s"] is not None and first["total_s"] >= first["ttft_s"]
    assert first["outcome"] == "length"
    # every line written while the request ran names it
    accepted = [line for line in logs if line["event"] == "request_accepted"]
    assert [a["request_id"] for a in accepted] == ["trace-42", "s-1", "b-7", made]


async def test_bad_request_ids_and_errors_carry_the_id(
    client: Client, backend: ScriptedBackend
) -> None:
    for bad in ("has space", "x" * 129, "é"):
        resp = await client.post("/v1/completions", headers={"X-Request-Id": bad},
                                 json={"model": MODEL, "prompt": "Hi"})
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "X-Request-Id"
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                      "request_id": 5})
    assert (await resp.json())["error"]["param"] == "request_id"
    # an error answer still names the request
    resp = await client.post("/v1/completions", headers={"X-Request-Id": "e-1"},
                             json={"model": MODEL, "prompt": "Hi", "bogus": 1})
    assert resp.status == 400 and resp.headers["X-Request-Id"] == "e-1"
    assert (await resp.json())["error"]["param"] == "bogus"
    assert backend.submitted == []


async def test_tokenize_and_detokenize_in_vllm_shapes(client: Client, backend: ScriptedBackend,
                                                      tok: Any) -> None:  # fmt: skip
    resp = await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                "return_token_strs": True})
    assert resp.status == 200
    out = await resp.json()
    want = tok.encode("Hello world", add_special_tokens=True)
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["max_model_len"] == tok.max_model_len
    assert out["token_strs"] == [tok.tokenizer.id_to_token(i) for i in want]
    plain = await (await client.post("/tokenize", json={
        "model": MODEL, "prompt": "Hello world", "add_special_tokens": False})).json()
    assert plain["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert plain["token_strs"] is None
    # chat messages: the ids /v1/chat/completions would prefill
    chat = await (await client.post("/tokenize", json={"model": MODEL,
                                                       "messages": CHAT})).json()
    await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                    "max_tokens": 1})
    assert chat["tokens"] == list(backend.submitted[-1].prompt_token_ids)
    back = await (await client.post("/detokenize", json={"model": MODEL,
                                                         "tokens": want})).json()
    assert back == {"prompt": tok.tokenizer.decode(want, skip_special_tokens=False)}
    for path, body, param in [
        ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "nope": 1}, "nope"),
        ("/tokenize", {"model": "missing", "prompt": "x"}, "model"),
        ("/detokenize", {"model": MODEL, "tokens": [10**9]}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": "1 2"}, "tokens"),
    ]:
        resp = await client.post(path, json=body)
        assert resp.status in (400, 404)
        assert (await resp.json())["error"]["param"] == param


async def test_version(client: Client) -> None:
    resp = await client.get("/version")
    assert resp.status == 200
    from importlib import metadata

    assert await resp.json() == {"version": metadata.version("aegaeon")}


def _prompt_text(backend: ScriptedBackend, tok: Any) -> str:
    req: GenerationRequest = backend.submitted[-1]
    return str(tok.tokenizer.decode(list(req.prompt_token_ids), skip_special_tokens=False))


async def test_chat_template_options(client: Client, backend: ScriptedBackend, tok: Any) -> None:
    async def chat(**extra: Any) -> int:
        resp = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": CHAT, "max_tokens": 1, **extra})
        return resp.status

    assert await chat() == 200
    with_prompt = _prompt_text(backend, tok)
    assert await chat(add_generation_prompt=False) == 200
    without = _prompt_text(backend, tok)
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)
    # the request's own template, with its own variables
    template = "{% for m in messages %}[{{ m.content }}|{{ flavour }}]{% endfor %}"
    assert await chat(chat_template=template,
                      chat_template_kwargs={"flavour": "mint"}) == 200
    assert _prompt_text(backend, tok).endswith("[Hello there|mint]")
    # continue the final (assistant) message instead of opening a new one
    resp = await client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 1, "continue_final_message": True,
        "add_generation_prompt": False,
        "messages": [*CHAT, {"role": "assistant", "content": "Well, hello"}]})
    assert resp.status == 200
    assert _prompt_text(backend, tok).endswith("Well, hello")
    # a prompt truncated to its last tokens
    assert await chat(truncate_prompt_tokens=3) == 200
    assert len(backend.submitted[-1].prompt_token_ids) == 3
    for extra, param in [({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                         ({"chat_template": "{% for %}"}, "chat_template"),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"add_generation_prompt": "yes"}, "add_generation_prompt")]:
        resp = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": CHAT, **extra})
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == param
