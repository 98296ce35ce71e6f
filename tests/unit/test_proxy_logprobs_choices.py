"""Log-probabilities, echo, n choices and vLLM's output extras in OpenAI's and vLLM's shapes
(the scripted backend reports what proxy_support.scripted_logprobs says)."""

from __future__ import annotations

from typing import Any

import pytest
from proxy_support import MODEL, Client, ScriptedBackend, scripted_logprobs, sse_chunks

CHAT = [{"role": "user", "content": "Hi"}]
# the backend's chunks: a token each, or each sequence's tokens together (as an instance
# sends a turn's steps): the answer is the same
GROUPED = pytest.mark.parametrize("grouped", [False, True], ids=["per_token", "grouped"])


@GROUPED
async def test_completion_logprobs_with_echo(client: Client, backend: ScriptedBackend, tok: Any,
                                             grouped: bool) -> None:  # fmt: skip
    backend.burst = grouped
    backend.token_ids = tok.encode(" red green blue", add_special_tokens=False)
    resp = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Colors:", "max_tokens": 3, "logprobs": 2, "echo": True})
    assert resp.status == 200
    choice = (await resp.json())["choices"][0]
    assert choice["text"] == "Colors: red green blue"
    prompt = tok.encode("Colors:", add_special_tokens=True)
    sent = backend.submitted[-1].sampling
    assert (sent.logprobs, sent.prompt_logprobs) == (2, 2)  # echo scores the prompt
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ids = prompt[1:] + backend.token_ids
    want = [scripted_logprobs(t, 2).logprob for t in ids]
    assert lp["token_logprobs"][1:] == pytest.approx(want)
    top = lp["top_logprobs"][-1]  # the chosen token is always among them (vLLM)
    assert tok.tokenizer.decode([ids[-1]], skip_special_tokens=False) in top
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # streamed: the same text and log-probabilities, piece by piece
    resp = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Colors:", "max_tokens": 3, "logprobs": 2, "echo": True,
        "stream": True})
    chunks = await sse_chunks(resp)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    streamed = [v for c in chunks if c["choices"][0]["logprobs"]
                for v in c["choices"][0]["logprobs"]["token_logprobs"]]  # fmt: skip
    assert text == choice["text"] and streamed == lp["token_logprobs"]


@GROUPED
async def test_chat_logprobs_whole_and_streamed(client: Client, backend: ScriptedBackend, tok: Any,
                                                grouped: bool) -> None:  # fmt: skip
    backend.burst = grouped
    backend.token_ids = tok.encode(" sure thing", add_special_tokens=False)
    body = {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": 3}
    out = await (await client.post("/v1/chat/completions", json=body)).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [
        tok.tokenizer.decode([t]) for t in backend.token_ids]
    for entry, token in zip(content, backend.token_ids, strict=True):
        assert entry["logprob"] == pytest.approx(scripted_logprobs(token, 3).logprob)
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = await sse_chunks(resp)
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert streamed == content
    # logprobs alone: each token's own, no alternatives
    plain = await (await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "logprobs": True})).json()
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])


@GROUPED
async def test_n_choices_whole_and_streamed(client: Client, backend: ScriptedBackend, tok: Any,
                                            grouped: bool) -> None:  # fmt: skip
    backend.burst = grouped
    backend.token_ids = tok.encode(" one two", add_special_tokens=False)
    out = await (await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "n": 3})).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in out["choices"]} == {" one two"}
    assert out["usage"]["completion_tokens"] == 3 * len(backend.token_ids)
    assert backend.submitted[-1].sampling.n == 3  # one request, n sequences
    resp = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "n": 2, "stream": True})
    chunks = await sse_chunks(resp)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: " one two", 1: " one two"}
    assert finishes == {0: "length", 1: "length"}


async def test_vllm_output_extras(client: Client, backend: ScriptedBackend, tok: Any) -> None:
    backend.token_ids = tok.encode(" hello", add_special_tokens=False)
    out = await (await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Say", "prompt_logprobs": 1, "return_token_ids": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})).json()
    prompt = tok.encode("Say", add_special_tokens=True)
    assert out["prompt_token_ids"] == prompt
    choice = out["choices"][0]
    assert choice["token_ids"] == backend.token_ids
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in backend.token_ids]
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    entry = scored[1][str(prompt[1])]
    assert entry["logprob"] == pytest.approx(scripted_logprobs(prompt[1], 1).logprob)
    chat = await (await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "prompt_logprobs": 0})).json()
    assert chat["prompt_logprobs"][0] is None  # chat: at the top, as vLLM answers


@pytest.mark.parametrize(("extra", "param"), [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 9}, "n"), ({"n": 0}, "n"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"), ({"min_tokens": 10, "max_tokens": 5},
                                                   "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"allowed_token_ids": []},
                                                        "allowed_token_ids"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"echo": 1}, "echo"),
])  # fmt: skip
async def test_bad_values_are_400s_naming_the_field(
    client: Client, backend: ScriptedBackend, extra: dict[str, Any], param: str
) -> None:
    resp = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, **extra})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param
    assert backend.submitted == []


async def test_sampling_fields_reach_the_backend(client: Client, backend: ScriptedBackend) -> None:
    resp = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 8, "min_p": 0.05, "presence_penalty": 1,
        "frequency_penalty": -0.5, "repetition_penalty": 1.2, "logit_bias": {"7": -100},
        "allowed_token_ids": [5, 6, 7], "min_tokens": 2, "top_k": 0})
    assert resp.status == 200
    s = backend.submitted[-1].sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (
        0.05, 1.0, -0.5, 1.2)
    assert s.logit_bias == {7: -100.0} and s.allowed_token_ids == (5, 6, 7)
    assert (s.min_tokens, s.top_k, s.logprobs, s.grammar) == (2, 0, -1, "")


@GROUPED
async def test_a_stop_tokens_log_probability_is_reported_its_text_is_not(
    client: Client, backend: ScriptedBackend, tok: Any, grouped: bool
) -> None:
    """lm-evaluation-harness drops the generated token's entry (``[ctxlen:-1]``): it must be
    there even when that token is the end of sequence."""
    backend.burst = grouped
    eos = tok.eos_token_ids[0]
    backend.token_ids = [*tok.encode(" Paris", add_special_tokens=False), eos]
    backend.finish = "stop"
    prompt = tok.encode("Capital:", add_special_tokens=True)
    out = await (await client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 5, "logprobs": 1, "echo": True,
        "return_token_ids": True})).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == tok.tokenizer.decode(prompt, skip_special_tokens=False) + " Paris"
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) + len(backend.token_ids)
    assert lp["token_logprobs"][-1] == pytest.approx(scripted_logprobs(eos, 1).logprob)
    assert choice["token_ids"] == backend.token_ids


@GROUPED
async def test_token_ids_keep_the_tokens_whose_text_a_stop_string_held(
    client: Client, backend: ScriptedBackend, tok: Any, grouped: bool
) -> None:
    backend.burst = grouped
    backend.token_ids = tok.encode(" one two three", add_special_tokens=False)
    for stream in (False, True):
        resp = await client.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "stop": [" two three"], "stream": stream,
            "return_token_ids": True})
        if stream:
            chunks = await sse_chunks(resp)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            ids = chunks[-1]["choices"][0]["token_ids"]
            # an event per token that has something to say: none for the held one
            assert len(chunks) <= len(backend.token_ids)
        else:
            choice = (await resp.json())["choices"][0]
            text, ids = choice["text"], choice["token_ids"]
        assert text == " one"
        assert ids == backend.token_ids  # " two" was held, " three" matched
