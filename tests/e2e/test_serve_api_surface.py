"""Through `aegaeon serve` (the shared node): the API surface clients of vLLM call beyond
plain generation — request ids, the access log, /tokenize, /detokenize, /version,
vLLM's integer priority, unknown fields refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from http_support import call_json, fetch_sync
from serve_harness import Served, until
from tokenizers import Tokenizer


def _model(served: Served, k: int = 0) -> str:
    return [m.id for m in served.client().models.list().data][k]


def test_tokenize_ids_equal_the_models_tokenizer(served: Served, small_market: Path) -> None:
    model = _model(served)
    tokenizer = Tokenizer.from_file(str(small_market / model / "tokenizer.json"))
    text = "Tokenize me, please: 42 🚀"
    status, out = call_json(served.url, "POST", "/tokenize", {"model": model, "prompt": text})
    assert status == 200
    assert out["tokens"] == tokenizer.encode(text, add_special_tokens=True).ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    status, back = call_json(served.url, "POST", "/detokenize",
                             {"model": model, "tokens": out["tokens"]})
    assert status == 200
    assert back["prompt"] == tokenizer.decode(out["tokens"], skip_special_tokens=False)
    # chat messages: the ids the chat endpoint prefills (usage counts them)
    messages = [{"role": "user", "content": text}]
    status, chat = call_json(served.url, "POST", "/tokenize",
                             {"model": model, "messages": messages})
    assert status == 200
    reply = served.client().chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=1)
    assert reply.usage is not None and reply.usage.prompt_tokens == chat["count"]
    status, version = call_json(served.url, "GET", "/version")
    assert status == 200 and isinstance(version["version"], str)


def test_request_id_travels_to_the_stats_and_the_access_log(served: Served) -> None:
    model = _model(served)
    body = {"model": model, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True,
            "priority": 0}  # vLLM's integer priority
    reply = fetch_sync("POST", served.base_url + "/completions", body,
                       {"X-Request-Id": "e2e-trace-7"})
    assert reply.status == 200 and reply.header("X-Request-Id") == "e2e-trace-7"
    assert reply.json()["id"] == "cmpl-e2e-trace-7"

    def recorded() -> bool:
        stats = served.get_json("/v1/aegaeon/stats")
        timings = stats["timings"]
        assert isinstance(timings, list)
        return any(t["request_id"] == "e2e-trace-7" for t in timings)

    until("the request's timing record", recorded, 10)

    def logged() -> dict[str, Any] | None:
        for line in (served.run_dir / "proxy.log").read_text(errors="replace").splitlines():
            if '"request_done"' in line and "e2e-trace-7" in line:
                return dict(json.loads(line[line.index("{"):]))
        return None

    line = until("the access log line", logged, 10)
    assert line["level"] == "info" and line["status"] == 200 and line["model"] == model
    assert line["prompt_tokens"] > 0 and line["output_tokens"] == 3
    assert line["ttft_s"] > 0 and line["total_s"] >= line["ttft_s"]


@pytest.mark.parametrize(("field", "value"), [("guided_jsn", {"type": "object"}),
                                              ("use_beam_search", True)])
def test_an_unknown_or_unsupported_field_is_a_400_naming_it(served: Served, field: str,
                                                            value: Any) -> None:  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model=_model(served), prompt="x", max_tokens=1,
                                           extra_body={field: value})
    assert info.value.body is not None
    assert info.value.body["param"] == field  # type: ignore[index]


def _engine(model_dir: Path) -> Any:
    from aegaeon_engine import LLM

    return LLM(model_dir, dtype="bfloat16")


def test_prompt_logprobs_equal_the_engine_alone(served: Served, small_market: Path) -> None:
    """Completions' echo and logprobs (what lm-evaluation-harness reads): the prompt's
    log-probabilities are the engine's own, from its raw logits."""
    model = _model(served)
    prompt = [5, 17, 99, 3, 250, 41, 7, 12, 600, 33]
    out = served.client().completions.create(model=model, prompt=prompt, max_tokens=1,
                                             temperature=0, logprobs=3, echo=True)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt) + 1
    llm = _engine(small_market / model)
    blocks = list(range(llm.kv_shape.blocks_for(len(prompt))))
    _, scored = llm.engine.prefill_scored(prompt, blocks, 3)
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx([s.logprob for s in scored],
                                                             abs=1e-3)
    for k, s in enumerate(scored, start=1):
        top = lp.top_logprobs[k]
        assert top is not None and max(top.values()) == pytest.approx(s.top_logprobs[0], abs=1e-3)
    # the generated token, greedy: the most likely one
    last = lp.top_logprobs[-1]
    assert last is not None and lp.token_logprobs[-1] == pytest.approx(max(last.values()))


def test_n_choices_logit_bias_and_allowed_tokens(served: Served) -> None:
    client, model = served.client(), _model(served)
    args: dict[str, Any] = dict(model=model, prompt="Once upon", max_tokens=6, temperature=1.0,
                                seed=9, n=3, extra_body={"ignore_eos": True})
    first = client.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1  # each sequence samples its own
    assert [c.text for c in client.completions.create(**args).choices] == [
        c.text for c in first.choices]  # seeded: the same three again
    assert first.usage is not None and first.usage.completion_tokens == 18
    raw = client.completions.with_raw_response.create(
        model=model, prompt="Once upon", max_tokens=4, temperature=0,
        logit_bias={"42": 100}, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert json.loads(raw.text)["choices"][0]["token_ids"] == [42] * 4
    raw = client.completions.with_raw_response.create(
        model=model, prompt="Once upon", max_tokens=8, temperature=1.5, extra_body={
            "ignore_eos": True, "return_token_ids": True, "allowed_token_ids": [7, 8, 9]})
    assert set(json.loads(raw.text)["choices"][0]["token_ids"]) <= {7, 8, 9}


BOUNDED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "colour": {"enum": ["red", "green", "blue"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"], "additionalProperties": False},
}, "required": ["name", "colour", "age", "tags", "address"], "additionalProperties": False}


def test_structured_outputs_hold_even_for_a_random_model(served: Served) -> None:
    import jsonschema

    client, model = served.client(), _model(served, 1)
    messages: Any = [{"role": "user", "content": "A person, please."}]
    for _ in range(3):
        out = client.chat.completions.create(model=model, messages=messages, temperature=1.0,
                                             max_tokens=200, response_format={
                                                 "type": "json_schema", "json_schema": {
                                                     "name": "p", "schema": BOUNDED}})
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), BOUNDED)
        choice = client.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                                temperature=1.0,
                                                extra_body={"guided_choice": ["yes", "no"]})
        assert choice.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=messages, extra_body={
            "guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}})
    assert info.value.body["param"] == "guided_json"  # type: ignore[index]


def test_forced_tool_calls_are_schema_valid_streamed_and_not(served: Served) -> None:
    import jsonschema

    client, model = served.client(), _model(served, 2)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"]}  # fmt: skip
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    messages: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    whole = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                           tool_choice="required", max_tokens=120)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = whole.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls)  # type: ignore[union-attr]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params)  # type: ignore[union-attr]
    args: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(
            model=model, messages=messages, tools=tools, max_tokens=120, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for choice in chunk.choices:
            for t in choice.delta.tool_calls or []:
                args[t.index] = args.get(t.index, "") + (t.function.arguments or "")
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and args
    for text in args.values():
        jsonschema.validate(json.loads(text), params)


def test_responses_output_text_equals_the_chat_greedy_text(served: Served) -> None:
    client, model = served.client(), _model(served)
    text = "Tell me about rivers."
    chat = client.chat.completions.create(model=model, messages=[{"role": "user",
                                                                  "content": text}],
                                          max_tokens=12, temperature=0)  # fmt: skip
    response = client.responses.create(model=model, input=text, max_output_tokens=12,
                                       temperature=0)
    assert response.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model, input=text, previous_response_id="resp_x")
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
