"""A model added with ``aegaeon market add --dtype fp8`` served through ``aegaeon serve``
(issue 27): its FP8 bytes go through the Model Cache and the instances' switches like
any model's, and its greedy tokens, before and after a switch away and back, equal a
fresh engine's on the same FP8 directory. On this CPU its matmuls fall back to
dequantized weights, with one log line per process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_harness import Served, serving

SOURCE = "llama-gqa-5m"
FP8_NAME = f"{SOURCE}-fp8"
OTHER = "mistral-11m"
PROMPT_IDS = [5, 17, 99, 3, 250, 41, 7, 12, 60, 33, 21, 8, 19, 77, 101, 4, 16, 2]
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def fp8_market(small_market: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from aegaeon_market.edit import add_model

    market = tmp_path_factory.mktemp("fp8") / "market"
    add_model(market, small_market / SOURCE, FP8_NAME, "fp8", progress=False)
    add_model(market, small_market / OTHER, OTHER, progress=False)
    return market


@pytest.fixture(scope="module")
def served(fp8_market: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(fp8_market, tmp_path_factory.mktemp("serve") / "run") as served:
        yield served


def test_fp8_model_serves_the_engines_tokens_across_switches(served: Served,
                                                              fp8_market: Path) -> None:
    from aegaeon_engine import SamplingParams
    from aegaeon_engine.llm import LLM
    from tokenizers import Tokenizer

    model_dir = fp8_market / FP8_NAME
    want = LLM(model_dir).generate([PROMPT_IDS], SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True))[0]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    want_text = tokenizer.decode(want, skip_special_tokens=True)
    client = served.client()
    assert {m.id for m in client.models.list().data} == {FP8_NAME, OTHER}

    def ask(model: str) -> str:
        reply = client.completions.create(model=model, prompt=PROMPT_IDS,
                                          max_tokens=NUM_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        return str(reply.choices[0].text)

    first = ask(FP8_NAME)
    ask(OTHER)  # the instances switch away from the FP8 model ...
    again = ask(FP8_NAME)  # ... and back, from the Model Cache
    assert first == want_text
    assert again == want_text
    # each instance (its own process) said once that its FP8 matmuls fall back
    logs = sorted(served.run_dir.glob("*-0.log"))
    assert [p.name for p in logs] == ["decode-0.log", "prefill-0.log"]
    for path in logs:
        text = path.read_text(errors="replace")
        assert text.count("FP8 matmuls fall back to dequantized weights") == 1, path.name
