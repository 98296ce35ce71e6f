"""``aegaeon serve --tp 2`` on the CPU: every instance a group of two processes over gloo.

The README's default market (SmolLM2-135M-Instruct twice, bfloat16 and Q4_1, and 8
random models) served by tensor-parallel instances against the same market served by
single-device ones, both in float32: every model's greedy tokens are the same, and
the README's question gets the README's answer. Six of the random models split two
ways (sharded: both ranks compute, their partial sums all-reduced); SmolLM2 (9 heads),
its Q4_1 blocks and the two random models whose heads do not divide run whole on each
group's first process. In bfloat16 a sharded model's tokens may drift from a single
device's after some tokens (its partial sums are rounded before the reduce, as in
any tensor-parallel engine): float32 makes the comparison exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_support import get_text
from real_market import REAL, real_market_dir
from serve_harness import Served, serve_config, serving_all

PROMPTS = ["Once upon a time", "The three primary colors are"]
NUM_TOKENS = 16
SHARDED = {"llama-gqa-5m", "qwen3-28m", "llama-46m", "mistral-63m", "qwen2-77m", "qwen3-103m"}


@pytest.fixture(scope="module")
def readme_market() -> Path:
    """The README's default market (`./scripts/serve` builds it), kept across sessions."""
    return real_market_dir("readme-default", {})


@pytest.fixture(scope="module")
def nodes(readme_market: Path, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[tuple[Served, Served]]:  # fmt: skip
    config = serve_config(readme_market, dtype="float32")
    root = tmp_path_factory.mktemp("serve-tp")
    # two independent nodes: the second starts while the first does (each node's
    # cachemgr fills its Model Cache on one thread)
    with serving_all([(readme_market, root / "tp2", ("--tp", "2"), config),
                      (readme_market, root / "tp1", (), config)]) as (tp2, tp1):  # fmt: skip
        yield tp2, tp1


def _greedy(served: Served, model: str, prompt: str) -> str:
    out = served.post_json("/v1/completions", {"model": model, "prompt": prompt, "temperature": 0,
                                               "max_tokens": NUM_TOKENS, "ignore_eos": True},
                           timeout_s=300)  # fmt: skip
    assert out["usage"]["completion_tokens"] == NUM_TOKENS
    return str(out["choices"][0]["text"])


def test_every_instance_is_a_group_of_two_processes(nodes: tuple[Served, Served]) -> None:
    tp2, tp1 = nodes
    # (a follower's process title: aegaeon-<instance>.r<rank>)
    assert sorted(_followers(tp2)) == ["aegaeon-decode-0.r1", "aegaeon-prefill-0.r1"]
    assert not _followers(tp1)
    # a sharded model's Model Cache region holds both shards: larger than its one-device
    # layout (its embeddings and norms are in each shard); a whole one is the same size
    regions = {m["name"]: m["nbytes"] for m in _cache_models(tp2)}
    whole = {m["name"]: m["nbytes"] for m in _cache_models(tp1)}
    for model in SHARDED & set(regions) & set(whole):
        assert regions[model] > whole[model], model
    for model in ({REAL, "mistral-11m", "qwen2-19m"} & set(regions) & set(whole)):
        assert regions[model] == whole[model], model


def _followers(served: Served) -> list[str]:
    titles = [" ".join(p.cmdline()).strip() for p in served.children()]
    return [t for t in titles if t.endswith(".r1")]


def _cache_models(served: Served) -> list[dict[str, Any]]:
    stats = served.get_json("/v1/aegaeon/stats?light=1")["cache"]
    assert isinstance(stats, dict)
    resident = stats["model_cache"]["models"]
    assert isinstance(resident, list)
    return resident


def test_tp2_greedy_tokens_equal_tp1_for_every_model(nodes: tuple[Served, Served]) -> None:
    tp2, tp1 = nodes
    models = [m["id"] for m in tp1.get_json("/v1/models")["data"]]
    assert len(models) == 10 and set(models) >= SHARDED
    for model in models:
        for prompt in PROMPTS:
            assert _greedy(tp2, model, prompt) == _greedy(tp1, model, prompt), (model, prompt)
    # the instances' metrics count a sharded model's device blocks as the group's parts
    services = tp2.get_json("/v1/aegaeon/services")["services"]
    assert isinstance(services, list)
    for service in services:
        if service["role"] in ("prefill", "decode"):
            status, text = get_text(service["metrics_url"])
            assert status == 200 and 'shape="L' in text and '-P2"' in text, service["name"]


def test_the_readme_question_gets_the_readme_answer(nodes: tuple[Served, Served]) -> None:
    tp2, _ = nodes
    out = tp2.post_json("/v1/chat/completions", {
        "model": REAL, "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert out["choices"][0]["message"]["content"] == "The capital of France is Paris."
