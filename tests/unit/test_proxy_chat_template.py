"""Chat templates render and tokenize exactly as transformers' apply_chat_template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest
from aegaeon_common.config import ModelConfig
from aegaeon_proxy.assets import ModelAssets, load_assets
from aegaeon_proxy.chat_template import ChatTemplate, ChatTemplateError
from aegaeon_proxy.errors import APIError
from aegaeon_proxy.prompts import chat_prompt

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is rain?"}],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "Another, please 🍐 — 谢谢"},
    ],
    [{"role": "user", "content": "  spaces around  \n"}],
    [{"role": "user", "content": "a <|eot_id|> [INST] <|im_end|> inside"}],
]


def _model_dirs(market: Path) -> list[Path]:
    return sorted(p for p in market.iterdir() if (p / "tokenizer_config.json").exists())


@pytest.fixture(scope="module")
def families(proxy_market: Path) -> list[tuple[ModelAssets, Any]]:
    transformers = pytest.importorskip("transformers")
    out = []
    seen = set()
    for path in _model_dirs(proxy_market):
        assets = load_assets(ModelConfig(name=path.name, path=path))
        assert assets.chat_template is not None
        if assets.chat_template.source in seen:
            continue  # one model per family
        seen.add(assets.chat_template.source)
        out.append((assets, transformers.AutoTokenizer.from_pretrained(str(path))))
    assert len(out) >= 3  # Llama-3, Mistral, ChatML
    return out


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_same_text_and_ids_as_transformers(families: list[tuple[ModelAssets, Any]],
                                           conversation: list[dict[str, Any]]) -> None:  # fmt: skip
    for assets, hf in families:
        assert assets.chat_template is not None
        ours = assets.chat_template.render(conversation, add_generation_prompt=True)
        theirs = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert ours == theirs, assets.name
        ids = chat_prompt({"messages": conversation}, assets).ids
        hf_ids = hf.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        if not isinstance(hf_ids, list):  # transformers 5 returns a BatchEncoding
            hf_ids = hf_ids["input_ids"]
        assert ids == hf_ids, assets.name


def test_special_tokens_are_not_added_twice(families: list[tuple[ModelAssets, Any]]) -> None:
    for assets, _ in families:
        ids = chat_prompt({"messages": CONVERSATIONS[0]}, assets).ids
        assert assets.chat_template is not None
        bos = assets.tokenizer.token_to_id(assets.chat_template.special_tokens.get("bos_token", ""))
        if bos is not None:
            assert ids.count(bos) == 1, assets.name


def test_list_of_text_parts_equals_joined_string(families: list[tuple[ModelAssets, Any]]) -> None:
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]
    for assets, _ in families:
        as_parts = chat_prompt({"messages": [{"role": "user", "content": parts}]}, assets).ids
        joined = {"messages": [{"role": "user", "content": "first part\nsecond part"}]}
        assert as_parts == chat_prompt(joined, assets).ids


def test_raise_exception_is_a_client_error(families: list[tuple[ModelAssets, Any]]) -> None:
    # the Mistral template refuses roles that do not alternate
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    refused = 0
    for assets, hf in families:
        try:
            hf.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError:
            refused += 1
            with pytest.raises(APIError) as info:
                chat_prompt({"messages": bad}, assets)
            assert info.value.status == 400
            assert info.value.param == "messages"
    assert refused >= 1


def test_template_features() -> None:
    source = (
        "{% for m in messages %}{{ m.content | tojson }}{% if loop.last %}{% break %}{% endif %}"
        "{% endfor %}{% generation %}[{{ bos_token }}]{% endgeneration %}"
        "{% if messages|length > 2 %}{{ raise_exception('too many') }}{% endif %}"
    )
    template = ChatTemplate(source, {"bos_token": "<s>"})
    assert template.content_format == "string"
    assert template.render([{"role": "user", "content": "<é>"}]) == '"<é>"[<s>]'
    with pytest.raises(ChatTemplateError, match="too many"):
        template.render([{"role": "user", "content": "x"}] * 3)


def test_openai_content_format_keeps_parts() -> None:
    source = (
        "{% for m in messages %}{% for p in m['content'] %}({{ p.text }}){% endfor %}{% endfor %}"
    )
    template = ChatTemplate(source, {})
    assert template.content_format == "openai"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert template.render([{"role": "user", "content": parts}]) == "(a)(b)"
