"""Request validation: every bad field is a 400 naming it; good values normalize."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aegaeon_common.config import ModelConfig
from aegaeon_proxy.assets import ModelAssets, load_assets
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.params import CHAT_FIELDS, FIELDS, parse_common
from aegaeon_proxy.prompts import build_request, chat_prompt, completion_prompt_ids

BASE = {"model": "m"}


@pytest.fixture(scope="module")
def assets(proxy_market: Path) -> ModelAssets:
    path = next(p for p in sorted(proxy_market.iterdir()) if p.name.startswith("llama"))
    return load_assets(ModelConfig(name=path.name, path=path))


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"model": 3}, "model"),
    ({"model": ""}, "model"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": "42"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 1 << 63}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 5]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": "1"}, "stop_token_ids"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": []}, "stream_options"),
    ({"stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ({"ignore_eos": 1}, "ignore_eos"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS)
def test_bad_field_is_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_common({**BASE, **fields}, FIELDS)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_good_fields_normalize() -> None:
    params = parse_common(
        {
            **BASE, "max_tokens": 5.0, "temperature": 0, "top_p": 1, "top_k": 0, "seed": -3,
            "stop": "x", "stop_token_ids": [1, 2], "stream": True, "n": 1,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "presence_penalty": 0, "logprobs": None, "user": "u",
        },
        FIELDS,
    )  # fmt: skip
    assert params.max_tokens == 5  # as asked: resolved against the window per request
    s = params.sampling  # the wire's shape, filled from the body
    assert s.temperature == 0.0
    assert s.top_k == 0  # off
    assert s.seed == (1 << 63) - 3  # OpenAI's int64, folded into [0, 2**63)
    assert params.stop == ("x",)
    assert s.stop_token_ids == (1, 2)
    assert params.stream and params.include_usage and s.ignore_eos
    assert s.logprobs == -1


def test_chat_logprobs_fill_one_count() -> None:
    def count(**fields: Any) -> int:
        return parse_common({**BASE, **fields}, CHAT_FIELDS).sampling.logprobs

    assert count() == -1 and count(logprobs=False) == -1 and count(logprobs=True) == 0
    assert count(logprobs=True, top_logprobs=5) == 5
    assert count(logprobs=False, top_logprobs=0) == -1
    with pytest.raises(APIError) as info:
        count(top_logprobs=2)
    assert info.value.param == "top_logprobs"


UNSUPPORTED: list[tuple[dict[str, Any], str]] = [
    ({"unknown_field": [1]}, "unknown_field"),
    ({"guided_jsn": {}}, "guided_jsn"),  # a typo is named, not dropped
    ({"best_of": 3}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ({"audio": {"voice": "x"}}, "audio"),
]


@pytest.mark.parametrize(("fields", "param"), UNSUPPORTED)
def test_unknown_or_unsupported_field_is_400_naming_it(fields: dict[str, Any],
                                                       param: str) -> None:  # fmt: skip
    from aegaeon_proxy.intake import CHAT_COMPLETIONS, COMPLETIONS
    from aegaeon_proxy.request_fields import check_fields

    for endpoint in (CHAT_COMPLETIONS, COMPLETIONS):
        with pytest.raises(APIError) as info:
            check_fields({**BASE, **fields}, endpoint.known)
        assert (info.value.status, info.value.param) == (400, param)
        assert info.value.code == "unsupported_field"


def test_harmless_and_default_fields_pass() -> None:
    from aegaeon_proxy.intake import CHAT_COMPLETIONS
    from aegaeon_proxy.request_fields import HARMLESS, check_fields

    body = {**BASE, "messages": [], "use_beam_search": False, "length_penalty": 1.0,
            "best_of": 1, "modalities": ["text"], **dict.fromkeys(HARMLESS, "x")}
    check_fields(body, CHAT_COMPLETIONS.known)
    assert {"user", "metadata", "store", "service_tier"} <= HARMLESS


@pytest.mark.parametrize(("value", "name"), [(0, "standard"), (-3, "interactive"),
                                             (1, "batch"), (7.0, "batch"),
                                             ("interactive", "interactive")])  # fmt: skip
def test_priority_takes_vllm_integers(value: Any, name: str) -> None:
    assert parse_common({**BASE, "priority": value}, FIELDS).priority == name


def test_max_completion_tokens_wins_for_chat() -> None:
    params = parse_common({**BASE, "max_tokens": 5, "max_completion_tokens": 7}, CHAT_FIELDS)
    assert params.max_tokens == 7


@pytest.mark.parametrize(
    ("prompt", "param"),
    [(None, "prompt"), (5, "prompt"), ([], "prompt"), (["a", "b"], "prompt"), ([1, "a"], "prompt"),
     ([10**9], "prompt"), ([-1], "prompt"), ([True], "prompt"), ({"a": 1}, "prompt")],
)  # fmt: skip
def test_bad_completion_prompt(assets: ModelAssets, prompt: Any, param: str) -> None:
    with pytest.raises(APIError) as info:
        completion_prompt_ids({"prompt": prompt}, assets)
    assert (info.value.status, info.value.param) == (400, param)


def test_completion_prompt_forms(assets: ModelAssets) -> None:
    ids = completion_prompt_ids({"prompt": "hi there"}, assets)
    assert ids[0] == assets.tokenizer.token_to_id("<|begin_of_text|>")  # BOS added once
    assert completion_prompt_ids({"prompt": ["hi there"]}, assets) == ids
    assert completion_prompt_ids({"prompt": [ids]}, assets) == ids
    assert completion_prompt_ids({"prompt": ids}, assets) == ids


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        ([1], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            "messages[0].content[0].text",
        ),
    ],
)
def test_bad_messages(assets: ModelAssets, messages: Any, param: str) -> None:
    with pytest.raises(APIError) as info:
        chat_prompt({"messages": messages}, assets)
    assert (info.value.status, info.value.param) == (400, param)


def test_context_window(assets: ModelAssets) -> None:
    window = assets.max_model_len
    params = parse_common({**BASE, "max_tokens": 10}, FIELDS)
    req = build_request("r", params, [1] * (window - 10), assets, chat=False)
    assert req.sampling.max_tokens == 10
    with pytest.raises(APIError) as info:
        build_request("r", params, [1] * (window - 9), assets, chat=False)
    assert (info.value.param, info.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(APIError) as info:
        build_request("r", params, [1] * window, assets, chat=True)
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")
    unbounded = parse_common(BASE, FIELDS)
    assert (
        build_request("r", unbounded, [1] * 5, assets, chat=True).sampling.max_tokens == window - 5
    )
    assert build_request("r", unbounded, [1] * 5, assets, chat=False).sampling.max_tokens == 16


def test_eos_added_unless_ignore_eos(assets: ModelAssets) -> None:
    assert assets.eos_token_ids
    req = build_request("r", parse_common({**BASE, "stop_token_ids": [5]}, FIELDS), [1], assets,
                        chat=False)  # fmt: skip
    assert req.sampling.stop_token_ids == (5, *assets.eos_token_ids)
    ignore = parse_common({**BASE, "stop_token_ids": [5], "ignore_eos": True}, FIELDS)
    req = build_request("r", ignore, [1], assets, chat=False)
    assert req.sampling.stop_token_ids == (5,)
    assert req.sampling.ignore_eos
    with pytest.raises(APIError) as info:
        build_request("r", parse_common({**BASE, "stop_token_ids": [10**7]}, FIELDS), [1], assets,
                      chat=False)  # fmt: skip
    assert info.value.param == "stop_token_ids"
