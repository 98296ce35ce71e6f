"""Incremental detokenizing: never a partial character, same text as one decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from aegaeon_proxy.detokenizer import REPLACEMENT, IncrementalDetokenizer
from aegaeon_proxy.stop_strings import StopStringMatcher
from tokenizers import Tokenizer

TEXTS = [
    "Hello 世界! 🎉🎉 naïve café — 😀👍🏽 日本語のテキスト",
    "👨‍👩‍👧‍👦 family, 🇫🇷 flag, ½ ∑ ∞ Ωmega",
    "plain ascii text, nothing special.",
    "中文测试：你好，世界。한국어 텍스트 العربية",
]


@pytest.fixture(scope="module")
def tokenizers(proxy_market: Path) -> list[Tokenizer]:
    dirs = sorted(p for p in proxy_market.iterdir() if (p / "tokenizer.json").exists())
    return [Tokenizer.from_file(str(d / "tokenizer.json")) for d in dirs]


def _stream(tok: Tokenizer, ids: list[int], step: int = 1) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    tail = detok.finish()
    return deltas, tail


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_streamed_text_equals_one_decode(tokenizers: list[Tokenizer], text: str, step: int) -> None:
    for tok in tokenizers:
        ids = tok.encode(text, add_special_tokens=False).ids
        deltas, tail = _stream(tok, ids, step)
        assert "".join(deltas) + tail == tok.decode(ids) == text
        assert tail == ""  # valid text needs nothing held back at the end
        for delta in deltas:
            assert REPLACEMENT not in delta


def test_multibyte_characters_are_split_across_tokens(tokenizers: list[Tokenizer]) -> None:
    # the point of the test: these tokenizers really do split an emoji into bytes
    tok = tokenizers[0]
    ids = tok.encode("🎉", add_special_tokens=False).ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_random_ids_match_one_decode(tokenizers: list[Tokenizer]) -> None:
    # arbitrary ids make invalid UTF-8; the total must still equal one decode
    rng = random.Random(7)
    for tok in tokenizers:
        vocab = tok.get_vocab_size()
        for _ in range(40):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            deltas, tail = _stream(tok, ids, rng.choice([1, 2, 5]))
            assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_not_shown(tokenizers: list[Tokenizer]) -> None:
    tok = tokenizers[0]
    special = next(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
    ids = [*tok.encode("Hi", add_special_tokens=False).ids, tok.token_to_id(special)]
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == "Hi"


@pytest.mark.parametrize(
    ("deltas", "stop", "sent", "stopped"),
    [
        (["Hello", " wor", "ld", "!"], ["world"], "Hello ", True),
        (["abc", "de"], ["xyz"], "abcde", False),
        (["ab", "c"], ["abc", "bc"], "", True),  # earliest match wins
        (["x<", "|e", "nd|>tail"], ["<|end|>"], "x", True),
        (["ends with wo"], ["world"], "ends with wo", False),  # held, then flushed
        (["a", "b", "a", "b", "a", "c"], ["abac"], "ab", True),
    ],
)
def test_stop_strings(deltas: list[str], stop: list[str], sent: str, stopped: bool) -> None:
    matcher = StopStringMatcher(stop)
    out = []
    for delta in deltas:
        out.append(matcher.push(delta))
        if matcher.stopped:
            break
    out.append(matcher.flush())
    assert "".join(out) == sent
    assert matcher.stopped == stopped


def test_stop_prefix_is_held_back_not_streamed() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("go ST") == "go "
    assert matcher.push("A") == "STA"  # no longer a prefix of STOP
    assert matcher.push("ST") == ""
    assert matcher.push("OP and more") == ""
    assert matcher.stopped
