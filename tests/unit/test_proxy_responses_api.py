"""``POST /v1/responses`` over the scripted backend: the chat request it becomes, the
response object and its stream as the OpenAI SDK reads them, errors naming its fields."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aegaeon_proxy.responses_api import chat_body
from openai.types.responses import Response
from proxy_support import MODEL, Client, ScriptedBackend

TOOL = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}


def test_input_items_become_chat_messages() -> None:
    body = chat_body({
        "model": MODEL, "instructions": "Be brief.", "max_output_tokens": 9, "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_time"},
        "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "object"}}},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Time?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_time",
             "arguments": '{"tz": "UTC"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
        ]})  # fmt: skip
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Time?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    assert body["max_completion_tokens"] == 9
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_time", "parameters": TOOL["parameters"]}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}


async def test_response_whole_streamed_and_errors(client: Client, backend: ScriptedBackend,
                                                  tok: Any) -> None:  # fmt: skip
    backend.token_ids = tok.encode(" Paris it is", add_special_tokens=False)
    body = {"model": MODEL, "input": "Capital of France?", "max_output_tokens": 50}
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == 200
    raw = await resp.json()
    out = Response.model_validate(raw)
    assert out.output_text == " Paris it is" and out.status == "incomplete"
    assert raw["incomplete_details"] == {"reason": "max_output_tokens"}
    assert raw["usage"]["output_tokens"] == len(backend.token_ids)
    assert raw["id"] == f"resp_{backend.submitted[-1].request_id}"
    # the chat endpoint's prompt for the same conversation
    chat = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Capital of France?"}]})
    assert chat.status == 200
    assert backend.submitted[-1].prompt_token_ids == backend.submitted[-2].prompt_token_ids
    stream = await client.post("/v1/responses", json={**body, "stream": True})
    events = []
    for frame in (await stream.read()).decode().split("\n\n"):
        if frame:
            name, data = frame.split("\n", 1)
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            events.append(event)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == " Paris it is"
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == text
    for extra, param in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                         ({"max_output_tokens": 0}, "max_output_tokens"),
                         ({"text": {"format": {"type": "json_schema", "name": "x",
                                               "schema": {"type": "objec"}}}},
                          "text.format.schema"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                          "input[0].content[0]"),
                         ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
                         ({"background": True}, "background")]:
        resp = await client.post("/v1/responses", json={**body, **extra})
        assert resp.status == 400, extra
        assert (await resp.json())["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
async def test_a_function_call_is_an_output_item(client: Client, backend: ScriptedBackend, tok: Any,
                                                 stream: bool) -> None:  # fmt: skip
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    backend.token_ids = tok.encode(call, add_special_tokens=False)
    backend.finish = "stop"
    body = {"model": MODEL, "input": "Time?", "tools": [TOOL], "tool_choice": "required",
            "max_output_tokens": 200, "stream": stream}  # fmt: skip
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == 200
    if stream:
        frames = [f for f in (await resp.read()).decode().split("\n\n") if f]
        raw = json.loads(frames[-1].split("\n", 1)[1].removeprefix("data: "))["response"]
    else:
        raw = await resp.json()
    out = Response.model_validate(raw)
    assert out.status == "completed"
    (item,) = out.output
    assert item.type == "function_call" and item.name == "get_time"
    assert json.loads(item.arguments) == {"tz": "UTC"}
    assert backend.submitted[-1].sampling.grammar  # required: forced by the grammar
