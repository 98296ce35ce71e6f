"""Tool calls (setup, prompts, parsing whole and streamed, the forcing grammar) and
structured-output constraints (which field, llguidance's grammar, 400s naming the field)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest
from aegaeon_common.config import ModelConfig
from aegaeon_proxy.assets import ModelAssets, load_assets
from aegaeon_proxy.chat_template import ChatTemplate
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.prompts import chat_prompt, render_chat
from aegaeon_proxy.structured import constraint_of, grammar_for
from aegaeon_proxy.tool_calls import ToolCallParser, tool_format, tool_setup
from proxy_support import MODEL, Client, ScriptedBackend, sse_chunks

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
          '{"tz": "CET"}}\n</tool_call>')


@pytest.fixture(scope="module")
def assets(proxy_market: Path) -> ModelAssets:
    return load_assets(ModelConfig(name=MODEL, path=proxy_market / MODEL))


def _parser(fmt: Any = "hermes", parallel: bool = True) -> ToolCallParser:
    return ToolCallParser(fmt, frozenset({"get_weather", "get_time"}), parallel)


def test_hermes_calls_parse_whole_and_streamed_alike() -> None:
    content, calls = _parser().whole(HERMES)
    assert content == "Let me check."
    assert calls is not None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "CET"})]
    for size in (1, 3, 7, 40):  # whatever the pieces, the fragments assemble to the calls
        parser = _parser()
        text, fragments = "", []
        pieces = [HERMES[i:i + size] for i in range(0, len(HERMES), size)]
        for k, piece in enumerate(pieces):
            got, frags = parser.push(piece, final=k == len(pieces) - 1)
            text += got
            fragments += frags
        assembled: dict[int, dict[str, str]] = {}
        for f in fragments:
            call = assembled.setdefault(f["index"], {"name": "", "arguments": ""})
            call["name"] += f["function"].get("name") or ""
            call["arguments"] += f["function"]["arguments"]
        assert text.strip() == "Let me check." and parser.called
        assert [(c["name"], json.loads(c["arguments"])) for c in assembled.values()] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text", [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>",
    "<tool_call>\n{\"name\": \"launch_rockets\", \"arguments\": {}}\n</tool_call>",
    "<tool_call>\n[1, 2]\n</tool_call>", "no call here <tool_ca",
])  # fmt: skip
def test_broken_calls_stay_text(text: str) -> None:
    assert _parser().whole(text) == (text, None)
    parser = _parser()
    got, fragments = parser.push(text[:10])
    more, frags = parser.push(text[10:], final=True)
    assert got + more == text and fragments + frags == [] and not parser.called


def test_llama_json_calls_and_one_call_without_parallel() -> None:
    text = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; ' \
           '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}'
    content, calls = _parser("llama3_json").whole(text)
    assert content == "" and calls is not None and len(calls) == 2
    _, one = _parser("llama3_json", parallel=False).whole(text)
    assert one is not None and len(one) == 1
    assert _parser("llama3_json").whole("It is sunny.") == ("It is sunny.", None)
    parser = _parser("llama3_json")
    assert parser.push("It is") == ("It is", [])  # not JSON: streamed as it comes


def test_tool_choice_checks() -> None:
    template = ChatTemplate("{{ messages }}", {})
    assert tool_setup({}, None, template) is None
    assert tool_setup({"tool_choice": "none"}, TOOLS, template) is None
    setup = tool_setup({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                       TOOLS, template)
    assert setup is not None and setup.named == "get_time"
    for body, param in [({"tool_choice": "always"}, "tool_choice"),
                        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"parallel_tool_calls": "no"}, "parallel_tool_calls")]:
        with pytest.raises(APIError) as err:
            tool_setup(body, TOOLS, template)
        assert err.value.param == param
    with pytest.raises(APIError) as err:
        tool_setup({"tool_choice": "required"}, None, template)
    assert err.value.param == "tool_choice"
    assert tool_format(ChatTemplate("{{ '<|python_tag|>' }}", {})) == "llama3_json"


def test_a_template_without_tools_gets_them_as_hermes(assets: ModelAssets) -> None:
    assert assets.chat_template is not None and not assets.chat_template.takes_tools
    turn = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    text = render_chat({"messages": turn}, assets, TOOLS)
    assert "<tools>" in text and '"get_time"' in text  # the functions are listed
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text
    prompt = chat_prompt({"messages": turn, "tools": TOOLS, "tool_choice": "none"}, assets)
    shown = assets.tokenizer.decode(prompt.ids)
    assert prompt.tools is None and "<tools>" not in shown  # "none": no tools shown


def _tokenizer(assets: ModelAssets, path: Path) -> llguidance.LLTokenizer:
    config = json.loads((path / "config.json").read_text())
    return llguidance.LLTokenizer((path / "tokenizer.json").read_text(),
                                  n_vocab=config["vocab_size"],
                                  eos_token=list(assets.eos_token_ids))  # fmt: skip


def _follows(tok: llguidance.LLTokenizer, assets: ModelAssets, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    ids = assets.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_required_and_named_grammars_force_valid_calls(assets: ModelAssets,
                                                       proxy_market: Path) -> None:  # fmt: skip
    tok = _tokenizer(assets, proxy_market / MODEL)
    template = ChatTemplate("{{ messages }}", {})
    required = tool_setup({"tool_choice": "required"}, TOOLS, template)
    assert required is not None and required.grammar() is not None
    grammar = asyncio.run(grammar_for(constraint_of({}, required)))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert _follows(tok, assets, grammar, call)
    assert _follows(tok, assets, grammar, call + "\n" + call)  # parallel calls
    assert not _follows(tok, assets, grammar, call.replace('"UTC"', "5"))  # off the schema
    assert not _follows(tok, assets, grammar, call.replace("tz", "zone"))  # closed object
    assert not _follows(tok, assets, grammar, "Sure! " + call)  # a call, nothing else
    named = tool_setup({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                       TOOLS, template)
    grammar = asyncio.run(grammar_for(constraint_of({}, named)))
    assert not _follows(tok, assets, grammar, call)  # another function
    ok = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}' \
         "\n</tool_call>"
    assert _follows(tok, assets, grammar, ok)
    jsonschema.validate(json.loads(ok.split("\n")[1])["arguments"], WEATHER)


@pytest.mark.parametrize(("body", "kind"), [
    ({"response_format": {"type": "json_object"}}, "json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": WEATHER,
                                                                 "strict": True}}}, "json"),
    ({"guided_json": json.dumps(WEATHER)}, "json"), ({"guided_regex": "[a-z]+"}, "regex"),
    ({"guided_choice": ["yes", "no"]}, "lark"), ({"guided_grammar": 'start: "a"+'}, "grammar"),
    ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "lark"),
    ({"structured_outputs": {"json": WEATHER}}, "json"),
    ({"response_format": {"type": "text"}}, None),
])  # fmt: skip
def test_each_way_to_ask_for_structure(body: dict[str, Any], kind: str | None) -> None:
    constraint = constraint_of(body)
    assert (constraint.kind if constraint else None) == kind
    grammar = asyncio.run(grammar_for(constraint))
    assert bool(grammar) == (kind is not None)
    if kind is not None:
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_strict_closes_objects(assets: ModelAssets, proxy_market: Path) -> None:
    tok = _tokenizer(assets, proxy_market / MODEL)
    doc = '{"city": "Paris", "unit": "c", "extra": 1}'
    for strict, ok in ((False, True), (True, False)):
        spec = {"name": "w", "schema": WEATHER, "strict": strict}
        grammar = asyncio.run(grammar_for(constraint_of(
            {"response_format": {"type": "json_schema", "json_schema": spec}})))
        assert _follows(tok, assets, grammar, doc) is ok


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"), ({"guided_json": {"minimum": "x"}},
                                                    "guided_json"),
    ({"guided_regex": "[a-z"}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"structured_outputs": {"json": WEATHER, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as err:
        asyncio.run(grammar_for(constraint_of(body)))
    assert (err.value.status, err.value.param) == (400, param)


async def test_tool_calls_through_the_front(client: Client, backend: ScriptedBackend,
                                            tok: Any) -> None:  # fmt: skip
    backend.token_ids = tok.encode(HERMES, add_special_tokens=False)
    backend.finish = "stop"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": TOOLS, "max_tokens": 200}  # fmt: skip
    out = await (await client.post("/v1/chat/completions", json=body)).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == [
        "get_weather", "get_time"]
    assert backend.submitted[-1].sampling.grammar == ""  # auto: nothing forced
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = await sse_chunks(resp)
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    fragments = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
    args: dict[int, str] = {}
    for f in fragments:
        args[f["index"]] = args.get(f["index"], "") + f["function"]["arguments"]
    assert [json.loads(a) for a in args.values()] == [
        json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    forced = await client.post("/v1/chat/completions",
                               json={**body, "tool_choice": "required"})
    assert forced.status == 200 and backend.submitted[-1].sampling.grammar  # forced
    bad = await client.post("/v1/chat/completions", json={
        **body, "tool_choice": "required", "response_format": {"type": "json_object"}})
    assert (await bad.json())["error"]["param"] == "response_format"
