"""The real SmolLM2-135M-Instruct (and its Q4_1 import) through `aegaeon serve`, as the
OpenAI SDK and evaluation harnesses use it: structured outputs parsed by the SDK, a
tool-calling loop, ``tool_choice: "auto"`` never answering broken JSON as a call, and
prompt log-probabilities as transformers computes them.

``AEGAEON_API_SAMPLES`` sets how many sampled requests each check makes, every one of
which must pass (default 6 here, to keep CI short; docs/results.md records runs of 20,
the issue's bar).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Annotated, Any

import jsonschema
import openai
import pytest
import torch
from lora_support import peft_prompt_logprobs
from pydantic import BaseModel, Field
from real_market import REAL, real_market_dir
from serve_harness import Served

SAMPLES = int(os.environ.get("AEGAEON_API_SAMPLES", "6"))
QUANTIZED = f"{REAL}-q4"
Short = Annotated[str, Field(max_length=24)]


class Colour(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: Short
    country: Short


class Person(BaseModel):
    name: Short
    age: int = Field(ge=0, le=120)
    favourite: Colour
    address: Address
    hobbies: list[Short] = Field(max_length=3)


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}  # fmt: skip
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
        "required": ["timezone"]}  # fmt: skip
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The weather in a city now"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                      "description": "The time in a timezone now"}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# room for a whole call (one required call here takes 31-38 tokens, three 110), not for a
# long answer: most answers are cut at it
AUTO_MAX_TOKENS = 64
QUESTIONS = ["What's the weather in Paris?", "What time is it in Tokyo?",
             "Is it raining in London?", "What's the time in New York?"]


def _many(fn: Any, n: int = SAMPLES, workers: int = 4) -> list[Any]:
    with ThreadPoolExecutor(workers) as pool:  # batched on the instances, within the
        return list(pool.map(fn, range(n)))  # default node's admission bounds


@pytest.mark.parametrize("model", [REAL, QUANTIZED])
def test_sdk_parse_of_a_pydantic_model_at_temperature_one(real_served: Served, model: str) -> None:
    client = real_served.client(600)

    def ask(k: int) -> Person | None:
        out = client.beta.chat.completions.parse(
            model=model, response_format=Person, temperature=1.0, max_tokens=300, seed=k,
            messages=[{"role": "user", "content": "Describe a person as JSON."}])
        return out.choices[0].message.parsed

    people = _many(ask)
    assert all(isinstance(p, Person) for p in people)  # every one parsed
    assert len({p.model_dump_json() for p in people}) > 1  # sampled, not one answer


def _check_call(call: Any) -> None:
    assert call.type == "function" and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_call(client: openai.OpenAI, **args: Any) -> tuple[list[Any], str | None]:
    with client.beta.chat.completions.stream(**args) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    return list(choice.message.tool_calls or []), choice.finish_reason


@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_loop_with_required_calls(real_served: Served, streamed: bool) -> None:
    client = real_served.client(600)

    def loop(k: int) -> str | None:
        messages: Any = [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
        args: dict[str, Any] = dict(model=REAL, messages=messages, tools=TOOLS,
                                    tool_choice="required", max_tokens=160, seed=k)
        if streamed:
            calls, finish = _streamed_call(client, **args)
        else:
            choice = client.chat.completions.create(**args).choices[0]
            calls, finish = list(choice.message.tool_calls or []), choice.finish_reason
        assert finish == "tool_calls" and calls
        for call in calls:
            _check_call(call)
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls]})  # fmt: skip
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"result": "18 degrees, 14:05"})})
        answer = client.chat.completions.create(model=REAL, messages=messages, tools=TOOLS,
                                                max_tokens=48, seed=k).choices[0]
        for call in answer.message.tool_calls or []:
            _check_call(call)
        return answer.finish_reason

    assert set(_many(loop)) <= {"stop", "length", "tool_calls"}


def test_auto_either_calls_or_answers_never_broken_json(real_served: Served) -> None:
    client = real_served.client(600)

    def ask(k: int) -> str:
        choice = client.chat.completions.create(
            model=REAL, messages=[{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
            tools=TOOLS, tool_choice="auto", max_tokens=AUTO_MAX_TOKENS, temperature=1.0,
            seed=k).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                _check_call(call)
            return "call"
        assert choice.finish_reason in ("stop", "length") and choice.message.content
        return "answer"

    assert set(_many(ask)) <= {"call", "answer"}


def test_prompt_logprobs_are_transformers(real_served: Served) -> None:
    """What lm-evaluation-harness's loglikelihood reads (echo, prompt log-probabilities)
    against transformers in float32 on the same weights; bounded by how far transformers
    itself moves between float32 and bfloat16."""
    from transformers import AutoTokenizer

    model_dir = real_market_dir() / REAL
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("Question: What is the capital of France?\nAnswer: Paris").input_ids
    out = real_served.client(600).completions.create(model=REAL, prompt=ids, max_tokens=1,
                                             temperature=0, logprobs=1, echo=True)
    served_lps = out.choices[0].logprobs.token_logprobs[1:len(ids)]  # type: ignore[union-attr]
    f32, bf16 = (peft_prompt_logprobs(model_dir, None, ids, dtype)
                 for dtype in (torch.float32, torch.bfloat16))
    ours = torch.tensor(served_lps, dtype=torch.float32)
    assert (ours - f32).abs().max() <= (bf16 - f32).abs().max()
